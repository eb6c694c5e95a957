// What model a bundle describes: its family, its dimensions and the options
// its family takes (docs/bundle-format.md, "model" and "Model options"). The
// manifest's model object is read into a ModelConfig by the option table
// (loaders/arch/model_options.h); the forward pass reads nothing else.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <vector>

#include "kernels/attention_span.h"

namespace nanreplay {

enum class Arch { kLlama, kGpt2 };

const char* arch_name(Arch arch);

// The llama family's model options, each as the Hugging Face model it comes from.
enum class RopeStyle { kRotateHalf, kInterleaved };  // interleaved: Meta, torchtitan, llama2.c
// head: Qwen3; full: OLMo 2; l2: Llama 4 (no weight, after rotary, rotary layers only)
enum class QkNorm { kNone, kHead, kFull, kL2 };
// How the causal mask reaches the softmax. They differ only where a masked
// score is not finite: excluded, a +inf or NaN at a future key is dropped;
// added, it makes the query's whole row NaN (inf + -inf), as PyTorch computes.
enum class AttentionMask : uint8_t {
  kExclude,           // masked keys take no part (nanoGPT's masked_fill(-inf), fused causal kernels)
  kAdditiveNegInf,    // scores + (-inf) at masked keys (llama2.c, Meta's llama, PyTorch's math SDPA)
  kAdditiveFinfoMin,  // scores + fp32's finfo.min at masked keys (Hugging Face eager attention)
  kFillFinfoMin,      // masked scores replaced by finfo.min of their type (Hugging Face GPT-2 eager)
};

// "exclude", "additive_neg_inf", ...: the names model.attention_mask takes (llama_options.cpp).
const char* attention_mask_name(AttentionMask mask);

// Where a block's norms sit. Pre: each sublayer reads a norm of the stream
// (llama). Post (OLMo 2): each sublayer reads the stream itself and its output
// is normalised before the residual add, h = x + norm(attn(x)).
// Sandwich (Gemma 2, Gemma 3): both, each sublayer reads a norm of the stream
// and its output is normalised again before the residual add.
enum class NormLayout : uint8_t { kPre, kPost, kSandwich };

// One layer's attention, as Hugging Face's config.layer_types names it
// (attention_kind_names() in loaders/arch/llama_options.cpp, in this order;
// a new kind is a value here and a name there).
enum class AttentionKind : uint8_t {
  kFull,     // "full_attention": every earlier key
  kSliding,  // "sliding_attention": the last sliding_window keys, the local rotary base
  kChunked,  // "chunked_attention" (Llama 4): the earlier keys of its own attention_chunk_size chunk
};

// "full_attention", "sliding_attention", "chunked_attention": the names layer_types takes (llama_options.cpp).
const char* attention_kind_name(AttentionKind kind);

// The gated MLP's activation on the gate projection (Hugging Face's hidden_act).
enum class HiddenAct : uint8_t { kSilu, kGeluTanh };  // gelu_tanh: gelu_pytorch_tanh (Gemma)

// Rotary frequency scaling: Llama 3.1's (rope_type "llama3"; Llama 4 with
// low_freq_factor == high_freq_factor) or YaRN's (GPT-OSS, DeepSeek-V3, Qwen3
// long context), as Hugging Face's modeling_rope_utils computes them; or
// linear (rope_type "linear": every frequency divided by factor; Gemma 3's
// full-attention layers).
enum class RopeScalingType : uint8_t { kLlama3, kYarn, kLinear };
struct RopeScaling {
  RopeScalingType type = RopeScalingType::kLlama3;
  double factor = 8.0;
  double low_freq_factor = 1.0;   // llama3 only
  double high_freq_factor = 4.0;  // llama3 only
  int64_t original_max_position_embeddings = 8192;
  // yarn only, Hugging Face's defaults when the config leaves them out:
  double beta_fast = 32.0;
  double beta_slow = 1.0;
  double mscale = 0.0;          // 0: absent (HF tests `mscale and mscale_all_dim`)
  double mscale_all_dim = 0.0;
  std::optional<double> attention_factor;  // cos and sin are multiplied by it; derived when absent
  bool truncate = true;         // floor/ceil the correction range
};

// YaRN's factor on cos and sin: the config's attention_factor, else
// get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim) when both
// are set, else get_mscale(factor), get_mscale(s, m) = 0.1 m ln(s) + 1 (1 for s <= 1).
double yarn_attention_factor(const RopeScaling& s);

// How a mixture of experts' router turns logits into routing weights.
enum class RouterKind : uint8_t {
  kSoftmaxTopK,  // "softmax_top_k" (Qwen3-MoE): softmax over every expert, then the top_k probabilities
  kTopKSoftmax,  // "top_k_softmax" (GPT-OSS): the top_k logits, then a softmax over those k alone
  kSigmoidTopK,  // "sigmoid_top_k" (Llama 4): the top_k logits, each through a sigmoid on its own
  // "sigmoid_grouped" (DeepSeek-V3, Kimi K2): fp32 logits through a sigmoid; the top_k experts by
  // sigmoid + the step's correction bias within the topk_group best of n_group groups, weighted by
  // the unbiased sigmoid (renormalized when norm_topk_prob) times routed_scaling_factor.
  kSigmoidGrouped,
};

// What each expert computes from its gate and up projections g and u.
enum class ExpertActivation : uint8_t {
  kSilu,    // "silu" (Qwen3-MoE): silu(g) * u
  kGptOss,  // "gpt_oss" (GPT-OSS): (u + 1) * g * sigmoid(swiglu_alpha * g)
};

// A mixture of experts in place of the dense MLP of every layer (or of the
// layers `layers` lists), routed as Hugging Face's Qwen3-MoE by default, or as
// GPT-OSS or Llama 4 with their options (docs/bundle-format.md, "Mixture of
// experts"); llama only.
struct MoeConfig {
  int64_t num_experts = 0;
  int64_t top_k = 0;
  int64_t intermediate_size = 0;  // each expert's width; the model's when absent
  bool norm_topk_prob = false;    // renormalize the top-k probabilities to sum 1
  double router_aux_loss_coef = 0.0;  // times load_balancing_loss_func over all layers
  double router_z_loss_coef = 0.0;    // times the mean of logsumexp(router logits)^2
  RouterKind router = RouterKind::kSoftmaxTopK;
  bool router_bias = false;  // GPT-OSS: mlp.gate.bias
  bool expert_bias = false;  // GPT-OSS: a bias on each expert's gate, up and down projections
  // GPT-OSS: each expert's gate and up projections are one matmul (its gate_up_proj): in bf16/fp16
  // the input is rounded once for both, and its gradient is summed over both before it is rounded.
  bool fused_gate_up = false;
  ExpertActivation expert_activation = ExpertActivation::kSilu;
  double swiglu_alpha = 0.0;  // gpt_oss only: the sigmoid's gain (GPT-OSS: 1.702)
  // GPT-OSS: g clamped to at most the limit and u to [-limit, limit] before the activation; absent: no clamp.
  std::optional<double> swiglu_limit{};
  // The layers with experts, ascending (Llama 4's moe_layers, DeepSeek-V3's layers from
  // first_k_dense_replace, and model.mtp's blocks past the decoder's layers); the others keep
  // the dense MLP. Empty: every layer.
  std::vector<int> layers{};
  // Llama 4: each expert reads its input times its routing weight, and its output is summed
  // unweighted (the weight on the output otherwise).
  bool scale_expert_input = false;
  // Llama 4, DeepSeek-V3: a dense SwiGLU MLP of this width beside the routed experts, on every
  // token, its output added to theirs. 0: none.
  int64_t shared_expert_intermediate_size = 0;
  // DeepSeek-V3's grouped router (sigmoid_grouped only): n_group groups of num_experts / n_group
  // experts, each scored by the sum of its two best biased scores; the top_k experts are chosen
  // within the topk_group best groups; their weights are multiplied by routed_scaling_factor.
  int64_t n_group = 1;
  int64_t topk_group = 1;
  double routed_scaling_factor = 1.0;
  // Whether the router adds e_score_correction_bias to its scores for the choice (DeepSeek-V3's
  // aux-loss-free balancing; sigmoid_grouped only). A buffer the job updates after each step, not
  // a parameter: each step's value comes from its state.json (router_score_bias).
  bool score_bias = false;
  // model.moe.score_bias_update: how the job moved the correction bias after each step, from the
  // tokens each expert received in it (docs/rolling-forward.md, "The router's correction bias"). Set:
  // a rolled-forward step without a logged bias replays with the bias derived by this rule.
  // Absent: such a step is refused by name.
  struct ScoreBiasUpdate {
    // kSignCentred: torchtitan's _update_expert_bias (delta = rate * sign(mean - tokens), minus its
    // mean); kSign: the DeepSeek-V3 paper's rule (the same without the mean subtracted).
    enum class Rule : uint8_t { kSignCentred, kSign };
    Rule rule = Rule::kSignCentred;
    double rate = 0.0;  // torchtitan's load_balance_coeff, the paper's bias update speed gamma
  };
  std::optional<ScoreBiasUpdate> score_bias_update{};
  // The replayed step's e_score_correction_bias by layer (every layer with experts when
  // score_bias): not a manifest key; replay_step sets it from the step's state.json, a what-if may
  // replace it (router-bias=frozen).
  std::map<int, std::vector<double>> step_score_bias{};
};

// DeepSeek-V3 / Kimi K2's multi-head latent attention (model.latent_attention,
// docs/bundle-format.md "Multi-head latent attention"), as Hugging Face's
// DeepseekV3Attention: q (through a compressed latent when q_lora_rank is set)
// and a compressed kv latent with one rotary key head shared by every head.
struct LatentAttention {
  int64_t q_lora_rank = 0;       // 0 (null in the manifest): a plain q_proj
  int64_t kv_lora_rank = 0;
  int64_t qk_nope_head_dim = 0;  // each head's q and k width without rotary
  int64_t qk_rope_head_dim = 0;  // the rotary width, k's shared across heads
  int64_t v_head_dim = 0;
  // The latents' RMSNorm eps: Hugging Face builds q_a_layernorm and kv_a_layernorm
  // with DeepseekV3RMSNorm's default 1e-6, not rms_norm_eps (torchtitan: norm_eps).
  double norm_eps = 1e-6;
  int64_t qk_head_dim() const { return qk_nope_head_dim + qk_rope_head_dim; }
};

// Multi-token prediction (model.mtp, docs/bundle-format.md "Multi-token
// prediction"), as Megatron-LM's MultiTokenPredictionBlock computes it
// (megatron/core/transformer/multi_token_prediction.py): `num_layers` depths,
// each a projection of [enorm(embedding of the tokens k ahead); hnorm(the
// previous depth's output)], one decoder block (model.layers.{num_layers + k - 1},
// with experts when moe.layers lists it, as DeepSeek-V3's), shared_head.norm and the
// model's own output head; the mean of the depths' cross-entropies times
// `loss_scale` adds to the gradient (not to the logged LM loss).
struct MultiTokenPrediction {
  int64_t num_layers = 0;   // Megatron's mtp_num_layers (DeepSeek-V3: num_nextn_predict_layers)
  double loss_scale = 0.0;  // Megatron's mtp_loss_scaling_factor, > 0
};

struct ModelConfig {
  Arch arch = Arch::kLlama;
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t num_layers = 0;
  int64_t num_heads = 0;
  int64_t num_kv_heads = 0;       // defaults to num_heads
  int64_t intermediate_size = 0;  // llama: required; gpt2: 4 * hidden_size
  int64_t max_seq_len = 0;
  double norm_eps = 1e-5;
  double rope_theta = 10000.0;
  bool tie_embeddings = false;    // gpt2: always true
  // llama only, one row each in loaders/arch/llama_options.cpp:
  RopeStyle rope_style = RopeStyle::kRotateHalf;
  std::optional<RopeScaling> rope_scaling;
  bool attention_bias = false;                // Qwen2: q, k, v projections carry a bias
  bool o_proj_bias = false;                   // GPT-OSS (and Llama's attention_bias): o_proj carries one too
  // GPT-OSS: one learned logit per head (self_attn.sinks) takes part in the
  // softmax as an extra key column and is dropped after it.
  bool attention_sinks = false;
  // Llama 4: per layer 1 = rotary, 0 = NoPE (Hugging Face's no_rope_layers); empty: all rotary.
  std::vector<int> no_rope_layers;
  // Llama 4: on NoPE layers q is scaled by log(floor((pos + 1) / floor_scale) + 1) * attn_scale + 1.
  struct TemperatureTuning {
    double floor_scale = 8192.0;
    double attn_scale = 0.1;
  };
  std::optional<TemperatureTuning> attn_temperature_tuning;
  // Llama 4: chunked layers attend within chunks of this many positions (0: none): those
  // layer_types names "chunked_attention", else (no layer_types) the rotary layers, as
  // Llama4TextConfig derives layer_types from no_rope_layers.
  int64_t attention_chunk_size = 0;
  QkNorm qk_norm = QkNorm::kNone;
  std::optional<double> attn_logit_softcap;   // Gemma 2: c * tanh(scores / c)
  std::optional<double> final_logit_softcap;  // Gemma 2: c * tanh(logits / c)
  int64_t sliding_window = 0;                 // Mistral: 0 = full causal attention
  std::optional<MoeConfig> moe;               // Qwen3-MoE: experts in place of the dense MLP
  std::optional<LatentAttention> latent_attention;  // DeepSeek-V3: in place of q/k/v_proj
  std::optional<MultiTokenPrediction> mtp;          // DeepSeek-V3: MTP layers after the decoder's
  int64_t explicit_head_dim = 0;              // Qwen3, Gemma 3: 0 = hidden_size / num_heads
  double partial_rotary_factor = 1.0;         // Phi, GLM: rotary on the first int(head_dim * factor) dims
  AttentionMask attention_mask = AttentionMask::kExclude;
  NormLayout norm_layout = NormLayout::kPre;      // OLMo 2: post; Gemma 2, 3: sandwich
  // Gemma 3, OLMo 3: each layer's attention kind; empty: every layer full
  // (with sliding_window, if set, on every layer as Mistral).
  std::vector<AttentionKind> layer_types;
  // Gemma 3: the rotary base of sliding layers, which are then unscaled (its local rotary).
  std::optional<double> rope_local_base_freq;
  bool rms_norm_offset = false;                   // Gemma: every RMSNorm scales by (1 + weight), in fp32
  bool scale_embeddings = false;                  // Gemma: embeddings times sqrt(hidden_size), in their type
  std::optional<double> query_pre_attn_scalar;    // Gemma: scores scaled by its **-0.5, not head_dim's
  HiddenAct hidden_act = HiddenAct::kSilu;        // Gemma: gelu_pytorch_tanh
  // Not a manifest key: the qk-norm what-if normalises q and k with unit
  // weights, which no checkpoint holds.
  bool qk_norm_unit_weights = false;
  // Not a manifest key: the qk-norm what-if on Llama 4 applies its L2 QK-norm on NoPE layers too.
  bool l2_qk_norm_every_layer = false;

  AttentionKind attention_kind(int layer) const {
    if (!layer_types.empty()) return layer_types.at(static_cast<size_t>(layer));
    return attention_chunk_size > 0 && rotary_layer(layer) ? AttentionKind::kChunked : AttentionKind::kFull;
  }
  // Whether any layer's kind is not plain full attention by default (inspect lists them then).
  bool has_layer_kinds() const { return !layer_types.empty() || attention_chunk_size > 0; }
  // The keys a query of `layer` sees at most (0: all earlier ones).
  int64_t window_of(int layer) const {
    if (layer_types.empty()) return sliding_window;
    return attention_kind(layer) == AttentionKind::kSliding ? sliding_window : 0;
  }
  // The keys a query of `layer` sees: its sliding window or its chunk, else every earlier one.
  AttentionSpan span_of(int layer) const {
    AttentionSpan span(window_of(layer));
    if (attention_kind(layer) == AttentionKind::kChunked) span.chunk = attention_chunk_size;
    return span;
  }
  // Whether `layer` takes the local rotary table (rope_local_base_freq, unscaled).
  bool local_rotary(int layer) const {
    return rope_local_base_freq.has_value() && attention_kind(layer) == AttentionKind::kSliding;
  }
  // Whether `layer` holds the mixture of experts (else the dense MLP).
  bool moe_layer(int layer) const {
    if (!moe) return false;
    if (moe->layers.empty()) return true;
    for (const int l : moe->layers) {
      if (l == layer) return true;
    }
    return false;
  }
  // A dense layer and an expert layer, where the model has them: layers differ
  // only in that, so these decide whether any layer has a site or parameter
  // (scanning every layer of an absurd num_layers would take minutes).
  std::vector<int> one_layer_of_each_kind() const {
    std::vector<int> layers;
    if (num_layers <= 0) return layers;
    const bool every_layer_moe = moe && moe->layers.empty();
    int dense = every_layer_moe ? num_layers : 0;
    while (dense < num_layers && moe_layer(dense)) ++dense;  // at most |moe.layers| + 1 tries
    if (dense < num_layers) layers.push_back(dense);
    if (every_layer_moe) layers.push_back(0);
    for (const int listed : moe ? moe->layers : std::vector<int>{}) {
      if (listed >= 0 && listed < num_layers) {
        layers.push_back(listed);
        break;
      }
    }
    return layers;
  }
  bool rotary_layer(int layer) const {
    return no_rope_layers.empty() || no_rope_layers.at(static_cast<size_t>(layer)) != 0;
  }
  // One head's q and k width (latent attention: qk_nope_head_dim + qk_rope_head_dim).
  int64_t head_dim() const {
    if (latent_attention) return latent_attention->qk_head_dim();
    return explicit_head_dim > 0 ? explicit_head_dim : hidden_size / num_heads;
  }
  // One head's v width: head_dim but for latent attention's own v_head_dim.
  int64_t v_head_dim() const { return latent_attention ? latent_attention->v_head_dim : head_dim(); }
  // As Hugging Face computes it: int(head_dim * partial_rotary_factor), the product in double;
  // latent attention turns its qk_rope_head_dim (DeepseekV3Config's head_dim).
  int64_t rotary_dim() const {
    if (latent_attention) return latent_attention->qk_rope_head_dim;
    return static_cast<int64_t>(static_cast<double>(head_dim()) * partial_rotary_factor);
  }
};

// The parameters a model may hold, by what they do. Their keys and shapes, and
// which option brings each, are the parameter table's (probes/param_table.cpp);
// the role lives here so an option that brings parameters is described in one
// header.
enum class ParamRole : uint8_t {
  kTokenEmbedding,
  kPositionEmbedding,  // gpt2
  kQBias,              // llama with attention_bias (Qwen2)
  kKBias,
  kVBias,
  kQNorm,              // llama with qk_norm (Qwen3, OLMo 2)
  kKNorm,
  kAttnNorm,
  kAttnNormBias,       // gpt2
  kQProj,
  kKProj,
  kVProj,
  kQkv,                // gpt2: q, k, v stacked along the output dimension
  kQkvBias,
  kOProj,
  kOProjBias,          // gpt2; llama with o_proj_bias (GPT-OSS)
  kQAProj,             // llama with latent_attention (DeepSeek-V3) and a q_lora_rank
  kQALayernorm,
  kQBProj,
  kKvAProj,            // llama with latent_attention: kv_a_proj_with_mqa, its norm, kv_b_proj
  kKvALayernorm,
  kKvBProj,
  kSinks,              // llama with attention_sinks (GPT-OSS): (num_heads,) logits
  kMlpNorm,
  kMlpNormBias,
  kAttnPostNorm,       // llama with norm_layout post (OLMo 2): attention's output, then the MLP's
  kMlpPostNorm,
  kMlpPreNorm,         // llama with norm_layout sandwich (Gemma 3): pre_feedforward_layernorm
  kGateProj,           // llama
  kUpProj,
  kUpBias,
  kDownProj,
  kDownBias,
  kRouter,             // llama with moe (Qwen3-MoE): the router's gate, then every expert's projections
  kRouterBias,         // moe with router_bias (GPT-OSS)
  kExpertGateProj,
  kExpertGateBias,     // moe with expert_bias (GPT-OSS)
  kExpertUpProj,
  kExpertUpBias,
  kExpertDownProj,
  kExpertDownBias,
  kSharedGateProj,     // moe with shared_expert_intermediate_size (Llama 4, DeepSeek-V3): the shared expert
  kSharedUpProj,
  kSharedDownProj,
  kFinalNorm,
  kFinalNormBias,
  kLmHead,             // llama without tied embeddings
};

}  // namespace nanreplay
