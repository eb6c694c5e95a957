// The bundle's data-parallel ranks spread over processes (replay/step/ranks/distributed.h,
// --split ranks): within a step each process replays its contiguous block of
// the ranks (rank_block), whole, in memory or streamed as one process would;
// at the end of the step every process gets every pass's probes and loss and
// every rank's gradient norm, and the ranks' gradient shares are added in
// rank order, as DDP's arithmetic in replay/step/gradients.h does. The bits are
// those of one process. A lone pass (bisection's) or a step cut short runs
// whole on every process.
#pragma once

#include <memory>
#include <vector>

#include "replay/step/step_model.h"

namespace nanreplay {

// `inner`: how each process replays its own ranks. `shapes`: every
// parameter's, in order; `scratch`: set when the step's gradients go to
// scratch files (a streamed replay), else they stay in memory.
std::unique_ptr<StepModel> spread_ranks(std::unique_ptr<StepModel> inner, ProcessWorld& world,
                                        std::vector<std::vector<int64_t>> shapes,
                                        std::shared_ptr<StreamScratch> scratch);

}  // namespace nanreplay
