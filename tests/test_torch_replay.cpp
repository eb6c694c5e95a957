// The replay engine and checkpoint loading on synthetic bundles written by
// the library itself: data-parallel loss combination, probe coverage,
// checkpoint validation and in-place use of fp32 tensors.
#include <catch2/catch.hpp>

#include <dlfcn.h>

#include <functional>

#include <torch/torch.h>

#include "loaders/base/error.h"
#include "loaders/formats/safetensors.h"
#include "replay/step/checkpoint.h"
#include "replay/workflows/replay_engine.h"
#include "synth/synthetic_bundle.h"
#include "tests/cli_harness.h"

using namespace nanreplay;
using nanreplay_test::ScratchDir;

namespace {

SyntheticSpec tiny(const std::string& preset) {
  SyntheticSpec spec = synthetic_preset(preset);
  spec.num_steps = 2;
  return spec;
}

// Rewrites a step's checkpoint through `edit`, which gets every tensor by name.
void rewrite_checkpoint(const std::filesystem::path& file,
                        const std::function<void(SafetensorsWriter&, const TensorInfo&)>& edit) {
  std::vector<uint8_t> copy;
  SafetensorsWriter writer;
  {
    const SafetensorsFile in = SafetensorsFile::open(file.string(), "model.safetensors");
    for (const TensorInfo& t : in.tensors()) edit(writer, t);
  }
  writer.write(file.string());
}

}  // namespace

TEST_CASE("data-parallel replay: every rank and micro-batch probed, losses combined as the spec says",
          "[torch][replay]") {
  ScratchDir dir("dp");
  write_synthetic_bundle(dir / "b", tiny("clean-dp"));
  const Bundle bundle(dir / "b");
  const ReplayReport report = replay_bundle(bundle, ReplayOptions{});
  REQUIRE(report.steps.size() == 2);
  CHECK_FALSE(report.reproduced);
  for (const StepOutcome& step : report.steps) {
    REQUIRE(step.rank_losses.size() == 2);
    CHECK(step.loss == Approx((step.rank_losses[0] + step.rank_losses[1]) / 2).epsilon(1e-12));
    CHECK(step.grad_norm > 0);
  }
  // Each (step, rank, micro-batch) has one forward and one backward record per site.
  const size_t sites = forward_sites(bundle.manifest().model).size();
  size_t forward = 0, backward = 0, grad = 0;
  for (const ProbeRecord& r : report.probes) {
    if (r.head != -1) continue;
    forward += r.phase == Phase::kForward;
    backward += r.phase == Phase::kBackward;
    grad += r.phase == Phase::kGrad;
  }
  CHECK(forward == 2 * 2 * 2 * sites);
  CHECK(backward == 2 * 2 * 2 * sites);
  CHECK(grad == 2 * expected_parameters(bundle.manifest().model).size());
}

TEST_CASE("replaying the same step twice is bitwise identical", "[torch][replay]") {
  ScratchDir dir("determinism");
  write_synthetic_bundle(dir / "b", tiny("clean-bf16"));
  const Bundle bundle(dir / "b");
  const ReplayReport a = replay_bundle(bundle, ReplayOptions{});
  const ReplayReport b = replay_bundle(bundle, ReplayOptions{});
  REQUIRE(a.probes.size() == b.probes.size());
  for (size_t i = 0; i < a.probes.size(); ++i) {
    CHECK(a.probes[i].stats.sum == b.probes[i].stats.sum);
    CHECK(a.probes[i].stats.max_abs == b.probes[i].stats.max_abs);
  }
  CHECK(a.steps[1].loss == b.steps[1].loss);
}

TEST_CASE("a checkpoint missing a parameter or with a wrong shape names them all", "[torch][checkpoint]") {
  ScratchDir dir("ckpt");
  write_synthetic_bundle(dir / "b", tiny("clean-fp32"));
  const auto model_file = dir / "b" / "steps" / "100" / "model.safetensors";
  rewrite_checkpoint(model_file, [](SafetensorsWriter& w, const TensorInfo& t) {
    if (t.name == "model.norm.weight") return;  // drop it
    if (t.name == "model.layers.1.mlp.up_proj.weight") {
      w.add(t.name, t.dtype, {t.shape[1], t.shape[0]}, t.data, t.nbytes());  // transposed shape
      return;
    }
    w.add(t.name, t.dtype, t.shape, t.data, t.nbytes());
  });
  const Bundle bundle(dir / "b");
  REQUIRE_THROWS_WITH(ModelCheckpoint(bundle.step_files(100), bundle.manifest().model),
                      Catch::Contains("steps/100/model.safetensors") &&
                          Catch::Contains("missing model.norm.weight") &&
                          Catch::Contains("model.layers.1.mlp.up_proj.weight has shape [64, 172], expected [172, 64]"));
}

TEST_CASE("fp32 tensors are used in place from the mapping, and bf16 is upcast", "[torch][checkpoint]") {
  ScratchDir dir("inplace");
  write_synthetic_bundle(dir / "b", tiny("clean-fp32"));
  const auto file = (dir / "b" / "steps" / "100" / "model.safetensors").string();
  const SafetensorsFile f = SafetensorsFile::open(file, "model.safetensors");
  const TensorInfo& info = f.at("model.norm.weight");
  const torch::Tensor view = tensor_from_safetensors(info, "model.safetensors");
  CHECK(view.data_ptr() == static_cast<const void*>(info.data));

  const uint16_t one_bf16 = 0x3F80, three_bf16 = 0x4040;
  const uint16_t values[2] = {one_bf16, three_bf16};
  SafetensorsWriter w;
  w.add("x", DType::kBF16, {2}, values, sizeof(values));
  w.write((dir / "bf16.safetensors").string());
  const SafetensorsFile g = SafetensorsFile::open((dir / "bf16.safetensors").string(), "bf16.safetensors");
  const torch::Tensor up = tensor_from_safetensors(g.at("x"), "bf16.safetensors");
  CHECK(up.scalar_type() == torch::kFloat32);
  CHECK(up[1].item<float>() == 3.0f);
}

TEST_CASE("a step whose batch holds an out-of-range token is reported, not replayed", "[torch][replay]") {
  ScratchDir dir("oor");
  SyntheticSpec spec = tiny("clean-fp32");
  spec.checksums = false;
  const SyntheticOutcome outcome = write_synthetic_bundle(dir / "b", spec);
  (void)outcome;
  const Bundle before(dir / "b");
  const int64_t sample = before.sampler().samples_for(before.manifest().steps[1])[0][0];
  const int64_t global = sample * before.manifest().data.seq_len + 3;
  const ShardLocation where = before.tokens().locate(global);
  const auto shard = dir / "b" / before.tokens().spec(where.shard).path;
  {
    std::fstream io(shard, std::ios::in | std::ios::out | std::ios::binary);
    io.seekp(where.offset * 2);
    const uint16_t bad = 60000;
    io.write(reinterpret_cast<const char*>(&bad), 2);
  }
  const Bundle bundle(dir / "b");
  const ReplayReport report = replay_bundle(bundle, ReplayOptions{});
  REQUIRE(report.steps.size() == 2);
  CHECK(report.steps[0].replayed);
  CHECK_FALSE(report.steps[1].replayed);
  REQUIRE_FALSE(report.findings.empty());
  CHECK(report.findings[0].name() == std::string("DATA_TOKEN_OUT_OF_RANGE"));
  CHECK(evidence_json(report.findings[0].evidence)["offset"] == where.offset);
  CHECK(evidence_json(report.findings[0].evidence)["shard"] == before.tokens().spec(where.shard).path);
  CHECK(exit_status_for(report) == 1);
}

TEST_CASE("the update check finds a flipped bit in a parameter it predicts in several slices",
          "[torch][replay]") {
  // An embedding of 8192 x 64 = 512 Ki elements is predicted in two slices of
  // rows; the flipped element sits in the second.
  ScratchDir dir("sliced-flip");
  SyntheticSpec spec = tiny("clean-fp32");
  spec.model.vocab_size = 8192;
  write_synthetic_bundle(dir / "b", spec);
  const std::string name = "model.embed_tokens.weight";
  const int64_t row = 6000, col = 3;
  rewrite_checkpoint(dir / "b" / "steps" / "101" / "model.safetensors",
                     [&](SafetensorsWriter& writer, const TensorInfo& t) {
                       std::vector<uint8_t> bytes(t.data, t.data + t.nbytes());
                       if (t.name == name) {
                         // |x| < 1: the exponent's top bit is clear; setting it keeps x finite.
                         bytes[static_cast<size_t>((row * 64 + col) * 4 + 3)] ^= 0x40;
                       }
                       writer.add(t.name, t.dtype, t.shape, bytes.data(), bytes.size());
                     });
  const Bundle bundle(dir / "b");
  ReplayOptions options;
  options.check_determinism = false;
  const ReplayReport report = replay_bundle(bundle, options);
  std::vector<const Finding*> flips;
  for (const Finding& f : report.findings) {
    if (f.name() == std::string("SYSTEM_BIT_FLIP")) flips.push_back(&f);
  }
  REQUIRE(flips.size() == 1);
  CHECK(evidence_json(flips[0]->evidence)["param"] == name);
  CHECK(evidence_json(flips[0]->evidence)["bit"] == 30);
  CHECK(evidence_json(flips[0]->evidence)["step"] == 101);
  CHECK(evidence_json(flips[0]->evidence)["index"] == nlohmann::json::array({row, col}));
}

TEST_CASE("set_compute_threads caps LibTorch and a BLAS thread pool of its own", "[torch][threads]") {
  using GetThreads = int (*)();
  using SetThreads = void (*)(int);
  const auto blas_threads = reinterpret_cast<GetThreads>(dlsym(RTLD_DEFAULT, "openblas_get_num_threads"));
  const auto set_blas_threads = reinterpret_cast<SetThreads>(dlsym(RTLD_DEFAULT, "openblas_set_num_threads"));
  const int torch_before = torch::get_num_threads();
  const int blas_before = blas_threads ? blas_threads() : 0;
  for (const int threads : {1, 3}) {
    set_compute_threads(threads);
    CHECK(torch::get_num_threads() == threads);
    if (blas_threads) {
      CHECK(blas_threads() == threads);
    } else {
      WARN("this LibTorch's BLAS is not OpenBLAS: only LibTorch's threads are set");
    }
  }
  torch::set_num_threads(torch_before);
  if (set_blas_threads) set_blas_threads(blas_before);
}
