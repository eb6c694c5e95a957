// Two separate linears for gate and up, as both models hold them (nn.Linear
// each): in bf16/fp16 each rounds its own input gradient.
#include "replay/arch/shared_expert.h"

#include <torch/torch.h>

#include "probes/param_table.h"

namespace nanreplay {

torch::Tensor shared_expert_mlp(const ModelConfig& m, const ParamMap& p, const torch::Tensor& h, int layer,
                                const Numerics& numerics, ProbeSession& probes) {
  using R = ParamRole;
  auto project = [&](const torch::Tensor& in, R role) {
    return numerics.linear(in, p.at(param_key(m.arch, role, layer)), torch::Tensor(), module_key(m.arch, role, layer));
  };
  const torch::Tensor gate = probes.site({SiteId::kMlpSharedGate, layer}, project(h, R::kSharedGateProj));
  const torch::Tensor up = probes.site({SiteId::kMlpSharedUp, layer}, project(h, R::kSharedUpProj));
  const torch::Tensor act = probes.site({SiteId::kMlpSharedAct, layer}, torch::silu(gate) * up);  // (B, T, S)
  return probes.site({SiteId::kMlpSharedDown, layer}, project(act, R::kSharedDownProj));
}

}  // namespace nanreplay
