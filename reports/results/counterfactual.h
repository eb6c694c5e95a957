// A spike's counterfactual replays (docs/spikes.md, "Data or model state"):
// the spike step's batch on the previous step's weights and the previous
// step's batch on the spike step's weights, beside the two real steps, and
// what the update check said of the update between them. Plain data; the
// replay fills the numbers (replay/workflows/counterfactual.h), a rule
// concludes (reports/triage/spike_counterfactual.h), the renderers show it.
#pragma once

#include <cmath>
#include <cstdint>
#include <optional>
#include <string>

namespace nanreplay {

// One quantity in the four combinations of batch and weights.
struct CounterfactualValues {
  double previous = NAN;                 // the previous step as replayed: its batch on its weights
  double spike = NAN;                    // the spike step as replayed
  double spike_batch_previous_weights = NAN;
  double previous_batch_spike_weights = NAN;
};

struct Counterfactuals {
  int64_t step = 0, previous_step = 0;
  std::optional<double> logged_loss, logged_previous_loss;
  CounterfactualValues loss;
  // The spike's site (its origin, else its first departure) and its
  // statistic over every pass, when the spike names one.
  std::string site;
  int head = -1, expert = -1;
  std::string statistic;  // "max_abs" or "rms"
  std::optional<CounterfactualValues> site_values;
  // The conclusion: "data", "model_state", "both", "interaction" (only this
  // batch on these weights), or "undecided" (no measure jumps between the steps).
  std::string conclusion = "undecided";
  std::string decided_by;  // "loss" or "site"; empty when undecided
  std::string sentence;
  // The update into `step` as the update check re-derived it: "corrupted"
  // (a bit flip or mismatch found), "computed" (it matches), "not_checked".
  std::string update = "not_checked";
  std::string update_code;  // the finding's code when corrupted
};

}  // namespace nanreplay
