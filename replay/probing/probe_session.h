// Probes for one forward/backward pass (one step, micro-batch and rank).
// `site()` records a site's forward statistics as the compute type holds it
// and hooks its gradient, whose statistics are taken when autograd delivers
// it (already summed over every consumer and rounded at the cast pair).
// With probes off, `site()` only applies the rounding: numerics are identical.
// On a GPU nothing is read back until take_records()/take_norm_checks().
// Bisection adds two cheaper levels: one all-finite flag per site (kFlags),
// and full statistics on one block only (ProbeScope::layer).
#pragma once

#include <memory>
#include <optional>
#include <vector>

#include <torch/types.h>

#include "probes/probe_record.h"
#include "probes/sites.h"
#include "replay/probing/numerics.h"

namespace nanreplay {

class CudaProbeStats;

struct BatchContext {
  int64_t step = 0;
  int micro_batch = 0;
  int rank = 0;
  std::vector<int64_t> sample_ids;  // dataset index of each batch row
  // Forward records of host tensors also name the sample and position of
  // their largest finite |x| (a spike incident's origin; largest_element.h).
  bool locate_largest = false;
};

// Statistics of a tensor laid out as `ref` says, decoded into a record (plus
// one record per head for per-head sites). `def` null: a parameter gradient
// (coordinates only, no sample or position). Used for forward, backward and
// parameter-gradient probes alike.
// `span`: the layer's sliding window or chunk (ModelConfig::span_of); causal
// sites then count only the keys each query sees.
std::vector<ProbeRecord> describe_tensor(const torch::Tensor& tensor, const SiteDef* def,
                                         const std::vector<int64_t>& sample_ids, const AttentionSpan& span = {});

// How a mixture-of-experts layer routed its tokens: the rows of a per-expert
// site's tensor are grouped by expert, each expert's in (batch row, position)
// order, so expert e holds rows [offsets[e], offsets[e + 1]).
struct ExpertRouting {
  std::vector<int64_t> offsets;  // num_experts + 1
  std::vector<int64_t> tokens;   // per routed row: batch row * seq_len + position
  int64_t seq_len = 0;
  int64_t rows() const { return offsets.empty() ? 0 : offsets.back(); }
};

enum class ProbeLevel {
  kOff,    // no statistics, no hooks: the fast path for training
  kFlags,  // one all-finite test per site (causal positions only for scores and
           // probs); records only the sites holding a non-finite value, with
           // count, nan_count and inf_count and no other statistics
  kFull,   // every statistic of every site, per head where the site has heads
};

struct ProbeScope {
  ProbeLevel level = ProbeLevel::kFull;
  // kFull only: probe just the sites of this block (-1: the sites outside the
  // layers), plus the residual-stream tensor feeding it, whose gradient is
  // the block's `input` site in the backward. Unset: every site.
  std::optional<int> layer;
};

// One process's probes of a pass split across processes
// (replay/step/ranks/distributed.h), before take_records resolves the aliases: a block's
// `input` aliases the block before it, which another process may have run.
struct ProbeHarvest {
  std::vector<ProbeRecord> forward;
  std::vector<ProbeRecord> backward;
  std::vector<std::pair<SiteRef, SiteRef>> aliases;
  std::vector<NormCheck> norm_checks;
};

class ProbeSession {
 public:
  // `enabled` false: no statistics, no hooks (the fast path for training and
  // cheap passes). `order` maps a SiteRef to its forward execution index.
  // Statistics of tensors on an accelerator are always deferred: taken where
  // the tensor lives and read back by take_records() (one copy per device).
  // `defer_host` defers CPU tensors the same way (so tests can exercise that
  // path without a GPU).
  ProbeSession(BatchContext context, const Numerics& numerics, bool enabled,
               const ModelConfig& model, bool defer_host = false);
  ProbeSession(BatchContext context, const Numerics& numerics, const ProbeScope& scope,
               const ModelConfig& model, bool defer_host = false);
  ~ProbeSession();
  ProbeSession(const ProbeSession&) = delete;
  ProbeSession& operator=(const ProbeSession&) = delete;

  // Returns the value the rest of the forward uses (rounded to the compute type).
  torch::Tensor site(const SiteRef& ref, const torch::Tensor& value);
  // A per-expert site (value: [routed rows, features] grouped as `routing`
  // says): statistics per expert and for the whole, forward and backward.
  torch::Tensor expert_site(const SiteRef& ref, const torch::Tensor& value,
                            std::shared_ptr<const ExpertRouting> routing);
  // Records `ref` as the very tensor already probed as `same_as` (embed and
  // layers.0.input; layers.i.output and layers.i+1.input).
  void alias(const SiteRef& ref, const SiteRef& same_as);

  // Notes a norm's per-row denominator moment (shape (B, T)) before eps is
  // added, for the zero-norm check; `moment_name` says which it is ("mean
  // square" for RMSNorm, "variance" for LayerNorm).
  void check_norm(const SiteRef& ref, const torch::Tensor& moment, double eps, const char* moment_name);
  // Full statistics are being taken (norm checks and per-sample losses with them).
  bool enabled() const;
  // The layer's scores as attn.scores holds them, kept until its attn.probs
  // site: should the probabilities be the pass's first non-finite site, the
  // origin's row is read for non-finite scores at masked keys (masked_row.h).
  // Host tensors at full statistics only, until the pass's origin is found.
  void hold_scores(int layer, const torch::Tensor& scores);

  // The layer-streamed replay's backward computes each piece of the forward
  // again from its saved input: the sites it produces from here on are
  // rounded and their gradients hooked, but their forward statistics, norm
  // checks and aliases, taken by the first forward, are not taken twice.
  // Call before each piece.
  void begin_recompute();

  // Forward records in execution order, then backward records in reverse
  // forward order; call after backward has run.
  std::vector<ProbeRecord> take_records();
  std::vector<NormCheck> take_norm_checks();

  // A step reads back all of its passes' values at once: each session adds
  // what it still holds where it was computed to `parts`; after one
  // read_back (device_stats.h) of them and one collect() of the CUDA kernel
  // the sessions share (share_kernel), each decodes its share, from `next`
  // on, in the order the sessions added theirs.
  void add_readback(std::vector<torch::Tensor>& parts) const;
  void resolve_from(const std::vector<double>& values, size_t& next, const std::vector<TensorStats>& kernel_results);
  void share_kernel(std::shared_ptr<CudaProbeStats> kernel);

  // A replay split across processes: each takes its own probes out, then
  // absorbs every process's (its own included), after which take_records
  // and take_norm_checks give what one process would have recorded.
  ProbeHarvest take_harvest();
  void absorb(ProbeHarvest harvest);

 private:
  torch::Tensor produce(const SiteRef& ref, const torch::Tensor& value, std::shared_ptr<const ExpertRouting> routing);
  struct State;
  std::shared_ptr<State> state_;  // shared with the gradient hooks
  const Numerics& numerics_;
};

}  // namespace nanreplay
