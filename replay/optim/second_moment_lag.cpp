// See second_moment_lag.h. Every v_hat is the one the named class's update
// divides by, from the state before this step's gradient (docs/optimizers.md#update-statistics).
#include "replay/optim/second_moment_lag.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include <torch/torch.h>

namespace nanreplay {

namespace {

torch::Tensor as_double(const ParamState& state, const char* key) { return state.tensors.at(key).to(torch::kFloat64); }

// Adam's exp_avg_sq over its bias correction 1 - beta2^t, t the updates already applied.
torch::Tensor adam_second_moment(const ParamState& state, const OptimizerRule& rule) {
  const double bias_correction2 = 1.0 - std::pow(rule.beta2, static_cast<double>(state.step));
  return as_double(state, "exp_avg_sq") / bias_correction2;
}

// torch.optim.Adafactor: row_var @ col_var / max(mean(row_var), eps1), or a vector's variance.
torch::Tensor torch_adafactor_second_moment(const torch::Tensor& grad, const ParamState& state, const OptimizerRule& rule) {
  if (grad.dim() <= 1) return as_double(state, "variance");
  const double eps1 = rule.eps1.value_or(static_cast<double>(std::numeric_limits<float>::epsilon()));
  const torch::Tensor row = as_double(state, "row_var"), col = as_double(state, "col_var");
  return torch::matmul(row, col) / row.mean({-2}, true).clamp_min(eps1);
}

// transformers' Adafactor: (row / mean(row)) [.., n, 1] * col [.., 1, m], or a vector's exp_avg_sq.
torch::Tensor hf_adafactor_second_moment(const torch::Tensor& grad, const ParamState& state) {
  if (grad.dim() < 2) return as_double(state, "exp_avg_sq");
  const torch::Tensor row = as_double(state, "exp_avg_sq_row"), col = as_double(state, "exp_avg_sq_col");
  return (row / row.mean({-1}, true)).unsqueeze(-1) * col.unsqueeze(-2);
}

}  // namespace

void MomentLagSums::add(const torch::Tensor& g2, const torch::Tensor& v_hat) {
  seen = true;
  sum_g2 += g2.sum().item<double>();
  sum_v += v_hat.sum().item<double>();
  const torch::Tensor positive = v_hat > 0;
  const int64_t count = positive.sum().item<int64_t>();
  if (count == 0) return;
  const torch::Tensor ratio = g2.masked_select(positive) / v_hat.masked_select(positive);
  max_ratio = held == 0 ? ratio.max().item<double>() : std::max(max_ratio, ratio.max().item<double>());
  sum_ratio_sq += ratio.square().sum().item<double>();
  held += count;
}

void MomentLagSums::finish(TensorUpdateStats& stats) const {
  if (!seen) return;
  if (sum_v > 0) stats.g2_over_v = sum_g2 / sum_v;  // the element counts cancel: mean over mean
  if (held == 0) return;
  stats.g2_over_v_max = max_ratio;
  stats.g2_over_v_rms = std::sqrt(sum_ratio_sq / static_cast<double>(held));
}

bool keeps_second_moment(const OptimizerRule& rule) { return rule.kind != OptimizerKind::kMuon; }

void fold_second_moment_lag(const torch::Tensor& param, const torch::Tensor& grad_in, const ParamState& state,
                            const OptimizerRule& rule, bool decay, MomentLagSums& sums) {
  torch::NoGradGuard no_grad;
  if (state.step == 0 || !keeps_second_moment(rule)) return;
  // In double: a spiking gradient's square overflows fp32 long before the gradient does.
  torch::Tensor grad = grad_in.to(torch::kFloat64);
  torch::Tensor v_hat;
  switch (rule.kind) {
    case OptimizerKind::kAdam:
    case OptimizerKind::kAdamW: {
      const bool decoupled = rule.kind == OptimizerKind::kAdamW || rule.decoupled_weight_decay;
      if (decay && rule.weight_decay != 0 && !decoupled) grad = grad.add(param.to(torch::kFloat64), rule.weight_decay);
      v_hat = adam_second_moment(state, rule);
      break;
    }
    case OptimizerKind::kAdafactor: v_hat = torch_adafactor_second_moment(grad, state, rule); break;
    case OptimizerKind::kAdafactorHf: v_hat = hf_adafactor_second_moment(grad, state); break;
    case OptimizerKind::kMuon: return;
  }
  sums.add(grad.square(), v_hat.reshape(grad.sizes()));
}

}  // namespace nanreplay
