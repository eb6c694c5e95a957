// What changed over a spike incident's window (docs/spikes.md, "What
// changed"): per attention head the largest query-key logit of each step
// (attention-logit growth), per expert of a mixture the largest activation
// inside and leaving its MLP (MoE outliers). Plain data; the replay fills it
// from the probe records it already takes (reports/triage/window_outliers.h),
// the renderers show it.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

namespace nanreplay {

// One head's largest |q k^T / sqrt(D)| (the attn.scores site's max |x|) per step.
struct HeadLogitSeries {
  int layer = 0, head = 0;
  std::vector<double> max_logit;  // one per WindowOutliers::steps entry
  // The last healthy step's value over the first step's (the healthy steps:
  // those before the spike's step), and the spike step's over the last
  // healthy step's; null where there is no such pair.
  std::optional<double> healthy_growth, spike_jump;
};

// One expert's largest |x| per step: mlp.expert.act (the activation its
// down_proj reads) and mlp.expert.down (what leaves the expert), and its
// largest router logit (NaN where not recorded).
struct ExpertOutlierSeries {
  int layer = 0, expert = 0;
  std::vector<double> act_max, down_max, router_logit_max;  // one per WindowOutliers::steps entry
  std::optional<double> spike_jump;       // the spike step's act_max over the step before
};

struct WindowOutliers {
  std::vector<int64_t> steps;  // the steps summarised, in order, up to the spike's step
  std::vector<HeadLogitSeries> heads;     // the top heads, largest max logit at the last step first
  std::vector<ExpertOutlierSeries> experts;  // a mixture of experts: the top experts, likewise; else empty
};

// Attention-logit growth named as a spike's mechanism: the origin is this
// head's attn.scores and its largest logit grew over the healthy steps.
struct LogitGrowthMechanism {
  int layer = 0, head = 0;
  double healthy_growth = 1.0, spike_jump = 1.0;
};

}  // namespace nanreplay
