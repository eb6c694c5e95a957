// One training step's gradients as the run computed them: every rank's
// micro-batches forward and backward, gradients accumulated over micro-batches,
// averaged over ranks and unscaled (before clipping). Shared by the replay and
// the synthetic-bundle trainer so both compute exactly the same thing.
#pragma once

#include <functional>
#include <map>
#include <vector>

#include "loaders/bundle.h"
#include "probes/probe_record.h"
#include "replay/model.h"

namespace nanreplay {

struct StepBatch {
  // samples[rank] = micro_batch_size * grad_accum_steps dataset indices.
  std::vector<std::vector<int64_t>> samples;
};

struct StepGradients {
  double loss = 0.0;                 // mean over ranks of the mean over micro-batches
  std::vector<double> rank_losses;
  std::vector<double> rank_grad_norms;
  double grad_norm = 0.0;            // global norm before clipping (clip_grad_norm_'s)
  std::vector<torch::Tensor> grads;  // per parameter, in `order`
  std::vector<ProbeRecord> probes;   // forward/backward records of every pass
  std::vector<NormCheck> norm_checks;  // with probes on
  std::vector<SampleLoss> sample_losses;  // with probes on
};

struct StepComputeOptions {
  bool probes = false;
  double loss_scale = 1.0;  // backward starts from loss * loss_scale
  const std::map<std::string, Fp8ModuleScales>* fp8_scales = nullptr;  // fp8 only
  // bf16/fp16 matmuls in the low type on the device (GPU) instead of emulated
  // by rounding fp32 (numerics.h); false on CPU.
  bool native_low_precision = false;
  // Called before each forward and each backward: (rank, micro-batch, "forward" | "backward").
  std::function<void(int rank, int micro_batch, const char* phase)> before_pass;
};

StepGradients compute_step_gradients(const Manifest& manifest, const TokenStream& tokens,
                                     int64_t step, const StepBatch& batch, ParamMap& params,
                                     const std::vector<std::string>& order,
                                     const StepComputeOptions& options);

// clip_grad_norm_'s total norm: the 2-norm of the per-tensor 2-norms.
double total_grad_norm(const std::vector<torch::Tensor>& grads);

}  // namespace nanreplay
