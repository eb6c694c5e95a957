// How a mixture of experts spread a step's tokens: per layer, the tokens each
// expert received (over every rank and micro-batch), from the per-expert
// probes, and NUMERIC_ROUTER_COLLAPSE when a layer sends far more than its
// share to one expert or leaves one without tokens (docs/triage.md).
#pragma once

#include <cstdint>
#include <set>
#include <vector>

#include "loaders/bundle/manifest.h"
#include "probes/probe_record.h"
#include "reports/results/finding.h"
#include "reports/results/report.h"

namespace nanreplay {

// [layer][expert] token counts of `step`, a row per layer with sites (with
// model.mtp, its blocks' rows after the decoder's); empty when the records
// hold no per-expert probes of it (a dense model, or probes off for the step).
std::vector<std::vector<int64_t>> expert_token_counts(const std::vector<ProbeRecord>& records, int64_t step,
                                                      const ModelConfig& model);

// An expert's share of a layer's tokens is collapsed above this point: four
// times its balanced share (top_k / num_experts), or, where that is out of
// reach, 80% of the way from the balanced share to every token (4 experts,
// top 2: 90%; 8 experts, top 2: 85%; 64 experts, top 8: 50%). Lower shares
// are the ordinary imbalance of a young or small model, not a collapse.
constexpr double kCollapsedOverBalanced = 4.0;
constexpr double kCollapsedOfTheRest = 0.8;
double collapsed_share(int64_t top_k, int64_t num_experts);
// An expert left without tokens counts only where it expected at least this many.
constexpr double kStarvedExpectedTokens = 16.0;

// The step whose expert load report.md and report.html show: the first
// non-finite value's step where its routing was probed, else the first
// NUMERIC_ROUTER_COLLAPSE's step, else the last step whose routing was
// probed; nullptr for a dense model.
const StepOutcome* expert_load_step(const ReplayReport& report);

// An expert's share of its layer's tokens (each token counted once, whatever top_k).
double expert_share(const std::vector<int64_t>& layer_counts, int64_t expert, int64_t top_k);

// Layers of `step` whose router probabilities held a non-finite value: their
// routing read NaN, so their token counts say nothing about the router.
std::set<int> layers_with_nonfinite_routing(const std::vector<ProbeRecord>& records, int64_t step);

// NUMERIC_ROUTER_COLLAPSE per layer of `counts`, except the `unjudged` layers.
std::vector<Finding> router_collapse_findings(const std::vector<std::vector<int64_t>>& counts, int64_t step,
                                              const MoeConfig& moe, const std::set<int>& unjudged = {});

}  // namespace nanreplay
