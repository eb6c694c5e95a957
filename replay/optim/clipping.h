// What every optimizer kind shares around its update: clip_grad_norm_ over
// all gradients first, and optimizer.no_decay's exclusion from weight decay.
#pragma once

#include <string>

#include <torch/types.h>

#include "loaders/bundle/manifest.h"

namespace nanreplay {

// clip_grad_norm_'s factor min(1, clip / (norm + 1e-6)), computed in fp32 as
// PyTorch does; 1 when no clipping is configured.
torch::Tensor clip_coefficient(double grad_norm, const OptimizerConfig& config);

// True when `name` is excluded from weight decay by optimizer.no_decay.
bool excluded_from_decay(const OptimizerConfig& config, const std::string& name);

}  // namespace nanreplay
