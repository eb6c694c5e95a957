// Puts the values a bundle's writer defaulted (manifest "provenance" entries
// "from": "default") beside every verdict that the replay does not reproduce
// the run: BUNDLE_DOES_NOT_REPRODUCE, SYSTEM_NOT_REPRODUCIBLE and the root cause
// resting on them. A defaulted norm_eps or rope_theta is the likelier cause.
#pragma once

#include <string>

#include "reports/results/report.h"

namespace nanreplay {

// Call after settle_verdict. No-op when nothing was defaulted.
void note_defaulted_values(ReplayReport& report);

// Appends `sentence` to BUNDLE_DOES_NOT_REPRODUCE, SYSTEM_NOT_REPRODUCIBLE and
// the root cause resting on either: what a reader should check first.
void note_on_reproduction_gaps(ReplayReport& report, const std::string& sentence);

}  // namespace nanreplay
