// What a spike's counterfactual replays mean (docs/spikes.md, "Data or
// model state"): whether the spike follows the spike step's batch (data),
// the spike step's weights (model state), either, or only the two together.
// Pure: numbers in, a conclusion and a sentence out. Consequences are
// context: the conclusion is reported beside the verdict, never a finding.
#pragma once

#include <optional>
#include <vector>

#include "reports/results/counterfactual.h"
#include "reports/results/finding.h"

namespace nanreplay {

// A measure decides only when the spike step's value is at least this many
// times the previous step's; a counterfactual "spikes" when its value lies at
// least halfway (in log) from the previous step's value to the spike step's.
constexpr double kCounterfactualMinJump = 1.5;

struct CounterfactualSpikes {
  bool spike_batch = false;    // the spike step's batch spikes on the previous weights
  bool spike_weights = false;  // the previous batch spikes on the spike step's weights
};
// None when the measure does not jump between the two steps (or is not finite there).
std::optional<CounterfactualSpikes> judge_counterfactual(const CounterfactualValues& values);

// Fills conclusion, decided_by and sentence (the loss first, then the site),
// and the update from the update check's findings into `c.step`.
void conclude_counterfactuals(Counterfactuals& c, const std::vector<Finding>& findings, bool update_checked);

}  // namespace nanreplay
