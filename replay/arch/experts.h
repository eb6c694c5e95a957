// A mixture-of-experts MLP as Hugging Face's Qwen3MoeSparseMoeBlock routes it,
// or GPT-OSS's or Llama 4's router and experts (with its shared expert,
// shared_expert.h), per docs/bundle-format.md "Mixture of experts"; a probe at
// every site of the layer; the router losses over the layers with experts.
#pragma once

#include <functional>
#include <vector>

#include <torch/types.h>

#include "replay/arch/model.h"

namespace nanreplay {

// Where a layer's expert parameters come from when the block's ParamMap lacks
// them: the layer-streamed replay (replay/step/layer_stream.h) loads a block
// without its experts and, once the router has chosen, only the experts it
// routed a token to. While one is alive on this thread, experts_mlp asks it
// for those experts' parameters (keyed by name) and leaves the experts no
// token reached out of the computation: an expert over no rows adds nothing
// to any value, and its parameters' gradient is zero, which the streamed
// replay writes without loading them. The in-memory replay passes every
// expert in the ParamMap and never asks.
class ExpertSource {
 public:
  using Fetch = std::function<ParamMap(int layer, const std::vector<int>& experts)>;
  explicit ExpertSource(Fetch fetch);  // installs it on this thread
  ~ExpertSource();                     // the one it replaced again
  ExpertSource(const ExpertSource&) = delete;
  ExpertSource& operator=(const ExpertSource&) = delete;

  // The source alive on this thread; null when none is.
  static const ExpertSource* current();
  ParamMap fetch(int layer, const std::vector<int>& experts) const { return fetch_(layer, experts); }

 private:
  Fetch fetch_;
  const ExpertSource* replaced_;
};

// The layer's MLP output (B, T, C) from the post-attention norm's output h.
torch::Tensor experts_mlp(const ModelConfig& model, const ParamMap& params, const torch::Tensor& h, int layer,
                          const Numerics& numerics, ProbeSession& probes, RouterOutputs& router);

// router_aux_loss_coef * load_balancing_loss_func + router_z_loss_coef * z-loss:
// what the step's loss adds to the cross-entropy (a scalar on the last layer's device).
torch::Tensor router_loss(const MoeConfig& moe, const RouterOutputs& router);

}  // namespace nanreplay
