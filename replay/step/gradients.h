// The pieces a step is made of (replay/step/step.h puts them together): one pass
// forward and backward, DDP's reduction of a rank's gradients, the gradient
// norm, a step's numerics.
#pragma once

#include <functional>
#include <map>
#include <vector>

#include "loaders/bundle/bundle.h"
#include "probes/probe_record.h"
#include "replay/arch/model.h"

namespace nanreplay {

struct StepBatch {
  // samples[rank] = micro_batch_size * grad_accum_steps dataset indices.
  std::vector<std::vector<int64_t>> samples;
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

class StepModel;  // replay/step/step_model.h

// `before_backward` runs between the forward and the backward (progress, interrupts).
PassOutput replay_pass(const ModelConfig& model, const TokenStream& tokens, int64_t seq_len,
                       const PassInput& input, StepModel& params, const Numerics& numerics,
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

// clip_grad_norm_'s total norm: the 2-norm of the per-tensor 2-norms; as a
// 0-dim tensor on the first gradient's device (gradients of a split model sit
// on two devices), or read back.
torch::Tensor total_grad_norm_tensor(const std::vector<torch::Tensor>& grads);
double total_grad_norm(const std::vector<torch::Tensor>& grads);

// (rows, seq_len + 1) token ids of the given samples: inputs then targets.
torch::Tensor sample_windows(const TokenStream& tokens, const std::vector<int64_t>& ids, int64_t seq_len);

}  // namespace nanreplay
