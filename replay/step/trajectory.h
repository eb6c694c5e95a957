// Rolling forward from one checkpoint: the parameters and optimizer state a
// replay carries from a step to the next when the next has no checkpoint of
// its own. It holds one step's worth (parameters, each one's optimizer state
// and update count, the fp16 loss scale) and updates them in place with the
// step's replayed gradients, exactly as "the update between two steps" of the
// bundle format says (clip_grad_norm_, then each parameter group's rule with
// its lr, then MuonClip; docs/optimizers.md; an fp16 step the scaler skips
// changes nothing and halves the scale). A layer-streamed
// replay keeps them on scratch files instead, one tensor at a time in memory.
#pragma once

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "loaders/bundle/bundle.h"
#include "replay/optim/optimizer.h"
#include "replay/step/checkpoint.h"
#include "replay/step/layer_stream.h"
#include "replay/step/score_bias_update.h"
#include "replay/step/step.h"

namespace nanreplay {

class Trajectory {
 public:
  // Starts from a step's checkpoint and optimizer state (owned copies: the
  // checkpoint's mapping stays read-only), on scratch files in `scratch` when set.
  void start(const Bundle& bundle, const StepFiles& files, std::shared_ptr<StreamScratch> scratch = nullptr);
  bool started() const { return !order_.empty(); }

  // After step `step` replayed to `result`: the parameters of the next step
  // (and, with model.moe.score_bias_update, its router's correction bias).
  void advance(const StepResult& result, const StepState& state, bool scaler_skipped);
  // `state` as the step after the last advance replays it: a rolled-forward
  // step (no checkpoint of its own: `files`) gets the correction bias derived
  // for it (StepState::derived_router_score_bias); otherwise unchanged.
  StepState with_derived_score_bias(StepState state, const StepFiles& files) const;
  // What the last advance did to each tensor (update_stats.h), once
  // measure_updates() asked for it (`run`; a little arithmetic per tensor);
  // empty otherwise, or when it changed nothing (a step the scaler skipped).
  void measure_updates() { measure_ = true; }
  const StepUpdateStats& last_update() const { return last_update_; }

  // The current parameters as the next step's checkpoint (the same tensors,
  // or what the scratch file holds when read).
  ModelCheckpoint checkpoint() const;
  // A copy of the current parameters that later updates leave alone.
  ModelCheckpoint snapshot() const;
  const std::vector<std::string>& order() const { return order_; }
  // The optimizer state the next update starts from (minimize writes it as a
  // derived step's optimizer.safetensors); read whole from scratch files.
  OptimizerMoments moments() const;

 private:
  void advance_on_scratch(const StepResult& result, const GroupLr& lr_of);
  void advance_score_bias(const StepResult& result, bool scaler_skipped);
  ScratchTensors& state_file(const std::string& key);
  ParamState scratch_state(size_t i) const;

  const Manifest* manifest_ = nullptr;
  ParamMap params_;
  std::vector<std::string> order_;
  OptimizerMoments moments_;
  // On scratch instead (a layer-streamed replay): the parameters, one file
  // per state name (a parameter without that state leaves its slot empty),
  // and each parameter's update count.
  std::shared_ptr<StreamScratch> scratch_;
  std::shared_ptr<ScratchTensors> params_file_;
  std::map<std::string, std::shared_ptr<ScratchTensors>> state_files_;
  std::vector<int64_t> scratch_steps_;
  bool measure_ = false;
  StepUpdateStats last_update_;
  // model.moe.score_bias_update: the bias derived for the next step, and its
  // update from step to step (replay/step/score_bias_update.h).
  std::map<int, std::vector<double>> next_score_bias_;
  std::optional<ScoreBiasSteps> score_bias_steps_;
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
  // A derived step's optimizer state (each parameter's state tensors and
  // update count); none when the step has a checkpoint of its own.
  std::optional<OptimizerMoments> moments;
};
// `placement`: where the steps before it replay (streamed: their parameters
// and moments on scratch files too).
RolledStart roll_to(const Bundle& bundle, int64_t step, const ComputePlacement& placement = {});

}  // namespace nanreplay
