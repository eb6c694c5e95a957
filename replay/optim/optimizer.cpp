// See optimizer.h: the kind -> rule table, each kind's state layout (the
// bundle format's table), the whole step and MuonClip.
#include "replay/optim/optimizer.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>

#include <torch/torch.h>

#include "loaders/bundle/optimizer_manifest.h"
#include "replay/optim/clipping.h"
#include "replay/optim/rules.h"
#include "replay/optim/second_moment_lag.h"

namespace nanreplay {

namespace {

using RuleFn = void (*)(torch::Tensor&, const torch::Tensor&, ParamState&, double, const OptimizerRule&, bool);

struct OptimizerRuleRow {
  OptimizerKind kind;
  RuleFn update;
  bool elementwise;
};

const OptimizerRuleRow& optimizer_rule_row(OptimizerKind kind) {
  static const OptimizerRuleRow rows[] = {
      {OptimizerKind::kAdamW, adam_family_update, true},
      {OptimizerKind::kAdam, adam_family_update, true},
      {OptimizerKind::kAdafactor, adafactor_update, false},
      {OptimizerKind::kAdafactorHf, adafactor_hf_update, false},
      {OptimizerKind::kMuon, muon_update, false},
  };
  for (const OptimizerRuleRow& row : rows) {
    if (row.kind == kind) return row;
  }
  throw std::logic_error("optimizer kind without an update rule");
}

// "model.layers.{i}.self_attn.{q,k}_proj.weight": the layer, or -1.
int attention_projection_layer(const std::string& name, char which) {
  const std::string prefix = "model.layers.";
  const std::string suffix = std::string(".self_attn.") + which + "_proj.weight";
  if (name.rfind(prefix, 0) != 0 || name.size() <= prefix.size() + suffix.size()) return -1;
  if (name.compare(name.size() - suffix.size(), suffix.size(), suffix) != 0) return -1;
  const std::string digits = name.substr(prefix.size(), name.size() - prefix.size() - suffix.size());
  if (digits.empty() || digits.find_first_not_of("0123456789") != std::string::npos) return -1;
  return std::stoi(digits);
}

// g = tau / max_logit for each query head over tau, 1 for the rest (rows are scaled by sqrt(g)).
std::vector<double> head_factors(const std::vector<double>& max_logits, double tau) {
  std::vector<double> g;
  for (double m : max_logits) g.push_back(m > tau ? tau / m : 1.0);
  return g;
}

void scale_head_rows(torch::Tensor& weight, int64_t head, int64_t head_dim, double g) {
  if (g >= 1.0) return;
  weight.narrow(0, head * head_dim, head_dim).mul_(std::sqrt(g));
}

}  // namespace

ParamState zero_state(const OptimizerRule& rule, const torch::Tensor& param) {
  ParamState state;
  for (const auto& [key, shape] : state_layout(rule, param.sizes().vec())) {
    state.tensors[key] = torch::zeros(shape, param.options().requires_grad(false));
  }
  return state;
}

bool elementwise_rule(const OptimizerRule& rule) { return optimizer_rule_row(rule.kind).elementwise; }

void update_param(torch::Tensor& param, const torch::Tensor& grad, ParamState& state, double lr,
                  const OptimizerRule& rule, bool decay) {
  optimizer_rule_row(rule.kind).update(param, grad, state, lr, rule, decay);
  state.step += 1;
}

TensorUpdateStats update_param_measured(const std::string& name, torch::Tensor& param, const torch::Tensor& grad,
                                        ParamState& state, double lr, const OptimizerRule& rule, bool decay) {
  torch::NoGradGuard no_grad;
  TensorUpdateStats stats;
  stats.param = name;
  MomentLagSums lag;
  fold_second_moment_lag(param, grad, state, rule, decay, lag);
  lag.finish(stats);
  const torch::Tensor before = param.to(torch::kFloat64);  // a copy: the update is in place
  update_param(param, grad, state, lr, rule, decay);
  const int64_t n = std::max<int64_t>(1, param.numel());
  stats.update_rms = (param.to(torch::kFloat64) - before).norm().item<double>() / std::sqrt(static_cast<double>(n));
  return stats;
}

void apply_qk_clip(const OptimizerConfig& config, const ModelConfig& model, const HeadLogitMax& logit_max,
                   const std::vector<std::string>& names, const std::function<torch::Tensor(size_t)>& param_of,
                   const std::function<void(size_t, const torch::Tensor&)>& store) {
  torch::NoGradGuard no_grad;
  const int64_t D = model.head_dim(), H = model.num_heads, G = model.num_kv_heads;
  for (size_t i = 0; i < names.size(); ++i) {
    const OptimizerRule& rule = *rule_of_param(config, names[i]).rule;
    if (!rule.qk_clip_tau) continue;
    const int q_layer = attention_projection_layer(names[i], 'q');
    const int k_layer = attention_projection_layer(names[i], 'k');
    const int layer = std::max(q_layer, k_layer);
    if (layer < 0) continue;
    if (static_cast<size_t>(layer) >= logit_max.size() || logit_max[layer].size() != static_cast<size_t>(H)) {
      throw std::logic_error("MuonClip without the step's per-head logits of layer " + std::to_string(layer));
    }
    const std::vector<double> g = head_factors(logit_max[layer], *rule.qk_clip_tau);
    if (std::all_of(g.begin(), g.end(), [](double v) { return v >= 1.0; })) continue;
    torch::Tensor weight = param_of(i);
    if (q_layer >= 0) {
      for (int64_t h = 0; h < H; ++h) scale_head_rows(weight, h, D, g[h]);
    } else {
      const int64_t per_kv = H / G;  // query head h reads key head h / per_kv
      for (int64_t j = 0; j < G; ++j) {
        const double smallest = *std::min_element(g.begin() + j * per_kv, g.begin() + (j + 1) * per_kv);
        scale_head_rows(weight, j, D, smallest);
      }
    }
    store(i, weight);
  }
}

void optimizer_update(std::vector<torch::Tensor>& params, const std::vector<torch::Tensor>& grads, double grad_norm,
                      OptimizerMoments& moments, const GroupLr& lr_of, const OptimizerConfig& config,
                      const std::vector<std::string>& names, const ModelConfig& model,
                      const HeadLogitMax& logit_max, std::vector<TensorUpdateStats>* measured) {
  torch::NoGradGuard no_grad;
  const torch::Tensor coef = clip_coefficient(grad_norm, config);
  if (moments.params.empty()) {
    for (size_t i = 0; i < params.size(); ++i) moments.params.push_back(zero_state(*rule_of_param(config, names[i]).rule, params[i]));
  }
  for (size_t i = 0; i < params.size(); ++i) {
    const ParamRule owner = rule_of_param(config, names[i]);
    const bool decay = !excluded_from_decay(config, names[i]);
    if (measured != nullptr) {
      measured->push_back(update_param_measured(names[i], params[i], grads[i] * coef, moments.params[i],
                                                lr_of(owner.group), *owner.rule, decay));
      continue;
    }
    update_param(params[i], grads[i] * coef, moments.params[i], lr_of(owner.group), *owner.rule, decay);
  }
  if (!uses_qk_clip(config)) return;
  apply_qk_clip(config, model, logit_max, names, [&](size_t i) { return params[i]; },
                [](size_t, const torch::Tensor&) {});
}

}  // namespace nanreplay
