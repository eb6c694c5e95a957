// `nanreplay run BUNDLE`: replay every step with probes, write report.json,
// report.md, report.html and trace.h5 into --out as one set, print the verdict.
#include "cli/run_command.h"

#include <cmath>
#include <csignal>
#include <optional>
#include <cstdlib>
#include <set>
#include <sstream>
#include <string>

#include "cli/cli_support.h"
#include "cli/command_table.h"
#include "cli/launch.h"
#include "cli/progress_line.h"
#include "cli/replay_flags.h"
#include "loaders/base/error.h"
#include "replay/step/layer_stream.h"
#include "reports/outputs/report_json.h"
#include "reports/outputs/run_outputs.h"
#include "reports/outputs/terminal_text.h"
#include "reports/results/number_text.h"

namespace nanreplay {

namespace fs = std::filesystem;

namespace {

std::optional<std::set<int64_t>> parse_step_list(const std::string& text) {
  if (text.empty()) return std::nullopt;
  std::set<int64_t> steps;
  std::stringstream items(text);
  std::string item;
  while (std::getline(items, item, ',')) {
    try {
      const size_t dash = item.find_first_of("-:", 1);  // 100-105 or 100:105, as import takes it
      size_t used = 0;
      if (dash == std::string::npos) {
        steps.insert(std::stoll(item, &used));
        if (used != item.size()) throw std::invalid_argument(item);
      } else {
        const int64_t from = std::stoll(item.substr(0, dash));
        const int64_t to = std::stoll(item.substr(dash + 1));
        if (to < from || to - from > 1000000) throw std::invalid_argument(item);
        for (int64_t s = from; s <= to; ++s) steps.insert(s);
      }
    } catch (const std::exception&) {
      throw UsageError("--steps: '" + item + "' is not a step or a range like 100-105 or 100:105");
    }
  }
  return steps;
}

// Test hook (tests/test_cli_faults.cpp): NANREPLAY_TEST_PAUSE_AT_STEP=N stops
// this process with SIGSTOP when the replay first reports step N, so a test
// can change a bundle file while it is mapped, at a known point, and SIGCONT
// it. It writes nothing and has no effect unless set.
// Across processes NANREPLAY_TEST_PAUSE_RANK=R pauses only rank R (RANK).
void pause_for_test_at(const ReplayProgress& p) {
  static const char* const wanted = std::getenv("NANREPLAY_TEST_PAUSE_AT_STEP");
  static const char* const wanted_rank = std::getenv("NANREPLAY_TEST_PAUSE_RANK");
  static const char* const rank = std::getenv("RANK");
  static bool paused = false;
  if (wanted == nullptr || paused || std::to_string(p.step) != wanted) return;
  if (wanted_rank != nullptr && (rank == nullptr || std::string(rank) != wanted_rank)) return;
  paused = true;
  std::raise(SIGSTOP);
}

ReplayReport replay_showing_progress(const Incident& incident, ProgressMode mode, CommandIo& io,
                                     RunOutputs& outputs) {
  ProgressLine progress(io.err, mode, io.err_is_terminal, "run");  // cleared on the way out
  IncidentHooks hooks;
  hooks.stop_requested = stop_requested;
  hooks.on_step_probes = outputs.probe_sink();
  hooks.on_replay_progress = [&](const ReplayProgress& p) {
    pause_for_test_at(p);
    progress.update(p);
  };
  return incident.replay(hooks);
}

// From the commit on the results are whole: a stop still ends in exit 130, saying so.
void announce_committed(const fs::path& out) {
  const std::string committed = "interrupted; the results in " + out.string() + " are complete";
  set_interrupted_message(committed);
  if (stop_requested()) throw Interrupted(committed);
}

cxxopts::Options run_options() {
  cxxopts::Options options("nanreplay run", "Replay every step of an incident bundle, forward and "
                                            "backward, with numeric probes on every tensor.\n"
                                            "Example: nanreplay run incident-bundle/ --out triage/");
  options.add_options()
      ("bundle", "incident bundle directory", cxxopts::value<std::string>())
      ("o,out", "output directory for report.json, report.md, report.html and trace.h5", cxxopts::value<std::string>()->default_value("nanreplay-out"))
      ("no-clobber", "refuse an --out that already holds results (by default a run replaces them, "
                     "each file whole, and a run that fails leaves them as they were)")
      ("force", "replace results already in --out (the default; kept for older scripts)")
      ("steps", "only these steps, e.g. 104,105 or 100-105 (or 100:105)", cxxopts::value<std::string>()->default_value(""))
      ("no-probes", "loss and gradient norm only (faster, no trace detail)")
      ("timings", "print where the time went (load, data checks, each step, self-checks, each output) "
                  "to stderr; report.json has it always")
      ("incident-kind", "spike or nonfinite: what the incident is, over the manifest's incident.kind "
                        "(unset: a logged spike with nothing non-finite logged is a spike)", cxxopts::value<std::string>())
      ("spike-loss-ratio", "a loss spikes at this many times its trend (default 1.5)", cxxopts::value<double>())
      ("spike-grad-ratio", "a gradient norm spikes at this many times its trend (default 4)", cxxopts::value<double>())
      ("spike-z", "... and this robust z-score above it (default 6)", cxxopts::value<double>())
      ("spike-site-z", "a site leaves its trajectory at this robust z-score (default 6)", cxxopts::value<double>());
  add_replay_flags(options, "print report.json to stdout instead of the verdict", true);
  options.parse_positional({"bundle"});
  options.positional_help("BUNDLE");
  return options;
}

// A spike threshold from the command line: finite and above `floor`.
std::optional<double> spike_flag(const cxxopts::ParseResult& parsed, const std::string& name, double floor) {
  if (!parsed.count(name)) return std::nullopt;
  const double value = parsed[name].as<double>();
  if (!(std::isfinite(value) && value > floor)) {
    throw UsageError("run: --" + name + " must be a finite number above " + format_number(floor) + ", got " +
                     format_number(value));
  }
  return value;
}

SpikeOverrides parse_spike_flags(const cxxopts::ParseResult& parsed) {
  SpikeOverrides spike;
  if (parsed.count("incident-kind")) {
    const std::string kind = parsed["incident-kind"].as<std::string>();
    if (kind != "spike" && kind != "nonfinite") {
      throw UsageError("run: --incident-kind must be spike or nonfinite, got '" + kind + "'");
    }
    spike.spike = kind == "spike";
  }
  spike.loss_ratio = spike_flag(parsed, "spike-loss-ratio", 1.0);
  spike.grad_norm_ratio = spike_flag(parsed, "spike-grad-ratio", 1.0);
  spike.zscore = spike_flag(parsed, "spike-z", 0.0);
  spike.site_zscore = spike_flag(parsed, "spike-site-z", 0.0);
  return spike;
}

void print_run_help(const cxxopts::Options& options, CommandIo& io) {
  io.out << options.help() << "\n" << what_if_help()
         << "  e.g. nanreplay run incident-bundle/ --what-if stable-softmax --what-if fp32-layers=2,3\n"
         << "  report.json then holds a `what_if` list: resolved or not, and the first non-finite value after\n"
         << exit_status_help("run");
}

}  // namespace

// Until the output directory exists a stop signal ends the process at once;
// from then on it is polled, and Interrupted unwinds through `outputs`, whose
// destructor removes what was staged before the deferral ends.
ReplayReport replay_and_write(const RunSettings& settings, CommandIo& io) {
  PhaseTimings loading;
  loading.started = PhaseTimings::Clock::now();
  std::optional<Incident> incident;
  {
    const PhaseTimer timer(loading, TimedPhase::kLoad);
    incident.emplace(settings.incident, IncidentUse::kReplay);
  }
  if (!incident->mode_note().empty() && !settings.quiet) io.err << "nanreplay: " << incident->mode_note() << "\n";
  const StopDeferral staged_output;  // destroyed after `outputs`: its cleanup runs first
  RunOutputs outputs(settings.out, incident->bundle().root(), settings.replace_existing);
  ReplayReport report = replay_showing_progress(*incident, settings.progress, io, outputs);
  report.timings.started = loading.started;
  report.timings.add(TimedPhase::kLoad, loading.of(TimedPhase::kLoad));
  outputs.write_and_commit(report, incident->steps_to_replay(), stop_requested);
  announce_committed(settings.out);
  if (settings.timings) {
    io.err << render_timings(report.timings);
    // A streamed mixture of experts loads only the experts a token was routed to (layer_stream.h).
    const ExpertLoads experts = streamed_expert_loads();
    if (experts.of > 0) {
      io.err << "streamed experts: " << experts.loaded << " expert tensors loaded, of " << experts.of
             << " had every block loaded all its experts\n";
    }
  }
  return report;
}

// A process of a replay split across processes other than rank 0: the same
// replay, nothing written or printed (rank 0 does both), the same exit status.
static int replay_without_outputs(const RunSettings& settings) {
  const Incident incident(settings.incident, IncidentUse::kReplay);
  IncidentHooks hooks;
  hooks.stop_requested = stop_requested;
  hooks.on_replay_progress = pause_for_test_at;
  return exit_status_for(incident.replay(hooks));
}

int run_command(const CommandArgs& args, CommandIo& io) {
  cxxopts::Options options = run_options();
  const auto parsed = parse_or_usage(options, args);
  if (parsed.count("help")) {
    print_run_help(options, io);
    return 0;
  }
  if (!parsed.count("bundle")) throw UsageError("run: missing BUNDLE (see nanreplay run --help)");
  if (parsed.count("no-clobber") && parsed.count("force")) {
    throw UsageError("run: --no-clobber and --force contradict each other");
  }
  RunSettings settings;
  settings.out = parsed["out"].as<std::string>();
  settings.replace_existing = parsed.count("no-clobber") == 0;
  const std::optional<std::set<int64_t>> steps = parse_step_list(parsed["steps"].as<std::string>());
  const ReplayFlags flags = parse_replay_flags(parsed, parsed.count("no-probes") == 0);
  settings.incident = flags.incident;
  settings.incident.bundle = parsed["bundle"].as<std::string>();
  settings.incident.only_steps = steps;
  settings.incident.max_memory = process_memory_limit(settings.incident.max_memory);
  settings.quiet = flags.quiet;
  settings.progress = flags.progress;
  settings.timings = parsed.count("timings") > 0;
  settings.incident.spike = parse_spike_flags(parsed);
  const double memory = static_cast<double>(settings.incident.max_memory->bytes);
  return run_launched(flags.launch, args, memory, [&](bool rank_zero) {
    if (!rank_zero) return replay_without_outputs(settings);
    // A streamed replay's scratch files go beside the results, on the disk the user chose for them.
    // (lexically_normal: "triage/" names triage, whose parent is wanted, not triage itself.)
    if (!settings.incident.scratch) {
      const fs::path out = fs::absolute(settings.out).lexically_normal();
      settings.incident.scratch = (out.has_filename() ? out : out.parent_path()).parent_path();
    }
    const ReplayReport report = replay_and_write(settings, io);
    if (flags.json) {
      io.out << report_to_json(report).dump(2) << "\n";
    } else if (!flags.quiet) {
      io.out << render_verdict(report, {io.color, settings.out.string()});
      io.out << "\nwrote " << (settings.out / "report.json").string() << ", report.md, report.html and "
             << (settings.out / "trace.h5").string() << "\n";
    }
    return exit_status_for(report);
  });
}

}  // namespace nanreplay
