// model.mtp; see mtp_option.h. Both keys are required: the number of depths
// decides which parameters the bundle holds, the scale changes every gradient,
// and Megatron's default scale (0.1) is not assumed.
#include "loaders/arch/mtp_option.h"

#include <string>

#include "loaders/arch/manifest_values.h"
#include "loaders/base/error.h"

namespace nanreplay {

namespace {

void refuse_unknown_mtp_keys(const JsonReader& mtp) {
  for (const auto& item : mtp.json().items()) {
    if (item.key() != "num_layers" && item.key() != "loss_scale") {
      throw InputError(mtp.file(), mtp.key_path(item.key()), "is not an mtp key (num_layers, loss_scale)");
    }
  }
}

// An option whose per-layer list or expert layout an MTP block past the decoder has no entry in.
const char* conflicting_mtp_option(const ModelConfig& m) {
  if (!m.layer_types.empty()) return "layer_types";
  if (!m.no_rope_layers.empty()) return "no_rope_layers";
  if (m.attention_chunk_size > 0) return "attention_chunk_size";
  if (m.scale_embeddings) return "scale_embeddings";
  if (m.final_logit_softcap) return "final_logit_softcap";  // Megatron's MTP logits are not capped
  if (m.moe && m.moe->layers.empty()) {
    return "moe on every layer (list model.moe.layers, the MTP blocks' layers included where they hold experts)";
  }
  return nullptr;
}

// model.moe.layers may list the MTP blocks' layers (num_layers + k - 1, DeepSeek-V3's MTP layer is a
// mixture of experts like the decoder layers past first_k_dense_replace), but none past the last depth.
// Such blocks are replayed with the decoder's routing, and score_bias_update derives their correction bias
// as a decoder layer's (Megatron-LM updates every router's expert_bias, the MTP layers' too). What the
// replay does not run for them is refused: their router losses (Megatron-LM adds each MoE layer's own,
// the MTP layers' too; the replay's is Hugging Face's one loss over the decoder's routers).
void check_mtp_experts(const JsonReader& model, const ModelConfig& m, int64_t depths) {
  if (!m.moe) return;
  const int64_t last = m.num_layers + depths - 1;
  bool experts = false;
  for (const int layer : m.moe->layers) {
    if (layer > last) {
      throw InputError(model.file(), model.key_path("moe") + ".layers",
                       "layer " + std::to_string(layer) + " is past the decoder's " + std::to_string(m.num_layers) +
                           " layers and model.mtp's " + std::to_string(depths) + " (the last is " +
                           std::to_string(last) + ")");
    }
    experts = experts || layer >= m.num_layers;
  }
  if (!experts) return;
  const char* unreplayed = m.moe->router_aux_loss_coef != 0 ? "router_aux_loss_coef"
                           : m.moe->router_z_loss_coef != 0 ? "router_z_loss_coef"
                                                            : nullptr;
  if (unreplayed != nullptr) {
    throw InputError(model.file(), model.key_path("moe") + "." + unreplayed,
                     "not replayed for the MTP blocks' experts (model.moe.layers lists an MTP block's layer): "
                     "expected 0");
  }
}

}  // namespace

MultiTokenPrediction parse_mtp(const JsonReader& model, const ModelConfig& config) {
  const JsonReader mtp = model.object("mtp");
  refuse_unknown_mtp_keys(mtp);
  const std::string key = model.key_path("mtp");
  if (config.arch != Arch::kLlama) throw InputError(model.file(), key, "multi-token prediction is replayed for llama only");
  if (const char* other = conflicting_mtp_option(config)) {
    throw InputError(model.file(), key,
                     std::string("not replayed together with model.") + other +
                         ": the MTP blocks are full-attention, rotary layers after the decoder's");
  }
  MultiTokenPrediction out;
  out.num_layers = positive_integer(mtp, "num_layers");
  if (out.num_layers > kMaxMtpLayers) {
    throw InputError(mtp.file(), mtp.key_path("num_layers"),
                     "expected at most 64 depths (DeepSeek-V3 trains 1), got " + std::to_string(out.num_layers));
  }
  // Megatron's mtp_loss_scaling_factor: 0 would be no MTP at all (leave the key out then).
  out.loss_scale = finite_number_above(mtp, "loss_scale", 0, false);
  check_mtp_experts(model, config, out.num_layers);
  return out;
}

nlohmann::json mtp_json(const MultiTokenPrediction& mtp) {
  return {{"num_layers", mtp.num_layers}, {"loss_scale", mtp.loss_scale}};
}

}  // namespace nanreplay
