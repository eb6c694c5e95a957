// What one optimizer step did to each parameter tensor, as a rolled-forward
// replay derives it or two checkpoints hold it: the update's RMS and, for
// Adam and Adafactor, how far the
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
  // Between two checkpoints: the update check found this tensor changed
  // outside the optimizer (a flipped bit, a rewrite), so its jump is not an
  // update's and NUMERIC_UPDATE_SPIKE neither judges it nor counts it as history.
  bool outside_optimizer = false;
};

// The update made from step `step`'s gradients (it gives step + 1's parameters).
struct StepUpdateStats {
  int64_t step = 0;
  std::vector<TensorUpdateStats> tensors;  // the checkpoint's order
};

}  // namespace nanreplay
