// A mixture-of-experts MLP as Hugging Face's Qwen3MoeSparseMoeBlock routes it,
// or GPT-OSS's or Llama 4's router and experts (with its shared expert,
// shared_expert.h), per docs/bundle-format.md "Mixture of experts"; a probe at
// every site of the layer; the router losses over the layers with experts.
#pragma once

#include <vector>

#include <torch/types.h>

#include "replay/arch/model.h"

namespace nanreplay {

// The layer's MLP output (B, T, C) from the post-attention norm's output h.
torch::Tensor experts_mlp(const ModelConfig& model, const ParamMap& params, const torch::Tensor& h, int layer,
                          const Numerics& numerics, ProbeSession& probes, RouterOutputs& router);

// router_aux_loss_coef * load_balancing_loss_func + router_z_loss_coef * z-loss:
// what the step's loss adds to the cross-entropy (a scalar on the last layer's device).
torch::Tensor router_loss(const MoeConfig& moe, const RouterOutputs& router);

}  // namespace nanreplay
