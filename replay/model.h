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

struct ForwardResult {
  torch::Tensor loss;         // scalar: mean next-token cross-entropy
  torch::Tensor sample_loss;  // (batch,) per-row mean, no grad; undefined with probes off
};

// inputs, targets: [batch, seq] int64. Every forward site goes through `probes`.
ForwardResult forward_loss(const ModelConfig& model, const ParamMap& params,
                           const torch::Tensor& inputs, const torch::Tensor& targets,
                           const Numerics& numerics, ProbeSession& probes);

}  // namespace nanreplay
