// The llama family's option rows (docs/bundle-format.md, "Model options"):
// one row per key, each with how the manifest's model object gives it and how
// it is written back. The field each fills is in model_config.h; the
// parameters an option brings are rows of probes/param_table.cpp, and its
// math is replay/arch/model.cpp's.
#include "loaders/arch/model_options.h"

#include "loaders/arch/manifest_values.h"
#include "loaders/base/error.h"

namespace nanreplay {

namespace {

RopeScaling parse_rope_scaling(const JsonReader& scaling) {
  // Hugging Face's configs name the type "rope_type" (older ones "type").
  const char* type_key = scaling.has("rope_type") || !scaling.has("type") ? "rope_type" : "type";
  one_of(scaling, type_key, {"llama3"});
  RopeScaling config;
  config.factor = finite_number_above(scaling, "factor", 0, false);
  config.low_freq_factor = finite_number_above(scaling, "low_freq_factor", 0, false);
  config.high_freq_factor = finite_number_above(scaling, "high_freq_factor", 0, false);
  if (!(config.high_freq_factor > config.low_freq_factor)) {
    throw InputError(scaling.file(), scaling.key_path("high_freq_factor"),
                     "expected more than low_freq_factor (" + exact_number_text(config.low_freq_factor) + "), got " +
                         exact_number_text(config.high_freq_factor));
  }
  config.original_max_position_embeddings = positive_integer(scaling, "original_max_position_embeddings");
  return config;
}

nlohmann::json rope_scaling_json(const RopeScaling& s) {
  return {{"rope_type", "llama3"},
          {"factor", s.factor},
          {"low_freq_factor", s.low_freq_factor},
          {"high_freq_factor", s.high_freq_factor},
          {"original_max_position_embeddings", s.original_max_position_embeddings}};
}

MoeConfig parse_moe(const JsonReader& moe, int64_t model_width) {
  MoeConfig config;
  config.num_experts = dimension(moe, "num_experts");
  config.top_k = dimension(moe, "top_k");
  if (config.top_k > config.num_experts) {
    throw InputError(moe.file(), moe.key_path("top_k"),
                     "expected at most num_experts (" + std::to_string(config.num_experts) + "), got " +
                         std::to_string(config.top_k));
  }
  config.intermediate_size = optional_dimension(moe, "intermediate_size", model_width);
  config.norm_topk_prob = moe.optional_boolean("norm_topk_prob").value_or(false);
  if (moe.has("router_aux_loss_coef")) {
    config.router_aux_loss_coef = finite_number_above(moe, "router_aux_loss_coef", 0, true);
  }
  if (moe.has("router_z_loss_coef")) {
    config.router_z_loss_coef = finite_number_above(moe, "router_z_loss_coef", 0, true);
  }
  return config;
}

nlohmann::json moe_json(const MoeConfig& moe) {
  return {{"num_experts", moe.num_experts},
          {"top_k", moe.top_k},
          {"intermediate_size", moe.intermediate_size},
          {"norm_topk_prob", moe.norm_topk_prob},
          {"router_aux_loss_coef", moe.router_aux_loss_coef},
          {"router_z_loss_coef", moe.router_z_loss_coef}};
}

// An optional soft cap: a finite number > 0.
std::optional<double> positive_softcap(const JsonReader& model, const char* key) {
  return finite_number_above(model, key, 0, false);
}

// Phi, GLM, StableLM: the share of each head's dimensions that rotary turns, in (0, 1].
double rotary_fraction(const JsonReader& model) {
  const double factor = finite_number_above(model, "partial_rotary_factor", 0, false);
  if (factor > 1) {
    throw InputError(model.file(), model.key_path("partial_rotary_factor"),
                     "expected at most 1 (rotary on part of each head), got " + exact_number_text(factor));
  }
  return factor;
}

// The manifest's names of the ways a causal mask reaches the softmax, in AttentionMask's order.
const std::vector<const char*>& attention_mask_names() {
  static const std::vector<const char*> names = {"exclude", "additive_neg_inf", "additive_finfo_min",
                                                 "fill_finfo_min"};
  return names;
}

AttentionMask parse_attention_mask(const JsonReader& model) {
  const std::string name = one_of(model, "attention_mask", attention_mask_names());
  const auto& names = attention_mask_names();
  for (size_t i = 0; i < names.size(); ++i) {
    if (name == names[i]) return static_cast<AttentionMask>(i);
  }
  throw std::logic_error("one_of returned a mask no row has");
}

}  // namespace

// In the order they are parsed (and refused on gpt2): the first bad key is the one reported.
// Each row: key; parse (the key is present and not null); write (only when not the default).
const std::vector<ModelOption>& llama_options() {
  using M = ModelConfig;
  using J = nlohmann::json;
  static const std::vector<ModelOption> rows = {
      {"rope_style",
       [](const JsonReader& r, M& m) {
         const bool interleaved = one_of(r, "rope_style", {"rotate_half", "interleaved"}) == "interleaved";
         m.rope_style = interleaved ? RopeStyle::kInterleaved : RopeStyle::kRotateHalf;
       },
       [](const M& m, J& j) {
         if (m.rope_style == RopeStyle::kInterleaved) j["rope_style"] = "interleaved";
       }},
      {"rope_scaling",
       [](const JsonReader& r, M& m) { m.rope_scaling = parse_rope_scaling(r.object("rope_scaling")); },
       [](const M& m, J& j) {
         if (m.rope_scaling) j["rope_scaling"] = rope_scaling_json(*m.rope_scaling);
       }},
      {"attention_bias",
       [](const JsonReader& r, M& m) { m.attention_bias = r.boolean("attention_bias"); },
       [](const M& m, J& j) {
         if (m.attention_bias) j["attention_bias"] = true;
       }},
      {"qk_norm",
       [](const JsonReader& r, M& m) {
         m.qk_norm = one_of(r, "qk_norm", {"head", "full"}) == "head" ? QkNorm::kHead : QkNorm::kFull;
       },
       [](const M& m, J& j) {
         if (m.qk_norm != QkNorm::kNone) j["qk_norm"] = m.qk_norm == QkNorm::kHead ? "head" : "full";
       }},
      {"attn_logit_softcap",
       [](const JsonReader& r, M& m) { m.attn_logit_softcap = positive_softcap(r, "attn_logit_softcap"); },
       [](const M& m, J& j) {
         if (m.attn_logit_softcap) j["attn_logit_softcap"] = *m.attn_logit_softcap;
       }},
      {"final_logit_softcap",
       [](const JsonReader& r, M& m) { m.final_logit_softcap = positive_softcap(r, "final_logit_softcap"); },
       [](const M& m, J& j) {
         if (m.final_logit_softcap) j["final_logit_softcap"] = *m.final_logit_softcap;
       }},
      {"sliding_window",
       [](const JsonReader& r, M& m) { m.sliding_window = dimension(r, "sliding_window"); },
       [](const M& m, J& j) {
         if (m.sliding_window > 0) j["sliding_window"] = m.sliding_window;
       }},
      // Qwen3, Gemma 3, GPT-OSS: a head width of its own (q_proj [heads * head_dim, hidden]);
      // hidden_size / num_heads when absent. The head layout is checked after every option.
      {"head_dim",
       [](const JsonReader& r, M& m) { m.explicit_head_dim = dimension(r, "head_dim"); },
       [](const M& m, J& j) {
         if (m.explicit_head_dim > 0) j["head_dim"] = m.explicit_head_dim;
       }},
      {"partial_rotary_factor",
       [](const JsonReader& r, M& m) { m.partial_rotary_factor = rotary_fraction(r); },
       [](const M& m, J& j) {
         if (m.partial_rotary_factor != 1.0) j["partial_rotary_factor"] = m.partial_rotary_factor;
       }},
      {"attention_mask",
       [](const JsonReader& r, M& m) { m.attention_mask = parse_attention_mask(r); },
       [](const M& m, J& j) {
         if (m.attention_mask != AttentionMask::kExclude) {
           j["attention_mask"] = attention_mask_names().at(static_cast<size_t>(m.attention_mask));
         }
       }},
      {"norm_layout",
       [](const JsonReader& r, M& m) {
         m.norm_layout = one_of(r, "norm_layout", {"pre", "post"}) == "post" ? NormLayout::kPost : NormLayout::kPre;
       },
       [](const M& m, J& j) {
         if (m.norm_layout == NormLayout::kPost) j["norm_layout"] = "post";
       }},
      // Each expert's width defaults to the model's intermediate_size, read before the options.
      {"moe",
       [](const JsonReader& r, M& m) { m.moe = parse_moe(r.object("moe"), m.intermediate_size); },
       [](const M& m, J& j) {
         if (m.moe) j["moe"] = moe_json(*m.moe);
       }},
  };
  return rows;
}

}  // namespace nanreplay
