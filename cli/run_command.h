// What `nanreplay run` and `nanreplay demo` share: replay an incident and
// write its four results whole or not at all, with the stop-signal semantics
// of docs/threat-model.md (immediate until output is staged, polled after).
#pragma once

#include <filesystem>

#include "cli/cli.h"
#include "cli/progress_line.h"
#include "replay/workflows/incident.h"

namespace nanreplay {

struct RunSettings {
  IncidentSettings incident;
  std::filesystem::path out;
  bool replace_existing = true;  // --no-clobber: refuse an --out that holds results
  bool quiet = false;            // no notes on stderr
  ProgressMode progress = ProgressMode::kNone;  // --progress, resolved (cli/progress_line.h)
  bool timings = false;          // --timings: where the time went, on stderr
};

// Checks (Incident), stages `out`, replays, writes and commits; throws
// Interrupted on a stop request, with nothing written unless committed.
ReplayReport replay_and_write(const RunSettings& settings, CommandIo& io);

}  // namespace nanreplay
