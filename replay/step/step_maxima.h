// A step's per-head logit maxima, per-expert activation maxima, router logit
// maxima and routed tokens (StepResult::attn_logit_max, ::expert_activation_max,
// ::router_logit_max, ::router_tokens; the tokens summed) when the replay is
// split over processes (docs/distributed.md): each process saw its own ranks
// (--split ranks) or its own layers (--split layers), so every process
// gathers every process's and keeps the largest, a NaN winning, as one
// process over every pass would have. Nothing is exchanged for one process.
#pragma once

#include "replay/step/step.h"

namespace nanreplay {

// Every process calls it at the same point of the same step (all of them
// replay every step). `attn`/`experts`/`routers`: which the step recorded.
void combine_step_maxima(StepResult& result, bool attn, bool experts, bool routers);

}  // namespace nanreplay
