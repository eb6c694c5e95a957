// The layer-streamed step in process (replay/step/layer_stream.h): against the
// in-memory step on the same checkpoint, every probe record, loss, norm and
// parameter gradient the same bits, for the step shapes that sum gradients
// differently (ranks, micro-batches, a tied head, router losses) and for
// bisection's cheap pass; and its scratch files. The CLI and every preset:
// tests/py/test_stream_presets.py.
#include <catch2/catch.hpp>

#include <torch/torch.h>

#include "replay/step/layer_stream.h"
#include "reports/triage/system/probe_comparison.h"
#include "replay/step/step.h"
#include "replay/step/step_scan.h"
#include "synth/synthetic_bundle.h"
#include "tests/cli_harness.h"

using namespace nanreplay;
using nanreplay_test::ScratchDir;

namespace {

struct BothWays {
  StepResult in_memory, streamed;
};

// The bundle's last step replayed in memory and streamed, with `request`.
BothWays replay_both_ways(const Bundle& bundle, const ScratchDir& dir, const StepRequest& request) {
  const StepFiles& files = bundle.steps().back();
  const StepState state = bundle.load_state(files);
  const StepBatch batch = batch_of_step(bundle, files.step);
  const StepInputs inputs{bundle.manifest(), bundle.tokens(), files.step, state, batch};
  ModelCheckpoint plain(files, bundle.manifest().model), streamed(files, bundle.manifest().model);
  ComputePlacement placement;
  placement.stream = std::make_shared<StreamScratch>(dir.path());
  return {replay_step(inputs, plain, ComputePlacement{}, request), replay_step(inputs, streamed, placement, request)};
}

void require_same(const StepResult& a, const StepResult& b) {
  CHECK(a.passes == b.passes);
  CHECK(a.complete == b.complete);
  CHECK(std::memcmp(&a.loss, &b.loss, sizeof(double)) == 0);
  CHECK(std::memcmp(&a.grad_norm, &b.grad_norm, sizeof(double)) == 0);
  CHECK(a.rank_grad_norms == b.rank_grad_norms);
  std::vector<const ProbeRecord*> before;
  for (const ProbeRecord& r : a.probes) before.push_back(&r);
  const ProbeComparison cmp = compare_probes(before, b.probes);
  INFO(cmp.difference);
  CHECK(cmp.difference.empty());
  CHECK(cmp.compared == static_cast<int64_t>(a.probes.size()));
  REQUIRE(a.grads.size() == b.grads.size());
  for (size_t i = 0; i < a.grads.size(); ++i) {
    INFO("gradient " << i);
    CHECK(torch::equal(a.grads[i].cpu(), b.grads[i]));
  }
  REQUIRE(a.norm_checks.size() == b.norm_checks.size());
  REQUIRE(a.sample_losses.size() == b.sample_losses.size());
  for (size_t i = 0; i < a.sample_losses.size(); ++i) CHECK(a.sample_losses[i].loss == b.sample_losses[i].loss);
}

}  // namespace

TEST_CASE("a streamed step is the in-memory step bit for bit: ranks, micro-batches, tied head, router losses",
          "[torch][stream]") {
  const std::string preset = GENERATE("clean-dp", "clean-accum", "clean-gpt2", "clean-moe");
  INFO(preset);
  ScratchDir dir("stream-" + preset);
  SyntheticSpec spec = synthetic_preset(preset);
  spec.num_steps = 2;
  write_synthetic_bundle(dir / "b", spec);
  const Bundle bundle(dir / "b");
  StepRequest request;
  const BothWays both = replay_both_ways(bundle, dir, request);
  CHECK_FALSE(both.in_memory.probes.empty());
  require_same(both.in_memory, both.streamed);
  // The gradients are on scratch files until the result goes.
  CHECK(std::distance(std::filesystem::directory_iterator(dir.path()), {}) == 2);  // b, and the scratch directory
}

TEST_CASE("a streamed cheap pass stops where the in-memory one stops, with the same flags", "[torch][stream]") {
  ScratchDir dir("stream-flags");
  write_synthetic_bundle(dir / "b", synthetic_preset("head-overflow"));
  const Bundle bundle(dir / "b");
  StepRequest request;
  request.probes = ProbeLevel::kFlags;
  request.stop_at_first_bad = true;
  const BothWays both = replay_both_ways(bundle, dir, request);
  REQUIRE(judge_step(both.in_memory, Compute::kFp16).bad);
  require_same(both.in_memory, both.streamed);
}

TEST_CASE("scratch tensors: written whole, read back the same, gone with their directory", "[torch][stream]") {
  ScratchDir dir("stream-scratch");
  std::filesystem::path made;
  {
    auto scratch = std::make_shared<StreamScratch>(dir.path());
    made = scratch->dir;
    CHECK(made.filename().string().rfind("nanreplay-scratch-", 0) == 0);
    ScratchTensors tensors(scratch, "t", {{2, 3}, {5}});
    CHECK_FALSE(tensors.holds(0));
    const torch::Tensor a = torch::randn({2, 3}), b = torch::randn({5});
    tensors.write(1, b);
    tensors.write(0, a);
    CHECK(torch::equal(tensors.read(0), a));
    CHECK(torch::equal(tensors.read(1), b));
    tensors.forget_all();
    CHECK_FALSE(tensors.holds(1));
    CHECK_THROWS_AS(tensors.read(1), std::logic_error);
    scratch.reset();
    CHECK(std::filesystem::exists(made));  // kept while its files are in use
  }
  CHECK_FALSE(std::filesystem::exists(made));
}
