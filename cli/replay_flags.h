// The flags `run`, `bisect` and `minimize` share, declared and parsed once:
// --threads, --device (and run's --cross-check), --emulate-low-precision,
// --max-memory, --stream, --scratch, --json, -q/--quiet, --progress,
// -h/--help and the repeatable --what-if, in the order
// both commands' --help lists them, with every check that needs no bundle.
#pragma once

#include <cxxopts.hpp>

#include "cli/launch.h"
#include "cli/progress_line.h"
#include "replay/workflows/incident.h"

namespace nanreplay {

struct ReplayFlags {
  // devices, cross_check, native_low_precision, threads, max_memory, what_ifs
  // and probes; the caller adds the bundle (and run's steps).
  IncidentSettings incident;
  bool json = false;
  bool quiet = false;
  ProgressMode progress = ProgressMode::kAuto;  // --progress (none under --quiet unless given)
  LaunchFlags launch;  // --nproc and the rest: across processes (cli/launch.h)
};

// `json_help`: what --json prints; `cross_check`: declare --cross-check (run);
// `what_if`: declare --what-if (run and bisect; minimize takes none, so its help lists none).
void add_replay_flags(cxxopts::Options& options, const char* json_help, bool cross_check, bool what_if = true);

// UsageError on a malformed --what-if or --max-memory, and on a what-if
// without probes (`probes` false: run --no-probes), which could not find the
// step it replays.
ReplayFlags parse_replay_flags(const cxxopts::ParseResult& args, bool probes);

}  // namespace nanreplay
