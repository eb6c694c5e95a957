// `nanreplay bisect BUNDLE`: the origin `run` would name, found coarse to fine
// with fewer replays, plus optional what-if replays. Writes nothing; prints
// the stages (or one stable JSON object with --json). Exit status as `run` on the same bundle.
#include "cli/cli_support.h"
#include "cli/launch.h"
#include "cli/command_table.h"
#include "cli/progress_line.h"
#include "cli/replay_flags.h"
#include "loaders/base/error.h"
#include "reports/outputs/bisect_output.h"
#include "reports/results/bisect_report.h"

namespace nanreplay {

namespace {

const char* const kBisectDescription =
    "Name the first non-finite value, as `nanreplay run` does, with fewer replays, coarse to fine:\n"
    "  step     the cheap any-non-finite pass (one flag per site) on the last step; when it is clean, on\n"
    "           the steps the log marks (a non-finite loss, or skipped by the fp16 loss scaler); then a\n"
    "           binary search below the first bad one\n"
    "  layer    the first flagged block of that pass (no replay of its own)\n"
    "  site     full probes on that block of the one pass holding it: site, head, element\n"
    "  samples  delta debugging (ddmin) over that pass's samples: the smallest set that still fails\n"
    "A replay is one pass: forward and backward of one rank's micro-batch (or of a subset of samples).\n"
    "The binary search assumes a step after the first bad one stays bad (true once parameters go\n"
    "non-finite): a transient failure the log does not mark can be missed (`nanreplay run` replays all).\n"
    "Example: nanreplay bisect incident-bundle/ --json --what-if stable-softmax --what-if drop-samples=212";

cxxopts::Options bisect_options() {
  cxxopts::Options options("nanreplay bisect", kBisectDescription);
  options.add_options()
      ("bundle", "incident bundle directory", cxxopts::value<std::string>())
      ("no-samples", "skip the samples stage (delta debugging)");
  add_replay_flags(options, "print one JSON object (bisect_version 1) instead of the text", false);
  options.parse_positional({"bundle"});
  options.positional_help("BUNDLE");
  return options;
}

void print_bisect_help(const cxxopts::Options& options, CommandIo& io) {
  io.out << options.help() << "\n" << what_if_help()
         << "  e.g. nanreplay bisect incident-bundle/ --what-if fp32-layers=all --what-if norm-eps=1e-5\n"
         << exit_status_help("bisect");
}

BisectReport bisect_showing_progress(const Incident& incident, bool minimize_samples, ProgressMode mode,
                                     CommandIo& io) {
  ProgressLine progress(io.err, mode, io.err_is_terminal, "bisect");  // cleared on the way out
  IncidentHooks hooks;
  hooks.stop_requested = stop_requested;
  hooks.on_bisect_progress = [&](const BisectProgress& p) { progress.update(p); };
  const StopDeferral polled;  // a stop ends the passes with Interrupted: nothing printed
  return incident.bisect(hooks, minimize_samples);
}

}  // namespace

int bisect_command(const CommandArgs& args, CommandIo& io) {
  cxxopts::Options options = bisect_options();
  const auto parsed = parse_or_usage(options, args);
  if (parsed.count("help")) {
    print_bisect_help(options, io);
    return 0;
  }
  if (!parsed.count("bundle")) throw UsageError("bisect: missing BUNDLE (see nanreplay bisect --help)");
  ReplayFlags flags = parse_replay_flags(parsed, true);
  flags.incident.bundle = parsed["bundle"].as<std::string>();
  flags.incident.max_memory = process_memory_limit(flags.incident.max_memory);
  const double memory = static_cast<double>(flags.incident.max_memory->bytes);
  return run_launched(flags.launch, args, memory, [&](bool rank_zero) {
    const bool quiet = flags.quiet || !rank_zero;  // across processes rank 0 alone prints
    const Incident incident(flags.incident, IncidentUse::kBisect);
    if (!incident.mode_note().empty() && !quiet) io.err << "nanreplay: " << incident.mode_note() << "\n";
    const ProgressMode progress = rank_zero ? flags.progress : ProgressMode::kNone;
    const BisectReport report = bisect_showing_progress(incident, parsed.count("no-samples") == 0, progress, io);
    if (flags.json && rank_zero) {
      io.out << bisect_to_json(report).dump(2) << "\n";
    } else if (!quiet) {
      io.out << render_bisect(report, {io.color});
    }
    return bisect_exit_status(report);  // as `run` on the same bundle (reports/results/bisect_report.h)
  });
}

}  // namespace nanreplay
