// See score_bias_update.h.
#include "replay/step/score_bias_update.h"

#include <algorithm>
#include <stdexcept>
#include <string>

#include <torch/torch.h>

namespace nanreplay {

namespace {

// One layer's update, as torchtitan's register_moe_load_balancing_hook's
// _update_expert_bias (torchtitan/components/optimizer/optimizer.py, read at
// commit b5bcd76c66d0acb1a08b176d9639425bc55e0b2a) computes it in an optimizer
// step pre-hook, so after the step's forward and backward and before its
// optimizer step, the bias then used by the next step's forward:
//   tokens_per_expert_E = tokens_per_expert_E_by_layer[i].float()   (summed over the
//       step's micro-batches, all-reduced over the data-parallel ranks)
//   expert_bias_delta_E = load_balance_coeff * torch.sign(tokens_per_expert_E.mean() - tokens_per_expert_E)
//   expert_bias_delta_E = expert_bias_delta_E - expert_bias_delta_E.mean()
//   moe.expert_bias_E.add_(expert_bias_delta_E)          (an fp32 buffer)
// The DeepSeek-V3 paper's rule (arXiv 2412.19437, section 2.1.2: each bias up
// by gamma when its expert is underloaded, down by gamma when overloaded) does
// not subtract the mean ("sign").
torch::Tensor layer_delta(const MoeConfig::ScoreBiasUpdate& update, const std::vector<int64_t>& tokens) {
  const torch::Tensor counts =
      torch::tensor(std::vector<int64_t>(tokens), torch::kInt64).to(torch::kFloat32);
  torch::Tensor delta = update.rate * torch::sign(counts.mean() - counts);
  if (update.rule == MoeConfig::ScoreBiasUpdate::Rule::kSignCentred) delta = delta - delta.mean();
  return delta;
}

}  // namespace

std::map<int, std::vector<double>> updated_score_bias(const MoeConfig::ScoreBiasUpdate& update,
                                                      const std::map<int, std::vector<double>>& bias,
                                                      const std::vector<std::vector<int64_t>>& tokens) {
  torch::NoGradGuard no_grad;
  std::map<int, std::vector<double>> next;
  for (const auto& [layer, values] : bias) {
    if (static_cast<size_t>(layer) >= tokens.size() || tokens[static_cast<size_t>(layer)].size() != values.size()) {
      throw std::logic_error("updated_score_bias: no token counts for layer " + std::to_string(layer));
    }
    torch::Tensor buffer = torch::tensor(values, torch::kFloat64).to(torch::kFloat32);
    buffer.add_(layer_delta(update, tokens[static_cast<size_t>(layer)]));
    const torch::Tensor wide = buffer.to(torch::kFloat64).contiguous();
    next[layer].assign(wide.data_ptr<double>(), wide.data_ptr<double>() + wide.numel());
  }
  return next;
}

std::map<int, std::vector<double>> ScoreBiasSteps::after_step(const std::map<int, std::vector<double>>& used,
                                                              const std::vector<std::vector<int64_t>>& tokens,
                                                              bool optimizer_stepped) {
  if (pending_.size() < tokens.size()) pending_.resize(tokens.size());
  for (size_t l = 0; l < tokens.size(); ++l) {
    std::vector<int64_t>& row = pending_[l];
    row.resize(std::max(row.size(), tokens[l].size()), 0);
    for (size_t e = 0; e < tokens[l].size(); ++e) row[e] += tokens[l][e];
  }
  if (!optimizer_stepped) return used;
  std::map<int, std::vector<double>> next = updated_score_bias(update_, used, pending_);
  pending_.clear();
  return next;
}

}  // namespace nanreplay
