// The device path of the probes, checked on the CPU: LibTorch-reduction
// statistics against the CPU kernel, deferred probe sessions against
// immediate ones, and a replay split across two (CPU) devices or
// cross-checked between them against the plain replay. The same code runs on
// GPUs; tests/gpu/ repeats these checks there.
#include <catch2/catch.hpp>

#include <torch/torch.h>

#include "kernels/tensor_stats.h"
#include "loaders/bundle/bundle.h"
#include "loaders/base/error.h"
#include "replay/probing/device_stats.h"
#include "replay/arch/model.h"
#include "replay/probing/probe_session.h"
#include "replay/workflows/replay_engine.h"
#include "synth/synthetic_bundle.h"
#include "tests/cli_harness.h"
#include "tests/stats_compare.h"

using namespace nanreplay;
using nanreplay_test::ScratchDir;

namespace {

torch::Tensor planted(torch::ScalarType type, std::vector<int64_t> shape) {
  torch::manual_seed(3);
  torch::Tensor x = torch::randn(shape) * 5;
  x.view(-1)[7] = 0.0;
  x.view(-1)[x.numel() - 5] = std::numeric_limits<float>::infinity();
  x.view(-1)[x.numel() / 2] = std::nanf("");
  x.view(-1)[x.numel() - 2] = -std::numeric_limits<float>::infinity();
  return x.to(type);
}

}  // namespace

TEST_CASE("device statistics equal the CPU kernel's, whole and per head with the causal mask",
          "[torch][devices]") {
  for (const torch::ScalarType type : {torch::kFloat32, torch::kBFloat16, torch::kHalf}) {
    CAPTURE(c10::toString(type));
    const torch::Tensor whole = planted(type, {3, 5, 7});
    const std::vector<TensorStats> rows = stats_from_rows(device_stats_rows(whole, false, false));
    REQUIRE(rows.size() == 1);
    nanreplay_test::check_same_stats(rows[0], compute_stats(whole.data_ptr(), elem_type_of(whole), whole.numel()));

    const torch::Tensor heads = planted(type, {2, 3, 6, 6});  // [batch, heads, rows, cols]
    for (const bool causal : {false, true}) {
      const std::vector<TensorStats> device = stats_from_rows(device_stats_rows(heads, true, causal));
      const std::vector<TensorStats> kernel =
          compute_head_stats(heads.data_ptr(), elem_type_of(heads), 2, 3, 6, 6, causal);
      REQUIRE(device.size() == kernel.size());
      for (size_t h = 0; h < kernel.size(); ++h) nanreplay_test::check_same_stats(device[h], kernel[h]);
    }
  }
  const torch::Tensor empty = torch::zeros({0, 4});
  const TensorStats none = stats_from_rows(device_stats_rows(empty, false, false)).at(0);
  CHECK(none.count == 0);
  CHECK(none.first_nonfinite == -1);
}

TEST_CASE("a deferred probe session records what an immediate one does", "[torch][devices]") {
  ModelConfig m;
  m.vocab_size = 32;
  m.hidden_size = 16;
  m.num_layers = 2;
  m.num_heads = 2;
  m.num_kv_heads = 2;
  m.intermediate_size = 24;
  m.max_seq_len = 8;
  torch::manual_seed(5);
  ParamMap params;
  for (const ParamSpec& spec : expected_parameters(m)) {
    params.emplace(spec.name, (torch::randn(spec.shape) * 0.2).requires_grad_(true));
  }
  params.at("model.layers.1.mlp.up_proj.weight").detach().mul_(1e6);  // overflows fp16 in layer 1
  const torch::Tensor tokens = torch::randint(0, 32, {2, 9}, torch::TensorOptions().dtype(torch::kLong));
  const Numerics fp16(Compute::kFp16);
  auto run = [&](bool defer) {
    ProbeSession probes({3, 0, 0, {40, 41}}, fp16, true, m, defer);
    const ForwardResult out = forward_loss(m, params, tokens.narrow(1, 0, 8), tokens.narrow(1, 1, 8), fp16, probes);
    out.loss.backward();
    for (auto& [name, p] : params) p.mutable_grad() = torch::Tensor();
    return std::make_pair(probes.take_records(), probes.take_norm_checks());
  };
  const auto [immediate, immediate_norms] = run(false);
  const auto [deferred, deferred_norms] = run(true);
  REQUIRE(immediate.size() == deferred.size());
  size_t nonfinite = 0;
  for (size_t i = 0; i < immediate.size(); ++i) {
    CAPTURE(probe_name(immediate[i]), phase_name(immediate[i].phase), immediate[i].head);
    CHECK(probe_name(deferred[i]) == probe_name(immediate[i]));
    CHECK(deferred[i].phase == immediate[i].phase);
    CHECK(deferred[i].head == immediate[i].head);
    CHECK(deferred[i].sample == immediate[i].sample);
    CHECK(deferred[i].position == immediate[i].position);
    CHECK(deferred[i].first_index == immediate[i].first_index);
    nanreplay_test::check_same_stats(deferred[i].stats, immediate[i].stats);
    nonfinite += !immediate[i].stats.all_finite();
  }
  CHECK(nonfinite > 0);  // the planted overflow was seen on both paths
  REQUIRE(immediate_norms.size() == deferred_norms.size());
  for (size_t i = 0; i < immediate_norms.size(); ++i) {
    CHECK(site_name(deferred_norms[i].site) == site_name(immediate_norms[i].site));
    CHECK(deferred_norms[i].min_moment == immediate_norms[i].min_moment);
    CHECK(deferred_norms[i].position == immediate_norms[i].position);
    CHECK(deferred_norms[i].sample == immediate_norms[i].sample);
  }
}

TEST_CASE("a replay split across two devices, or cross-checked between them, matches the plain one",
          "[torch][devices]") {
  ScratchDir dir("devices");
  SyntheticSpec spec = synthetic_preset("head-overflow");
  write_synthetic_bundle(dir / "b", spec);
  const Bundle bundle(dir / "b");
  ReplayOptions plain;
  plain.check_determinism = false;
  const ReplayReport a = replay_bundle(bundle, plain);
  ReplayOptions split = plain;
  split.devices = {"cpu", "cpu"};
  const ReplayReport b = replay_bundle(bundle, split);
  ReplayOptions cross = plain;
  cross.devices = {"cpu", "cpu"};
  cross.cross_check = true;
  const ReplayReport c = replay_bundle(bundle, cross);

  REQUIRE(a.first_nonfinite);
  REQUIRE(b.first_nonfinite);
  CHECK(b.first_nonfinite->site == a.first_nonfinite->site);
  CHECK(b.first_nonfinite->head == a.first_nonfinite->head);
  CHECK(b.first_nonfinite->position == a.first_nonfinite->position);
  REQUIRE(a.probes.size() == b.probes.size());
  for (size_t i = 0; i < a.probes.size(); ++i) {
    CHECK(a.probes[i].stats.sum == b.probes[i].stats.sum);  // same kernels, same bits
  }
  CHECK(b.devices == std::vector<std::string>{"cpu", "cpu"});
  CHECK(b.low_precision == "emulated");
  REQUIRE(c.cross_check);
  CHECK(c.cross_check->identical);
  CHECK(c.cross_check->step == a.first_nonfinite->step);
  CHECK(c.cross_check->probes_compared > 100);
}

TEST_CASE("device requests are checked before anything is loaded", "[torch][devices]") {
  CHECK_NOTHROW(validate_devices({"cpu"}, false));
  CHECK_NOTHROW(validate_devices({"cpu", "cpu"}, true));
  CHECK_THROWS_AS(validate_devices({"gpu0"}, false), UsageError);
  CHECK_THROWS_AS(validate_devices({"cuda:x"}, false), UsageError);
  CHECK_THROWS_AS(validate_devices({"cpu", "cpu", "cpu"}, false), UsageError);
  CHECK_THROWS_AS(validate_devices({"cpu"}, true), UsageError);
  if (!torch::cuda::is_available()) {
    CHECK_THROWS_WITH(validate_devices({"cuda:0"}, false), Catch::Contains("--device cuda:0"));
  }
}
