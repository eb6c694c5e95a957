// Where a site's largest finite |x| lies: the sample and position a spike's
// origin names (docs/spikes.md). One extra reduction per forward site, so the
// replay asks for it only on a spike incident (BatchContext::locate_largest),
// and only of host tensors (an accelerator's records leave it at -1).
#pragma once

#include <cstdint>
#include <vector>

#include <torch/types.h>

#include "kernels/attention_span.h"
#include "probes/probe_record.h"
#include "probes/sites.h"

namespace nanreplay {

struct ExpertRouting;

// Fills largest_sample / largest_position of `records` (describe_tensor's:
// the whole tensor, then one per head), from `tensor` laid out as `def` says.
// Causal sites count the visible keys only, as their statistics do.
void locate_largest(std::vector<ProbeRecord>& records, const torch::Tensor& tensor, const SiteDef& def,
                    const std::vector<int64_t>& sample_ids, const AttentionSpan& span);

// The same for a per-expert site's records (the whole, then one per expert).
void locate_largest_routed(std::vector<ProbeRecord>& records, const torch::Tensor& tensor,
                           const ExpertRouting& routing, const std::vector<int64_t>& sample_ids);

}  // namespace nanreplay
