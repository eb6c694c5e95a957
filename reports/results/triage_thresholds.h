// The thresholds every layer of triage judges by (data, numeric, system),
// named once, here: plain data, below the rules that read them.
#pragma once

#include "loaders/bundle/manifest.h"
#include "probes/data_checks.h"

namespace nanreplay {

struct TriageThresholds {
  double loss_rel_tol = 1e-4;        // replayed vs logged loss / grad norm
  // A derived (rolled-forward) step's loss vs the logged one: rounding
  // differences between two AdamW implementations compound step by step.
  double trajectory_rel_tol = 1e-3;
  double loss_outlier_z = 6.0;       // per-sample loss, robust z above the median
  double loss_outlier_nats = 1.0;    // ... and at least this far above it
  double fp8_scale_jump = 3.0;       // ratio between adjacent steps
  double headroom_warn_bits = 1.0;   // a finite site this close to its dtype max
  // A token's embedding row is an outlier at this many times the median row
  // norm and this robust z above it (docs/triage.md).
  double embedding_outlier_ratio = 10.0;
  double embedding_outlier_z = 10.0;
  // NUMERIC_UPDATE_SPIKE (docs/triage.md): a tensor's update RMS this many
  // times the median of its previous (at least update_history) steps, or, for
  // Adam, its mean g^2 this many times the mean bias-corrected v it starts from.
  double update_jump_ratio = 4.0;
  int update_history = 2;
  double update_g2_over_v = 25.0;
  // NUMERIC_EXPERT_OUTLIER_ACTIVATION (docs/triage.md): an expert's output
  // max |x| this many times the median of its layer's other experts' and
  // above this floor; or, where its layer's others moved with it, this many
  // times the median of its own output maxima in the window's earlier steps
  // (at least expert_history of them, each with tokens routed to it).
  double expert_outlier_ratio = 16.0;
  double expert_outlier_floor = 64.0;
  int expert_history = 2;
  DataCheckOptions data;
};

// Defaults for the bundle's precision: reduced precision compares looser.
inline TriageThresholds default_thresholds(Compute compute) {
  TriageThresholds t;
  if (compute != Compute::kFp32) {
    t.loss_rel_tol = 1e-2;
    t.trajectory_rel_tol = 5e-2;
  }
  return t;
}

}  // namespace nanreplay
