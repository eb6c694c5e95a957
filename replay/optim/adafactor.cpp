// torch.optim.Adafactor (torch/optim/_adafactor.py, _single_tensor_adafactor):
// beta2_t = 1 - t^beta2_decay, rho_t = min(lr, 1/sqrt(t)), step size
// alpha = max(eps2, RMS(param before decay)) * rho_t, decoupled decay by
// lr * weight_decay, a factored second moment (row_var, col_var) for matrices
// or a full one (variance) for vectors, eps1 (default fp32's epsilon) as the
// floor of the row mean and of sqrt(variance), and the update divided by
// max(1, RMS(update) / d). Scalars that PyTorch takes through .item() are
// doubles here too.
#include <algorithm>
#include <cmath>
#include <limits>

#include <torch/torch.h>

#include "replay/optim/rules.h"

namespace nanreplay {

namespace {

double rms_item(const torch::Tensor& t) {
  return t.norm(2).item<double>() / std::sqrt(static_cast<double>(t.numel()));
}

// The variance estimate of a matrix from its factors, row_var [.., n, 1] and col_var [.., 1, m].
torch::Tensor factored_variance(const torch::Tensor& grad, ParamState& state, double one_minus_beta2_t, double eps1) {
  torch::Tensor& row_var = state.tensors.at("row_var");
  torch::Tensor& col_var = state.tensors.at("col_var");
  const torch::Tensor row_mean =
      torch::linalg_vector_norm(grad, 2, {-1}, true, c10::nullopt).square_().div_(static_cast<double>(grad.size(-1)));
  row_var.lerp_(row_mean, one_minus_beta2_t);
  const torch::Tensor col_mean =
      torch::linalg_vector_norm(grad, 2, {-2}, true, c10::nullopt).square_().div_(static_cast<double>(grad.size(-2)));
  col_var.lerp_(col_mean, one_minus_beta2_t);
  torch::Tensor estimate = torch::matmul(row_var, col_var);
  estimate.div_(row_var.mean({-2}, true).clamp_min_(eps1));
  return estimate;
}

}  // namespace

void adafactor_update(torch::Tensor& param, const torch::Tensor& grad_in, ParamState& state, double lr,
                      const OptimizerRule& rule, bool decay) {
  torch::NoGradGuard no_grad;
  const torch::Tensor grad = rule.maximize ? -grad_in : grad_in;
  const double eps1 = rule.eps1.value_or(static_cast<double>(std::numeric_limits<float>::epsilon()));
  const double t = static_cast<double>(state.step + 1);
  const double one_minus_beta2_t = std::pow(t, rule.beta2_decay);
  const double rho_t = std::min(lr, 1.0 / std::pow(t, 0.5));
  const double alpha = std::max(rule.eps2, rms_item(param)) * rho_t;
  if (decay && rule.weight_decay != 0) param.mul_(1.0 - lr * rule.weight_decay);
  torch::Tensor estimate;
  if (grad.dim() > 1) {
    estimate = factored_variance(grad, state, one_minus_beta2_t, eps1);
  } else {
    torch::Tensor& variance = state.tensors.at("variance");
    variance.lerp_(grad * grad, one_minus_beta2_t);
    estimate = variance.clone();
  }
  torch::Tensor update = estimate.clamp_min_(eps1 * eps1).rsqrt_();
  update.mul_(grad);
  const double denom =
      std::max(1.0, update.norm(2).item<double>() / (std::sqrt(static_cast<double>(update.numel())) * rule.d));
  param.add_(update, -alpha / denom);
}

}  // namespace nanreplay
