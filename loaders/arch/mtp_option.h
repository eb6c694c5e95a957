// model.mtp (DeepSeek-V3's multi-token prediction, as Megatron-LM trains it):
// its keys read and written back, and the models it cannot be replayed with
// refused by name (docs/bundle-format.md, "Multi-token prediction").
#pragma once

#include <nlohmann/json.hpp>

#include "loaders/arch/model_config.h"
#include "loaders/base/json_util.h"

namespace nanreplay {

// The most depths model.mtp.num_layers takes (DeepSeek-V3 trains 1).
constexpr int64_t kMaxMtpLayers = 64;

// The object under `model`'s "mtp"; `config` holds the dimensions and every other option.
MultiTokenPrediction parse_mtp(const JsonReader& model, const ModelConfig& config);
nlohmann::json mtp_json(const MultiTokenPrediction& mtp);

}  // namespace nanreplay
