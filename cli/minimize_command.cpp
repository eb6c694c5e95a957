// `nanreplay minimize BUNDLE --out MIN`: the smallest bundle that still fails
// the same way (docs/minimize.md). Bisects BUNDLE, writes candidates into a
// staging directory beside MIN, replays each, and renames the first that
// names the same origin into place: MIN appears whole or not at all, and
// BUNDLE is only read.
#include <stdlib.h>

#include <cerrno>
#include <chrono>
#include <cstring>

#include "cli/cli_support.h"
#include "cli/command_table.h"
#include "cli/progress_line.h"
#include "cli/replay_flags.h"
#include "cli/staging_dir.h"
#include "loaders/base/error.h"
#include "nanreplay_version.h"
#include "replay/workflows/incident.h"
#include "replay/workflows/minimize.h"
#include "reports/outputs/minimize_output.h"

namespace nanreplay {

namespace {

namespace fs = std::filesystem;

const char* const kMinimizeDescription =
    "Write the smallest bundle that still fails the same way: the failing step (and the step before when the\n"
    "non-finite values came in with its checkpoint), the samples delta debugging keeps (one micro-batch of one\n"
    "rank, only the token windows they read, original indices recorded), and for a forward origin at layer L\n"
    "the model cut to layers 0..L. Each candidate is replayed; the first that names the same origin is\n"
    "written, a cut that changes it is reported and a larger bundle tried. Nothing is written otherwise.\n"
    "Without an origin, a flipped bit the update check names: the two steps around it, as few samples as\n"
    "still show the same flip.\n"
    "Example: nanreplay minimize incident-bundle/ --out incident-min/";

cxxopts::Options minimize_options() {
  cxxopts::Options options("nanreplay minimize", kMinimizeDescription);
  options.add_options()
      ("bundle", "incident bundle directory (only read)", cxxopts::value<std::string>())
      ("out", "the minimized bundle's directory (must not exist, or be empty)", cxxopts::value<std::string>());
  add_replay_flags(options, "print one JSON object (minimize_version 1) instead of the text", false,
                   /*what_if=*/false);
  options.parse_positional({"bundle"});
  options.positional_help("BUNDLE --out MIN");
  return options;
}

fs::path checked_out(const fs::path& out, const fs::path& bundle) {
  std::error_code ec;
  if (fs::exists(out, ec) && !(fs::is_directory(out, ec) && fs::is_empty(out, ec))) {
    throw OutputError(out.string(), "already exists; minimize writes a new bundle (choose another --out)");
  }
  const fs::path inside = enclosing_bundle(out);
  if (!inside.empty() && fs::equivalent(inside, bundle, ec)) {
    throw UsageError("minimize: --out " + out.string() + " lies inside the bundle " + bundle.string() +
                     "; the bundle is only read");
  }
  return out;
}

}  // namespace

int minimize_command(const CommandArgs& args, CommandIo& io) {
  cxxopts::Options options = minimize_options();
  const auto parsed = parse_or_usage(options, args);
  if (parsed.count("help")) {
    io.out << options.help() << exit_status_help("minimize");
    return 0;
  }
  if (!parsed.count("bundle")) throw UsageError("minimize: missing BUNDLE (see nanreplay minimize --help)");
  if (!parsed.count("out")) throw UsageError("minimize: missing --out MIN (see nanreplay minimize --help)");
  ReplayFlags flags = parse_replay_flags(parsed, true);
  flags.incident.bundle = parsed["bundle"].as<std::string>();
  const fs::path out = checked_out(parsed["out"].as<std::string>(), flags.incident.bundle);
  const Incident incident(flags.incident, IncidentUse::kBisect);

  ProgressLine progress(io.err, flags.progress, io.err_is_terminal, "minimize");
  IncidentHooks hooks;
  hooks.stop_requested = stop_requested;
  hooks.on_bisect_progress = [&](const BisectProgress& p) { progress.update(p); };
  const StopDeferral staged_output;  // a stop ends the passes with Interrupted; staging is removed
  const auto started = std::chrono::steady_clock::now();  // elapsed_seconds counts the bisection too
  const BisectReport bisected = incident.bisect(hooks, true);

  MinimizeOptions minimize;
  minimize.tool_version = NANREPLAY_VERSION;
  minimize.devices = flags.incident.devices;
  minimize.native_low_precision = flags.incident.native_low_precision;
  minimize.should_stop = stop_requested;
  minimize.on_progress = [&](const std::string& stage) { progress.update(BisectProgress{stage, 0, 0}); };
  std::optional<StagingDir> staging;  // made only when there is something to minimize
  minimize.workspace = [&] { return staging.emplace(out, "minimize").dir(); };
  MinimizeOutcome outcome = minimize_bundle(incident.bundle(), bisected, minimize);
  MinimizeReport& report = outcome.report;
  report.bundle = flags.incident.bundle.string();
  if (!outcome.accepted.empty()) {
    if (stop_requested()) throw Interrupted("interrupted while minimizing; nothing was written");
    std::error_code ec;
    if (fs::exists(out, ec)) fs::remove(out, ec);  // the empty directory the user made
    fs::rename(outcome.accepted, out, ec);
    if (ec) throw OutputError(out.string(), "cannot move the bundle into place: " + ec.message());
    report.out = out.string();
    // bisect names an origin; a flipped bit is the update check's, which only run makes.
    report.reproduce_command = report.flip ? "nanreplay run " + out.string() + " --out triage/"
                                           : "nanreplay bisect " + out.string() + "   (or: nanreplay run " +
                                                 out.string() + " --out triage/)";
  }
  report.elapsed_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  progress.clear();
  if (flags.json) {
    io.out << minimize_to_json(report).dump(2) << "\n";
  } else if (!flags.quiet) {
    io.out << render_minimize(report, {io.color});
  }
  // 0: the command did what was asked (MIN is there); 1: the other answer, nothing written.
  return static_cast<int>(report.written() ? ExitStatus::kClean : ExitStatus::kFound);
}

}  // namespace nanreplay
