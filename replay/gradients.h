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

// One pass: forward and backward of one batch of samples (a rank's
// micro-batch, or any rows a bisection picks). Parameter gradients accumulate
// into the parameters' .grad, as autograd does across micro-batches.
struct PassInput {
  BatchContext context;       // step, micro-batch, rank, and the rows' sample ids
  double backward_scale = 1;  // backward starts from loss * backward_scale
};

struct PassOutput {
  double loss = 0.0;                  // the batch's mean next-token cross-entropy
  std::vector<SampleLoss> sample_losses;  // with full probes
  std::vector<ProbeRecord> probes;    // forward then backward records
  std::vector<NormCheck> norm_checks;  // with full probes
};

// `before_backward` runs between the forward and the backward (progress, interrupts).
PassOutput replay_pass(const ModelConfig& model, const TokenStream& tokens, int64_t seq_len,
                       const PassInput& input, ParamMap& params, const Numerics& numerics,
                       const ProbeScope& scope, const std::function<void()>& before_backward = {});

// The arithmetic of a step: the bundle's precision with this step's fp8 scales.
Numerics step_numerics(const Manifest& manifest, const std::map<std::string, Fp8ModuleScales>* fp8_scales);

// DDP's reduction of one rank's accumulated gradients into the step's:
// unscaled by `inv_scale`, divided by the world size and summed. Returns the
// rank's unscaled gradients (for its own norm).
std::vector<torch::Tensor> add_rank_gradients(const ParamMap& params, const std::vector<std::string>& order,
                                              double inv_scale, int64_t world_size,
                                              std::vector<torch::Tensor>& step_grads);

// Clears every parameter's .grad (before a rank's first micro-batch).
void clear_gradients(ParamMap& params, const std::vector<std::string>& order);

StepGradients compute_step_gradients(const Manifest& manifest, const TokenStream& tokens,
                                     int64_t step, const StepBatch& batch, ParamMap& params,
                                     const std::vector<std::string>& order,
                                     const StepComputeOptions& options);

// clip_grad_norm_'s total norm: the 2-norm of the per-tensor 2-norms.
double total_grad_norm(const std::vector<torch::Tensor>& grads);

}  // namespace nanreplay
