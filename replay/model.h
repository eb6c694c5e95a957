// The replayed transformer: llama and gpt2 of the bundle spec, written as one
// op per line with a probe at every site, parameters looked up by their
// safetensors keys. Returns the micro-batch's mean next-token cross-entropy.
#pragma once

#include <string>
#include <unordered_map>

#include <torch/types.h>

#include "loaders/manifest.h"
#include "replay/numerics.h"
#include "replay/probe_session.h"

namespace nanreplay {

using ParamMap = std::unordered_map<std::string, torch::Tensor>;

// inputs, targets: [batch, seq] int64. Every forward site goes through `probes`.
torch::Tensor forward_loss(const ModelConfig& model, const ParamMap& params,
                           const torch::Tensor& inputs, const torch::Tensor& targets,
                           const Numerics& numerics, ProbeSession& probes);

}  // namespace nanreplay
