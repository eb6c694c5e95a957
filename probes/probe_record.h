// One probe: the statistics of one site (or one head of it) at one point of the
// replay (step, micro-batch, rank, phase). Plain data, shared by the replay,
// the report and the trace writer.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kernels/tensor_stats.h"

namespace nanreplay {

enum class Phase { kForward = 0, kBackward = 1, kGrad = 2 };
const char* phase_name(Phase phase);  // "forward", "backward", "grad"

struct ProbeRecord {
  int64_t step = 0;
  int micro_batch = -1;  // -1: not per micro-batch (phase grad)
  int rank = -1;         // -1: all ranks (phase grad)
  Phase phase = Phase::kForward;
  int order = 0;         // position of the site in this phase's execution order
  std::string site;      // "layers.2.attn.scores" or a parameter key for phase grad
  int layer = -1;        // -1: outside the layers
  int head = -1;         // -1: the whole tensor; >= 0: one head of a per-head site
  std::vector<int64_t> shape;
  TensorStats stats;
  // Decoded first non-finite element (valid when stats.first_nonfinite >= 0).
  std::vector<int64_t> first_index;  // coordinates in `shape`
  int64_t sample = -1;               // dataset index of the batch row, -1: n/a
  int64_t position = -1;             // token position, -1: n/a
  int first_head = -1;               // head of the first element for per-head sites
};

}  // namespace nanreplay
