// Routing is computed once per layer: every (token, chosen expert) pair becomes
// one routed row, rows grouped by expert and in token order within an expert,
// so each expert's projections are one matmul over a contiguous slice and its
// statistics are taken on the tokens routed to it only. No dense
// [tokens, experts, features] tensor exists.
#include "replay/arch/experts.h"

#include <torch/torch.h>

#include "probes/param_table.h"
#include "replay/arch/router_logit_max.h"

namespace nanreplay {

namespace {

namespace F = torch::nn::functional;

struct Routing {
  torch::Tensor token_of_row;   // (rows) int64: the token (batch row * T + position) each row computes
  torch::Tensor weight_of_row;  // (rows) fp32 routing weight, differentiable (reaches the router)
  torch::Tensor expert_tokens;  // (E) int64
  std::shared_ptr<ExpertRouting> host;  // the same on the host, for the per-expert probes
};

// The top_k experts of every token by probability, ties to the lower expert
// index (a stable descending sort), weights renormalized when norm_topk_prob.
Routing route(const MoeConfig& moe, const torch::Tensor& probs, int64_t seq_len) {
  const int64_t tokens = probs.size(0), k = moe.top_k, E = moe.num_experts;
  torch::Tensor chosen;
  {
    torch::NoGradGuard no_grad;
    chosen = std::get<1>(probs.detach().sort(/*stable=*/true, /*dim=*/-1, /*descending=*/true)).narrow(1, 0, k);
  }
  torch::Tensor weights = probs.gather(1, chosen);  // (tokens, k)
  if (moe.norm_topk_prob) weights = weights / weights.sum(-1, /*keepdim=*/true);
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

}  // namespace

torch::Tensor experts_mlp(const ModelConfig& m, const ParamMap& p, const torch::Tensor& h, int layer,
                          const Numerics& numerics, ProbeSession& probes, RouterOutputs& router) {
  const MoeConfig& moe = *m.moe;
  const int64_t B = h.size(0), T = h.size(1), C = h.size(2);
  auto weight = [&](ParamRole role, int expert = -1) -> const torch::Tensor& {
    return p.at(param_key(m.arch, role, layer, expert));
  };
  auto module = [&](ParamRole role, int expert = -1) { return module_key(m.arch, role, layer, expert); };
  // The router: its matmul rounded like any linear (unless router-fp32), its softmax in fp32 and not rounded.
  const Numerics gate_numerics = numerics.for_router();
  const torch::Tensor logits = probes.site(
      {SiteId::kMlpRouter, layer}, gate_numerics.linear(h, weight(ParamRole::kRouter), {}, module(ParamRole::kRouter)));
  RouterLogitRecorder::record(layer, logits);  // a spike incident's per-expert maxima, when asked for
  const torch::Tensor probs =
      probes.site({SiteId::kMlpRouterProbs, layer}, torch::softmax(logits.to(torch::kFloat32), -1));  // (B, T, E)
  const Routing routing = route(moe, probs.view({B * T, -1}), T);
  router.logits.push_back(logits.view({B * T, -1}));
  router.probs.push_back(probs.view({B * T, -1}));
  router.expert_tokens.push_back(routing.expert_tokens);

  const std::vector<int64_t>& offsets = routing.host->offsets;
  std::vector<int64_t> counts;
  for (int e = 0; e < moe.num_experts; ++e) counts.push_back(offsets[e + 1] - offsets[e]);
  // One matmul per expert over its slice of the routed rows, concatenated in expert order.
  // The slices come from one split_with_sizes, whose backward joins the experts'
  // gradients with one cat; a narrow per expert would have each backward fill a
  // zero tensor the size of all the routed rows and autograd add the E of them
  // (the same values, at E times the memory traffic: 15-20 % of the layer).
  auto per_expert = [&](const torch::Tensor& rows, ParamRole role) {
    const std::vector<torch::Tensor> slices = rows.split_with_sizes(counts, 0);
    std::vector<torch::Tensor> parts;
    for (int e = 0; e < moe.num_experts; ++e) {
      parts.push_back(numerics.linear(slices[static_cast<size_t>(e)], weight(role, e), {}, module(role, e)));
    }
    return torch::cat(parts, 0);
  };
  const auto& shared_routing = routing.host;
  const torch::Tensor x = h.reshape({B * T, C}).index_select(0, routing.token_of_row);  // (rows, C)
  const torch::Tensor gate =
      probes.expert_site({SiteId::kMlpExpertGate, layer}, per_expert(x, ParamRole::kExpertGateProj), shared_routing);
  const torch::Tensor up =
      probes.expert_site({SiteId::kMlpExpertUp, layer}, per_expert(x, ParamRole::kExpertUpProj), shared_routing);
  const torch::Tensor act =
      probes.expert_site({SiteId::kMlpExpertAct, layer}, F::silu(gate) * up, shared_routing);
  const torch::Tensor down =
      probes.expert_site({SiteId::kMlpExpertDown, layer}, per_expert(act, ParamRole::kExpertDownProj), shared_routing);
  // The weighted sum from zeros, lower experts first (Hugging Face's index_add_ loop).
  const torch::Tensor combined = torch::zeros({B * T, C}, down.options())
                                     .index_add(0, routing.token_of_row, down * routing.weight_of_row.unsqueeze(1));
  return probes.site({SiteId::kMlpCombine, layer}, combined.view({B, T, C}));
}

torch::Tensor router_loss(const MoeConfig& moe, const RouterOutputs& router) {
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
