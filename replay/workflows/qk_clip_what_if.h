// The qk-clip=TAU what-if (docs/bisect-and-what-if.md): Kimi K2's MuonClip
// as a fix. The bad step's own per-head largest logits are measured (the
// StepResult::attn_logit_max a MuonClip run reads), each head over TAU has its
// q and k rows rescaled by the optimizer's own rule (replay/optim/optimizer.h's
// apply_qk_clip, MHA/GQA or latent attention), and the step is held again on
// the rescaled weights for the what-if to replay.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "replay/step/step_scan.h"

namespace nanreplay {

// Measures `step`'s per-head maxima (a head whose maximum is not finite in
// the step's own precision is measured again with q k^T in fp32, never
// rounded), and, when a head exceeds `tau`, emplaces the step on the clipped
// weights in `clipped` (left empty when nothing is clipped). Adds the passes
// it ran to `passes`; returns what changed, for the report.
std::string qk_clip_step(LoadedStep& step, double tau, const ComputePlacement& placement, const PassHook& before_pass,
                         std::optional<LoadedStep>& clipped, int64_t& passes);

}  // namespace nanreplay
