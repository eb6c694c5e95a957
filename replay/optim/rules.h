// Each optimizer kind's update of one parameter (optimizer.h's update_param
// picks one by kind): in place, gradient already clipped, state.step not yet
// advanced. Every op follows the named class's source, op for op.
#pragma once

#include <torch/types.h>

#include "loaders/bundle/manifest.h"
#include "replay/optim/optimizer.h"

namespace nanreplay {

// torch.optim.Adam (L2 decay added to the gradient; decoupled_weight_decay:
// AdamW's) and torch.optim.AdamW, amsgrad and maximize included.
void adam_family_update(torch::Tensor& param, const torch::Tensor& grad, ParamState& state, double lr,
                        const OptimizerRule& rule, bool decay);
// torch.optim.Adafactor (torch/optim/_adafactor.py, single-tensor path).
void adafactor_update(torch::Tensor& param, const torch::Tensor& grad, ParamState& state, double lr,
                      const OptimizerRule& rule, bool decay);
// transformers.optimization.Adafactor.
void adafactor_hf_update(torch::Tensor& param, const torch::Tensor& grad, ParamState& state, double lr,
                         const OptimizerRule& rule, bool decay);
// torch.optim.Muon (torch/optim/_muon.py), its Newton-Schulz in bf16.
void muon_update(torch::Tensor& param, const torch::Tensor& grad, ParamState& state, double lr,
                 const OptimizerRule& rule, bool decay);

// Muon's orthogonalisation of `update` (2-D, fp32), as a GPU computes it in
// bf16: each matmul from bf16 operands accumulated in fp32 then rounded to
// bf16, each elementwise op rounded to bf16. Returns a bf16 tensor.
torch::Tensor newton_schulz_bf16(const torch::Tensor& update, const OptimizerRule& rule);

}  // namespace nanreplay
