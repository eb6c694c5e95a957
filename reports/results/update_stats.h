// What one optimizer step did to each parameter tensor, as a rolled-forward
// replay derives it: the update's RMS and, for Adam-family rules, how far the
// new squared gradient runs ahead of the second moment the update divides by
// (docs/optimizers.md#update-statistics). Plain data: replay/optim measures
// it, reports/triage/numeric/update_spike.h judges it.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace nanreplay {

struct TensorUpdateStats {
  std::string param;
  double update_rms = 0.0;  // ||theta_after - theta_before|| / sqrt(numel), before MuonClip
  // Adam family, from the second update on: g^2 / v_hat, with g the gradient
  // the rule reads (clipped; Adam's L2 term added) and v_hat the exp_avg_sq
  // the step starts from, bias-corrected by its own update count.
  std::optional<double> g2_over_v;      // mean(g^2) / mean(v_hat) over the tensor
  std::optional<double> g2_over_v_max;  // the largest element's, over elements with v_hat > 0
  std::optional<double> g2_over_v_rms;  // the elements' root mean square, same elements
};

// The update computed from step `step`'s gradients (it gives step + 1's parameters).
struct StepUpdateStats {
  int64_t step = 0;
  std::vector<TensorUpdateStats> tensors;  // the checkpoint's order
};

}  // namespace nanreplay
