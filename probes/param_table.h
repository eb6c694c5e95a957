// The parameters of each architecture, in one table per architecture: role,
// safetensors key ("{i}" for the layer), shape. The loader's checks
// (expected_parameters), the forward pass, synthetic bundles and the capture
// helper (tests/test_capture_param_table.cpp compares its list with this one)
// all read it, so a key is written down once.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "loaders/bundle/manifest.h"

namespace nanreplay {

// ParamRole, the parameters a model may hold, is loaders/arch/model_config.h's.

// Where a parameter sits: before the layers (embeddings), in every layer, after them.
enum class ParamPlace : uint8_t { kBefore, kLayer, kAfter };

struct ParamDef {
  ParamRole role;
  // "model.layers.{i}.self_attn.q_proj.weight"; "{i}" only in per-layer keys,
  // "{e}" (the expert) only in per-expert ones.
  const char* key;
  ParamPlace place;
  std::vector<int64_t> (*shape)(const ModelConfig& m);
  // null: always; else the model option that brings it (a row of
  // loaders/arch/llama_options.cpp) or the dimension that decides it.
  bool (*present)(const ModelConfig& m) = nullptr;
  // null: in every layer the model has it in; else which layers hold it
  // (the dense MLP or the experts, by model.moe.layers).
  bool (*in_layer)(const ModelConfig& m, int layer) = nullptr;
};

// Whether the model has this parameter (its options decide for some), in
// `layer` for a per-layer one (-1: in any layer).
bool has_parameter(const ParamDef& def, const ModelConfig& m, int layer = -1);

// The architecture's parameters in the bundle format's order within a layer
// and outside (embeddings, layers, final norm, head).
const std::vector<ParamDef>& param_table(Arch arch);

// Whether the key names one expert's parameter ("{e}" in it).
bool is_per_expert(const ParamDef& def);

// The key of `role` (in `layer` for per-layer roles, of `expert` for per-expert ones).
std::string param_key(Arch arch, ParamRole role, int layer = -1, int expert = -1);
// A linear's key prefix ("model.layers.0.self_attn.q_proj"): what fp8 scales are keyed by.
std::string module_key(Arch arch, ParamRole role, int layer = -1, int expert = -1);

// Multi-token prediction (model.mtp): depth k (1-based) is decoder block
// num_layers + k - 1 plus its own parameters beside it, under DeepSeek-V3's
// Hugging Face names (model.layers.{i}.enorm.weight ...). The checkpoint's
// per-depth copies of embed_tokens and shared_head.head are not parameters:
// Megatron-LM shares the model's embedding and output head with every depth.
enum class MtpPart : uint8_t { kEnorm, kHnorm, kEhProj, kHeadNorm };
int mtp_block_layer(const ModelConfig& m, int depth);
std::string mtp_key(const ModelConfig& m, int depth, MtpPart part);
std::vector<int64_t> mtp_shape(const ModelConfig& m, MtpPart part);

}  // namespace nanreplay
