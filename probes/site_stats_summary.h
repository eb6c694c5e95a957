// A step's forward sites summarised as a run logs them in state.json's
// `logged.site_stats` (docs/spikes.md): per site name, the largest finite |x|
// and the root mean square of the finite elements over every micro-batch and
// rank, and the same per head or per expert. The synthetic trainer writes
// these; SYSTEM_SITE_MISMATCH compares the replay's with the logged ones.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "loaders/bundle/step_state.h"
#include "probes/probe_record.h"

namespace nanreplay {

std::map<std::string, LoggedSiteStats> summarize_forward_sites(const std::vector<ProbeRecord>& records);

}  // namespace nanreplay
