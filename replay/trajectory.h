// Rolling forward from one checkpoint: the parameters and AdamW state a
// replay carries from a step to the next when the next has no checkpoint of
// its own. It holds one step's worth (parameters, both moments, the step
// count, the fp16 loss scale) and updates them in place with the step's
// replayed gradients, exactly as "the update between two steps" of the
// bundle format says (clip_grad_norm_, then PyTorch's AdamW; an fp16 step the
// scaler skips changes nothing and halves the scale).
#pragma once

#include <string>
#include <vector>

#include "loaders/bundle.h"
#include "replay/adamw.h"
#include "replay/checkpoint.h"
#include "replay/step.h"

namespace nanreplay {

class Trajectory {
 public:
  // Starts from a step's checkpoint and optimizer state (owned copies: the
  // checkpoint's mapping stays read-only).
  void start(const Bundle& bundle, const StepFiles& files);
  bool started() const { return !order_.empty(); }

  // After step `step` replayed to `result`: the parameters of the next step.
  void advance(const StepResult& result, const StepState& state, bool scaler_skipped);

  // The current parameters as the next step's checkpoint (the same tensors).
  ModelCheckpoint checkpoint() const { return ModelCheckpoint(params_, order_); }
  // A copy of the current parameters that later updates leave alone.
  ModelCheckpoint snapshot() const;
  const ParamMap& params() const { return params_; }
  const std::vector<std::string>& order() const { return order_; }
  // The AdamW state the next update starts from (minimize writes it as a
  // derived step's optimizer.safetensors).
  const AdamWMoments& moments() const { return moments_; }

 private:
  const Manifest* manifest_ = nullptr;
  ParamMap params_;
  std::vector<std::string> order_;
  AdamWMoments moments_;
};

// fp16's loss scale along a rolled-forward window: a step's state.json
// loss_scale when it names one, otherwise the previous step's, halved when
// the scaler skipped that step. Elsewhere every step's own (default 1).
class LossScales {
 public:
  explicit LossScales(bool rolls_forward) : rolls_forward_(rolls_forward) {}
  // The scale of the step `state` describes; call once per step, in order.
  double of(const StepState& state);
  void step_done(bool scaler_skipped);

 private:
  bool rolls_forward_;
  std::optional<double> carried_;
  double current_ = 1.0;
};

// The state a step is replayed with: its state.json with the loss scale `scales` gives it.
StepState with_loss_scale(StepState state, double loss_scale);

// A step of a rolled-forward bundle as the replay starts it: its parameters
// (its checkpoint, or rolled forward from the last checkpoint before it,
// replaying each step on the host without probes) and its loss scale (which
// in fp16 may carry from every step before).
struct RolledStart {
  ModelCheckpoint checkpoint;
  StepState state;
  // A derived step's AdamW state (its parameters' moments and step count);
  // none when the step has a checkpoint of its own.
  std::optional<AdamWMoments> moments;
};
RolledStart roll_to(const Bundle& bundle, int64_t step);

}  // namespace nanreplay
