// See optimizer.h: the kind -> rule table, each kind's state layout (the
// bundle format's table), the whole step and MuonClip.
#include "replay/optim/optimizer.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <utility>

#include <torch/torch.h>

#include "loaders/bundle/optimizer_manifest.h"
#include "probes/param_table.h"
#include "probes/sites.h"
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

// g = tau / max_logit for each query head over tau, 1 for the rest.
std::vector<double> head_factors(const std::vector<double>& max_logits, double tau) {
  std::vector<double> g;
  for (double m : max_logits) g.push_back(m > tau ? tau / m : 1.0);
  return g;
}

// Rows [first_row, first_row + rows) of a weight are multiplied by sqrt(g)
// (by g itself where whole_factor), g the smallest factor of query heads
// [first_head, first_head + heads): several only for a key head that several read.
struct ClipRowRun {
  int64_t first_row, rows, first_head, heads;
  bool whole_factor;
};

// q_proj and k_proj: each head's head_dim rows by sqrt(g).
std::vector<ClipRowRun> mha_clip_runs(const ModelConfig& m, ParamRole role) {
  const int64_t D = m.head_dim(), H = m.num_heads, G = m.num_kv_heads;
  std::vector<ClipRowRun> runs;
  if (role == ParamRole::kQProj) {
    for (int64_t h = 0; h < H; ++h) runs.push_back({h * D, D, h, 1, false});
  } else {
    const int64_t per_kv = H / G;  // query head h reads key head h / per_kv
    for (int64_t j = 0; j < G; ++j) runs.push_back({j * D, D, j * per_kv, per_kv, false});
  }
  return runs;
}

// Latent attention, as Megatron-LM's MLASelfAttention.clip_qk with alpha 0.5:
// q's per-head [nope N, rope R] rows by sqrt(g) and g (the rotary key is one
// head every head shares, so q_pe carries all of g); kv_b_proj's per-head
// [k_nope N, v Dv] rows: k_nope by sqrt(g), v untouched. kv_a_proj_with_mqa
// (the shared k_pe) is not rescaled.
std::vector<ClipRowRun> latent_clip_runs(const LatentAttention& a, int64_t H, ParamRole role) {
  const int64_t N = a.qk_nope_head_dim, R = a.qk_rope_head_dim, Dv = a.v_head_dim;
  std::vector<ClipRowRun> runs;
  for (int64_t h = 0; h < H; ++h) {
    if (role == ParamRole::kKvBProj) {
      runs.push_back({h * (N + Dv), N, h, 1, false});
    } else {
      runs.push_back({h * (N + R), N, h, 1, false});
      runs.push_back({h * (N + R) + N, R, h, 1, true});
    }
  }
  return runs;
}

// The rows MuonClip rescales in parameter `name` and its layer; none for a parameter it leaves alone.
std::pair<int, std::vector<ClipRowRun>> qk_clip_rows(const ModelConfig& m, const std::string& name) {
  const int layer = layer_of_parameter(name);
  if (m.arch != Arch::kLlama || layer < 0) return {-1, {}};
  // Each model holds only its own: q_proj and k_proj, or q_proj or q_b_proj and kv_b_proj.
  for (const ParamRole role : {ParamRole::kQProj, ParamRole::kKProj, ParamRole::kQBProj, ParamRole::kKvBProj}) {
    if (name != param_key(m.arch, role, layer)) continue;
    return {layer, m.latent_attention ? latent_clip_runs(*m.latent_attention, m.num_heads, role) : mha_clip_runs(m, role)};
  }
  return {-1, {}};
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
  for (size_t i = 0; i < names.size(); ++i) {
    const OptimizerRule& rule = *rule_of_param(config, names[i]).rule;
    if (!rule.qk_clip_tau) continue;
    const auto [layer, runs] = qk_clip_rows(model, names[i]);
    if (layer < 0) continue;
    if (static_cast<size_t>(layer) >= logit_max.size() || logit_max[layer].size() != static_cast<size_t>(model.num_heads)) {
      throw std::logic_error("MuonClip without the step's per-head logits of layer " + std::to_string(layer));
    }
    const std::vector<double> g = head_factors(logit_max[layer], *rule.qk_clip_tau);
    if (std::all_of(g.begin(), g.end(), [](double v) { return v >= 1.0; })) continue;
    torch::Tensor weight = param_of(i);
    for (const ClipRowRun& run : runs) {
      const double smallest = *std::min_element(g.begin() + run.first_head, g.begin() + run.first_head + run.heads);
      if (smallest >= 1.0) continue;
      weight.narrow(0, run.first_row, run.rows).mul_(run.whole_factor ? smallest : std::sqrt(smallest));
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
