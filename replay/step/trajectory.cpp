// See trajectory.h.
#include "replay/step/trajectory.h"

#include <algorithm>
#include <cstring>

#include <torch/torch.h>

#include "loaders/base/error.h"
#include "loaders/bundle/optimizer_manifest.h"
#include "loaders/formats/safetensors.h"
#include "replay/optim/clipping.h"
#include "replay/optim/optimizer_state_file.h"
#include "replay/step/step_scan.h"

namespace nanreplay {

namespace {

// The host, streamed or not as `placement` is: rolling forward replays on the host.
ComputePlacement host_only(const ComputePlacement& placement) {
  ComputePlacement host;
  host.stream = placement.stream;
  return host;
}

}  // namespace

void Trajectory::start(const Bundle& bundle, const StepFiles& files, std::shared_ptr<StreamScratch> scratch) {
  torch::NoGradGuard no_grad;
  manifest_ = &bundle.manifest();
  const OptimizerConfig& config = *manifest_->optimizer;
  const ModelCheckpoint checkpoint(files, bundle.manifest().model);
  params_.clear();
  order_ = checkpoint.order();
  const SafetensorsFile optimizer =
      SafetensorsFile::open(files.optimizer.string(), files.label("optimizer.safetensors"));
  moments_ = OptimizerMoments{};
  next_score_bias_.clear();
  score_bias_steps_.reset();
  scratch_ = std::move(scratch);
  std::vector<std::vector<int64_t>> shapes;
  for (const ParamSpec& spec : expected_parameters(bundle.manifest().model)) shapes.push_back(spec.shape);
  if (scratch_) {
    params_file_ = std::make_shared<ScratchTensors>(scratch_, "derived-parameters", shapes);
    state_files_.clear();
    scratch_steps_.assign(order_.size(), 0);
  }
  for (size_t i = 0; i < order_.size(); ++i) {
    const std::string& name = order_[i];
    const OptimizerRule& rule = *rule_of_param(config, name).rule;
    ParamState state = read_param_state(optimizer, name, shapes[i], rule);
    if (!scratch_) {
      params_.emplace(name, checkpoint.params().at(name).detach().clone().requires_grad_(true));
      moments_.params.push_back(std::move(state));
      continue;
    }
    params_file_->write(i, checkpoint.param(name));
    checkpoint.release(name);
    scratch_steps_[i] = state.step;
    for (const auto& [key, tensor] : state.tensors) state_file(key).write(i, tensor);
  }
}

// The scratch file of state `key`, made on first use with every parameter's
// shape under its rule (a parameter without that state: an empty slot).
ScratchTensors& Trajectory::state_file(const std::string& key) {
  auto found = state_files_.find(key);
  if (found != state_files_.end()) return *found->second;
  std::vector<std::vector<int64_t>> shapes;
  const std::vector<ParamSpec> specs = expected_parameters(manifest_->model);
  for (const ParamSpec& spec : specs) {
    std::vector<int64_t> shape{0};
    for (const auto& [name, layout_shape] : state_layout(*rule_of_param(*manifest_->optimizer, spec.name).rule, spec.shape)) {
      if (name == key) shape = layout_shape;
    }
    shapes.push_back(shape);
  }
  auto file = std::make_shared<ScratchTensors>(scratch_, "state-" + key, shapes);
  return *state_files_.emplace(key, file).first->second;
}

ParamState Trajectory::scratch_state(size_t i) const {
  ParamState state;
  state.step = scratch_steps_.at(i);
  for (const auto& [key, file] : state_files_) {
    if (file->holds(i)) state.tensors[key] = file->read(i);
  }
  return state;
}

// torchtitan updates the bias in an optimizer step pre-hook (score_bias_update.h):
// from the bias the step used and every token counted since the last update.
void Trajectory::advance_score_bias(const StepResult& result, bool scaler_skipped) {
  const std::optional<MoeConfig>& moe = manifest_->model.moe;
  if (!moe || !moe->score_bias_update || !result.score_bias) return;
  if (result.router_tokens.empty()) throw std::logic_error("Trajectory::advance: the step counted no routed tokens");
  if (!score_bias_steps_) score_bias_steps_.emplace(*moe->score_bias_update);
  next_score_bias_ = score_bias_steps_->after_step(result.score_bias->by_layer, result.router_tokens, !scaler_skipped);
}

StepState Trajectory::with_derived_score_bias(StepState state, const StepFiles& files) const {
  if (!files.has_model) state.derived_router_score_bias = next_score_bias_;
  return state;
}

void Trajectory::advance(const StepResult& result, const StepState& state, bool scaler_skipped) {
  last_update_ = StepUpdateStats{state.step, {}};
  advance_score_bias(result, scaler_skipped);
  if (scaler_skipped) return;  // GradScaler: no update
  const std::string label = "step " + std::to_string(state.step);
  const GroupLr lr_of = [&state, label](const std::string& group) {
    const std::optional<double> lr = state.lr_of(group);
    if (!lr) throw std::logic_error("Trajectory::advance without the lr of group " + group + " at " + label);
    return *lr;
  };
  if (scratch_) return advance_on_scratch(result, lr_of);
  std::vector<torch::Tensor> plain, grads;
  for (size_t i = 0; i < order_.size(); ++i) {
    plain.push_back(params_.at(order_[i]).detach());
    grads.push_back(result.grads.at(i).to(plain.back().device()));  // a replay on a device: masters stay on the host
  }
  optimizer_update(plain, grads, result.grad_norm, moments_, lr_of, *manifest_->optimizer, order_,
                   manifest_->model, result.attn_logit_max, measure_ ? &last_update_.tensors : nullptr);
}

// optimizer_update's arithmetic, one parameter at a time through the scratch files.
void Trajectory::advance_on_scratch(const StepResult& result, const GroupLr& lr_of) {
  torch::NoGradGuard no_grad;
  const OptimizerConfig& config = *manifest_->optimizer;
  const torch::Tensor coef = clip_coefficient(result.grad_norm, config);
  for (size_t i = 0; i < order_.size(); ++i) {
    const ParamRule owner = rule_of_param(config, order_[i]);
    torch::Tensor param = params_file_->read(i);
    ParamState state = scratch_state(i);
    const bool decay = !excluded_from_decay(config, order_[i]);
    if (measure_) {
      last_update_.tensors.push_back(update_param_measured(order_[i], param, result.grads[i] * coef, state,
                                                           lr_of(owner.group), *owner.rule, decay));
    } else {
      update_param(param, result.grads[i] * coef, state, lr_of(owner.group), *owner.rule, decay);
    }
    params_file_->write(i, param);
    for (const auto& [key, tensor] : state.tensors) state_file(key).write(i, tensor);
    scratch_steps_[i] = state.step;
  }
  if (!uses_qk_clip(config)) return;
  apply_qk_clip(config, manifest_->model, result.attn_logit_max, order_,
                [this](size_t i) { return params_file_->read(i); },
                [this](size_t i, const torch::Tensor& value) { params_file_->write(i, value); });
}

ModelCheckpoint Trajectory::checkpoint() const {
  if (!scratch_) return ModelCheckpoint(params_, order_);
  return ModelCheckpoint([file = params_file_](size_t i) { return file->read(i); }, order_);
}

OptimizerMoments Trajectory::moments() const {
  if (!scratch_) return moments_;
  OptimizerMoments whole;
  for (size_t i = 0; i < order_.size(); ++i) whole.params.push_back(scratch_state(i));
  return whole;
}

ModelCheckpoint Trajectory::snapshot() const {
  torch::NoGradGuard no_grad;
  if (scratch_) {
    std::vector<std::vector<int64_t>> shapes;
    for (const ParamSpec& spec : expected_parameters(manifest_->model)) shapes.push_back(spec.shape);
    auto copy = std::make_shared<ScratchTensors>(scratch_, "snapshot", shapes);
    for (size_t i = 0; i < order_.size(); ++i) copy->write(i, params_file_->read(i));
    return ModelCheckpoint([copy](size_t i) { return copy->read(i); }, order_);
  }
  ParamMap copy;
  for (const auto& [name, tensor] : params_) copy.emplace(name, tensor.detach().clone().requires_grad_(true));
  return ModelCheckpoint(std::move(copy), order_);
}

double LossScales::of(const StepState& state) {
  current_ = rolls_forward_ && !state.loss_scale_given && carried_ ? *carried_ : state.loss_scale;
  return current_;
}

void LossScales::step_done(bool scaler_skipped) { carried_ = scaler_skipped ? current_ / 2 : current_; }

StepState with_loss_scale(StepState state, double loss_scale) {
  state.loss_scale = loss_scale;
  return state;
}

RolledStart roll_to(const Bundle& bundle, int64_t step, const ComputePlacement& placement) {
  const std::vector<StepFiles>& steps = bundle.steps();
  const Manifest& m = bundle.manifest();
  const auto target = std::find_if(steps.begin(), steps.end(), [&](const StepFiles& f) { return f.step == step; });
  if (target == steps.end()) throw std::logic_error("roll_to: step " + std::to_string(step) + " not listed");
  auto from = target;
  while (!from->has_model) --from;  // the first step always has one
  // The parameters need only the steps since the last checkpoint; an fp16
  // loss scale the step does not name is carried from the very first step.
  const bool fp16 = m.precision.compute == Compute::kFp16;
  if (fp16 && bundle.rolls_forward() && !bundle.load_state(*target).loss_scale_given) from = steps.begin();
  Trajectory trajectory;
  LossScales scales(bundle.rolls_forward());
  for (auto it = from; it != target; ++it) {
    const StepState logged = bundle.load_state(*it);
    const StepState state = trajectory.with_derived_score_bias(with_loss_scale(logged, scales.of(logged)), *it);
    ModelCheckpoint checkpoint = it->has_model ? ModelCheckpoint(*it, m.model) : trajectory.checkpoint();
    StepRequest request;
    request.probes = ProbeLevel::kOff;
    const StepResult result = replay_step({m, bundle.tokens(), it->step, state, batch_of_step(bundle, it->step)},
                                          checkpoint, host_only(placement), request);
    const bool skipped = judge_step(result, m.precision.compute).scaler_skips;
    scales.step_done(skipped);
    if ((it + 1)->has_model) continue;  // the next step starts from its own checkpoint
    if (it->has_model) trajectory.start(bundle, *it, placement.stream);
    trajectory.advance(result, state, skipped);
  }
  const StepState logged = bundle.load_state(*target);
  std::optional<OptimizerMoments> moments;
  if (!target->has_model) moments = trajectory.moments();
  return {target->has_model ? ModelCheckpoint(*target, m.model) : trajectory.checkpoint(),
          trajectory.with_derived_score_bias(with_loss_scale(logged, scales.of(logged)), *target), std::move(moments)};
}

}  // namespace nanreplay
