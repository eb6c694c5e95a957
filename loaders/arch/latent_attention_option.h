// model.latent_attention (DeepSeek-V3, Kimi K2): its keys read and written
// back, and the llama options it cannot be replayed with refused by name
// (docs/bundle-format.md, "Multi-head latent attention").
#pragma once

#include <nlohmann/json.hpp>

#include "loaders/arch/model_config.h"
#include "loaders/base/json_util.h"

namespace nanreplay {

// The object under `model`'s "latent_attention"; `config` holds the dimensions and every other option.
LatentAttention parse_latent_attention(const JsonReader& model, const ModelConfig& config);
nlohmann::json latent_attention_json(const LatentAttention& latent);

}  // namespace nanreplay
