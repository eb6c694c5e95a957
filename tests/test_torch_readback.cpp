// A step on a device reads its values back once: losses, norms and every
// probe's statistics together, however many sites, passes, ranks and
// experts it probes. Counted on the CPU through the path device tensors take
// (StepRequest::defer_host_probes), and checked against the host path's
// records. Also: preparing the next step ahead changes no report.
#include <catch2/catch.hpp>

#include <cstring>

#include <torch/torch.h>

#include "replay/probing/device_stats.h"
#include "replay/workflows/replay_engine.h"
#include "replay/step/step.h"
#include "replay/step/step_scan.h"
#include "synth/synthetic_bundle.h"
#include "tests/cli_harness.h"

using namespace nanreplay;
using nanreplay_test::ScratchDir;

namespace {

struct Counted {
  StepResult result;
  int64_t readbacks = 0;
};

// The bundle's last step, its statistics left where they are (deferred) or taken on the host.
Counted replay_last_step(const Bundle& bundle, bool deferred) {
  const StepFiles& files = bundle.steps().back();
  const StepState state = bundle.load_state(files);
  const StepBatch batch = batch_of_step(bundle, files.step);
  const StepInputs inputs{bundle.manifest(), bundle.tokens(), files.step, state, batch};
  ModelCheckpoint checkpoint(files, bundle.manifest().model);
  StepRequest request;
  request.defer_host_probes = deferred;
  const int64_t before = readback_count();
  Counted counted;
  counted.result = replay_step(inputs, checkpoint, ComputePlacement{}, request);
  counted.readbacks = readback_count() - before;
  return counted;
}

// Each record of the deferred path against the host kernel's: the same site, counts, extremes and
// first non-finite element (sums are taken in another order, so only close).
void require_same_records(const StepResult& host, const StepResult& deferred) {
  REQUIRE(host.probes.size() == deferred.probes.size());
  for (size_t i = 0; i < host.probes.size(); ++i) {
    const ProbeRecord& a = host.probes[i];
    const ProbeRecord& b = deferred.probes[i];
    INFO("record " << i << ": " << site_name(a.site) << " head " << a.head << " expert " << a.expert);
    REQUIRE(a.site == b.site);
    REQUIRE(a.phase == b.phase);
    CHECK(a.head == b.head);
    CHECK(a.expert == b.expert);
    CHECK(a.stats.count == b.stats.count);
    CHECK(a.stats.nan_count == b.stats.nan_count);
    CHECK(a.stats.inf_count == b.stats.inf_count);
    CHECK(a.stats.max_abs == b.stats.max_abs);
    CHECK(a.stats.first_nonfinite == b.stats.first_nonfinite);
    CHECK(a.sample == b.sample);
    CHECK(a.position == b.position);
    CHECK(a.stats.sum_sq == Approx(b.stats.sum_sq).epsilon(1e-5));  // the CPU kernel sums in blocks
  }
  CHECK(std::memcmp(&host.loss, &deferred.loss, sizeof(double)) == 0);  // NaN as NaN
  CHECK(std::memcmp(&host.grad_norm, &deferred.grad_norm, sizeof(double)) == 0);
  CHECK(host.norm_checks.size() == deferred.norm_checks.size());
}

}  // namespace

TEST_CASE("a step reads its losses, norms and every probe back in one copy", "[torch][readback]") {
  // One rank and micro-batch; two ranks; four micro-batches; experts; an overflowing head.
  const auto preset = GENERATE(as<std::string>{}, "clean-fp32", "clean-dp", "clean-accum", "clean-moe",
                               "head-overflow");
  INFO(preset);
  ScratchDir dir("readback");
  SyntheticSpec spec = synthetic_preset(preset);
  write_synthetic_bundle(dir / "b", spec);
  const Bundle bundle(dir / "b");

  const Counted deferred = replay_last_step(bundle, true);
  const Counted host = replay_last_step(bundle, false);
  // The host path reads back the step's scalars only; the deferred one adds every probe to that copy.
  CHECK(host.readbacks == 1);
  CHECK(deferred.readbacks == 1);
  CHECK(deferred.result.passes >= 1);
  CHECK(deferred.result.probes.size() > 100);  // many sites, one copy
  require_same_records(host.result, deferred.result);
}

TEST_CASE("preparing each next step on a worker thread changes nothing in the report", "[torch][readback]") {
  ScratchDir dir("ahead");
  write_synthetic_bundle(dir / "b", synthetic_preset("head-overflow"));
  const Bundle bundle(dir / "b");
  ReplayOptions in_turn, ahead;
  in_turn.prepare_ahead = false;
  ahead.prepare_ahead = true;
  const ReplayReport a = replay_bundle(bundle, in_turn);
  const ReplayReport b = replay_bundle(bundle, ahead);
  REQUIRE(a.steps.size() == b.steps.size());
  for (size_t i = 0; i < a.steps.size(); ++i) {
    CHECK(std::memcmp(&a.steps[i].loss, &b.steps[i].loss, sizeof(double)) == 0);
    CHECK(std::memcmp(&a.steps[i].grad_norm, &b.steps[i].grad_norm, sizeof(double)) == 0);
  }
  REQUIRE(a.findings.size() == b.findings.size());
  for (size_t i = 0; i < a.findings.size(); ++i) CHECK(a.findings[i].message == b.findings[i].message);
  REQUIRE(a.first_nonfinite.has_value() == b.first_nonfinite.has_value());
  CHECK(a.reproduced == b.reproduced);
}
