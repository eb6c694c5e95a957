// See clipping.h.
#include "replay/optim/clipping.h"

#include <torch/torch.h>

#include "loaders/base/glob_match.h"
#include "loaders/bundle/optimizer_manifest.h"

namespace nanreplay {

torch::Tensor clip_coefficient(double grad_norm, const OptimizerConfig& config) {
  if (!config.grad_clip) return torch::tensor(1.0f);
  // A non-finite norm poisons every gradient, as in PyTorch.
  return torch::clamp_max(torch::tensor(static_cast<float>(*config.grad_clip)) /
                              (torch::tensor(static_cast<float>(grad_norm)) + 1e-6),
                          1.0);
}

bool excluded_from_decay(const OptimizerConfig& config, const std::string& name) {
  for (const std::string& pattern : config.no_decay) {
    if (glob_match(pattern, name)) return true;
  }
  return false;
}

}  // namespace nanreplay
