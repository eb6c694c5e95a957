// The shared expert of a mixture of experts (model.moe.shared_expert_intermediate_size):
// a dense SwiGLU MLP beside the routed experts, on every token, as Llama 4's
// shared_expert (a Llama4TextMLP) and DeepSeek-V3's shared_experts compute it.
#pragma once

#include <torch/types.h>

#include "replay/arch/model.h"

namespace nanreplay {

// down(silu(gate(h)) * up(h)) from the post-attention norm's output h (B, T, C),
// with the mlp.shared.gate, .up, .act and .down sites.
torch::Tensor shared_expert_mlp(const ModelConfig& model, const ParamMap& params, const torch::Tensor& h, int layer,
                                const Numerics& numerics, ProbeSession& probes);

}  // namespace nanreplay
