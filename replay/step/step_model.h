// Where a step's parameters are and where their gradients accumulate: every
// parameter in memory as an autograd leaf (its .grad), or streamed layer by
// layer with the gradients on scratch files (replay/step/layer_stream.h). The
// step (replay/step/step.h) and bisection's passes (replay/step/step_scan.h) drive
// either through this one interface, with the same arithmetic.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <torch/types.h>

#include "replay/step/checkpoint.h"
#include "replay/step/layer_stream.h"
#include "replay/arch/model.h"

namespace nanreplay {

class StepModel {
 public:
  virtual ~StepModel() = default;
  // One batch forward, then backward from loss * backward_scale; the
  // gradients accumulate across passes as autograd's .grad does.
  // `before_backward` runs between the two.
  virtual ForwardResult forward_backward(const ModelConfig& model, const Numerics& numerics, ProbeSession& probes,
                                         const torch::Tensor& inputs, const torch::Tensor& targets,
                                         double backward_scale, const std::function<void()>& before_backward,
                                         const StreamedModel::BlockHook& on_block = {}) = 0;
  // Before a step (or a lone pass): no step gradient yet. `whole_step`:
  // every rank's every micro-batch follows (what lets a replay across
  // processes spread the ranks, replay/step/rank_spread.h).
  virtual void begin_step(bool whole_step) = 0;
  // Before rank `rank`'s first micro-batch: no gradient accumulated.
  virtual void begin_rank(int rank) = 0;
  // DDP's reduction of the rank's gradients into the step's (replay/step/gradients.h);
  // returns the rank's gradient norm as a 0-dim tensor.
  virtual torch::Tensor end_rank(double inv_scale, int64_t world_size) = 0;
  // After the last rank: what only accumulated the ranks' gradients can go.
  virtual void end_ranks() = 0;
  // After the last rank: the step's gradients (on the host unless
  // `where_computed`) and their global norm (0-dim).
  virtual GradientSet step_gradients(bool where_computed) = 0;
  virtual torch::Tensor step_grad_norm() = 0;
};

// The parameters in memory: `params` (leaves) in `order`.
std::unique_ptr<StepModel> in_memory_model(ParamMap& params, const std::vector<std::string>& order);
// A checkpoint computed where `placement` says: placed in memory, or
// streamed when placement.stream is set.
std::unique_ptr<StepModel> checkpoint_model(ModelCheckpoint& checkpoint, const ModelConfig& model,
                                            const ComputePlacement& placement);

}  // namespace nanreplay
