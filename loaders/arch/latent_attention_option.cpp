// model.latent_attention; see latent_attention_option.h. Every width is
// required (each changes a parameter's shape or the scores' scale), q_lora_rank
// as null when q has no latent: nothing here is assumed from DeepSeek-V3's sizes.
#include "loaders/arch/latent_attention_option.h"

#include <algorithm>
#include <string>
#include <vector>

#include "loaders/arch/manifest_values.h"
#include "loaders/base/error.h"

namespace nanreplay {

namespace {

const std::vector<const char*>& latent_attention_keys() {
  static const std::vector<const char*> keys = {"q_lora_rank",      "kv_lora_rank", "qk_nope_head_dim",
                                                "qk_rope_head_dim", "v_head_dim",   "norm_eps"};
  return keys;
}

void refuse_unknown_latent_keys(const JsonReader& latent) {
  for (const auto& item : latent.json().items()) {
    bool known = false;
    for (const char* key : latent_attention_keys()) known = known || item.key() == key;
    if (!known) {
      throw InputError(latent.file(), latent.key_path(item.key()),
                       "is not a latent_attention key (q_lora_rank, kv_lora_rank, qk_nope_head_dim, "
                       "qk_rope_head_dim, v_head_dim, norm_eps)");
    }
  }
}

// An option DeepseekV3Attention has no counterpart of: the replay would ignore it.
const char* conflicting_option(const ModelConfig& m) {
  if (m.qk_norm != QkNorm::kNone) return "qk_norm";
  if (m.explicit_head_dim > 0) return "head_dim";
  if (m.partial_rotary_factor != 1.0) return "partial_rotary_factor";
  if (m.attention_bias) return "attention_bias";
  if (m.attention_sinks) return "attention_sinks";
  if (!m.no_rope_layers.empty()) return "no_rope_layers";
  if (m.attn_temperature_tuning) return "attn_temperature_tuning";
  if (m.query_pre_attn_scalar) return "query_pre_attn_scalar";
  if (m.rms_norm_offset) return "rms_norm_offset";
  return nullptr;
}

void check_latent_fits_model(const JsonReader& model, const ModelConfig& m) {
  const std::string key = model.key_path("latent_attention");
  if (const char* other = conflicting_option(m)) {
    throw InputError(model.file(), key,
                     std::string("not replayed together with model.") + other +
                         ": DeepSeek-V3's latent attention has no such option (remove one of the two)");
  }
  if (m.num_kv_heads != m.num_heads) {
    throw InputError(model.file(), key,
                     "expected model.num_kv_heads = num_heads (" + std::to_string(m.num_heads) +
                         "): every head has its own k and v from the kv latent, got num_kv_heads " +
                         std::to_string(m.num_kv_heads));
  }
}

}  // namespace

LatentAttention parse_latent_attention(const JsonReader& model, const ModelConfig& config) {
  const JsonReader latent = model.object("latent_attention");
  refuse_unknown_latent_keys(latent);
  LatentAttention out;
  // null: a plain q_proj (DeepSeek-V2-Lite); absent is refused, as the two models differ.
  if (!latent.json().contains("q_lora_rank")) {
    throw InputError(latent.file(), latent.key_path("q_lora_rank"),
                     "required: the rank of q's latent, or null for a plain q_proj");
  }
  if (latent.has("q_lora_rank")) out.q_lora_rank = dimension(latent, "q_lora_rank");
  out.kv_lora_rank = dimension(latent, "kv_lora_rank");
  out.qk_nope_head_dim = dimension(latent, "qk_nope_head_dim");
  out.qk_rope_head_dim = dimension(latent, "qk_rope_head_dim");
  out.v_head_dim = dimension(latent, "v_head_dim");
  if (out.qk_rope_head_dim % 2 != 0) {
    throw InputError(latent.file(), latent.key_path("qk_rope_head_dim"),
                     "expected an even width (rotary turns pairs of dimensions), got " +
                         std::to_string(out.qk_rope_head_dim));
  }
  if (latent.has("norm_eps")) out.norm_eps = finite_number_above(latent, "norm_eps", 0, true);
  check_latent_fits_model(model, config);
  // q_b_proj and kv_b_proj are [heads * width, rank]: kept to a dimension, as q_proj is.
  if (config.num_heads * (out.qk_nope_head_dim + std::max(out.qk_rope_head_dim, out.v_head_dim)) > kLargestDimension) {
    throw InputError(latent.file(), latent.key_path("qk_nope_head_dim"),
                     "expected num_heads * the head widths of at most 2^30");
  }
  return out;
}

nlohmann::json latent_attention_json(const LatentAttention& latent) {
  return {{"q_lora_rank", latent.q_lora_rank > 0 ? nlohmann::json(latent.q_lora_rank) : nlohmann::json()},
          {"kv_lora_rank", latent.kv_lora_rank},
          {"qk_nope_head_dim", latent.qk_nope_head_dim},
          {"qk_rope_head_dim", latent.qk_rope_head_dim},
          {"v_head_dim", latent.v_head_dim},
          {"norm_eps", latent.norm_eps}};
}

}  // namespace nanreplay
