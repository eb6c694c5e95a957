// The llama family's option rows (docs/bundle-format.md, "Model options"):
// one row per key, each with how the manifest's model object gives it and how
// it is written back. The field each fills is in model_config.h; the
// parameters an option brings are rows of probes/param_table.cpp, and its
// math is replay/arch/model.cpp's.
#include "loaders/arch/model_options.h"

#include <cmath>

#include "loaders/arch/latent_attention_option.h"
#include "loaders/arch/manifest_values.h"
#include "loaders/arch/moe_option.h"
#include "loaders/arch/mtp_option.h"
#include "loaders/base/error.h"

namespace nanreplay {

namespace {

// Llama 3.1's scaling; Llama 4 sets low_freq_factor == high_freq_factor (no blended band:
// Hugging Face's torch.where never picks the 0/0 blend there), so only high < low is refused.
RopeScaling parse_llama3_scaling(const JsonReader& scaling) {
  RopeScaling config;
  config.factor = finite_number_above(scaling, "factor", 0, false);
  config.low_freq_factor = finite_number_above(scaling, "low_freq_factor", 0, false);
  config.high_freq_factor = finite_number_above(scaling, "high_freq_factor", 0, false);
  if (config.high_freq_factor < config.low_freq_factor) {
    throw InputError(scaling.file(), scaling.key_path("high_freq_factor"),
                     "expected at least low_freq_factor (" + exact_number_text(config.low_freq_factor) + "), got " +
                         exact_number_text(config.high_freq_factor));
  }
  config.original_max_position_embeddings = positive_integer(scaling, "original_max_position_embeddings");
  return config;
}

// YaRN as Hugging Face's _compute_yarn_parameters: factor and original_max_position_embeddings
// required; beta_fast 32, beta_slow 1, truncate true when absent; mscale, mscale_all_dim and
// attention_factor absent unless given (the attention factor is then derived).
RopeScaling parse_yarn_scaling(const JsonReader& scaling) {
  RopeScaling config;
  config.type = RopeScalingType::kYarn;
  config.factor = finite_number_above(scaling, "factor", 0, false);
  config.original_max_position_embeddings = positive_integer(scaling, "original_max_position_embeddings");
  if (scaling.has("beta_fast")) config.beta_fast = finite_number_above(scaling, "beta_fast", 0, false);
  if (scaling.has("beta_slow")) config.beta_slow = finite_number_above(scaling, "beta_slow", 0, false);
  if (scaling.has("mscale")) config.mscale = finite_number_above(scaling, "mscale", 0, true);
  if (scaling.has("mscale_all_dim")) config.mscale_all_dim = finite_number_above(scaling, "mscale_all_dim", 0, true);
  if (scaling.has("attention_factor")) {
    config.attention_factor = finite_number_above(scaling, "attention_factor", 0, false);
  }
  config.truncate = scaling.optional_boolean("truncate").value_or(true);
  return config;
}

// Linear as Hugging Face's _compute_linear_scaling_rope_parameters: inv_freq / factor.
RopeScaling parse_linear_scaling(const JsonReader& scaling) {
  RopeScaling config;
  config.type = RopeScalingType::kLinear;
  config.factor = finite_number_above(scaling, "factor", 0, false);
  return config;
}

RopeScaling parse_rope_scaling(const JsonReader& scaling) {
  // Hugging Face's configs name the type "rope_type" (older ones "type").
  const char* type_key = scaling.has("rope_type") || !scaling.has("type") ? "rope_type" : "type";
  const std::string type = one_of(scaling, type_key, {"llama3", "yarn", "linear"});
  if (type == "linear") return parse_linear_scaling(scaling);
  return type == "yarn" ? parse_yarn_scaling(scaling) : parse_llama3_scaling(scaling);
}

nlohmann::json rope_scaling_json(const RopeScaling& s) {
  if (s.type == RopeScalingType::kLinear) return {{"rope_type", "linear"}, {"factor", s.factor}};
  if (s.type == RopeScalingType::kYarn) {
    nlohmann::json j = {{"rope_type", "yarn"},
                        {"factor", s.factor},
                        {"original_max_position_embeddings", s.original_max_position_embeddings},
                        {"beta_fast", s.beta_fast},
                        {"beta_slow", s.beta_slow},
                        {"truncate", s.truncate}};
    if (s.mscale != 0) j["mscale"] = s.mscale;
    if (s.mscale_all_dim != 0) j["mscale_all_dim"] = s.mscale_all_dim;
    if (s.attention_factor) j["attention_factor"] = *s.attention_factor;
    return j;
  }
  return {{"rope_type", "llama3"},
          {"factor", s.factor},
          {"low_freq_factor", s.low_freq_factor},
          {"high_freq_factor", s.high_freq_factor},
          {"original_max_position_embeddings", s.original_max_position_embeddings}};
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

// Hugging Face's names of the attention kinds of config.layer_types, in AttentionKind's order.
const std::vector<const char*>& attention_kind_names() {
  static const std::vector<const char*> names = {"full_attention", "sliding_attention", "chunked_attention"};
  return names;
}

// One kind per layer; a sliding layer needs sliding_window, a chunked one attention_chunk_size
// (their rows are parsed before this one).
std::vector<AttentionKind> parse_layer_types(const JsonReader& model, const ModelConfig& m) {
  const nlohmann::json& types = model.array("layer_types");
  const std::string key = model.key_path("layer_types");
  if (static_cast<int64_t>(types.size()) != m.num_layers) {
    throw InputError(model.file(), key,
                     "expected one entry per layer (" + std::to_string(m.num_layers) + "), got " +
                         std::to_string(types.size()));
  }
  const auto& names = attention_kind_names();
  std::vector<AttentionKind> kinds;
  for (size_t i = 0; i < types.size(); ++i) {
    const std::string at = key + "[" + std::to_string(i) + "]";
    size_t found = names.size();
    for (size_t n = 0; types[i].is_string() && n < names.size(); ++n) {
      if (types[i].get<std::string>() == names[n]) found = n;
    }
    if (found == names.size()) {
      std::string choices;
      for (const char* name : names) choices += std::string(choices.empty() ? "" : " or ") + "\"" + name + "\"";
      throw InputError(model.file(), at, "expected " + choices + ", got " + types[i].dump());
    }
    kinds.push_back(static_cast<AttentionKind>(found));
    if (kinds.back() == AttentionKind::kSliding && m.sliding_window == 0) {
      throw InputError(model.file(), at, "a sliding_attention layer needs model.sliding_window, which is absent");
    }
    if (kinds.back() == AttentionKind::kChunked && m.attention_chunk_size == 0) {
      throw InputError(model.file(), at, "a chunked_attention layer needs model.attention_chunk_size, which is absent");
    }
  }
  return kinds;
}

nlohmann::json layer_types_json(const std::vector<AttentionKind>& kinds) {
  nlohmann::json j = nlohmann::json::array();
  for (const AttentionKind kind : kinds) j.push_back(attention_kind_names().at(static_cast<size_t>(kind)));
  return j;
}

// Llama 4's no_rope_layers: one 0 or 1 per layer (1: the layer turns q and k).
std::vector<int> parse_no_rope_layers(const JsonReader& model, int64_t num_layers) {
  const nlohmann::json& flags = model.array("no_rope_layers");
  const std::string key = model.key_path("no_rope_layers");
  if (static_cast<int64_t>(flags.size()) != num_layers) {
    throw InputError(model.file(), key,
                     "expected one entry per layer (" + std::to_string(num_layers) + "), got " +
                         std::to_string(flags.size()));
  }
  std::vector<int> out;
  for (size_t i = 0; i < flags.size(); ++i) {
    if (!flags[i].is_number_integer() || (flags[i].get<int64_t>() != 0 && flags[i].get<int64_t>() != 1)) {
      throw InputError(model.file(), key + "[" + std::to_string(i) + "]",
                       "expected 1 (rotary) or 0 (NoPE), got " + json_describe(flags[i]));
    }
    out.push_back(flags[i].get<int>());
  }
  return out;
}

// Llama 4's attention temperature tuning: both numbers required (Llama4TextConfig's defaults,
// 8192 and 0.1, are written out by whoever writes the manifest).
ModelConfig::TemperatureTuning parse_temperature_tuning(const JsonReader& tuning) {
  ModelConfig::TemperatureTuning out;
  out.floor_scale = finite_number_above(tuning, "floor_scale", 0, false);
  out.attn_scale = finite_number_above(tuning, "attn_scale", 0, true);
  return out;
}

}  // namespace

const char* attention_kind_name(AttentionKind kind) { return attention_kind_names().at(static_cast<size_t>(kind)); }

const char* attention_mask_name(AttentionMask mask) { return attention_mask_names().at(static_cast<size_t>(mask)); }

double yarn_attention_factor(const RopeScaling& s) {
  if (s.attention_factor) return *s.attention_factor;
  const auto get_mscale = [](double scale, double mscale) {
    return scale <= 1 ? 1.0 : 0.1 * mscale * std::log(scale) + 1.0;
  };
  if (s.mscale != 0 && s.mscale_all_dim != 0) {
    return get_mscale(s.factor, s.mscale) / get_mscale(s.factor, s.mscale_all_dim);
  }
  return get_mscale(s.factor, 1.0);
}

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
      // GPT-OSS: o_proj's bias (Hugging Face's attention_bias in GptOss and Llama configs).
      {"o_proj_bias",
       [](const JsonReader& r, M& m) { m.o_proj_bias = r.boolean("o_proj_bias"); },
       [](const M& m, J& j) {
         if (m.o_proj_bias) j["o_proj_bias"] = true;
       }},
      // GPT-OSS: a learned logit per head in the softmax (parameter self_attn.sinks).
      {"attention_sinks",
       [](const JsonReader& r, M& m) { m.attention_sinks = r.boolean("attention_sinks"); },
       [](const M& m, J& j) {
         if (m.attention_sinks) j["attention_sinks"] = true;
       }},
      // Llama 4: which layers turn q and k (1) and which are NoPE (0), one entry per layer.
      {"no_rope_layers",
       [](const JsonReader& r, M& m) { m.no_rope_layers = parse_no_rope_layers(r, m.num_layers); },
       [](const M& m, J& j) {
         if (!m.no_rope_layers.empty()) j["no_rope_layers"] = m.no_rope_layers;
       }},
      {"attn_temperature_tuning",
       [](const JsonReader& r, M& m) {
         m.attn_temperature_tuning = parse_temperature_tuning(r.object("attn_temperature_tuning"));
       },
       [](const M& m, J& j) {
         if (m.attn_temperature_tuning) {
           j["attn_temperature_tuning"] = {{"floor_scale", m.attn_temperature_tuning->floor_scale},
                                           {"attn_scale", m.attn_temperature_tuning->attn_scale}};
         }
       }},
      {"attention_chunk_size",
       [](const JsonReader& r, M& m) { m.attention_chunk_size = dimension(r, "attention_chunk_size"); },
       [](const M& m, J& j) {
         if (m.attention_chunk_size > 0) j["attention_chunk_size"] = m.attention_chunk_size;
       }},
      {"qk_norm",
       [](const JsonReader& r, M& m) {
         const std::string kind = one_of(r, "qk_norm", {"head", "full", "l2"});
         m.qk_norm = kind == "head" ? QkNorm::kHead : kind == "full" ? QkNorm::kFull : QkNorm::kL2;
       },
       [](const M& m, J& j) {
         if (m.qk_norm != QkNorm::kNone) {
           j["qk_norm"] = m.qk_norm == QkNorm::kHead ? "head" : m.qk_norm == QkNorm::kFull ? "full" : "l2";
         }
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
         const std::string layout = one_of(r, "norm_layout", {"pre", "post", "sandwich"});
         m.norm_layout = layout == "post" ? NormLayout::kPost : layout == "sandwich" ? NormLayout::kSandwich : NormLayout::kPre;
       },
       [](const M& m, J& j) {
         if (m.norm_layout == NormLayout::kPost) j["norm_layout"] = "post";
         if (m.norm_layout == NormLayout::kSandwich) j["norm_layout"] = "sandwich";
       }},
      // Gemma 3, OLMo 3, Llama 4 (Hugging Face's config.layer_types): each layer's attention kind.
      {"layer_types",
       [](const JsonReader& r, M& m) { m.layer_types = parse_layer_types(r, m); },
       [](const M& m, J& j) {
         if (!m.layer_types.empty()) j["layer_types"] = layer_types_json(m.layer_types);
       }},
      // Gemma 3: sliding layers' rotary base; they are then unscaled (its local rotary).
      {"rope_local_base_freq",
       [](const JsonReader& r, M& m) { m.rope_local_base_freq = finite_number_above(r, "rope_local_base_freq", 0, false); },
       [](const M& m, J& j) {
         if (m.rope_local_base_freq) j["rope_local_base_freq"] = *m.rope_local_base_freq;
       }},
      // Gemma: RMSNorm as x_hat * (1 + weight) in fp32, cast back to the input's type.
      {"rms_norm_offset",
       [](const JsonReader& r, M& m) { m.rms_norm_offset = r.boolean("rms_norm_offset"); },
       [](const M& m, J& j) {
         if (m.rms_norm_offset) j["rms_norm_offset"] = true;
       }},
      // Gemma: the embeddings times sqrt(hidden_size), that scale rounded to the weight's type.
      {"scale_embeddings",
       [](const JsonReader& r, M& m) { m.scale_embeddings = r.boolean("scale_embeddings"); },
       [](const M& m, J& j) {
         if (m.scale_embeddings) j["scale_embeddings"] = true;
       }},
      // Gemma: scores times query_pre_attn_scalar ** -0.5 in place of dividing by sqrt(head_dim).
      {"query_pre_attn_scalar",
       [](const JsonReader& r, M& m) { m.query_pre_attn_scalar = finite_number_above(r, "query_pre_attn_scalar", 0, false); },
       [](const M& m, J& j) {
         if (m.query_pre_attn_scalar) j["query_pre_attn_scalar"] = *m.query_pre_attn_scalar;
       }},
      // Gemma: the gated MLP's activation; silu when absent.
      {"hidden_act",
       [](const JsonReader& r, M& m) {
         m.hidden_act = one_of(r, "hidden_act", {"silu", "gelu_pytorch_tanh"}) == "silu" ? HiddenAct::kSilu
                                                                                        : HiddenAct::kGeluTanh;
       },
       [](const M& m, J& j) {
         if (m.hidden_act == HiddenAct::kGeluTanh) j["hidden_act"] = "gelu_pytorch_tanh";
       }},
      // Each expert's width defaults to the model's intermediate_size, read before the options
      // (loaders/arch/moe_option.cpp).
      {"moe",
       [](const JsonReader& r, M& m) {
         // The experts' activation is moe.expert_activation's (silu-based): a dense hidden_act would be ignored.
         if (m.hidden_act != HiddenAct::kSilu) {
           throw InputError(r.file(), r.key_path("moe"), "the experts apply silu; hidden_act gelu_pytorch_tanh "
                                                          "with moe is not replayed");
         }
         // model.mtp (read after) may give its blocks experts: their layers follow the decoder's.
         m.moe = parse_moe(r.object("moe"), m, r.has("mtp") ? kMaxMtpLayers : 0);
       },
       [](const M& m, J& j) {
         // A model cut to fewer layers (minimize) may keep none of the layers with experts.
         const int64_t layers = m.num_layers + (m.mtp ? m.mtp->num_layers : 0);  // the MTP blocks' experts too
         if (m.moe && moe_in_first_layers(*m.moe, layers)) j["moe"] = moe_json(*m.moe, layers);
       }},
      // DeepSeek-V3, Kimi K2: multi-head latent attention in place of q/k/v_proj. Last: it refuses
      // the options above that DeepseekV3Attention has no counterpart of.
      {"latent_attention",
       [](const JsonReader& r, M& m) { m.latent_attention = parse_latent_attention(r, m); },
       [](const M& m, J& j) {
         if (m.latent_attention) j["latent_attention"] = latent_attention_json(*m.latent_attention);
       }},
      // DeepSeek-V3 trained as Megatron-LM does: multi-token prediction layers after the decoder's
      // (loaders/arch/mtp_option.cpp). After moe: it refuses a model with experts on every layer.
      {"mtp",
       [](const JsonReader& r, M& m) { m.mtp = parse_mtp(r, m); },
       [](const M& m, J& j) {
         if (m.mtp) j["mtp"] = mtp_json(*m.mtp);
       }},
  };
  return rows;
}

}  // namespace nanreplay
