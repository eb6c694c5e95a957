// What model a bundle describes: its family, its dimensions and the options
// its family takes (docs/bundle-format.md, "model" and "Model options"). The
// manifest's model object is read into a ModelConfig by the option table
// (loaders/arch/model_options.h); the forward pass reads nothing else.
#pragma once

#include <cstdint>
#include <optional>

namespace nanreplay {

enum class Arch { kLlama, kGpt2 };

const char* arch_name(Arch arch);

// The llama family's model options, each as the Hugging Face model it comes from.
enum class RopeStyle { kRotateHalf, kInterleaved };  // interleaved: Meta, torchtitan, llama2.c
enum class QkNorm { kNone, kHead, kFull };           // head: Qwen3; full: OLMo 2
// How the causal mask reaches the softmax. They differ only where a masked
// score is not finite: excluded, a +inf or NaN at a future key is dropped;
// added, it makes the query's whole row NaN (inf + -inf), as PyTorch computes.
enum class AttentionMask : uint8_t {
  kExclude,           // masked keys take no part (nanoGPT's masked_fill(-inf), fused causal kernels)
  kAdditiveNegInf,    // scores + (-inf) at masked keys (llama2.c, Meta's llama, PyTorch's math SDPA)
  kAdditiveFinfoMin,  // scores + fp32's finfo.min at masked keys (Hugging Face eager attention)
  kFillFinfoMin,      // masked scores replaced by finfo.min of their type (Hugging Face GPT-2 eager)
};

// Where a block's norms sit. Pre: each sublayer reads a norm of the stream
// (llama). Post (OLMo 2): each sublayer reads the stream itself and its output
// is normalised before the residual add, h = x + norm(attn(x)).
enum class NormLayout : uint8_t { kPre, kPost };

// Llama 3.1's rotary frequency scaling (rope_type "llama3").
struct RopeScaling {
  double factor = 8.0;
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  int64_t original_max_position_embeddings = 8192;
};

// A mixture of experts in place of every layer's dense MLP, routed as Hugging
// Face's Qwen3-MoE (docs/bundle-format.md, "Mixture of experts"); llama only.
struct MoeConfig {
  int64_t num_experts = 0;
  int64_t top_k = 0;
  int64_t intermediate_size = 0;  // each expert's width; the model's when absent
  bool norm_topk_prob = false;    // renormalize the top-k probabilities to sum 1
  double router_aux_loss_coef = 0.0;  // times load_balancing_loss_func over all layers
  double router_z_loss_coef = 0.0;    // times the mean of logsumexp(router logits)^2
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
  QkNorm qk_norm = QkNorm::kNone;
  std::optional<double> attn_logit_softcap;   // Gemma 2: c * tanh(scores / c)
  std::optional<double> final_logit_softcap;  // Gemma 2: c * tanh(logits / c)
  int64_t sliding_window = 0;                 // Mistral: 0 = full causal attention
  std::optional<MoeConfig> moe;               // Qwen3-MoE: experts in place of the dense MLP
  int64_t explicit_head_dim = 0;              // Qwen3, Gemma 3: 0 = hidden_size / num_heads
  double partial_rotary_factor = 1.0;         // Phi, GLM: rotary on the first int(head_dim * factor) dims
  AttentionMask attention_mask = AttentionMask::kExclude;
  NormLayout norm_layout = NormLayout::kPre;      // OLMo 2: post
  // Not a manifest key: the qk-norm what-if normalises q and k with unit
  // weights, which no checkpoint holds.
  bool qk_norm_unit_weights = false;

  int64_t head_dim() const { return explicit_head_dim > 0 ? explicit_head_dim : hidden_size / num_heads; }
  // As Hugging Face computes it: int(head_dim * partial_rotary_factor), the product in double.
  int64_t rotary_dim() const {
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
  kOProjBias,
  kMlpNorm,
  kMlpNormBias,
  kAttnPostNorm,       // llama with norm_layout post (OLMo 2): attention's output, then the MLP's
  kMlpPostNorm,
  kGateProj,           // llama
  kUpProj,
  kUpBias,
  kDownProj,
  kDownBias,
  kRouter,             // llama with moe (Qwen3-MoE): the router's gate, then every expert's projections
  kExpertGateProj,
  kExpertUpProj,
  kExpertDownProj,
  kFinalNorm,
  kFinalNormBias,
  kLmHead,             // llama without tied embeddings
};

}  // namespace nanreplay
