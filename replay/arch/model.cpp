// Forward passes of the two architectures. Dimension letters: B batch,
// T positions, C hidden, H query heads, G kv heads, D head_dim, F mlp width,
// V vocab. Each line that produces a site tensor hands it to the probes,
// which also round it to the compute type.
#include "replay/arch/model.h"

#include <cmath>
#include <optional>

#include <torch/torch.h>

#include "probes/param_table.h"
#include "replay/probing/device_stats.h"
#include "replay/arch/experts.h"
#include "replay/arch/head_logit_max.h"
#include "replay/arch/latent_attention.h"
#include "replay/arch/multi_token_prediction.h"

namespace nanreplay {

namespace {

namespace F = torch::nn::functional;

const torch::Tensor& param(const ParamMap& params, const std::string& name) {
  auto it = params.find(name);
  if (it == params.end()) throw std::logic_error("parameter not loaded: " + name);
  return it->second;
}

// Parameters by role (probes/param_table.h), in `layer` for per-layer ones.
struct Weights {
  const ParamMap& params;
  Arch arch;
  const torch::Tensor& operator()(ParamRole role, int layer = -1) const {
    return param(params, param_key(arch, role, layer));
  }
  std::string module(ParamRole role, int layer = -1) const { return module_key(arch, role, layer); }
};

// x / sqrt(mean(x^2) + eps) * weight over the last dim, in fp32. The mean
// square goes to the zero-norm check before eps is added: one row per token,
// so per head (x: (B, T, heads, D), Qwen3's q_norm) a token's smallest one.
// With `offset` (Gemma's RMSNorm, model.rms_norm_offset) the scale is
// 1 + weight and the whole norm is fp32, x * rsqrt(mean(x^2) + eps) as
// Gemma3RMSNorm writes it; the site it feeds casts it back.
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps,
                       ProbeSession& probes, const SiteRef& site, bool offset = false) {
  const torch::Tensor mean_square = x.pow(2).mean(-1, /*keepdim=*/true);  // (B, T, [heads,] 1)
  const torch::Tensor moment = mean_square.squeeze(-1);
  probes.check_norm(site, moment.dim() > 2 ? std::get<0>(moment.flatten(2).min(-1)) : moment, eps, "mean square");
  if (offset) return x.to(torch::kFloat32) * torch::rsqrt(mean_square.to(torch::kFloat32) + eps) * (1.0 + weight.to(torch::kFloat32));
  return x / torch::sqrt(mean_square + eps) * weight;
}

// Rotary embedding over the last dim of x: (B, heads, T, D). Rotate-half
// (Hugging Face) pairs element i with i + D/2; interleaved (Meta's reference
// llama, torchtitan, llama2.c) pairs 2i with 2i+1. The tables match the style.
torch::Tensor apply_rotary(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                           RopeStyle style) {
  if (style == RopeStyle::kInterleaved) {
    std::vector<int64_t> paired = x.sizes().vec();
    paired.back() /= 2;
    paired.push_back(2);
    const torch::Tensor pairs = x.reshape(paired);  // (..., D/2, 2)
    const torch::Tensor even = pairs.select(-1, 0), odd = pairs.select(-1, 1);
    return x * cos + torch::stack({-odd, even}, -1).flatten(-2) * sin;
  }
  const int64_t half = x.size(-1) / 2;
  const torch::Tensor x1 = x.narrow(-1, 0, half);
  const torch::Tensor x2 = x.narrow(-1, half, half);
  return x * cos + torch::cat({-x2, x1}, -1) * sin;
}

// Llama 3.1's frequency scaling, as Hugging Face's _compute_llama3_parameters:
// long wavelengths divided by `factor`, short ones kept, a smooth blend between.
torch::Tensor llama3_scaled(const torch::Tensor& inv_freq, const RopeScaling& s) {
  const double old_context = static_cast<double>(s.original_max_position_embeddings);
  const double low_freq_wavelen = old_context / s.low_freq_factor;
  const double high_freq_wavelen = old_context / s.high_freq_factor;
  const torch::Tensor wavelen = 2 * M_PI / inv_freq;
  torch::Tensor scaled = torch::where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq);
  const torch::Tensor smooth = (old_context / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
  const torch::Tensor smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled;
  const torch::Tensor medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen);
  return torch::where(medium, smoothed, scaled);
}

// YaRN's frequencies, as Hugging Face's _compute_yarn_parameters: each
// frequency blends its interpolated (divided by factor) and extrapolated
// (kept) values by a linear ramp over the dimensions between the correction
// range's bounds, found from beta_fast and beta_slow rotations over the
// original context (floored and ceiled with truncate). `pos_freqs`:
// theta^(2i/R) in fp32.
torch::Tensor yarn_inv_freq(const torch::Tensor& pos_freqs, int64_t dim, double base, const RopeScaling& s) {
  const double context = static_cast<double>(s.original_max_position_embeddings);
  const auto correction_dim = [&](double rotations) {
    return (static_cast<double>(dim) * std::log(context / (rotations * 2 * M_PI))) / (2 * std::log(base));
  };
  double low = correction_dim(s.beta_fast), high = correction_dim(s.beta_slow);
  if (s.truncate) {
    low = std::floor(low);
    high = std::ceil(high);
  }
  low = std::max(low, 0.0);
  high = std::min(high, static_cast<double>(dim - 1));
  if (low == high) high += 0.001;  // HF: "Prevent singularity"
  const torch::Tensor ramp =
      torch::clamp((torch::arange(dim / 2, pos_freqs.options()) - low) / (high - low), 0, 1);  // (R/2)
  const torch::Tensor extrapolation_factor = 1 - ramp;
  const torch::Tensor extrapolation = 1.0 / pos_freqs;
  const torch::Tensor interpolation = 1.0 / (s.factor * pos_freqs);
  return interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor;
}

// cos and sin tables (T, R) with frequencies theta^(-2i/R) (scaled for
// rope_scaling), computed as Hugging Face's LlamaRotaryEmbedding does in fp32.
// R is the rotary width: head_dim, or its first int(head_dim * factor) dims
// with partial_rotary_factor (Hugging Face's Phi: the frequencies over R).
// YaRN multiplies both tables by its attention factor (HF's attention_scaling).
std::pair<torch::Tensor, torch::Tensor> rotary_tables(int64_t seq, const ModelConfig& m, const torch::Device& device) {
  const int64_t rotary_dim = m.rotary_dim();
  const auto f32 = torch::TensorOptions().dtype(torch::kFloat32).device(device);
  const torch::Tensor pos_freqs =
      torch::pow(m.rope_theta, torch::arange(0, rotary_dim, 2, f32) / static_cast<double>(rotary_dim));
  const bool yarn = m.rope_scaling && m.rope_scaling->type == RopeScalingType::kYarn;
  torch::Tensor inv_freq = yarn ? yarn_inv_freq(pos_freqs, rotary_dim, m.rope_theta, *m.rope_scaling) : 1.0 / pos_freqs;
  if (m.rope_scaling && m.rope_scaling->type == RopeScalingType::kLinear) {
    inv_freq = inv_freq / m.rope_scaling->factor;  // HF's _compute_linear_scaling_rope_parameters
  } else if (m.rope_scaling && !yarn) {
    inv_freq = llama3_scaled(inv_freq, *m.rope_scaling);
  }
  const torch::Tensor freqs = torch::outer(torch::arange(seq, f32), inv_freq);
  const torch::Tensor angles = m.rope_style == RopeStyle::kInterleaved ? freqs.repeat_interleave(2, -1)
                                                                        : torch::cat({freqs, freqs}, -1);
  if (!yarn) return {angles.cos(), angles.sin()};
  const double attention_factor = yarn_attention_factor(*m.rope_scaling);
  return {angles.cos() * attention_factor, angles.sin() * attention_factor};
}

// Gemma 3's local rotary (its sliding layers): the rotary base rope_local_base_freq, unscaled.
ModelConfig local_rotary_model(const ModelConfig& m) {
  ModelConfig local = m;
  local.rope_theta = *m.rope_local_base_freq;
  local.rope_scaling.reset();
  return local;
}

// Rotary on the first `rotary_dim` dims of x: (B, heads, T, D), the rest
// passed through (Hugging Face's Phi: cat(rotated q_rot, q_pass)).
torch::Tensor apply_partial_rotary(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                                   RopeStyle style, int64_t rotary_dim) {
  const int64_t D = x.size(-1);
  if (rotary_dim == D) return apply_rotary(x, cos, sin, style);
  return torch::cat({apply_rotary(x.narrow(-1, 0, rotary_dim), cos, sin, style), x.narrow(-1, rotary_dim, D - rotary_dim)},
                    -1);
}

// The softmax's input: the (capped) scores with the causal mask applied as
// the run applied it (model.attention_mask). Excluded keys are filled with
// -inf whatever their score; an additive mask adds -inf or fp32's finfo.min,
// so a +inf or NaN score at a future key turns its query's row NaN, as in
// PyTorch; fill_finfo_min puts the smallest value of the type the scores are
// held in (`held_in`) at masked keys.
torch::Tensor apply_attention_mask(const torch::Tensor& scores, const torch::Tensor& visible, AttentionMask mask,
                                   torch::ScalarType held_in) {
  switch (mask) {
    case AttentionMask::kExclude:
      return scores.masked_fill(visible.logical_not(), -std::numeric_limits<float>::infinity());
    case AttentionMask::kAdditiveNegInf:
    case AttentionMask::kAdditiveFinfoMin: {
      const double masked = mask == AttentionMask::kAdditiveNegInf ? -std::numeric_limits<float>::infinity()
                                                                   : std::numeric_limits<float>::lowest();
      const torch::Tensor additive = torch::zeros(visible.sizes(), scores.options().requires_grad(false))
                                         .masked_fill(visible.logical_not(), masked);  // (T, T) fp32
      return scores + additive;
    }
    case AttentionMask::kFillFinfoMin: {
      const double lowest = held_in == torch::kBFloat16 ? -3.3895313892515355e38
                            : held_in == torch::kHalf   ? -65504.0
                                                        : static_cast<double>(std::numeric_limits<float>::lowest());
      return scores.masked_fill(visible.logical_not(), lowest);
    }
  }
  throw std::logic_error("unknown attention mask");
}

// Gemma 2's soft cap c * tanh(x / c), in fp32 from the (rounded) input.
torch::Tensor soft_capped(const torch::Tensor& x, const std::optional<double>& cap) {
  if (!cap) return x;
  return *cap * torch::tanh(x.to(torch::kFloat32) / *cap);
}

// Llama 4 (Llama4TextAttention), after rotary: on rotary layers with qk_norm
// l2, q and k L2-normalised over each head without a weight, x * rsqrt(mean(x^2)
// + eps) in fp32 (Llama4TextL2Norm); on NoPE layers with attn_temperature_tuning,
// q scaled at position t by log(floor((t + 1) / floor_scale) + 1) * attn_scale + 1.
// x: (B, T, heads*D) as rotary left it.
torch::Tensor llama4_after_rotary(const ModelConfig& m, int layer, const torch::Tensor& x, int64_t heads, bool query,
                                  const Numerics& block, ProbeSession& probes) {
  const int64_t B = x.size(0), T = x.size(1), D = m.head_dim();
  const bool rotary = m.rotary_layer(layer);
  torch::Tensor out = x;
  if (m.qk_norm == QkNorm::kL2 && (rotary || m.l2_qk_norm_every_layer)) {
    const SiteRef ref{query ? SiteId::kAttnQ : SiteId::kAttnK, layer};
    const auto rounded = [&](const torch::Tensor& t) { return block.rounds_site(ref) ? block.round(t) : t; };
    const torch::Tensor per_head = rounded(x).view({B, T, heads, D});
    const torch::Tensor mean_square = per_head.pow(2).mean(-1, /*keepdim=*/true);  // (B, T, heads, 1)
    probes.check_norm(ref, std::get<0>(mean_square.squeeze(-1).min(-1)), m.norm_eps, "mean square");
    out = rounded((per_head * torch::rsqrt(mean_square + m.norm_eps)).reshape({B, T, heads * D}));
  }
  if (query && m.attn_temperature_tuning && !rotary) {
    const ModelConfig::TemperatureTuning& tuning = *m.attn_temperature_tuning;
    const torch::Tensor positions = torch::arange(T, out.options().dtype(torch::kFloat32));
    const torch::Tensor scales =
        torch::log(torch::floor((positions + 1.0) / tuning.floor_scale) + 1.0) * tuning.attn_scale + 1.0;  // (T)
    out = out * scales.view({1, T, 1});
  }
  return out;
}

struct AttentionInputs {
  torch::Tensor q;  // (B, T, H*D) as probed
  torch::Tensor k;  // (B, T, G*D)
  torch::Tensor v;  // (B, T, G*Dv): Dv = D but for latent attention's v_head_dim
  torch::Tensor sinks;  // (H) GPT-OSS's sink logits (model.attention_sinks), else undefined
};

// GPT-OSS's softmax (eager_attention_forward): each head's sink logit joins
// the masked scores as one more key column, the row's max is subtracted, the
// softmax taken and the column dropped. The sink stays fp32 (autocast's cat
// promotes it with the fp32 mask). Returns (probs (B, H, T, T), sink (B, H, T, 1)).
std::pair<torch::Tensor, torch::Tensor> softmax_with_sinks(const torch::Tensor& logits, const torch::Tensor& sinks) {
  const int64_t B = logits.size(0), H = logits.size(1), T = logits.size(2);
  const torch::Tensor column = sinks.to(logits.device(), torch::kFloat32).view({1, H, 1, 1}).expand({B, H, T, 1});
  torch::Tensor combined = torch::cat({logits.to(torch::kFloat32), column}, -1);  // (B, H, T, T+1)
  combined = combined - std::get<0>(combined.max(-1, /*keepdim=*/true));
  const torch::Tensor all = torch::softmax(combined, -1);
  return {all.narrow(-1, 0, all.size(-1) - 1), all.narrow(-1, all.size(-1) - 1, 1)};
}

// The scores' scale as Numerics::attention_scores takes it: Gemma's query_pre_attn_scalar, or
// latent attention's scaling s as the scalar whose ** -0.5 it is; none: divided by sqrt(D).
std::optional<double> scores_scalar(const ModelConfig& m) {
  if (!m.latent_attention) return m.query_pre_attn_scalar;
  return std::pow(latent_attention_scaling(m), -2.0);
}

// Scores, probabilities and context of causal attention; returns (B, T, H*Dv).
torch::Tensor causal_attention(const ModelConfig& m, const AttentionInputs& in, int layer,
                               const Numerics& numerics, ProbeSession& probes) {
  const int64_t B = in.q.size(0), T = in.q.size(1), H = m.num_heads, G = m.num_kv_heads,
                D = m.head_dim(), Dv = m.v_head_dim();
  torch::Tensor q = in.q.view({B, T, H, D}).transpose(1, 2);  // (B, H, T, D)
  torch::Tensor k = in.k.view({B, T, G, D}).transpose(1, 2);  // (B, G, T, D)
  torch::Tensor v = in.v.view({B, T, G, Dv}).transpose(1, 2);  // (B, G, T, Dv)
  if (G != H) {  // query head h reads kv head h / (H / G)
    k = k.repeat_interleave(H / G, 1);  // (B, H, T, D)
    v = v.repeat_interleave(H / G, 1);
  }
  // The scores site is before any soft cap: the cap hides how close they came to overflowing.
  const torch::Tensor scores =
      probes.site({SiteId::kAttnScores, layer}, numerics.attention_scores(q, k, scores_scalar(m)));  // (B, H, T, T)
  const torch::Tensor visible = visible_keys(T, m.span_of(layer), scores.device());
  probes.hold_scores(layer, scores);  // for what the mask does to a row with a non-finite masked score
  HeadLogitRecorder::record(layer, scores, visible.logical_not());  // MuonClip's per-head maxima, when asked for
  // The type the softmax's input is held in: the compute type's, unless a cap made it fp32.
  const bool rounded = numerics.reduced() && numerics.rounds_site({SiteId::kAttnScores, layer});
  const torch::ScalarType held_in =
      rounded && !m.attn_logit_softcap ? numerics.low_type() : torch::kFloat32;
  const torch::Tensor logits =
      apply_attention_mask(soft_capped(scores, m.attn_logit_softcap), visible, m.attention_mask, held_in);
  torch::Tensor probs;
  if (in.sinks.defined()) {
    auto [keys, sink] = softmax_with_sinks(logits, in.sinks);
    probs = probes.site({SiteId::kAttnProbs, layer}, keys);
    probes.site({SiteId::kAttnSink, layer}, sink.detach());  // the sink's share, forward only: nothing reads it
  } else {
    probs = probes.site({SiteId::kAttnProbs, layer}, torch::softmax(logits, -1));
  }
  const torch::Tensor context =
      probes.site({SiteId::kAttnContext, layer}, numerics.matmul(probs, v));  // (B, H, T, Dv)
  return context.transpose(1, 2).reshape({B, T, H * Dv});
}

// Cross-entropy in fp32 from the (rounded) logits; the loss site itself.
// Written as the two ops cross_entropy is made of (log_softmax, then
// nll_loss: the same values bit for bit) so the per-sample losses of the
// outlier check reuse the log-probabilities instead of a second log_softmax
// over the whole (tokens, vocab) logits.
// `extra`: what the loss adds to the cross-entropy (a mixture of experts'
// router losses), or undefined; the per-sample losses are cross-entropy only.
ForwardResult next_token_loss(const torch::Tensor& logits, const torch::Tensor& all_targets,
                              ProbeSession& probes, const std::optional<double>& final_softcap = std::nullopt,
                              const torch::Tensor& extra = {}) {
  const torch::Tensor targets = all_targets.to(logits.device()).reshape({-1});
  const int64_t V = logits.size(-1);
  const torch::Tensor log_probs = torch::log_softmax(soft_capped(logits, final_softcap).reshape({-1, V}), 1);
  ForwardResult result;
  const torch::Tensor cross_entropy = torch::nll_loss(log_probs, targets);
  result.loss = probes.site({SiteId::kLoss, -1}, extra.defined() ? cross_entropy + extra.to(logits.device()) : cross_entropy);
  if (probes.enabled()) {  // per-sample losses for the outlier check
    torch::NoGradGuard no_grad;
    result.sample_loss =
        -log_probs.detach().gather(1, targets.unsqueeze(1)).view({all_targets.size(0), -1}).mean(1);
  }
  return result;
}

// The dense gated MLP, down(act(gate(h)) * up(h)): act is silu (llama's SwiGLU) or
// gelu_pytorch_tanh (Gemma's GeGLU).
torch::Tensor gated_mlp(const ModelConfig& m, const Weights& w, int layer, const torch::Tensor& h,
                        const Numerics& block, ProbeSession& probes) {
  using R = ParamRole;
  auto proj = [&](const torch::Tensor& in, R role) {
    return block.linear(in, w(role, layer), torch::Tensor(), w.module(role, layer));
  };
  const torch::Tensor gate = probes.site({SiteId::kMlpGate, layer}, proj(h, R::kGateProj));
  const torch::Tensor up = probes.site({SiteId::kMlpUp, layer}, proj(h, R::kUpProj));
  const torch::Tensor activated = m.hidden_act == HiddenAct::kGeluTanh
                                      ? F::gelu(gate, F::GELUFuncOptions().approximate("tanh"))
                                      : F::silu(gate);
  const torch::Tensor act = probes.site({SiteId::kMlpAct, layer}, activated * up);  // (B, T, F)
  return probes.site({SiteId::kMlpDown, layer}, proj(act, R::kDownProj));
}

// The block's linears, latent norms and rotary as latent attention reads them (latent_attention.h).
LatentAttentionOps latent_ops(const ModelConfig& m, const Weights& w, int layer, const torch::Tensor& cos,
                              const torch::Tensor& sin, const Numerics& block, ProbeSession& probes) {
  LatentAttentionOps ops;
  ops.linear = [w, layer, &block](const torch::Tensor& in, ParamRole role) {
    return block.linear(in, w(role, layer), torch::Tensor(), w.module(role, layer));
  };
  ops.norm = [&m, w, layer, &probes](const torch::Tensor& in, ParamRole weight, SiteId site) {
    const SiteRef ref{site, layer};
    return probes.site(ref, rms_norm(in, w(weight, layer), m.latent_attention->norm_eps, probes, ref));
  };
  ops.rotary = [&m, cos, sin](const torch::Tensor& x) { return apply_rotary(x, cos, sin, m.rope_style); };
  return ops;
}

}  // namespace

ModelPass::ModelPass(const ModelConfig& model, const Numerics& numerics, ProbeSession& probes)
    : m_(model), numerics_(numerics), probes_(probes) {}

torch::Tensor ModelPass::embed(const ParamMap& p, const torch::Tensor& inputs) {
  using R = ParamRole;
  const Weights w{p, m_.arch};
  const torch::Tensor embedding = w(R::kTokenEmbedding);
  inputs_ = inputs;
  torch::Tensor tokens = F::embedding(inputs.to(embedding.device()), embedding);  // (B, T, C)
  if (m_.arch == Arch::kGpt2) {
    const torch::Tensor positions =
        torch::arange(inputs.size(1), torch::TensorOptions().dtype(torch::kLong).device(embedding.device()));
    tokens = tokens + F::embedding(positions, w(R::kPositionEmbedding));
  }
  if (m_.scale_embeddings) {  // Gemma3TextScaledWordEmbedding: times sqrt(hidden), held in the weight's type
    const torch::Tensor scale =
        torch::full({}, std::sqrt(static_cast<double>(m_.hidden_size)), torch::TensorOptions().dtype(torch::kFloat32))
            .to(embedding.scalar_type());
    tokens = tokens * scale.to(embedding.device());
  }
  return probes_.site({SiteId::kEmbed, -1}, tokens);
}

torch::Tensor ModelPass::block(const ParamMap& p, int layer, const torch::Tensor& x) {
  // The residual stream entering block L is the tensor probed as the one before it.
  probes_.alias({SiteId::kInput, layer}, layer == 0 ? SiteRef{SiteId::kEmbed, -1} : SiteRef{SiteId::kOutput, layer - 1});
  return m_.arch == Arch::kLlama ? llama_block(p, layer, x) : gpt2_block(p, layer, x);
}

torch::Tensor ModelPass::mtp_block(const ParamMap& p, int layer, const torch::Tensor& x) {
  // An MTP block's input is its depth's eh_proj output, probed in the block's own scope.
  probes_.alias({SiteId::kInput, layer}, {SiteId::kMtpEhProj, layer});
  return llama_block(p, layer, x);
}

std::pair<torch::Tensor, torch::Tensor> ModelPass::rotary_for(int layer, int64_t seq, const torch::Device& device) {
  // One table per rotary kind: Gemma 3's sliding layers take the local one.
  const bool local = m_.local_rotary(layer);
  torch::Tensor& cos = local ? cos_local_ : cos_;
  torch::Tensor& sin = local ? sin_local_ : sin_;
  if (!cos.defined()) std::tie(cos, sin) = rotary_tables(seq, local ? local_rotary_model(m_) : m_, device);
  if (cos.device() != device) {
    cos = cos.to(device);
    sin = sin.to(device);
  }
  return {cos, sin};
}

torch::Tensor ModelPass::llama_block(const ParamMap& p, int layer, torch::Tensor x) {
  const ModelConfig& m = m_;
  ProbeSession& probes = probes_;
  const int64_t B = x.size(0), T = x.size(1), H = m.num_heads, G = m.num_kv_heads, D = m.head_dim();
  const int64_t rotary_dim = m.rotary_dim();
  using R = ParamRole;
  const Weights w{p, Arch::kLlama};
  // With the layers split across devices, the activations follow the layer's weights.
  const torch::Device device = w(R::kOProj, layer).device();
  // Pre-norm (llama): each sublayer reads a norm of the stream. Post-norm (OLMo 2): it reads the
  // stream itself, and its output is normalised before the residual add.
  // Sandwich (Gemma 2, 3): both.
  const bool pre_norm = m.norm_layout != NormLayout::kPost;
  const bool post_norm = m.norm_layout != NormLayout::kPre;
  auto sublayer_norm = [&](const torch::Tensor& in, R weight, SiteId site) {
    return probes.site({site, layer}, rms_norm(in, w(weight, layer), m.norm_eps, probes, {site, layer}, m.rms_norm_offset));
  };
  if (x.device() != device) x = x.to(device);
  torch::Tensor cos, sin;  // not a structured binding: C++17 lambdas cannot capture one
  std::tie(cos, sin) = rotary_for(layer, T, device);
  auto rope = [&](const torch::Tensor& in, int64_t heads) {
    if (!m.rotary_layer(layer)) return in;  // Llama 4's NoPE layers
    const torch::Tensor per_head = in.view({B, T, heads, D}).transpose(1, 2);  // (B, heads, T, D)
    return apply_partial_rotary(per_head, cos, sin, m.rope_style, rotary_dim).transpose(1, 2).reshape({B, T, heads * D});
  };
  const Numerics block = numerics_.in_layer(layer);  // what-ifs may run a layer in fp32
  auto proj = [&](const torch::Tensor& in, R role, std::optional<R> bias = std::nullopt) {
    return block.linear(in, w(role, layer), bias ? w(*bias, layer) : torch::Tensor(), w.module(role, layer));
  };
  const auto with_bias = [&](R bias) { return m.attention_bias ? std::optional<R>(bias) : std::nullopt; };
  // q_norm / k_norm before rotary: in fp32 from the rounded projection (as
  // autocast hands it over), rounded again as the site they feed would be.
  auto qk_normed = [&](const torch::Tensor& projected, R weight, SiteId site, int64_t heads) {
    if (m.qk_norm == QkNorm::kNone || m.qk_norm == QkNorm::kL2) return projected;  // l2: after rotary
    const SiteRef ref{site, layer};
    const auto rounded = [&](const torch::Tensor& t) { return block.rounds_site(ref) ? block.round(t) : t; };
    const torch::Tensor in = rounded(projected);
    // Unit weights: a scale of 1, which an offset norm's weight of 0 gives.
    const torch::Tensor scale = !m.qk_norm_unit_weights ? w(weight, layer)
                                : m.rms_norm_offset     ? torch::zeros({D}, in.options())
                                                        : torch::ones({D}, in.options());
    const bool offset = m.rms_norm_offset;
    const torch::Tensor normed =
        m.qk_norm == QkNorm::kHead
            ? rms_norm(in.view({B, T, heads, D}), scale, m.norm_eps, probes, ref, offset).reshape({B, T, heads * D})
            : rms_norm(in, scale, m.norm_eps, probes, ref, offset);
    return rounded(normed);
  };
  const torch::Tensor h = pre_norm ? sublayer_norm(x, R::kAttnNorm, SiteId::kAttnNorm) : x;
  AttentionInputs attn;
  // q or k: projection (+ bias), QK-norm, rotary, then Llama 4's L2 norm or temperature.
  auto q_or_k = [&](R projection, R bias, R norm, SiteId site, int64_t heads) {
    const torch::Tensor roped = rope(qk_normed(proj(h, projection, with_bias(bias)), norm, site, heads), heads);
    return probes.site({site, layer}, llama4_after_rotary(m, layer, roped, heads, site == SiteId::kAttnQ, block, probes));
  };
  if (m.latent_attention) {
    const LatentQkv qkv = latent_attention_qkv(m, layer, h, latent_ops(m, w, layer, cos, sin, block, probes), block, probes);
    attn.q = qkv.q;
    attn.k = qkv.k;
    attn.v = qkv.v;
  } else {
    attn.q = q_or_k(R::kQProj, R::kQBias, R::kQNorm, SiteId::kAttnQ, H);
    attn.k = q_or_k(R::kKProj, R::kKBias, R::kKNorm, SiteId::kAttnK, G);
    attn.v = probes.site({SiteId::kAttnV, layer}, proj(h, R::kVProj, with_bias(R::kVBias)));
  }
  if (m.attention_sinks) attn.sinks = w(R::kSinks, layer);
  const torch::Tensor context = causal_attention(m, attn, layer, block, probes);
  const std::optional<R> o_bias = m.o_proj_bias ? std::optional<R>(R::kOProjBias) : std::nullopt;
  torch::Tensor attn_out = probes.site({SiteId::kAttnOut, layer}, proj(context, R::kOProj, o_bias));
  if (post_norm) attn_out = sublayer_norm(attn_out, R::kAttnPostNorm, SiteId::kAttnPostNorm);
  x = probes.site({SiteId::kAttnResidual, layer}, x + attn_out);
  const R mlp_norm = m.norm_layout == NormLayout::kSandwich ? R::kMlpPreNorm : R::kMlpNorm;  // pre_feedforward_layernorm
  const torch::Tensor h2 = pre_norm ? sublayer_norm(x, mlp_norm, SiteId::kMlpNorm) : x;
  torch::Tensor mlp_out;
  if (m.moe_layer(layer)) {  // model.moe.layers: some layers keep the dense MLP (Llama 4, DeepSeek-V3)
    mlp_out = experts_mlp(m, p, h2, layer, block, probes, router_);
  } else {
    mlp_out = gated_mlp(m, w, layer, h2, block, probes);
  }
  if (post_norm) mlp_out = sublayer_norm(mlp_out, R::kMlpPostNorm, SiteId::kMlpPostNorm);
  return probes.site({SiteId::kOutput, layer}, x + mlp_out);
}

torch::Tensor ModelPass::gpt2_block(const ParamMap& p, int layer, torch::Tensor x) {
  const ModelConfig& m = m_;
  ProbeSession& probes = probes_;
  const int64_t C = m.hidden_size;
  using R = ParamRole;
  const Weights w{p, Arch::kGpt2};
  auto layer_norm = [&](const torch::Tensor& in, R weight, R bias, const SiteRef& site) {
    if (probes.enabled()) {
      probes.check_norm(site, in.detach().var(-1, /*unbiased=*/false), m.norm_eps, "variance");
    }
    return F::layer_norm(
        in, F::LayerNormFuncOptions({C}).weight(w(weight, site.layer)).bias(w(bias, site.layer)).eps(m.norm_eps));
  };
  x = x.to(w(R::kAttnNorm, layer).device());  // split layers: follow the weights
  const Numerics block = numerics_.in_layer(layer);  // what-ifs may run a layer in fp32
  auto linear = [&](const torch::Tensor& in, R weight, R bias) {
    return block.linear(in, w(weight, layer), w(bias, layer), w.module(weight, layer));
  };
  const torch::Tensor h = probes.site({SiteId::kAttnNorm, layer},
                                      layer_norm(x, R::kAttnNorm, R::kAttnNormBias, {SiteId::kAttnNorm, layer}));
  const std::vector<torch::Tensor> qkv = linear(h, R::kQkv, R::kQkvBias).split(C, -1);  // 3 x (B, T, C)
  AttentionInputs attn;
  attn.q = probes.site({SiteId::kAttnQ, layer}, qkv[0]);
  attn.k = probes.site({SiteId::kAttnK, layer}, qkv[1]);
  attn.v = probes.site({SiteId::kAttnV, layer}, qkv[2]);
  const torch::Tensor context = causal_attention(m, attn, layer, block, probes);
  const torch::Tensor attn_out = probes.site({SiteId::kAttnOut, layer}, linear(context, R::kOProj, R::kOProjBias));
  x = probes.site({SiteId::kAttnResidual, layer}, x + attn_out);
  const torch::Tensor h2 = probes.site({SiteId::kMlpNorm, layer},
                                       layer_norm(x, R::kMlpNorm, R::kMlpNormBias, {SiteId::kMlpNorm, layer}));
  const torch::Tensor up = probes.site({SiteId::kMlpUp, layer}, linear(h2, R::kUpProj, R::kUpBias));
  const torch::Tensor act =
      probes.site({SiteId::kMlpAct, layer}, F::gelu(up, F::GELUFuncOptions().approximate("tanh")));
  const torch::Tensor down = probes.site({SiteId::kMlpDown, layer}, linear(act, R::kDownProj, R::kDownBias));
  return probes.site({SiteId::kOutput, layer}, x + down);
}

ForwardResult ModelPass::head(const ParamMap& p, const torch::Tensor& x_in, const torch::Tensor& targets) {
  using R = ParamRole;
  const Weights w{p, m_.arch};
  const SiteRef norm_site{SiteId::kFinalNorm, -1};
  const torch::Tensor x = x_in.to(w(R::kFinalNorm).device());
  torch::Tensor final_norm;
  if (m_.arch == Arch::kLlama) {
    final_norm = probes_.site(norm_site, rms_norm(x, w(R::kFinalNorm), m_.norm_eps, probes_, norm_site, m_.rms_norm_offset));
  } else {
    if (probes_.enabled()) probes_.check_norm(norm_site, x.detach().var(-1, /*unbiased=*/false), m_.norm_eps, "variance");
    final_norm = probes_.site(
        norm_site, F::layer_norm(x, F::LayerNormFuncOptions({m_.hidden_size})
                                        .weight(w(R::kFinalNorm))
                                        .bias(w(R::kFinalNormBias))
                                        .eps(m_.norm_eps)));
  }
  // gpt2's head is always the token embedding; a tied head on a split model
  // reads it through a differentiable copy.
  const bool tied = m_.arch == Arch::kGpt2 || m_.tie_embeddings;
  const torch::Tensor head = (tied ? w(R::kTokenEmbedding) : w(R::kLmHead)).to(x.device());
  // The logits site is before the final soft cap, which only the loss reads.
  const torch::Tensor logits =
      probes_.site({SiteId::kLogits, -1}, numerics_.linear(final_norm, head, {}, "lm_head"));  // (B, T, V)
  if (m_.arch == Arch::kGpt2) return next_token_loss(logits, targets, probes_);
  ForwardResult result = next_token_loss(logits, targets, probes_, m_.final_logit_softcap,
                                         m_.moe ? router_loss(*m_.moe, router_) : torch::Tensor());
  if (m_.mtp) add_mtp_loss(p, final_norm, head, targets, result);
  return result;
}

// Megatron-LM's MultiTokenPredictionBlock.forward and process_mtp_loss
// (megatron/core/transformer/multi_token_prediction.py), context parallelism
// and packed sequences aside. Depth k starts from the previous depth's output
// (k = 1: the decoder's, after its final norm, as GPTModel hands it over):
//   ids, labels, loss_mask rolled one more position left (roll_tensor);
//   x = eh_proj(cat(enorm(embed(ids)), hnorm(hidden)))   (_concat_embeddings: embedding first)
//   hidden = shared_head.norm(block(x))                  (_postprocess: the MTP layer's final_layernorm)
//   loss_k = masked mean cross-entropy of lm_head(hidden) against labels
// and the loss's gradient gains mtp_loss_scaling_factor / D * sum_k loss_k.
// Each depth's tensors are probe sites in its block's scope layers.{L+k-1}
// (mtp.embed ... mtp.eh_proj, the block's, mtp.final_norm ... mtp.loss):
// a site rounds as the numerics.round() it stands for, so nothing changes.
void ModelPass::add_mtp_loss(const ParamMap& p, const torch::Tensor& main_hidden, const torch::Tensor& head,
                             const torch::Tensor& targets, ForwardResult& result) {
  if (!inputs_.defined()) throw std::logic_error("multi-token prediction needs the pass's own embed()");
  // The blocks' ModelPass counts them as layers (rotary, spans, weights); the probes are this pass's own.
  const ModelConfig blocks_model = with_mtp_blocks(m_);
  ModelPass blocks(blocks_model, numerics_, probes_);
  const torch::Tensor& embedding = param(p, param_key(m_.arch, ParamRole::kTokenEmbedding));
  torch::Tensor ids = inputs_, labels = targets.to(inputs_.device()), loss_mask = torch::ones_like(inputs_);
  torch::Tensor hidden = main_hidden, total;
  const double depth_scale = m_.mtp->loss_scale / static_cast<double>(m_.mtp->num_layers);
  for (int depth = 1; depth <= m_.mtp->num_layers; ++depth) {
    const auto weight = [&](MtpPart part) -> const torch::Tensor& { return param(p, mtp_key(m_, depth, part)); };
    const int layer = mtp_block_layer(m_, depth);
    const auto site = [layer](SiteId id) { return SiteRef{id, layer}; };
    // enorm, hnorm, shared_head.norm: RMSNorms whose output (and zero check) is their site.
    const auto normed = [&](SiteId id, const torch::Tensor& in, MtpPart part) {
      return probes_.site(site(id), rms_norm(in, weight(part), m_.norm_eps, probes_, site(id)));
    };
    const Numerics numerics = numerics_.in_layer(layer);
    const torch::Device device = weight(MtpPart::kEhProj).device();
    ids = roll_left(ids);
    // The embedding module's output, held in the compute type as the embed site holds the decoder's.
    const torch::Tensor embedded =
        probes_.site(site(SiteId::kMtpEmbed), F::embedding(ids.to(embedding.device()), embedding).to(device));
    const torch::Tensor enormed = normed(SiteId::kMtpEnorm, embedded, MtpPart::kEnorm);
    const torch::Tensor hnormed = normed(SiteId::kMtpHnorm, hidden.to(device), MtpPart::kHnorm);
    const std::string eh_proj = mtp_key(m_, depth, MtpPart::kEhProj);
    const torch::Tensor x = probes_.site(
        site(SiteId::kMtpEhProj), numerics.linear(torch::cat({enormed, hnormed}, -1), weight(MtpPart::kEhProj),
                                                  torch::Tensor(), eh_proj.substr(0, eh_proj.rfind('.'))));
    hidden = normed(SiteId::kMtpFinalNorm, blocks.mtp_block(p, layer, x), MtpPart::kHeadNorm);
    const torch::Tensor logits =
        probes_.site(site(SiteId::kMtpLogits), numerics_.linear(hidden, head.to(device), {}, "lm_head"));
    labels = roll_left(labels);
    loss_mask = roll_left(loss_mask);
    const torch::Tensor depth_loss =
        probes_.site(site(SiteId::kMtpLoss), masked_mean_cross_entropy(logits, labels, loss_mask));
    result.mtp_losses.push_back(depth_loss.detach());
    const torch::Tensor scaled = depth_scale * depth_loss.to(result.loss.device());
    total = total.defined() ? total + scaled : scaled;
  }
  result.loss = with_mtp_gradient(result.loss, total);
  MtpLossRecorder::record(result.mtp_losses);
}

ForwardResult forward_loss(const ModelConfig& model, const ParamMap& params,
                           const torch::Tensor& inputs, const torch::Tensor& targets,
                           const Numerics& numerics, ProbeSession& probes) {
  ModelPass pass(model, numerics, probes);
  torch::Tensor x = pass.embed(params, inputs);
  for (int layer = 0; layer < model.num_layers; ++layer) x = pass.block(params, layer, x);
  return pass.head(params, x, targets);
}

}  // namespace nanreplay
