// transformers.optimization.Adafactor (Hugging Face), its step() op for op.
// Where it differs from torch.optim.Adafactor: eps1 (1e-30) is added to
// grad^2 before the moments; the step size is rel * max(eps2, RMS(param))
// with rel = min(1e-2 (or 1e-6 * t with warmup_init), 1/sqrt(t)) under
// relative_step, else the external lr; the update is divided by
// max(1, RMS(update) / clip_threshold) and then scaled; beta1 keeps an
// exp_avg of the scaled update; weight decay is p += -weight_decay * step * p
// with its own step size, not the external lr.
#include <algorithm>
#include <cmath>

#include <torch/torch.h>

#include "replay/optim/rules.h"

namespace nanreplay {

namespace {

// Hugging Face's _rms: norm(2) / sqrt(numel), a 0-d fp32 tensor.
torch::Tensor hf_rms(const torch::Tensor& t) { return t.norm(2) / std::pow(static_cast<double>(t.numel()), 0.5); }

// _get_lr: rel_step_sz * param_scale. Where RMS wins the max, the product is
// a fp32 tensor op (rounded to fp32) as in Python.
double hf_step_size(const OptimizerRule& rule, int64_t step, double external_lr, const torch::Tensor& param) {
  double relative = external_lr;
  if (rule.relative_step) {
    const double min_step = rule.warmup_init ? 1e-6 * static_cast<double>(step) : 1e-2;
    relative = std::min(min_step, 1.0 / std::sqrt(static_cast<double>(step)));
  }
  if (!rule.scale_parameter) return relative;
  const float rms = hf_rms(param).item<float>();
  if (static_cast<double>(rms) > rule.eps2) return static_cast<double>(rms * static_cast<float>(relative));
  return rule.eps2 * relative;
}

// _approx_sq_grad: (row / mean(row)).rsqrt() [.., n, 1] times col.rsqrt() [.., 1, m].
torch::Tensor hf_approx_sq_grad(const torch::Tensor& row, const torch::Tensor& col) {
  const torch::Tensor r_factor = (row / row.mean({-1}, true)).rsqrt_().unsqueeze(-1);
  const torch::Tensor c_factor = col.unsqueeze(-2).rsqrt();
  return torch::mul(r_factor, c_factor);
}

}  // namespace

void adafactor_hf_update(torch::Tensor& param, const torch::Tensor& grad, ParamState& state, double lr,
                         const OptimizerRule& rule, bool decay) {
  torch::NoGradGuard no_grad;
  const int64_t step = state.step + 1;
  const double step_size = hf_step_size(rule, step, lr, param);
  const double beta2t = 1.0 - std::pow(static_cast<double>(step), rule.decay_rate);
  torch::Tensor update = grad.pow(2) + rule.eps1.value_or(1e-30);
  if (grad.dim() >= 2) {
    torch::Tensor& row = state.tensors.at("exp_avg_sq_row");
    torch::Tensor& col = state.tensors.at("exp_avg_sq_col");
    row.mul_(beta2t).add_(update.mean({-1}), 1.0 - beta2t);
    col.mul_(beta2t).add_(update.mean({-2}), 1.0 - beta2t);
    update = hf_approx_sq_grad(row, col);
    update.mul_(grad);
  } else {
    torch::Tensor& exp_avg_sq = state.tensors.at("exp_avg_sq");
    exp_avg_sq.mul_(beta2t).add_(update, 1.0 - beta2t);
    update = exp_avg_sq.rsqrt().mul_(grad);
  }
  update.div_((hf_rms(update) / rule.clip_threshold).clamp_min_(1.0));
  update.mul_(step_size);
  if (rule.hf_beta1) {
    torch::Tensor& exp_avg = state.tensors.at("exp_avg");
    exp_avg.mul_(*rule.hf_beta1).add_(update, 1.0 - *rule.hf_beta1);
    update = exp_avg;
  }
  if (decay && rule.weight_decay != 0) param.add_(param, -rule.weight_decay * step_size);
  param.add_(-update);
}

}  // namespace nanreplay
