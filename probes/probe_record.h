// One probe: the statistics of one site (or one head of it) at one point of the
// replay (step, micro-batch, rank, phase). Plain data, shared by the replay,
// the report and the trace writer.
#pragma once

#include <cstdint>
#include <limits>
#include <memory>
#include <tuple>
#include <string>
#include <vector>

#include "kernels/tensor_stats.h"
#include "probes/damage_shape.h"
#include "probes/masked_score.h"
#include "probes/sites.h"

namespace nanreplay {

enum class Phase { kForward = 0, kBackward = 1, kGrad = 2 };
const char* phase_name(Phase phase);  // "forward", "backward", "grad"

// What a probe is of, as people read it: the site's name ("layers.2.attn.scores"),
// or for phase grad the parameter's key. Names are made here, where shown.
std::string probe_name(Phase phase, const SiteRef& site, const std::string& param);

struct ProbeRecord {
  int64_t step = 0;
  int micro_batch = -1;  // -1: not per micro-batch (phase grad)
  int rank = -1;         // -1: all ranks (phase grad)
  Phase phase = Phase::kForward;
  int order = 0;         // position of the site in this phase's execution order
  SiteRef site;          // phase forward / backward: which probe site
  std::string param;     // phase grad: the parameter's safetensors key
  int layer = -1;        // -1: outside the layers
  int head = -1;         // -1: the whole tensor; >= 0: one head of a per-head site
  int expert = -1;       // -1: the whole tensor; >= 0: one expert of a per-expert site
  int64_t routed_tokens = -1;  // per-expert sites: tokens routed to `expert` (all experts' for the whole), -1: n/a
  std::vector<int64_t> shape;
  TensorStats stats;
  // Decoded first non-finite element (valid when stats.first_nonfinite >= 0).
  std::vector<int64_t> first_index;  // coordinates in `shape`
  int64_t sample = -1;               // dataset index of the batch row, -1: n/a
  int64_t position = -1;             // token position, -1: n/a
  int first_head = -1;               // head of the first element for per-head sites
  int first_expert = -1;             // expert of the first element for per-expert sites
  // The element of largest finite |x| (a spike's origin names it), located
  // only when the replay asks (BatchContext::locate_largest); -1: not located.
  int64_t largest_sample = -1;
  int64_t largest_position = -1;
  // Where the bad elements of this site's tensor lie (damage_shape.h): the
  // first non-finite forward site of a pass, every forward site of a spike
  // incident; host tensors only, shared by the site's records (a split
  // replay sends it with them). Null: not taken.
  std::shared_ptr<const DamageShape> damage;
  // The pass's first non-finite forward site, when it is a layer's attn.scores
  // or attn.probs and the origin's row held a non-finite score at a masked key:
  // what the mask did to that row (masked_score.h). Host tensors only; null otherwise.
  std::shared_ptr<const MaskedScore> masked_score;
  // log2(dtype max / max |x|): how many doublings the largest finite value of
  // this site could take before it overflows the type it is held in (+inf
  // when the site is all zero). Near zero means a near miss.
  double headroom_bits = 0.0;
};

// A record of a whole site's tensor, not of one head or one expert of it.
inline bool is_whole(const ProbeRecord& r) { return r.head < 0 && r.expert < 0; }

// Execution order within a step: (micro-batch, phase, site order, rank), the
// parameter gradients after every micro-batch. Lower comes first.
inline std::string probe_name(const ProbeRecord& r) { return probe_name(r.phase, r.site, r.param); }

inline std::tuple<int, int, int, int> execution_key(const ProbeRecord& r) {
  if (r.phase == Phase::kGrad) return {std::numeric_limits<int>::max(), 2, r.order, 0};
  return {r.micro_batch, static_cast<int>(r.phase), r.order, r.rank};
}

// One batch row's mean next-token loss, for the per-sample outlier check.
struct SampleLoss {
  int64_t sample = 0;
  int rank = 0;
  int micro_batch = 0;
  double loss = 0.0;
};

// A norm whose denominator (mean square for RMSNorm, variance for LayerNorm)
// came close to zero: the rows where it fell below eps, and the smallest.
struct NormCheck {
  int64_t step = 0;
  int micro_batch = 0;
  int rank = 0;
  SiteRef site;           // the norm's output site, e.g. layers.0.attn_norm
  int layer = -1;
  const char* moment = "mean square";  // what the norm divides by: "mean square" (RMSNorm) or "variance" (LayerNorm)
  double eps = 0.0;
  double min_moment = 0.0;      // smallest mean square / variance over rows
  int64_t rows_below_eps = 0;   // rows whose moment is < eps (or denominator 0)
  bool zero_denominator = false;  // moment + eps == 0 somewhere: 0/0 follows
  int64_t sample = -1;          // row of the smallest moment
  int64_t position = -1;
};

}  // namespace nanreplay
