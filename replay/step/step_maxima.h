// A step's per-head logit maxima and per-expert activation maxima
// (StepResult::attn_logit_max, ::expert_activation_max) when the replay is
// split over processes (docs/distributed.md): each process saw its own ranks
// (--split ranks) or its own layers (--split layers), so every process
// gathers every process's and keeps the largest, a NaN winning, as one
// process over every pass would have. Nothing is exchanged for one process.
#pragma once

#include "replay/step/step.h"

namespace nanreplay {

// Every process calls it at the same point of the same step (all of them
// replay every step). `attn`/`experts`: which of the two the step recorded.
void combine_step_maxima(StepResult& result, bool attn, bool experts);

}  // namespace nanreplay
