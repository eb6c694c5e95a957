// See checkpoint_update.h. A tensor at a time: its update RMS from the two
// checkpoints (or the optimizer's own update, at the last step), then g^2 /
// v_hat from the state of s's checkpoint (replay/optim/second_moment_lag.h).
#include "replay/step/checkpoint_update.h"

#include <algorithm>
#include <cmath>
#include <optional>

#include <torch/torch.h>

#include "loaders/bundle/optimizer_manifest.h"
#include "replay/optim/clipping.h"
#include "replay/optim/optimizer_state_file.h"
#include "replay/optim/second_moment_lag.h"

namespace nanreplay {

namespace {

// Rows read per pass: about 256 Ki elements, a few MiB of fp64 temporaries.
constexpr int64_t kUpdateSliceElements = int64_t{1} << 18;

int64_t update_slice_rows(int64_t rows, int64_t numel) {
  const int64_t row_elements = rows > 0 ? numel / rows : 0;
  return std::max<int64_t>(1, kUpdateSliceElements / std::max<int64_t>(1, row_elements));
}

// What every tensor of the step shares.
struct StepSources {
  const Bundle& bundle;
  const CheckpointUpdateInput& in;
  const OptimizerConfig* config = nullptr;    // none: no rule, the RMS only
  std::optional<SafetensorsFile> optimizer{};  // s's state, where the bundle has it
  torch::Tensor clip{};                      // clip_grad_norm_'s factor; undefined: no usable gradients
};

// One tensor: s's value and its clipped gradient, both viewed [rows, -1], and its rule.
struct TensorSources {
  std::string name;
  torch::Tensor param, grad;  // the parameter's own shape
  const OptimizerRule* rule = nullptr;
  std::string group;
  bool decay = true;
};

// ||model(s+1) - model(s)|| / sqrt(numel) in fp64, model(s+1) read a slice of rows at a time.
double stored_update_rms(const SafetensorsFile& next, const std::string& name, const torch::Tensor& param) {
  const TensorInfo& info = next.at(name);
  const int64_t rows = info.shape.empty() ? 1 : info.shape[0];
  const torch::Tensor before = param.reshape({rows, -1});
  const int64_t per_slice = update_slice_rows(rows, info.numel());
  double sum_sq = 0.0;
  for (int64_t row = 0; row < rows; row += per_slice) {
    const int64_t count = std::min(per_slice, rows - row);
    const torch::Tensor slice = before.narrow(0, row, count);
    const torch::Tensor after = tensor_from_safetensors(tensor_rows(info, row, count), next.label()).reshape(slice.sizes());
    sum_sq += (after.to(torch::kFloat64) - slice.to(torch::kFloat64)).square().sum().item<double>();
  }
  next.release(info);
  return std::sqrt(sum_sq / static_cast<double>(std::max<int64_t>(1, info.numel())));
}

// g^2 / v_hat from s's stored state: a slice of rows at a time for an
// elementwise rule, whole for one whose moment is factored.
void fold_stored_lag(const StepSources& s, const TensorSources& t, MomentLagSums& sums) {
  const SafetensorsFile& optimizer = *s.optimizer;
  const int64_t updates_before = stored_update_count(optimizer, t.name);
  if (updates_before <= 0 || !keeps_second_moment(*t.rule)) return;  // no moment yet, or no count to correct it by
  const std::vector<int64_t> shape = t.param.sizes().vec();
  if (!elementwise_rule(*t.rule)) {
    const ParamState state = read_param_state(optimizer, t.name, shape, *t.rule);
    fold_second_moment_lag(t.param, t.grad, state, *t.rule, t.decay, sums);
    for (const auto& [key, layout] : state_layout(*t.rule, shape)) optimizer.release(optimizer.at(t.name + "." + key));
    return;
  }
  const int64_t rows = shape.empty() ? 1 : shape[0];
  const torch::Tensor param = t.param.reshape({rows, -1}), grad = t.grad.reshape({rows, -1});
  const int64_t per_slice = update_slice_rows(rows, param.numel());
  const StateLayout layout = state_layout(*t.rule, shape);
  for (int64_t row = 0; row < rows; row += per_slice) {
    const int64_t count = std::min(per_slice, rows - row);
    ParamState state;
    state.step = updates_before;
    for (const auto& [key, key_shape] : layout) {
      (void)key_shape;
      const TensorInfo& info = optimizer.at(t.name + "." + key);
      state.tensors[key] = tensor_from_safetensors(tensor_rows(info, row, count), optimizer.label()).reshape({count, -1});
    }
    fold_second_moment_lag(param.narrow(0, row, count), grad.narrow(0, row, count), state, *t.rule, t.decay, sums);
  }
  for (const auto& [key, key_shape] : layout) optimizer.release(optimizer.at(t.name + "." + key));
}

// The last step: the optimizer's own update of s's checkpoint with s's state and lr.
TensorUpdateStats predicted_update(const StepSources& s, const TensorSources& t, double lr) {
  torch::Tensor param = t.param.detach().clone();
  ParamState state = read_param_state(*s.optimizer, t.name, param.sizes().vec(), *t.rule);
  return update_param_measured(t.name, param, t.grad, state, lr, *t.rule, t.decay);
}

TensorSources tensor_sources(const StepSources& s, size_t i) {
  TensorSources t;
  t.name = s.in.checkpoint->order()[i];
  t.param = s.in.checkpoint->param(t.name).detach();
  if (s.clip.defined()) t.grad = s.in.grads->grads[i].to(torch::kCPU).reshape(t.param.sizes()) * s.clip;
  if (s.config != nullptr) {
    const ParamRule owner = rule_of_param(*s.config, t.name);
    t.rule = owner.rule;
    t.group = owner.group;
    t.decay = !excluded_from_decay(*s.config, t.name);
  }
  return t;
}

StepSources step_sources(const Bundle& bundle, const CheckpointUpdateInput& in) {
  StepSources s{bundle, in};
  const auto& optimizer = bundle.manifest().optimizer;
  if (optimizer) s.config = &*optimizer;
  if (s.config != nullptr && bundle.has_optimizer(*in.current)) {
    s.optimizer.emplace(SafetensorsFile::open(in.current->optimizer.string(), in.current->label("optimizer.safetensors")));
  }
  const bool usable = in.grads != nullptr && !in.skipped_by_scaler && std::isfinite(in.grads->grad_norm) &&
                      in.grads->grads.size() == in.checkpoint->order().size();
  if (usable && s.config != nullptr) s.clip = clip_coefficient(in.grads->grad_norm, *s.config);
  return s;
}

// Every group that holds a parameter has an lr in s's state.json.
bool every_group_has_lr(const StepSources& s) {
  for (const std::string& name : s.in.checkpoint->order()) {
    if (!s.in.state->lr_of(rule_of_param(*s.config, name).group)) return false;
  }
  return true;
}

}  // namespace

StepUpdateStats checkpoint_update_stats(const Bundle& bundle, const CheckpointUpdateInput& in) {
  torch::NoGradGuard no_grad;
  StepUpdateStats out{in.current->step, {}};
  const StepSources s = step_sources(bundle, in);
  std::optional<SafetensorsFile> next;
  if (in.next != nullptr) {
    next.emplace(SafetensorsFile::open(in.next->model.string(), in.next->label("model.safetensors")));
  } else if (!s.optimizer || !s.clip.defined() || in.state == nullptr || !every_group_has_lr(s)) {
    return out;  // the last step: measured only where the optimizer's own update can be computed
  }
  for (size_t i = 0; i < in.checkpoint->order().size(); ++i) {
    const TensorSources t = tensor_sources(s, i);
    if (!next) {
      out.tensors.push_back(predicted_update(s, t, *in.state->lr_of(t.group)));
    } else {
      TensorUpdateStats stats;
      stats.param = t.name;
      stats.update_rms = stored_update_rms(*next, t.name, t.param);
      MomentLagSums sums;
      if (s.optimizer && s.clip.defined()) fold_stored_lag(s, t, sums);
      sums.finish(stats);
      out.tensors.push_back(std::move(stats));
    }
    in.checkpoint->release(t.name);  // a streamed replay's checkpoint is larger than memory
  }
  return out;
}

}  // namespace nanreplay
