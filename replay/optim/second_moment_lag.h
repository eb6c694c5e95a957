// How far a step's squared gradient runs ahead of the second moment its
// update divides by (update_stats.h's g2_over_v*), for every rule that keeps
// one: Adam and AdamW (exp_avg_sq, bias-corrected), PyTorch's and Hugging
// Face's Adafactor (factored: outer(row, col) / mean(row); a vector's full
// moment). Muon keeps none. The sums fold slice by slice, so an elementwise
// rule's ratio can be taken a slice of rows at a time (the update check's
// walk over checkpoints, reports/triage/system) or whole (rolling forward).
#pragma once

#include <cstdint>

#include <torch/types.h>

#include "replay/optim/optimizer.h"

namespace nanreplay {

// Sums over the elements seen so far; finish() writes the three ratios.
struct MomentLagSums {
  double sum_g2 = 0.0;        // sum of g^2 over every element
  double sum_v = 0.0;         // sum of v_hat over every element
  double max_ratio = 0.0;     // over the elements with v_hat > 0
  double sum_ratio_sq = 0.0;  // the same elements
  int64_t held = 0;           // how many elements have v_hat > 0
  bool seen = false;          // some v_hat was folded in

  // g2 and v_hat: fp64 tensors of one shape.
  void add(const torch::Tensor& g2, const torch::Tensor& v_hat);
  // g2_over_v = sum(g^2) / sum(v_hat) when that is > 0; max and rms when some v_hat > 0.
  void finish(TensorUpdateStats& stats) const;
};

// Folds the ratio of `param`'s update into `sums`: `grad` the clipped
// gradient the rule reads, `state` the state the update starts from (before
// this step's gradient enters it). Nothing at the first update (state.step
// 0: no moment yet), nothing for Muon.
void fold_second_moment_lag(const torch::Tensor& param, const torch::Tensor& grad, const ParamState& state,
                            const OptimizerRule& rule, bool decay, MomentLagSums& sums);

// True for the rules fold_second_moment_lag measures.
bool keeps_second_moment(const OptimizerRule& rule);

}  // namespace nanreplay
