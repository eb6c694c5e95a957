// The layer-streamed step in process (replay/step/layer_stream.h): against the
// in-memory step on the same checkpoint, every probe record, loss, norm and
// parameter gradient the same bits, for the step shapes that sum gradients
// differently (ranks, micro-batches, a tied head, router losses) and for
// bisection's cheap pass; a mixture of experts that loads only the experts
// a token was routed to (four routers); and its scratch files. The CLI and every preset:
// tests/py/test_stream_presets.py.
#include <catch2/catch.hpp>

#include <algorithm>
#include <map>
#include <set>
#include <string>
#include <tuple>
#include <utility>

#include <torch/torch.h>

#include "probes/sites.h"
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

namespace {

// Passes' (rank, micro-batch, layer, expert) with a token routed to the expert,
// from the forward records of its per-expert up projection site.
std::set<std::tuple<int, int, int, int>> experts_with_tokens(const StepResult& result) {
  std::set<std::tuple<int, int, int, int>> out;
  for (const ProbeRecord& r : result.probes) {
    if (r.phase == Phase::kForward && r.site.id == SiteId::kMlpExpertUp && r.expert >= 0 && r.routed_tokens > 0) {
      out.emplace(r.rank, r.micro_batch, r.layer, r.expert);
    }
  }
  return out;
}

// The layers with experts.
std::vector<int> moe_layers(const ModelConfig& model) {
  std::vector<int> out;
  for (int layer = 0; layer < static_cast<int>(model.num_layers); ++layer) {
    if (model.moe_layer(layer)) out.push_back(layer);
  }
  return out;
}

// Tensors one expert of a layer with experts holds (weights, GPT-OSS's biases).
int64_t tensors_per_expert(const ModelConfig& model) {
  const std::string prefix = "layers." + std::to_string(moe_layers(model).front()) + ".mlp.experts.0.";
  int64_t n = 0;
  for (const ParamSpec& spec : expected_parameters(model)) n += spec.name.find(prefix) != std::string::npos;
  return n;
}

}  // namespace

// Many experts, few tokens a pass, two ranks of two micro-batches: most experts
// get no token in a pass, some get tokens in one pass of a rank and none in
// another (their gradient accumulates a zero the streamed replay never loads).
TEST_CASE("a streamed MoE block loads only the experts its router sent a token to, same bits",
          "[torch][stream][moe]") {
  const std::string preset = GENERATE("clean-moe", "clean-deepseek-moe", "clean-gpt-oss-moe", "clean-llama4-moe");
  INFO(preset);
  ScratchDir dir("stream-lazy-" + preset);
  SyntheticSpec spec = synthetic_preset(preset);
  spec.num_steps = 1;
  spec.model.moe->num_experts = 16;
  spec.seq_len = 8;
  spec.micro_batch_size = 1;
  spec.grad_accum_steps = 2;
  spec.world_size = 2;
  write_synthetic_bundle(dir / "b", spec);
  const Bundle bundle(dir / "b");
  const ExpertLoads before = streamed_expert_loads();
  const BothWays both = replay_both_ways(bundle, dir, StepRequest{});
  const ExpertLoads after = streamed_expert_loads();
  require_same(both.in_memory, both.streamed);
  const ModelConfig& model = bundle.manifest().model;
  const int64_t per_expert = tensors_per_expert(model), passes = both.streamed.passes;
  REQUIRE(passes == 4);
  // Each pass computes each block twice (forward, then again for the backward).
  const auto ran = experts_with_tokens(both.in_memory);
  CHECK(after.of - before.of ==
        2 * passes * static_cast<int64_t>(moe_layers(model).size()) * model.moe->num_experts * per_expert);
  CHECK(after.loaded - before.loaded == 2 * static_cast<int64_t>(ran.size()) * per_expert);
  CHECK(after.loaded - before.loaded < after.of - before.of);
  // What the spec is for: an expert with tokens in one micro-batch of a rank
  // and none in the other, and an expert with no token in the whole step.
  std::map<std::tuple<int, int, int>, int> micro_batches_with_tokens;  // (rank, layer, expert)
  std::set<std::pair<int, int>> run_in_step;                           // (layer, expert)
  for (const auto& [rank, micro, layer, expert] : ran) {
    ++micro_batches_with_tokens[{rank, layer, expert}];
    run_in_step.emplace(layer, expert);
  }
  CHECK(std::any_of(micro_batches_with_tokens.begin(), micro_batches_with_tokens.end(),
                    [](const auto& entry) { return entry.second == 1; }));
  CHECK(run_in_step.size() < moe_layers(model).size() * static_cast<size_t>(model.moe->num_experts));
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
