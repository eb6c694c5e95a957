// clip_grad_norm_ then AdamW, following PyTorch's arithmetic op for op.
#include "replay/optim/adamw.h"

#include <cmath>

#include <torch/torch.h>

namespace nanreplay {

bool glob_match(const std::string& pattern, const std::string& name) {
  size_t p = 0, n = 0, star = std::string::npos, mark = 0;
  while (n < name.size()) {
    if (p < pattern.size() && (pattern[p] == '?' || pattern[p] == name[n])) {
      ++p;
      ++n;
    } else if (p < pattern.size() && pattern[p] == '*') {
      star = p++;
      mark = n;
    } else if (star != std::string::npos) {
      p = star + 1;
      n = ++mark;
    } else {
      return false;
    }
  }
  while (p < pattern.size() && pattern[p] == '*') ++p;
  return p == pattern.size();
}

torch::Tensor clip_coefficient(double grad_norm, const OptimizerConfig& config) {
  if (!config.grad_clip) return torch::tensor(1.0f);
  // A non-finite norm poisons every gradient, as in PyTorch.
  return torch::clamp_max(torch::tensor(static_cast<float>(*config.grad_clip)) /
                              (torch::tensor(static_cast<float>(grad_norm)) + 1e-6),
                          1.0);
}

bool excluded_from_decay(const OptimizerConfig& config, const std::string& name) {
  for (const std::string& pattern : config.no_decay) {
    if (glob_match(pattern, name)) return true;
  }
  return false;
}

void adamw_step_one(torch::Tensor& param, const torch::Tensor& grad, torch::Tensor& exp_avg,
                    torch::Tensor& exp_avg_sq, int64_t updates_before, double lr,
                    const OptimizerConfig& config, bool decay) {
  torch::NoGradGuard no_grad;
  const double t = static_cast<double>(updates_before + 1);
  const double bias_correction1 = 1.0 - std::pow(config.beta1, t);
  const double bias_correction2_sqrt = std::sqrt(1.0 - std::pow(config.beta2, t));
  const double step_size = lr / bias_correction1;
  if (decay) param.mul_(1.0 - lr * config.weight_decay);
  exp_avg.mul_(config.beta1).add_(grad, 1.0 - config.beta1);
  exp_avg_sq.mul_(config.beta2).addcmul_(grad, grad, 1.0 - config.beta2);
  const torch::Tensor denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(config.eps);
  param.addcdiv_(exp_avg, denom, -step_size);
}

void adamw_update(std::vector<torch::Tensor>& params, std::vector<torch::Tensor> grads,
                  double grad_norm, AdamWMoments& moments, double lr,
                  const OptimizerConfig& config, const std::vector<std::string>& names) {
  torch::NoGradGuard no_grad;
  const torch::Tensor coef = clip_coefficient(grad_norm, config);
  if (moments.exp_avg.empty()) {
    for (const torch::Tensor& p : params) {
      moments.exp_avg.push_back(torch::zeros_like(p));
      moments.exp_avg_sq.push_back(torch::zeros_like(p));
    }
  }
  for (size_t i = 0; i < params.size(); ++i) {
    adamw_step_one(params[i], grads[i] * coef, moments.exp_avg[i], moments.exp_avg_sq[i],
                   moments.step, lr, config, !excluded_from_decay(config, names[i]));
  }
  moments.step += 1;
}

}  // namespace nanreplay
