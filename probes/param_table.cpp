// The parameter tables; see param_table.h and docs/bundle-format.md.
#include "probes/param_table.h"

#include <stdexcept>

namespace nanreplay {

namespace {

using R = ParamRole;
using Shape = std::vector<int64_t>;

Shape hidden(const ModelConfig& m) { return {m.hidden_size}; }
Shape square(const ModelConfig& m) { return {m.hidden_size, m.hidden_size}; }
Shape vocab_rows(const ModelConfig& m) { return {m.vocab_size, m.hidden_size}; }
Shape kv_rows(const ModelConfig& m) { return {m.num_kv_heads * m.head_dim(), m.hidden_size}; }
// An explicit head_dim (Qwen3, Gemma 3) makes q_proj [heads * head_dim, hidden] and o_proj its transpose.
Shape q_rows(const ModelConfig& m) { return {m.num_heads * m.head_dim(), m.hidden_size}; }
Shape o_cols(const ModelConfig& m) { return {m.hidden_size, m.num_heads * m.v_head_dim()}; }
Shape mlp_in(const ModelConfig& m) { return {m.intermediate_size, m.hidden_size}; }
Shape mlp_out(const ModelConfig& m) { return {m.hidden_size, m.intermediate_size}; }
Shape qkv(const ModelConfig& m) { return {3 * m.hidden_size, m.hidden_size}; }
Shape qkv_bias(const ModelConfig& m) { return {3 * m.hidden_size}; }
Shape positions(const ModelConfig& m) { return {m.max_seq_len, m.hidden_size}; }
Shape mlp_width(const ModelConfig& m) { return {m.intermediate_size}; }
Shape q_width(const ModelConfig& m) { return {m.num_heads * m.head_dim()}; }
Shape kv_width(const ModelConfig& m) { return {m.num_kv_heads * m.head_dim()}; }
// Qwen3 normalises each head (head_dim weights), OLMo 2 the whole projection.
Shape router(const ModelConfig& m) { return {m.moe->num_experts, m.hidden_size}; }
Shape expert_in(const ModelConfig& m) { return {m.moe->intermediate_size, m.hidden_size}; }
Shape expert_out(const ModelConfig& m) { return {m.hidden_size, m.moe->intermediate_size}; }
Shape expert_width(const ModelConfig& m) { return {m.moe->intermediate_size}; }
Shape per_expert_row(const ModelConfig& m) { return {m.moe->num_experts}; }
Shape shared_in(const ModelConfig& m) { return {m.moe->shared_expert_intermediate_size, m.hidden_size}; }
Shape shared_out(const ModelConfig& m) { return {m.hidden_size, m.moe->shared_expert_intermediate_size}; }
Shape q_norm(const ModelConfig& m) { return m.qk_norm == QkNorm::kHead ? Shape{m.head_dim()} : q_width(m); }
Shape k_norm(const ModelConfig& m) { return m.qk_norm == QkNorm::kHead ? Shape{m.head_dim()} : kv_width(m); }

// DeepseekV3Attention's projections (model.latent_attention), [out, in] as nn.Linear holds them.
Shape q_a_rows(const ModelConfig& m) { return {m.latent_attention->q_lora_rank, m.hidden_size}; }
Shape q_a_width(const ModelConfig& m) { return {m.latent_attention->q_lora_rank}; }
Shape q_b_rows(const ModelConfig& m) { return {m.num_heads * m.head_dim(), m.latent_attention->q_lora_rank}; }
Shape kv_a_rows(const ModelConfig& m) {
  return {m.latent_attention->kv_lora_rank + m.latent_attention->qk_rope_head_dim, m.hidden_size};
}
Shape kv_a_width(const ModelConfig& m) { return {m.latent_attention->kv_lora_rank}; }
Shape kv_b_rows(const ModelConfig& m) {
  const LatentAttention& a = *m.latent_attention;
  return {m.num_heads * (a.qk_nope_head_dim + a.v_head_dim), a.kv_lora_rank};
}

// Which model option brings a parameter (loaders/arch/llama_options.cpp's rows).
// Latent attention replaces k_proj and v_proj, and q_proj where it compresses q.
bool separate_kv(const ModelConfig& m) { return !m.latent_attention; }
bool plain_q(const ModelConfig& m) { return !m.latent_attention || m.latent_attention->q_lora_rank == 0; }
bool compressed_q(const ModelConfig& m) { return m.latent_attention && m.latent_attention->q_lora_rank > 0; }
bool latent_kv(const ModelConfig& m) { return m.latent_attention.has_value(); }
bool with_attention_bias(const ModelConfig& m) { return m.attention_bias; }
// Llama 4's L2 QK-norm has no weight.
bool with_qk_norm(const ModelConfig& m) { return m.qk_norm == QkNorm::kHead || m.qk_norm == QkNorm::kFull; }
bool with_o_proj_bias(const ModelConfig& m) { return m.o_proj_bias; }
bool with_sinks(const ModelConfig& m) { return m.attention_sinks; }
Shape per_head(const ModelConfig& m) { return {m.num_heads}; }
bool untied_head(const ModelConfig& m) { return !m.tie_embeddings; }
bool experts(const ModelConfig& m) { return m.moe.has_value(); }
bool with_router_bias(const ModelConfig& m) { return m.moe && m.moe->router_bias; }
bool with_expert_bias(const ModelConfig& m) { return m.moe && m.moe->expert_bias; }
bool with_shared_expert(const ModelConfig& m) { return m.moe && m.moe->shared_expert_intermediate_size > 0; }
// Which layers hold the dense MLP and which the experts (model.moe.layers; every layer when absent).
bool dense_layer(const ModelConfig& m, int layer) { return !m.moe_layer(layer); }
bool expert_layer(const ModelConfig& m, int layer) { return m.moe_layer(layer); }
bool pre_norms(const ModelConfig& m) { return m.norm_layout == NormLayout::kPre; }
bool sandwich_norms(const ModelConfig& m) { return m.norm_layout == NormLayout::kSandwich; }
bool norm_before_sublayer(const ModelConfig& m) { return m.norm_layout != NormLayout::kPost; }
bool norm_after_sublayer(const ModelConfig& m) { return m.norm_layout != NormLayout::kPre; }

void fill(std::string& text, const char* field, int value) {
  const size_t at = text.find(field);
  if (at != std::string::npos) text.replace(at, 3, std::to_string(value));
}

std::string with_layer(const char* key, int layer, int expert) {
  std::string text = key;
  fill(text, "{i}", layer);
  fill(text, "{e}", expert);
  return text;
}

}  // namespace

const std::vector<ParamDef>& param_table(Arch arch) {
  static const std::vector<ParamDef> llama = {
      {R::kTokenEmbedding, "model.embed_tokens.weight", ParamPlace::kBefore, vocab_rows},
      {R::kAttnNorm, "model.layers.{i}.input_layernorm.weight", ParamPlace::kLayer, hidden, norm_before_sublayer},
      // Hugging Face's module order: a bias after its weight, q_norm and k_norm after o_proj;
      // GPT-OSS's sinks, the attention module's own parameter, before its projections.
      {R::kSinks, "model.layers.{i}.self_attn.sinks", ParamPlace::kLayer, per_head, with_sinks},
      {R::kQProj, "model.layers.{i}.self_attn.q_proj.weight", ParamPlace::kLayer, q_rows, plain_q},
      {R::kQBias, "model.layers.{i}.self_attn.q_proj.bias", ParamPlace::kLayer, q_width, with_attention_bias},
      // DeepseekV3Attention's order: q_proj or q_a_proj, q_a_layernorm, q_b_proj; then the kv latent's.
      {R::kQAProj, "model.layers.{i}.self_attn.q_a_proj.weight", ParamPlace::kLayer, q_a_rows, compressed_q},
      {R::kQALayernorm, "model.layers.{i}.self_attn.q_a_layernorm.weight", ParamPlace::kLayer, q_a_width, compressed_q},
      {R::kQBProj, "model.layers.{i}.self_attn.q_b_proj.weight", ParamPlace::kLayer, q_b_rows, compressed_q},
      {R::kKvAProj, "model.layers.{i}.self_attn.kv_a_proj_with_mqa.weight", ParamPlace::kLayer, kv_a_rows, latent_kv},
      {R::kKvALayernorm, "model.layers.{i}.self_attn.kv_a_layernorm.weight", ParamPlace::kLayer, kv_a_width, latent_kv},
      {R::kKvBProj, "model.layers.{i}.self_attn.kv_b_proj.weight", ParamPlace::kLayer, kv_b_rows, latent_kv},
      {R::kKProj, "model.layers.{i}.self_attn.k_proj.weight", ParamPlace::kLayer, kv_rows, separate_kv},
      {R::kKBias, "model.layers.{i}.self_attn.k_proj.bias", ParamPlace::kLayer, kv_width, with_attention_bias},
      {R::kVProj, "model.layers.{i}.self_attn.v_proj.weight", ParamPlace::kLayer, kv_rows, separate_kv},
      {R::kVBias, "model.layers.{i}.self_attn.v_proj.bias", ParamPlace::kLayer, kv_width, with_attention_bias},
      {R::kOProj, "model.layers.{i}.self_attn.o_proj.weight", ParamPlace::kLayer, o_cols},
      {R::kOProjBias, "model.layers.{i}.self_attn.o_proj.bias", ParamPlace::kLayer, hidden, with_o_proj_bias},
      {R::kQNorm, "model.layers.{i}.self_attn.q_norm.weight", ParamPlace::kLayer, q_norm, with_qk_norm},
      {R::kKNorm, "model.layers.{i}.self_attn.k_norm.weight", ParamPlace::kLayer, k_norm, with_qk_norm},
      {R::kMlpNorm, "model.layers.{i}.post_attention_layernorm.weight", ParamPlace::kLayer, hidden, pre_norms},
      {R::kGateProj, "model.layers.{i}.mlp.gate_proj.weight", ParamPlace::kLayer, mlp_in, nullptr, dense_layer},
      {R::kUpProj, "model.layers.{i}.mlp.up_proj.weight", ParamPlace::kLayer, mlp_in, nullptr, dense_layer},
      {R::kDownProj, "model.layers.{i}.mlp.down_proj.weight", ParamPlace::kLayer, mlp_out, nullptr, dense_layer},
      // Qwen3MoeSparseMoeBlock's order: the router, then expert 0's projections, expert 1's, ...
      // GPT-OSS's biases (router_bias, expert_bias) each after its weight; its fused, interleaved
      // gate_up_proj is stored split into these per-expert keys (docs/bundle-format.md).
      // Then the shared expert (Llama 4's shared_expert, DeepSeek-V3's shared_experts).
      {R::kRouter, "model.layers.{i}.mlp.gate.weight", ParamPlace::kLayer, router, experts, expert_layer},
      {R::kRouterBias, "model.layers.{i}.mlp.gate.bias", ParamPlace::kLayer, per_expert_row, with_router_bias, expert_layer},
      {R::kExpertGateProj, "model.layers.{i}.mlp.experts.{e}.gate_proj.weight", ParamPlace::kLayer, expert_in, experts, expert_layer},
      {R::kExpertGateBias, "model.layers.{i}.mlp.experts.{e}.gate_proj.bias", ParamPlace::kLayer, expert_width, with_expert_bias, expert_layer},
      {R::kExpertUpProj, "model.layers.{i}.mlp.experts.{e}.up_proj.weight", ParamPlace::kLayer, expert_in, experts, expert_layer},
      {R::kExpertUpBias, "model.layers.{i}.mlp.experts.{e}.up_proj.bias", ParamPlace::kLayer, expert_width, with_expert_bias, expert_layer},
      {R::kExpertDownProj, "model.layers.{i}.mlp.experts.{e}.down_proj.weight", ParamPlace::kLayer, expert_out, experts, expert_layer},
      {R::kExpertDownBias, "model.layers.{i}.mlp.experts.{e}.down_proj.bias", ParamPlace::kLayer, hidden, with_expert_bias, expert_layer},
      {R::kSharedGateProj, "model.layers.{i}.mlp.shared_expert.gate_proj.weight", ParamPlace::kLayer, shared_in, with_shared_expert, expert_layer},
      {R::kSharedUpProj, "model.layers.{i}.mlp.shared_expert.up_proj.weight", ParamPlace::kLayer, shared_in, with_shared_expert, expert_layer},
      {R::kSharedDownProj, "model.layers.{i}.mlp.shared_expert.down_proj.weight", ParamPlace::kLayer, shared_out, with_shared_expert, expert_layer},
      // OLMo 2's post-norms (Olmo2DecoderLayer's order: after the MLP). Hugging Face names the
      // attention output's norm post_attention_layernorm, the key llama's pre-MLP norm has.
      // Gemma 3's sandwich (Gemma3DecoderLayer's order): input, post-attention, pre- and post-feedforward.
      {R::kAttnPostNorm, "model.layers.{i}.post_attention_layernorm.weight", ParamPlace::kLayer, hidden, norm_after_sublayer},
      {R::kMlpPreNorm, "model.layers.{i}.pre_feedforward_layernorm.weight", ParamPlace::kLayer, hidden, sandwich_norms},
      {R::kMlpPostNorm, "model.layers.{i}.post_feedforward_layernorm.weight", ParamPlace::kLayer, hidden, norm_after_sublayer},
      {R::kFinalNorm, "model.norm.weight", ParamPlace::kAfter, hidden},
      {R::kLmHead, "lm_head.weight", ParamPlace::kAfter, vocab_rows, untied_head},
  };
  // nanoGPT's names; the MLP is 4 x hidden_size wide (intermediate_size says so).
  static const std::vector<ParamDef> gpt2 = {
      {R::kTokenEmbedding, "transformer.wte.weight", ParamPlace::kBefore, vocab_rows},
      {R::kPositionEmbedding, "transformer.wpe.weight", ParamPlace::kBefore, positions},
      {R::kAttnNorm, "transformer.h.{i}.ln_1.weight", ParamPlace::kLayer, hidden},
      {R::kAttnNormBias, "transformer.h.{i}.ln_1.bias", ParamPlace::kLayer, hidden},
      {R::kQkv, "transformer.h.{i}.attn.c_attn.weight", ParamPlace::kLayer, qkv},
      {R::kQkvBias, "transformer.h.{i}.attn.c_attn.bias", ParamPlace::kLayer, qkv_bias},
      {R::kOProj, "transformer.h.{i}.attn.c_proj.weight", ParamPlace::kLayer, square},
      {R::kOProjBias, "transformer.h.{i}.attn.c_proj.bias", ParamPlace::kLayer, hidden},
      {R::kMlpNorm, "transformer.h.{i}.ln_2.weight", ParamPlace::kLayer, hidden},
      {R::kMlpNormBias, "transformer.h.{i}.ln_2.bias", ParamPlace::kLayer, hidden},
      {R::kUpProj, "transformer.h.{i}.mlp.c_fc.weight", ParamPlace::kLayer, mlp_in},
      {R::kUpBias, "transformer.h.{i}.mlp.c_fc.bias", ParamPlace::kLayer, mlp_width},
      {R::kDownProj, "transformer.h.{i}.mlp.c_proj.weight", ParamPlace::kLayer, mlp_out},
      {R::kDownBias, "transformer.h.{i}.mlp.c_proj.bias", ParamPlace::kLayer, hidden},
      {R::kFinalNorm, "transformer.ln_f.weight", ParamPlace::kAfter, hidden},
      {R::kFinalNormBias, "transformer.ln_f.bias", ParamPlace::kAfter, hidden},
  };
  return arch == Arch::kLlama ? llama : gpt2;
}

bool has_parameter(const ParamDef& def, const ModelConfig& m, int layer) {
  if (def.present != nullptr && !def.present(m)) return false;
  if (def.in_layer == nullptr) return true;
  if (layer >= 0) return def.in_layer(m, layer);
  for (const int any : m.one_layer_of_each_kind()) {
    if (def.in_layer(m, any)) return true;
  }
  return false;
}

bool is_per_expert(const ParamDef& def) { return std::string(def.key).find("{e}") != std::string::npos; }

std::string param_key(Arch arch, ParamRole role, int layer, int expert) {
  for (const ParamDef& def : param_table(arch)) {
    if (def.role == role) return with_layer(def.key, layer, expert);
  }
  throw std::logic_error(std::string("no parameter of this role in ") + arch_name(arch));
}

int mtp_block_layer(const ModelConfig& m, int depth) { return static_cast<int>(m.num_layers) + depth - 1; }

std::string mtp_key(const ModelConfig& m, int depth, MtpPart part) {
  const char* name = part == MtpPart::kEnorm    ? "enorm.weight"
                     : part == MtpPart::kHnorm  ? "hnorm.weight"
                     : part == MtpPart::kEhProj ? "eh_proj.weight"
                                                : "shared_head.norm.weight";
  return "model.layers." + std::to_string(mtp_block_layer(m, depth)) + "." + name;
}

std::vector<int64_t> mtp_shape(const ModelConfig& m, MtpPart part) {
  // eh_proj: Linear(2 * hidden, hidden), its input [enorm(embedding); hnorm(hidden)].
  if (part == MtpPart::kEhProj) return {m.hidden_size, 2 * m.hidden_size};
  return {m.hidden_size};
}

std::string module_key(Arch arch, ParamRole role, int layer, int expert) {
  const std::string key = param_key(arch, role, layer, expert);
  return key.substr(0, key.rfind('.'));
}

}  // namespace nanreplay
