// Multi-head latent attention; see latent_attention.h. Letters as model.cpp's,
// and N: qk_nope_head_dim, R: qk_rope_head_dim, L: kv_lora_rank, Dv: v_head_dim.
// Precision as the llama block's (docs/bundle-format.md, "Precision as
// replayed"): a latent reaches its norm rounded, as autocast hands a linear's
// output over; q_pe and k_pe rotate in fp32, rounded as attn.q and attn.k.
#include "replay/arch/latent_attention.h"

#include <cmath>

#include <torch/torch.h>

namespace nanreplay {

namespace {

// A compressed latent after its RMSNorm, probed at `site` (the norm's output).
torch::Tensor normed_latent(const torch::Tensor& projected, ParamRole weight, const SiteRef& site,
                            const LatentAttentionOps& ops, const Numerics& block) {
  const torch::Tensor in = block.rounds_site(site) ? block.round(projected) : projected;
  return ops.norm(in, weight, site.id);
}

// Hugging Face's yarn_get_mscale: 0.1 * mscale * ln(scale) + 1, or 1 for scale <= 1.
double yarn_get_mscale(double scale, double mscale) { return scale <= 1 ? 1.0 : 0.1 * mscale * std::log(scale) + 1.0; }

}  // namespace

LatentQkv latent_attention_qkv(const ModelConfig& m, int layer, const torch::Tensor& h, const LatentAttentionOps& ops,
                               const Numerics& block, ProbeSession& probes) {
  using Role = ParamRole;
  const LatentAttention& a = *m.latent_attention;
  const int64_t B = h.size(0), T = h.size(1), H = m.num_heads;
  const int64_t N = a.qk_nope_head_dim, R = a.qk_rope_head_dim, L = a.kv_lora_rank, Dv = a.v_head_dim;
  // q: q_proj, or q_b_proj of the normalised q latent; (B, H, T, N + R).
  const torch::Tensor q_states =
      a.q_lora_rank > 0 ? ops.linear(normed_latent(ops.linear(h, Role::kQAProj), Role::kQALayernorm,
                                                   {SiteId::kAttnQLatent, layer}, ops, block),
                                     Role::kQBProj)
                        : ops.linear(h, Role::kQProj);
  const torch::Tensor q = q_states.view({B, T, H, N + R}).transpose(1, 2);
  // kv_a_proj_with_mqa: the kv latent (L) and one rotary key head (R) every head shares.
  const torch::Tensor compressed = ops.linear(h, Role::kKvAProj);  // (B, T, L + R)
  const torch::Tensor kv_latent =
      normed_latent(compressed.narrow(-1, 0, L), Role::kKvALayernorm, {SiteId::kAttnKvLatent, layer}, ops, block);
  const torch::Tensor kv = ops.linear(kv_latent, Role::kKvBProj).view({B, T, H, N + Dv}).transpose(1, 2);
  const torch::Tensor k_pe = ops.rotary(compressed.narrow(-1, L, R).reshape({B, 1, T, R})).expand({B, H, T, R});
  const torch::Tensor q_pe = ops.rotary(q.narrow(-1, N, R));
  const auto as_tokens = [&](const torch::Tensor& per_head) { return per_head.transpose(1, 2).reshape({B, T, -1}); };
  LatentQkv out;
  out.q = probes.site({SiteId::kAttnQ, layer}, as_tokens(torch::cat({q.narrow(-1, 0, N), q_pe}, -1)));
  out.k = probes.site({SiteId::kAttnK, layer}, as_tokens(torch::cat({kv.narrow(-1, 0, N), k_pe}, -1)));
  out.v = probes.site({SiteId::kAttnV, layer}, as_tokens(kv.narrow(-1, N, Dv)));
  return out;
}

double latent_attention_scaling(const ModelConfig& m) {
  double scaling = std::pow(static_cast<double>(m.latent_attention->qk_head_dim()), -0.5);
  if (m.rope_scaling && m.rope_scaling->mscale_all_dim != 0) {
    const double mscale = yarn_get_mscale(m.rope_scaling->factor, m.rope_scaling->mscale_all_dim);
    scaling = scaling * mscale * mscale;
  }
  return scaling;
}

}  // namespace nanreplay
