// clip_grad_norm_ then AdamW, following PyTorch's arithmetic op for op.
#include "replay/adamw.h"

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

void adamw_update(std::vector<torch::Tensor>& params, std::vector<torch::Tensor> grads,
                  double grad_norm, AdamWMoments& moments, double lr,
                  const OptimizerConfig& config, const std::vector<std::string>& names) {
  torch::NoGradGuard no_grad;
  if (config.grad_clip) {
    // clip_grad_norm_: coefficient computed in fp32 and clamped at 1; a
    // non-finite norm poisons every gradient, as in PyTorch.
    const torch::Tensor coef =
        torch::clamp_max(torch::tensor(static_cast<float>(*config.grad_clip)) /
                             (torch::tensor(static_cast<float>(grad_norm)) + 1e-6),
                         1.0);
    for (torch::Tensor& g : grads) g = g * coef;
  }
  if (moments.exp_avg.empty()) {
    for (const torch::Tensor& p : params) {
      moments.exp_avg.push_back(torch::zeros_like(p));
      moments.exp_avg_sq.push_back(torch::zeros_like(p));
    }
  }
  moments.step += 1;
  const double t = static_cast<double>(moments.step);
  const double bias_correction1 = 1.0 - std::pow(config.beta1, t);
  const double bias_correction2 = 1.0 - std::pow(config.beta2, t);
  const double step_size = lr / bias_correction1;
  const double bias_correction2_sqrt = std::sqrt(bias_correction2);
  for (size_t i = 0; i < params.size(); ++i) {
    bool decay = true;
    for (const std::string& pattern : config.no_decay) decay = decay && !glob_match(pattern, names[i]);
    if (decay) params[i].mul_(1.0 - lr * config.weight_decay);
    moments.exp_avg[i].mul_(config.beta1).add_(grads[i], 1.0 - config.beta1);
    moments.exp_avg_sq[i].mul_(config.beta2).addcmul_(grads[i], grads[i], 1.0 - config.beta2);
    const torch::Tensor denom = (moments.exp_avg_sq[i].sqrt() / bias_correction2_sqrt).add_(config.eps);
    params[i].addcdiv_(moments.exp_avg[i], denom, -step_size);
  }
}

}  // namespace nanreplay
