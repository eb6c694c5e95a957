// torch.optim.Adam and torch.optim.AdamW, single-tensor path (as of 1.13,
// whose arithmetic later releases keep): maximize negates the gradient; Adam
// adds weight_decay * param to it (L2), AdamW (or Adam with
// decoupled_weight_decay) shrinks the parameter by lr * weight_decay first;
// amsgrad divides by the running maximum of exp_avg_sq.
#include <cmath>

#include <torch/torch.h>

#include "replay/optim/rules.h"

namespace nanreplay {

void adam_family_update(torch::Tensor& param, const torch::Tensor& grad_in, ParamState& state, double lr,
                        const OptimizerRule& rule, bool decay) {
  torch::NoGradGuard no_grad;
  torch::Tensor grad = rule.maximize ? -grad_in : grad_in;
  const bool decoupled = rule.kind == OptimizerKind::kAdamW || rule.decoupled_weight_decay;
  if (decay && rule.weight_decay != 0) {
    if (decoupled) {
      param.mul_(1.0 - lr * rule.weight_decay);
    } else {
      grad = grad.add(param, rule.weight_decay);
    }
  }
  torch::Tensor& exp_avg = state.tensors.at("exp_avg");
  torch::Tensor& exp_avg_sq = state.tensors.at("exp_avg_sq");
  const double t = static_cast<double>(state.step + 1);
  const double bias_correction1 = 1.0 - std::pow(rule.beta1, t);
  const double bias_correction2_sqrt = std::sqrt(1.0 - std::pow(rule.beta2, t));
  const double step_size = lr / bias_correction1;
  exp_avg.mul_(rule.beta1).add_(grad, 1.0 - rule.beta1);
  exp_avg_sq.mul_(rule.beta2).addcmul_(grad, grad, 1.0 - rule.beta2);
  torch::Tensor second = exp_avg_sq;
  if (rule.amsgrad) {
    torch::Tensor& max_exp_avg_sq = state.tensors.at("max_exp_avg_sq");
    torch::maximum_out(max_exp_avg_sq, max_exp_avg_sq, exp_avg_sq);
    second = max_exp_avg_sq;
  }
  const torch::Tensor denom = (second.sqrt() / bias_correction2_sqrt).add_(rule.eps);
  param.addcdiv_(exp_avg, denom, -step_size);
}

}  // namespace nanreplay
