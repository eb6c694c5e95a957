// model.moe's keys; see moe_option.h. Every value that changes the math is
// required where no default is Hugging Face's, and refused where nothing reads it.
#include "loaders/arch/moe_option.h"

#include <algorithm>
#include <string>

#include "loaders/arch/manifest_values.h"
#include "loaders/base/error.h"

namespace nanreplay {

namespace {

// The manifest's router names, in RouterKind's order.
const std::vector<const char*>& router_names() {
  static const std::vector<const char*> names = {"softmax_top_k", "top_k_softmax", "sigmoid_top_k",
                                                    "sigmoid_grouped"};
  return names;
}

RouterKind parse_router(const JsonReader& moe) {
  const std::string name = one_of(moe, "router", router_names());
  const auto& names = router_names();
  return static_cast<RouterKind>(std::find(names.begin(), names.end(), name) - names.begin());
}

// GPT-OSS's routing and experts (model.moe's optional keys): absent, Qwen3-MoE's.
// gpt_oss's alpha is required with it, never assumed: it changes every expert's output.
void parse_moe_variant(const JsonReader& moe, MoeConfig& config) {
  if (moe.has("router")) config.router = parse_router(moe);
  config.router_bias = moe.optional_boolean("router_bias").value_or(false);
  config.expert_bias = moe.optional_boolean("expert_bias").value_or(false);
  config.fused_gate_up = moe.optional_boolean("fused_gate_up").value_or(false);
  if (moe.has("expert_activation")) {
    config.expert_activation = one_of(moe, "expert_activation", {"silu", "gpt_oss"}) == "gpt_oss"
                                   ? ExpertActivation::kGptOss
                                   : ExpertActivation::kSilu;
  }
  if (config.expert_activation == ExpertActivation::kGptOss) {
    config.swiglu_alpha = finite_number_above(moe, "swiglu_alpha", 0, false);
  } else if (moe.has("swiglu_alpha")) {
    throw InputError(moe.file(), moe.key_path("swiglu_alpha"),
                     "only expert_activation \"gpt_oss\" reads it; silu experts have no alpha");
  }
  if (moe.has("swiglu_limit")) config.swiglu_limit = finite_number_above(moe, "swiglu_limit", 0, false);
}

// moe.layers: distinct layer indices in [0, num_layers + mtp_layers_at_most), at least one, kept
// ascending (model.mtp's blocks follow the decoder's layers; mtp_option.cpp bounds them by its depths).
std::vector<int> parse_moe_layers(const JsonReader& moe, int64_t num_layers, int64_t mtp_layers_at_most) {
  const nlohmann::json& list = moe.array("layers");
  const std::string key = moe.key_path("layers");
  if (list.empty()) throw InputError(moe.file(), key, "expected at least one layer (leave model.moe out for none)");
  std::vector<int> layers;
  for (size_t i = 0; i < list.size(); ++i) {
    const std::string at = key + "[" + std::to_string(i) + "]";
    if (!list[i].is_number_integer() || list[i].get<int64_t>() < 0 ||
        list[i].get<int64_t>() >= num_layers + mtp_layers_at_most) {
      throw InputError(moe.file(), at, "expected a layer index in [0, " + std::to_string(num_layers) + ")" +
                                           (mtp_layers_at_most > 0 ? " or an MTP block's (model.mtp)" : "") +
                                           ", got " + json_describe(list[i]));
    }
    const int layer = list[i].get<int>();
    if (std::find(layers.begin(), layers.end(), layer) != layers.end()) {
      throw InputError(moe.file(), at, "layer " + std::to_string(layer) + " is listed twice");
    }
    layers.push_back(layer);
  }
  std::sort(layers.begin(), layers.end());
  return layers;
}

// Llama 4's and DeepSeek-V3's keys: which layers, where the weight goes, the shared expert.
// Llama 4 adds no load-balancing loss, so which probabilities one would read is not defined.
void parse_moe_layout(const JsonReader& moe, const ModelConfig& model, MoeConfig& config, int64_t mtp_layers_at_most) {
  if (moe.has("layers")) config.layers = parse_moe_layers(moe, model.num_layers, mtp_layers_at_most);
  config.scale_expert_input = moe.optional_boolean("scale_expert_input").value_or(false);
  config.shared_expert_intermediate_size = optional_dimension(moe, "shared_expert_intermediate_size", 0);
  if (config.router == RouterKind::kSigmoidTopK && config.router_aux_loss_coef != 0) {
    throw InputError(moe.file(), moe.key_path("router_aux_loss_coef"),
                     "router \"sigmoid_top_k\" (Llama 4) has no load-balancing loss to weight; expected 0");
  }
}

// The keys only DeepSeek-V3's grouped router reads.
const std::vector<const char*>& grouped_router_keys() {
  static const std::vector<const char*> keys = {"n_group", "topk_group", "routed_scaling_factor", "router_score_bias",
                                                "score_bias_update"};
  return keys;
}

// The score_bias_update rules' names, in MoeConfig::ScoreBiasUpdate::Rule's order.
const std::vector<const char*>& score_bias_rule_names() {
  static const std::vector<const char*> names = {"sign_centred", "sign"};
  return names;
}

// model.moe.score_bias_update {"rule", "rate"}: how the job moved the correction bias between steps
// (torchtitan's _update_expert_bias: "sign_centred"; the DeepSeek-V3 paper's: "sign"). Only with a
// bias to move (router_score_bias true); both keys required, nothing else read.
std::optional<MoeConfig::ScoreBiasUpdate> parse_score_bias_update(const JsonReader& moe, const MoeConfig& config) {
  const std::optional<JsonReader> update = moe.optional_object("score_bias_update");
  if (!update) return std::nullopt;
  if (!config.score_bias) {
    throw InputError(moe.file(), moe.key_path("score_bias_update"),
                     "router_score_bias is false: the router adds no correction bias to update");
  }
  for (const auto& [key, value] : update->json().items()) {
    if (key != "rule" && key != "rate") {
      throw InputError(moe.file(), update->key_path(key), "not a key of score_bias_update (expected \"rule\" and \"rate\")");
    }
  }
  const std::string rule = one_of(*update, "rule", score_bias_rule_names());
  const auto& names = score_bias_rule_names();
  MoeConfig::ScoreBiasUpdate parsed;
  parsed.rule = static_cast<MoeConfig::ScoreBiasUpdate::Rule>(std::find(names.begin(), names.end(), rule) - names.begin());
  parsed.rate = finite_number_above(*update, "rate", 0, false);
  return parsed;
}

// DeepSeek-V3's grouped router (router "sigmoid_grouped"): n_group, topk_group, routed_scaling_factor
// and norm_topk_prob are required (DeepseekV3Config's defaults 8, 4, 2.5 and true are not this format's
// defaults); router_score_bias defaults to true (DeepseekV3TopkRouter always holds the buffer).
// Every other router refuses the keys by name.
void parse_grouped_router(const JsonReader& moe, MoeConfig& config) {
  if (config.router != RouterKind::kSigmoidGrouped) {
    for (const char* key : grouped_router_keys()) {
      if (moe.has(key)) {
        throw InputError(moe.file(), moe.key_path(key), "only router \"sigmoid_grouped\" (DeepSeek-V3) reads it");
      }
    }
    return;
  }
  if (!moe.has("norm_topk_prob")) {
    throw InputError(moe.file(), moe.key_path("norm_topk_prob"),
                     "required with router \"sigmoid_grouped\" (DeepseekV3Config's default is true, this format's false)");
  }
  if (config.router_aux_loss_coef != 0) {
    throw InputError(moe.file(), moe.key_path("router_aux_loss_coef"),
                     "router \"sigmoid_grouped\" (DeepSeek-V3) balances by its correction bias, with no "
                     "load-balancing loss to weight; expected 0");
  }
  config.n_group = dimension(moe, "n_group");
  if (config.num_experts % config.n_group != 0 || config.num_experts / config.n_group < 2) {
    throw InputError(moe.file(), moe.key_path("n_group"),
                     "expected a divisor of num_experts (" + std::to_string(config.num_experts) +
                         ") leaving at least 2 experts a group (a group scores its two best), got " +
                         std::to_string(config.n_group));
  }
  config.topk_group = dimension(moe, "topk_group");
  if (config.topk_group > config.n_group) {
    throw InputError(moe.file(), moe.key_path("topk_group"),
                     "expected at most n_group (" + std::to_string(config.n_group) + "), got " +
                         std::to_string(config.topk_group));
  }
  config.routed_scaling_factor = finite_number_above(moe, "routed_scaling_factor", 0, false);
  config.score_bias = moe.optional_boolean("router_score_bias").value_or(true);
  config.score_bias_update = parse_score_bias_update(moe, config);
}

}  // namespace

MoeConfig parse_moe(const JsonReader& moe, const ModelConfig& model, int64_t mtp_layers_at_most) {
  MoeConfig config;
  config.num_experts = dimension(moe, "num_experts");
  config.top_k = dimension(moe, "top_k");
  if (config.top_k > config.num_experts) {
    throw InputError(moe.file(), moe.key_path("top_k"),
                     "expected at most num_experts (" + std::to_string(config.num_experts) + "), got " +
                         std::to_string(config.top_k));
  }
  config.intermediate_size = optional_dimension(moe, "intermediate_size", model.intermediate_size);
  config.norm_topk_prob = moe.optional_boolean("norm_topk_prob").value_or(false);
  if (moe.has("router_aux_loss_coef")) {
    config.router_aux_loss_coef = finite_number_above(moe, "router_aux_loss_coef", 0, true);
  }
  if (moe.has("router_z_loss_coef")) {
    config.router_z_loss_coef = finite_number_above(moe, "router_z_loss_coef", 0, true);
  }
  parse_moe_variant(moe, config);
  parse_moe_layout(moe, model, config, mtp_layers_at_most);
  parse_grouped_router(moe, config);
  return config;
}

bool moe_in_first_layers(const MoeConfig& moe, int64_t num_layers) {
  return moe.layers.empty() || moe.layers.front() < num_layers;
}

// Today's keys always; the variants' only where they differ from Qwen3-MoE's,
// so a Qwen3-MoE bundle is written back as before.
nlohmann::json moe_json(const MoeConfig& moe, int64_t num_layers) {
  nlohmann::json j = {{"num_experts", moe.num_experts},
                      {"top_k", moe.top_k},
                      {"intermediate_size", moe.intermediate_size},
                      {"norm_topk_prob", moe.norm_topk_prob},
                      {"router_aux_loss_coef", moe.router_aux_loss_coef},
                      {"router_z_loss_coef", moe.router_z_loss_coef}};
  if (moe.router != RouterKind::kSoftmaxTopK) j["router"] = router_names().at(static_cast<size_t>(moe.router));
  if (moe.router_bias) j["router_bias"] = true;
  if (moe.expert_bias) j["expert_bias"] = true;
  if (moe.fused_gate_up) j["fused_gate_up"] = true;
  if (moe.expert_activation == ExpertActivation::kGptOss) {
    j["expert_activation"] = "gpt_oss";
    j["swiglu_alpha"] = moe.swiglu_alpha;
  }
  if (moe.swiglu_limit) j["swiglu_limit"] = *moe.swiglu_limit;
  if (!moe.layers.empty()) {
    nlohmann::json kept = nlohmann::json::array();
    for (const int layer : moe.layers) {
      if (layer < num_layers) kept.push_back(layer);
    }
    j["layers"] = kept;
  }
  if (moe.scale_expert_input) j["scale_expert_input"] = true;
  if (moe.shared_expert_intermediate_size > 0) {
    j["shared_expert_intermediate_size"] = moe.shared_expert_intermediate_size;
  }
  if (moe.router == RouterKind::kSigmoidGrouped) {
    j["n_group"] = moe.n_group;
    j["topk_group"] = moe.topk_group;
    j["routed_scaling_factor"] = moe.routed_scaling_factor;
    j["router_score_bias"] = moe.score_bias;
    if (moe.score_bias_update) {
      j["score_bias_update"] = {
          {"rule", score_bias_rule_names().at(static_cast<size_t>(moe.score_bias_update->rule))},
          {"rate", moe.score_bias_update->rate}};
    }
  }
  return j;
}

}  // namespace nanreplay
