// Replay on a GPU, checked against the CPU replay of the same bundle:
// statistics taken on the device, the origin named, a model split across two
// devices and the cross-device check. Runs only where a CUDA device exists
// (gpu_main.cpp); scripts/gpu_check.sh builds and runs it on such a machine.
#include <catch2/catch.hpp>

#include <cmath>

#include <torch/cuda.h>
#include <torch/torch.h>

#include "kernels/tensor_stats.h"
#include "loaders/bundle/bundle.h"
#include "replay/probing/cuda_probe_stats.h"
#include "replay/probing/device_stats.h"
#include "replay/workflows/replay_engine.h"
#include "synth/synthetic_bundle.h"
#include "tests/cli_harness.h"
#include "tests/stats_compare.h"

using namespace nanreplay;
using nanreplay_test::ScratchDir;

namespace {

ReplayReport replay_on(const Bundle& bundle, std::vector<std::string> devices, bool cross_check = false,
                       bool native = true) {
  ReplayOptions options;
  options.devices = std::move(devices);
  options.cross_check = cross_check;
  options.native_low_precision = native;
  options.check_determinism = false;
  return replay_bundle(bundle, options);
}

std::string second_gpu() { return torch::cuda::device_count() > 1 ? "cuda:1" : "cuda:0"; }

}  // namespace

// Both GPU paths of a probe: LibTorch reductions (device_stats.h) and, where
// built, the CUDA statistics kernel (cuda_probe_stats.h), which replays use.
TEST_CASE("statistics taken on the GPU equal the CPU kernel's", "[gpu]") {
  torch::manual_seed(11);
  INFO("CUDA statistics kernel in this build: " << (CudaProbeStats::available() ? "yes" : "no"));
  for (const torch::ScalarType type : {torch::kFloat32, torch::kBFloat16, torch::kHalf}) {
    CAPTURE(c10::toString(type));
    torch::Tensor host = (torch::randn({2, 4, 16, 16}) * 30).to(type);
    host.view(-1)[100] = std::nanf("");
    host.view(-1)[1000] = -INFINITY;
    const ElemType elem = elem_type_of(host);
    const torch::Tensor device = host.to(torch::Device("cuda:0"));
    for (const bool causal : {false, true}) {
      CAPTURE(causal);
      const std::vector<TensorStats> gpu = stats_from_rows(device_stats_rows(device, true, causal).cpu());
      const std::vector<TensorStats> cpu = compute_head_stats(host.data_ptr(), elem, 2, 4, 16, 16, causal);
      REQUIRE(gpu.size() == cpu.size());
      for (size_t h = 0; h < cpu.size(); ++h) nanreplay_test::check_same_stats(gpu[h], cpu[h], 1e-4, 1e-4);
      if (!CudaProbeStats::available()) continue;
      // The kernel: per head, whole, and a non-contiguous view, queued then read back once.
      CudaProbeStats kernel;
      const CudaProbeStats::Ticket heads = kernel.add(device, true, causal);
      const CudaProbeStats::Ticket whole = kernel.add(device, false, false);
      const torch::Tensor transposed = device.transpose(2, 3);
      const CudaProbeStats::Ticket strided = kernel.add(transposed, false, false);
      const std::vector<TensorStats> results = kernel.collect();
      REQUIRE(heads.count == 4);
      REQUIRE(results.size() == 6);
      for (size_t h = 0; h < cpu.size(); ++h) nanreplay_test::check_same_stats(results[heads.first + h], cpu[h], 1e-4, 1e-4);
      nanreplay_test::check_same_stats(results[whole.first], compute_stats(host.data_ptr(), elem, host.numel()), 1e-4, 1e-4);
      const torch::Tensor host_transposed = host.transpose(2, 3).contiguous();
      nanreplay_test::check_same_stats(results[strided.first], compute_stats(host_transposed.data_ptr(), elem, host.numel()), 1e-4, 1e-4);
      CHECK(kernel.collect().empty());  // collect() empties the queue
    }
  }
}

TEST_CASE("an fp16 overflow replayed on the GPU is named where the CPU names it", "[gpu]") {
  ScratchDir dir("gpu-overflow");
  write_synthetic_bundle(dir / "b", synthetic_preset("head-overflow"));
  const Bundle bundle(dir / "b");
  const ReplayReport cpu = replay_on(bundle, {"cpu"});
  REQUIRE(cpu.first_nonfinite);
  for (const bool native : {true, false}) {
    CAPTURE(native);
    const ReplayReport gpu = replay_on(bundle, {"cuda:0"}, false, native);
    CHECK(gpu.low_precision == (native ? "native" : "emulated"));
    REQUIRE(gpu.first_nonfinite);
    CHECK(gpu.first_nonfinite->step == cpu.first_nonfinite->step);
    CHECK(gpu.first_nonfinite->site == cpu.first_nonfinite->site);
    CHECK(gpu.first_nonfinite->head == cpu.first_nonfinite->head);
    CHECK(gpu.first_nonfinite->sample == cpu.first_nonfinite->sample);
    CHECK(gpu.first_nonfinite->position == cpu.first_nonfinite->position);
    CHECK(gpu.probes.size() == cpu.probes.size());
  }
}

TEST_CASE("fp32 on the GPU reproduces the CPU losses and flags nothing on a clean bundle", "[gpu]") {
  ScratchDir dir("gpu-clean");
  write_synthetic_bundle(dir / "b", synthetic_preset("clean-fp32"));
  const Bundle bundle(dir / "b");
  const ReplayReport cpu = replay_on(bundle, {"cpu"});
  const ReplayReport gpu = replay_on(bundle, {"cuda:0"});
  CHECK_FALSE(gpu.first_nonfinite);
  CHECK(gpu.low_precision == "fp32");
  REQUIRE(gpu.steps.size() == cpu.steps.size());
  for (size_t i = 0; i < cpu.steps.size(); ++i) {
    CHECK(gpu.steps[i].loss == Approx(cpu.steps[i].loss).epsilon(1e-5));
    CHECK(gpu.steps[i].grad_norm == Approx(cpu.steps[i].grad_norm).epsilon(1e-4));
  }
  for (const Finding& f : gpu.findings) {
    INFO(f.name() << ": " << f.message);
    CHECK(f.severity != Severity::kError);
  }
}

TEST_CASE("a model split across two GPUs replays bit for bit as on one, and cross-checks clean", "[gpu]") {
  ScratchDir dir("gpu-split");
  write_synthetic_bundle(dir / "b", synthetic_preset("head-overflow"));
  const Bundle bundle(dir / "b");
  const ReplayReport one = replay_on(bundle, {"cuda:0"});
  const ReplayReport two = replay_on(bundle, {"cuda:0", second_gpu()});
  REQUIRE(one.probes.size() == two.probes.size());
  for (size_t i = 0; i < one.probes.size(); ++i) {
    CAPTURE(probe_name(one.probes[i]));
    CHECK(one.probes[i].stats.max_abs == two.probes[i].stats.max_abs);
    CHECK(one.probes[i].stats.nan_count == two.probes[i].stats.nan_count);
  }
  REQUIRE(two.first_nonfinite);
  CHECK(two.first_nonfinite->site == one.first_nonfinite->site);

  const ReplayReport cross = replay_on(bundle, {"cuda:0", second_gpu()}, true);
  REQUIRE(cross.cross_check);
  CHECK(cross.cross_check->identical);
  CHECK(cross.cross_check->probes_compared > 100);
}

TEST_CASE("a mixture of experts routes on the GPU exactly as on the CPU, and names the same expert", "[gpu][moe]") {
  ScratchDir dir("gpu-moe");
  write_synthetic_bundle(dir / "clean", synthetic_preset("clean-moe"));
  const Bundle clean(dir / "clean");
  const ReplayReport cpu = replay_on(clean, {"cpu"});
  const ReplayReport gpu = replay_on(clean, {"cuda:0"});
  REQUIRE(gpu.steps.size() == cpu.steps.size());
  for (size_t i = 0; i < cpu.steps.size(); ++i) {
    CHECK(gpu.steps[i].expert_tokens == cpu.steps[i].expert_tokens);  // routing: same tokens to the same experts
    CHECK(gpu.steps[i].loss == Approx(cpu.steps[i].loss).epsilon(1e-5));
  }
  write_synthetic_bundle(dir / "fault", synthetic_preset("expert-overflow"));
  const Bundle fault(dir / "fault");
  const ReplayReport cpu_fault = replay_on(fault, {"cpu"});
  const ReplayReport gpu_fault = replay_on(fault, {"cuda:0"});
  REQUIRE(cpu_fault.first_nonfinite);
  REQUIRE(gpu_fault.first_nonfinite);
  CHECK(gpu_fault.first_nonfinite->site == cpu_fault.first_nonfinite->site);
  CHECK(gpu_fault.first_nonfinite->expert == cpu_fault.first_nonfinite->expert);
  CHECK(gpu_fault.first_nonfinite->sample == cpu_fault.first_nonfinite->sample);
  CHECK(gpu_fault.first_nonfinite->position == cpu_fault.first_nonfinite->position);
}
