// DeepSeek-V3 / Kimi K2's multi-head latent attention (model.latent_attention,
// docs/bundle-format.md "Multi-head latent attention"): one layer's q, k and v
// as Hugging Face's DeepseekV3Attention computes them, probed at attn.q_latent,
// attn.kv_latent, attn.q, attn.k and attn.v; the scores, softmax and context
// are the llama block's causal attention, with v's own width.
#pragma once

#include <functional>

#include <torch/types.h>

#include "loaders/arch/model_config.h"
#include "probes/sites.h"
#include "replay/probing/numerics.h"
#include "replay/probing/probe_session.h"

namespace nanreplay {

// What the llama block lends the latent attention, applied as it applies them to its own tensors.
struct LatentAttentionOps {
  // The linear of `weight`'s parameter in this layer (rounded operands, fp32 output).
  std::function<torch::Tensor(const torch::Tensor& in, ParamRole weight)> linear;
  // RMSNorm with `weight` in fp32, the zero-norm check and the probe at `site`.
  std::function<torch::Tensor(const torch::Tensor& in, ParamRole weight, SiteId site)> norm;
  // Rotary over the last dim of (B, heads, T, qk_rope_head_dim), in the model's rope_style.
  std::function<torch::Tensor(const torch::Tensor& x)> rotary;
};

struct LatentQkv {
  torch::Tensor q;  // (B, T, H * qk_head_dim) as probed: [q_nope, rotated q_pe] per head
  torch::Tensor k;  // (B, T, H * qk_head_dim): [k_nope, the shared rotated k_pe] per head
  torch::Tensor v;  // (B, T, H * v_head_dim)
};

// q, k and v of `layer` from the attention norm's output h (B, T, C).
LatentQkv latent_attention_qkv(const ModelConfig& model, int layer, const torch::Tensor& h,
                               const LatentAttentionOps& ops, const Numerics& block, ProbeSession& probes);

// The scores' scale, DeepseekV3Attention's self.scaling: qk_head_dim ** -0.5, times
// yarn_get_mscale(factor, mscale_all_dim) squared where rope_scaling sets mscale_all_dim.
double latent_attention_scaling(const ModelConfig& model);

}  // namespace nanreplay
