// See trajectory.h.
#include "replay/step/trajectory.h"

#include <algorithm>
#include <cstring>

#include <torch/torch.h>

#include "loaders/base/error.h"
#include "loaders/formats/safetensors.h"
#include "replay/step/step_scan.h"

namespace nanreplay {

namespace {

int64_t updates_applied(const SafetensorsFile& optimizer) {
  const TensorInfo& step = optimizer.at("step");
  if (step.dtype == DType::kI64) {
    int64_t value = 0;
    std::memcpy(&value, step.data, 8);
    return value;
  }
  float value = 0;
  std::memcpy(&value, step.data, 4);
  return static_cast<int64_t>(value);
}

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
  const ModelCheckpoint checkpoint(files, bundle.manifest().model);
  params_.clear();
  order_ = checkpoint.order();
  const std::string label = files.label("optimizer.safetensors");
  const SafetensorsFile optimizer = SafetensorsFile::open(files.optimizer.string(), label);
  moments_ = AdamWMoments{};
  moments_.step = updates_applied(optimizer);
  scratch_ = std::move(scratch);
  if (scratch_) {
    std::vector<std::vector<int64_t>> shapes;
    for (const ParamSpec& spec : expected_parameters(bundle.manifest().model)) shapes.push_back(spec.shape);
    params_file_ = std::make_shared<ScratchTensors>(scratch_, "derived-parameters", shapes);
    exp_avg_file_ = std::make_shared<ScratchTensors>(scratch_, "exp-avg", shapes);
    exp_avg_sq_file_ = std::make_shared<ScratchTensors>(scratch_, "exp-avg-sq", shapes);
  }
  for (size_t i = 0; i < order_.size(); ++i) {
    const std::string& name = order_[i];
    if (scratch_) {
      params_file_->write(i, checkpoint.param(name));
      checkpoint.release(name);
    } else {
      params_.emplace(name, checkpoint.params().at(name).detach().clone().requires_grad_(true));
    }
    for (const char* moment : {".exp_avg", ".exp_avg_sq"}) {
      const TensorInfo& info = optimizer.at(name + moment);
      torch::Tensor value = tensor_from_safetensors(info, label);
      const bool average = std::string(moment) == ".exp_avg";
      if (scratch_) {
        (average ? exp_avg_file_ : exp_avg_sq_file_)->write(i, value);
      } else {
        (average ? moments_.exp_avg : moments_.exp_avg_sq).push_back(value.clone());
      }
      optimizer.release(info);
    }
  }
}

void Trajectory::advance(const StepResult& result, const StepState& state, bool scaler_skipped) {
  if (scaler_skipped) return;  // GradScaler: no update
  if (!state.lr) throw std::logic_error("Trajectory::advance without lr (the structure check requires it)");
  if (scratch_) return advance_on_scratch(result, *state.lr);
  std::vector<torch::Tensor> plain, grads;
  for (size_t i = 0; i < order_.size(); ++i) {
    plain.push_back(params_.at(order_[i]).detach());
    grads.push_back(result.grads.at(i).to(plain.back().device()));  // a replay on a device: masters stay on the host
  }
  adamw_update(plain, std::move(grads), result.grad_norm, moments_, *state.lr, *manifest_->optimizer, order_);
}

// adamw_update's arithmetic, one parameter at a time through the scratch files.
void Trajectory::advance_on_scratch(const StepResult& result, double lr) {
  torch::NoGradGuard no_grad;
  const OptimizerConfig& config = *manifest_->optimizer;
  const torch::Tensor coef = clip_coefficient(result.grad_norm, config);
  for (size_t i = 0; i < order_.size(); ++i) {
    torch::Tensor param = params_file_->read(i), exp_avg = exp_avg_file_->read(i), exp_avg_sq = exp_avg_sq_file_->read(i);
    adamw_step_one(param, result.grads[i] * coef, exp_avg, exp_avg_sq, moments_.step, lr, config,
                   !excluded_from_decay(config, order_[i]));
    params_file_->write(i, param);
    exp_avg_file_->write(i, exp_avg);
    exp_avg_sq_file_->write(i, exp_avg_sq);
  }
  moments_.step += 1;
}

ModelCheckpoint Trajectory::checkpoint() const {
  if (!scratch_) return ModelCheckpoint(params_, order_);
  return ModelCheckpoint([file = params_file_](size_t i) { return file->read(i); }, order_);
}

AdamWMoments Trajectory::moments() const {
  if (!scratch_) return moments_;
  AdamWMoments whole;
  whole.step = moments_.step;
  for (size_t i = 0; i < order_.size(); ++i) {
    whole.exp_avg.push_back(exp_avg_file_->read(i));
    whole.exp_avg_sq.push_back(exp_avg_sq_file_->read(i));
  }
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
    const StepState state = with_loss_scale(logged, scales.of(logged));
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
  std::optional<AdamWMoments> moments;
  if (!target->has_model) moments = trajectory.moments();
  return {target->has_model ? ModelCheckpoint(*target, m.model) : trajectory.checkpoint(),
          with_loss_scale(logged, scales.of(logged)), std::move(moments)};
}

}  // namespace nanreplay
