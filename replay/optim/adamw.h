// PyTorch's AdamW step (torch.optim.AdamW, single-tensor path, as of 1.13)
// preceded by clip_grad_norm_, exactly as the bundle spec defines the update
// between two checkpoints. Used to train synthetic bundles and to predict
// model(s+1) from model(s) when hunting flipped bits.
#pragma once

#include <string>
#include <vector>

#include <torch/types.h>

#include "loaders/bundle/manifest.h"

namespace nanreplay {

struct AdamWMoments {
  std::vector<torch::Tensor> exp_avg;
  std::vector<torch::Tensor> exp_avg_sq;
  int64_t step = 0;  // updates already applied
};

// True when `name` matches the fnmatch-style glob (`*` any run, `?` one char).
bool glob_match(const std::string& pattern, const std::string& name);

// clip_grad_norm_'s factor min(1, clip / (norm + 1e-6)), computed in fp32 as
// PyTorch does; 1 when no clipping is configured.
torch::Tensor clip_coefficient(double grad_norm, const OptimizerConfig& config);

// One AdamW step of one parameter, in place: decoupled decay (unless
// excluded), moments, bias correction with t = `updates_before` + 1.
void adamw_step_one(torch::Tensor& param, const torch::Tensor& grad, torch::Tensor& exp_avg,
                    torch::Tensor& exp_avg_sq, int64_t updates_before, double lr,
                    const OptimizerConfig& config, bool decay);

// True when `name` is excluded from weight decay by optimizer.no_decay.
bool excluded_from_decay(const OptimizerConfig& config, const std::string& name);

// Updates `params` (plain fp32 tensors, no autograd) and `moments` in place.
// `grads` are unscaled and unclipped; `grad_norm` is their total norm.
void adamw_update(std::vector<torch::Tensor>& params, std::vector<torch::Tensor> grads,
                  double grad_norm, AdamWMoments& moments, double lr,
                  const OptimizerConfig& config, const std::vector<std::string>& names);

}  // namespace nanreplay
