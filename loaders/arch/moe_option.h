// model.moe (Qwen3-MoE, GPT-OSS, Llama 4, DeepSeek-V3's layout): its keys read
// and written back (docs/bundle-format.md, "Mixture of experts"). A key left
// out means Qwen3-MoE's behaviour on every layer, so older bundles read and
// write back exactly as before.
#pragma once

#include <nlohmann/json.hpp>

#include "loaders/arch/model_config.h"
#include "loaders/base/json_util.h"

namespace nanreplay {

// The object under `model`'s "moe"; `config` holds the dimensions (num_layers, intermediate_size).
// moe.layers may also list up to `mtp_layers_at_most` layers past the decoder's (model.mtp's blocks,
// which mtp_option.cpp checks against the number of depths once it is read).
MoeConfig parse_moe(const JsonReader& moe, const ModelConfig& config, int64_t mtp_layers_at_most = 0);
// Written back for a model of `num_layers` layers (a minimized bundle keeps the layers it has).
nlohmann::json moe_json(const MoeConfig& moe, int64_t num_layers);
// Whether the first `num_layers` layers hold any experts (a minimized model may keep none).
bool moe_in_first_layers(const MoeConfig& moe, int64_t num_layers);

}  // namespace nanreplay
