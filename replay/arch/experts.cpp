// Routing is computed once per layer: every (token, chosen expert) pair becomes
// one routed row, rows grouped by expert and in token order within an expert,
// so each expert's projections are one matmul over a contiguous slice and its
// statistics are taken on the tokens routed to it only. No dense
// [tokens, experts, features] tensor exists.
#include "replay/arch/experts.h"

#include <functional>
#include <stdexcept>
#include <string>

#include <torch/torch.h>

#include "probes/param_table.h"
#include "replay/arch/expert_activation_max.h"
#include "replay/arch/router_logit_max.h"
#include "replay/arch/shared_expert.h"

namespace nanreplay {

namespace {

namespace F = torch::nn::functional;

struct Routing {
  torch::Tensor token_of_row;   // (rows) int64: the token (batch row * T + position) each row computes
  torch::Tensor weight_of_row;  // (rows) fp32 routing weight, differentiable (reaches the router)
  torch::Tensor expert_tokens;  // (E) int64
  std::shared_ptr<ExpertRouting> host;  // the same on the host, for the per-expert probes
};

// The top_k experts of every token by `ranking` (probabilities or logits, as
// the router kind says), ties to the lower expert index (a stable descending sort).
torch::Tensor top_k_experts(const torch::Tensor& ranking, int64_t k) {
  torch::NoGradGuard no_grad;
  return std::get<1>(ranking.detach().sort(/*stable=*/true, /*dim=*/-1, /*descending=*/true)).narrow(1, 0, k);
}

// GPT-OSS's routing scores: a softmax over each token's top_k logits alone,
// scattered over zeros at the other experts (GptOssTopKRouter's router_scores).
// Llama 4's: each chosen logit's sigmoid, 0 elsewhere (Llama4Router scatters the
// top logits over -inf, whose sigmoid is 0).
torch::Tensor top_k_scores(RouterKind kind, const torch::Tensor& logits, const torch::Tensor& chosen) {
  const torch::Tensor top = logits.gather(1, chosen);
  return torch::zeros_like(logits).scatter(1, chosen, kind == RouterKind::kSigmoidTopK ? torch::sigmoid(top)
                                                                                      : torch::softmax(top, -1));
}

// DeepSeek-V3's choice (DeepseekV3TopkRouter.get_topk_indices): the scores plus
// the layer's correction bias; each of n_group groups scored by the sum of its
// two best; the topk_group best groups kept and the other experts' biased scores
// set to 0.0 (masked_fill 0.0, as Hugging Face: not -inf, so a kept expert whose
// biased score is below 0 ranks under a dropped one); then the top_k. Ties go
// to the lower group and expert index (torch.topk leaves their order unspecified).
torch::Tensor grouped_top_k_experts(const MoeConfig& moe, const torch::Tensor& scores, const torch::Tensor& bias) {
  torch::NoGradGuard no_grad;
  const int64_t tokens = scores.size(0), groups = moe.n_group, per_group = moe.num_experts / moe.n_group;
  torch::Tensor for_choice = scores.detach();
  if (bias.defined()) for_choice = for_choice + bias.unsqueeze(0);
  const torch::Tensor best_two =
      std::get<0>(for_choice.view({tokens, groups, per_group}).sort(/*stable=*/true, /*dim=*/-1, /*descending=*/true))
          .narrow(-1, 0, 2);
  const torch::Tensor kept_groups = top_k_experts(best_two.sum(-1), moe.topk_group);  // (tokens, topk_group)
  const torch::Tensor group_mask = torch::zeros({tokens, groups}, scores.options()).scatter(1, kept_groups, 1.0);
  const torch::Tensor score_mask =
      group_mask.unsqueeze(-1).expand({tokens, groups, per_group}).reshape({tokens, moe.num_experts});
  return top_k_experts(for_choice.masked_fill(score_mask.logical_not(), 0.0), moe.top_k);
}

// The routed rows of the chosen experts, weighted by `scores` (tokens, E) at
// them, renormalized when norm_topk_prob (DeepSeek-V3: over the sum + 1e-20,
// then times routed_scaling_factor).
Routing route(const MoeConfig& moe, const torch::Tensor& scores, const torch::Tensor& chosen, int64_t seq_len) {
  const int64_t tokens = scores.size(0), k = moe.top_k, E = moe.num_experts;
  torch::Tensor weights = scores.gather(1, chosen);  // (tokens, k)
  if (moe.router == RouterKind::kSigmoidGrouped) {
    if (moe.norm_topk_prob) weights = weights / (weights.sum(-1, /*keepdim=*/true) + 1e-20);
    weights = weights * moe.routed_scaling_factor;
  } else if (moe.norm_topk_prob) {
    weights = weights / weights.sum(-1, /*keepdim=*/true);
  }
  Routing r;
  torch::Tensor order;
  {
    torch::NoGradGuard no_grad;
    const torch::Tensor expert = chosen.reshape({-1});
    const torch::Tensor token = torch::arange(tokens, expert.options()).repeat_interleave(k);
    order = std::get<1>((expert * tokens + token).sort());  // keys are distinct: grouped by expert, tokens in order
    r.token_of_row = token.index_select(0, order);
    r.expert_tokens = torch::bincount(expert, {}, E);
  }
  r.weight_of_row = weights.reshape({-1}).index_select(0, order);
  auto host = std::make_shared<ExpertRouting>();
  const torch::Tensor counts = r.expert_tokens.cpu().contiguous();
  host->offsets.push_back(0);
  for (int64_t e = 0; e < E; ++e) host->offsets.push_back(host->offsets.back() + counts.data_ptr<int64_t>()[e]);
  const torch::Tensor rows = r.token_of_row.cpu().contiguous();
  host->tokens.assign(rows.data_ptr<int64_t>(), rows.data_ptr<int64_t>() + rows.numel());
  host->seq_len = seq_len;
  r.host = std::move(host);
  return r;
}

// What an expert computes from its gate and up projections: the optional
// clamp (GPT-OSS's swiglu_limit), then silu(g) * u or GPT-OSS's
// (u + 1) * g * sigmoid(alpha * g).
torch::Tensor expert_activation(const MoeConfig& moe, torch::Tensor gate, torch::Tensor up) {
  if (moe.swiglu_limit) {
    gate = gate.clamp_max(*moe.swiglu_limit);
    up = up.clamp(-*moe.swiglu_limit, *moe.swiglu_limit);
  }
  if (moe.expert_activation == ExpertActivation::kGptOss) {
    return (up + 1) * (gate * torch::sigmoid(gate * moe.swiglu_alpha));
  }
  return F::silu(gate) * up;
}

}  // namespace

namespace {

// The layer's router: its logits (the mlp.router site), then routing scores
// (mlp.router_probs) and the rows they route; appends what the router losses read.
Routing route_layer(const ModelConfig& m, const ParamMap& p, const torch::Tensor& h, int layer,
                    const Numerics& numerics, ProbeSession& probes, RouterOutputs& router) {
  const MoeConfig& moe = *m.moe;
  const int64_t B = h.size(0), T = h.size(1);
  const torch::Tensor bias =
      moe.router_bias ? p.at(param_key(m.arch, ParamRole::kRouterBias, layer)) : torch::Tensor();
  // The router: its matmul rounded like any linear (unless router-fp32), its softmax in fp32 and not rounded.
  const Numerics gate_numerics = numerics.for_router();
  const torch::Tensor& gate_weight = p.at(param_key(m.arch, ParamRole::kRouter, layer));
  // DeepSeek-V3: F.linear(x.float(), weight.float()) on the model's bf16 values, fp32 out (the
  // step's numerics keep this site unrounded, replay_step's StepArithmetic).
  const torch::Tensor raw_logits =
      moe.router == RouterKind::kSigmoidGrouped
          ? F::linear(numerics.round(h), numerics.round(gate_weight))
          : gate_numerics.linear(h, gate_weight, bias, module_key(m.arch, ParamRole::kRouter, layer));
  const torch::Tensor logits = probes.site({SiteId::kMlpRouter, layer}, raw_logits);
  RouterLogitRecorder::record(layer, logits);  // a spike incident's per-expert maxima, when asked for
  Routing routing;
  torch::Tensor balance_probs;  // what load_balancing_loss_func softmaxes: the router's first output
  if (moe.router == RouterKind::kSigmoidGrouped) {  // chosen by the biased sigmoid, weighted by the plain one
    const auto found = moe.step_score_bias.find(layer);
    const torch::Tensor score_bias =
        found == moe.step_score_bias.end()
            ? torch::Tensor()
            : torch::tensor(found->second, torch::kFloat64).to(logits.device(), torch::kFloat32);
    const torch::Tensor scores = probes.site({SiteId::kMlpRouterProbs, layer}, torch::sigmoid(logits.to(torch::kFloat32)));
    balance_probs = scores.view({B * T, -1});
    routing = route(moe, balance_probs, grouped_top_k_experts(moe, balance_probs, score_bias), T);
  } else if (moe.router != RouterKind::kSoftmaxTopK) {  // chosen by the logits
    const torch::Tensor flat_logits = logits.view({B * T, -1}).to(torch::kFloat32);
    const torch::Tensor chosen = top_k_experts(flat_logits, moe.top_k);
    torch::Tensor scores = top_k_scores(moe.router, flat_logits, chosen);
    // Llama4Router casts its fp32 sigmoid back to the logits' type.
    if (moe.router == RouterKind::kSigmoidTopK) scores = gate_numerics.round(scores);
    scores = probes.site({SiteId::kMlpRouterProbs, layer}, scores.view({B, T, -1}));
    routing = route(moe, scores.view({B * T, -1}), chosen, T);
    // What load_balancing_loss_func softmaxes (GPT-OSS); sigmoid_top_k has no aux loss to read it.
    balance_probs = moe.router == RouterKind::kSigmoidTopK ? scores.view({B * T, -1})
                                                           : torch::softmax(scores.view({B * T, -1}), -1);
  } else {
    const torch::Tensor probs =
        probes.site({SiteId::kMlpRouterProbs, layer}, torch::softmax(logits.to(torch::kFloat32), -1));  // (B, T, E)
    balance_probs = probs.view({B * T, -1});
    routing = route(moe, balance_probs, top_k_experts(balance_probs, moe.top_k), T);
  }
  router.logits.push_back(logits.view({B * T, -1}));
  router.probs.push_back(balance_probs);
  router.expert_tokens.push_back(routing.expert_tokens);
  RouterLogitRecorder::record_tokens(layer, routing.expert_tokens);  // the correction bias update reads them
  return routing;
}

// The experts' outputs summed per token from zeros, lower experts first (Hugging Face's
// index_add_ loop), each times its weight unless the weight scaled its input; then the
// shared expert's output added, the routed sum rounded first (as its own tensor in the
// compute type, as Llama4TextMoe's and DeepseekV3MoE's are): the mlp.combine site.
torch::Tensor combine_experts(const ModelConfig& m, const ParamMap& p, const torch::Tensor& h, int layer,
                              const Numerics& numerics, ProbeSession& probes, const torch::Tensor& down,
                              const Routing& routing) {
  const int64_t B = h.size(0), T = h.size(1), C = h.size(2);
  const torch::Tensor weighted = m.moe->scale_expert_input ? down : down * routing.weight_of_row.unsqueeze(1);
  torch::Tensor combined = torch::zeros({B * T, C}, down.options()).index_add(0, routing.token_of_row, weighted);
  if (m.moe->shared_expert_intermediate_size > 0) {
    combined = numerics.round(combined) + shared_expert_mlp(m, p, h, layer, numerics, probes).view({B * T, C});
  }
  return probes.site({SiteId::kMlpCombine, layer}, combined.view({B, T, C}));
}

// Whether the block's parameters hold expert e of `layer` (its gate projection
// stands for the others: every expert has one, GPT-OSS's fused gate_up stored split).
bool has_expert(const ModelConfig& m, const ParamMap& p, int layer, int e) {
  return p.count(param_key(m.arch, ParamRole::kExpertGateProj, layer, e)) != 0;
}

// The parameters of the experts with rows that the block's parameters lack,
// from this thread's ExpertSource (none lacking: nothing asked).
ParamMap fetch_missing_experts(const ModelConfig& m, const ParamMap& p, int layer, const std::vector<int64_t>& counts) {
  std::vector<int> wanted;
  for (int e = 0; e < m.moe->num_experts; ++e) {
    if (counts[static_cast<size_t>(e)] > 0 && !has_expert(m, p, layer, e)) wanted.push_back(e);
  }
  if (wanted.empty()) return {};
  const ExpertSource* source = ExpertSource::current();
  if (source == nullptr) {
    throw std::logic_error("experts_mlp: layer " + std::to_string(layer) +
                           "'s experts are not in its parameters and no ExpertSource is alive");
  }
  return source->fetch(layer, wanted);
}

thread_local const ExpertSource* current_source = nullptr;

}  // namespace

ExpertSource::ExpertSource(Fetch fetch) : fetch_(std::move(fetch)), replaced_(current_source) {
  current_source = this;
}

ExpertSource::~ExpertSource() { current_source = replaced_; }

const ExpertSource* ExpertSource::current() { return current_source; }

torch::Tensor experts_mlp(const ModelConfig& m, const ParamMap& p, const torch::Tensor& h, int layer,
                          const Numerics& numerics, ProbeSession& probes, RouterOutputs& router) {
  using R = ParamRole;
  const MoeConfig& moe = *m.moe;
  const int64_t B = h.size(0), T = h.size(1), C = h.size(2);
  const Routing routing = route_layer(m, p, h, layer, numerics, probes, router);
  const std::vector<int64_t>& offsets = routing.host->offsets;
  std::vector<int64_t> counts;
  for (int e = 0; e < moe.num_experts; ++e) counts.push_back(offsets[e + 1] - offsets[e]);
  const ParamMap fetched = fetch_missing_experts(m, p, layer, counts);
  auto weight = [&](R role, int e) -> const torch::Tensor& {
    const std::string key = param_key(m.arch, role, layer, e);
    const auto found = fetched.find(key);
    return found != fetched.end() ? found->second : p.at(key);
  };
  auto bias = [&](R role, int e) { return moe.expert_bias ? weight(role, e) : torch::Tensor(); };
  // An expert is computed when it has rows or its parameters are at hand (in
  // memory, all of them: an expert over no rows still takes part, as before).
  auto computed = [&](int e) { return counts[static_cast<size_t>(e)] > 0 || has_expert(m, p, layer, e); };
  // One matmul per expert over its slice of the routed rows, concatenated in expert order.
  // The slices come from one split_with_sizes, whose backward joins the experts'
  // gradients with one cat; a narrow per expert would have each backward fill a
  // zero tensor the size of all the routed rows and autograd add the E of them
  // (the same values, at E times the memory traffic: 15-20 % of the layer).
  // An expert left out has no rows: the cat of the others is the same tensor.
  auto per_expert = [&](const torch::Tensor& rows, const std::function<torch::Tensor(const torch::Tensor&, int)>& project) {
    const std::vector<torch::Tensor> slices = rows.split_with_sizes(counts, 0);
    std::vector<torch::Tensor> parts;
    for (int e = 0; e < moe.num_experts; ++e) {
      if (computed(e)) parts.push_back(project(slices[static_cast<size_t>(e)], e));
    }
    return torch::cat(parts, 0);
  };
  auto linear = [&](R role, R bias_role) {
    return [&, role, bias_role](const torch::Tensor& rows, int e) {
      return numerics.linear(rows, weight(role, e), bias(bias_role, e), module_key(m.arch, role, layer, e));
    };
  };
  const auto& shared_routing = routing.host;
  torch::Tensor x = h.reshape({B * T, C}).index_select(0, routing.token_of_row);  // (rows, C)
  // Llama 4: the input scaled by the weight (rounded as the linear's input), the output summed unweighted.
  if (moe.scale_expert_input) x = x * routing.weight_of_row.unsqueeze(1);
  torch::Tensor gate, up;
  if (moe.fused_gate_up) {  // GPT-OSS's gate_up_proj: gate's rows then up's, one matmul (fp8: gate_proj's scales)
    const torch::Tensor both = per_expert(x, [&](const torch::Tensor& rows, int e) {
      const torch::Tensor b = moe.expert_bias ? torch::cat({bias(R::kExpertGateBias, e), bias(R::kExpertUpBias, e)})
                                              : torch::Tensor();
      return numerics.linear(rows, torch::cat({weight(R::kExpertGateProj, e), weight(R::kExpertUpProj, e)}), b,
                             module_key(m.arch, R::kExpertGateProj, layer, e));
    });
    gate = probes.expert_site({SiteId::kMlpExpertGate, layer}, both.narrow(1, 0, moe.intermediate_size), shared_routing);
    up = probes.expert_site({SiteId::kMlpExpertUp, layer}, both.narrow(1, moe.intermediate_size, moe.intermediate_size),
                            shared_routing);
  } else {
    gate = probes.expert_site({SiteId::kMlpExpertGate, layer}, per_expert(x, linear(R::kExpertGateProj, R::kExpertGateBias)),
                              shared_routing);
    up = probes.expert_site({SiteId::kMlpExpertUp, layer}, per_expert(x, linear(R::kExpertUpProj, R::kExpertUpBias)),
                            shared_routing);
  }
  const torch::Tensor act =
      probes.expert_site({SiteId::kMlpExpertAct, layer}, expert_activation(moe, gate, up), shared_routing);
  const torch::Tensor down = probes.expert_site(
      {SiteId::kMlpExpertDown, layer}, per_expert(act, linear(R::kExpertDownProj, R::kExpertDownBias)), shared_routing);
  ExpertActivationRecorder::record(layer, x, down, offsets);  // report.json's per-expert maxima, when asked for
  return combine_experts(m, p, h, layer, numerics, probes, down, routing);
}

torch::Tensor router_loss(const MoeConfig& moe, const RouterOutputs& router) {
  if (router.probs.empty()) return {};  // no layer with experts (a model cut short by minimize)
  const torch::Device device = router.probs.back().device();
  auto on_device = [&](const std::vector<torch::Tensor>& parts) {
    std::vector<torch::Tensor> moved;
    for (const torch::Tensor& t : parts) moved.push_back(t.to(device));
    return torch::cat(moved, 0);
  };
  torch::Tensor loss = torch::zeros({}, torch::TensorOptions().dtype(torch::kFloat32).device(device));
  if (moe.router_aux_loss_coef != 0) {
    // load_balancing_loss_func: E * sum_e (share of routed slots to e) * (mean probability of e),
    // over every layer's tokens at once; only the probabilities carry a gradient.
    const torch::Tensor probs = on_device(router.probs);
    torch::Tensor slots = torch::zeros({moe.num_experts}, torch::TensorOptions().dtype(torch::kLong).device(device));
    for (const torch::Tensor& counts : router.expert_tokens) slots = slots + counts.to(device);
    const torch::Tensor share = slots.to(torch::kFloat32) / static_cast<double>(probs.size(0));
    const torch::Tensor balance = (share * probs.mean(0)).sum() * static_cast<double>(moe.num_experts);
    loss = loss + moe.router_aux_loss_coef * balance;
  }
  if (moe.router_z_loss_coef != 0) {  // ST-MoE: mean over layers and tokens of logsumexp(r)^2
    const torch::Tensor z = torch::logsumexp(on_device(router.logits).to(torch::kFloat32), -1).pow(2).mean();
    loss = loss + moe.router_z_loss_coef * z;
  }
  return loss;
}

}  // namespace nanreplay
