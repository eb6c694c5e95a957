// The subcommands of nanreplay, one table that drives dispatch, the listing
// in `nanreplay --help` and "did you mean" suggestions. Each handler parses
// its own options, calls the core library and renders at the edge.
#include "cli/commands.h"

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include <cxxopts.hpp>

#include "loaders/bundle.h"
#include "loaders/error.h"
#include "nanreplay_version.h"
#include "replay/replay_engine.h"
#include "replay/synthetic_bundle.h"
#include "reports/output_dir.h"
#include "reports/report.h"
#include "reports/terminal_text.h"
#include "reports/trace_writer.h"

namespace nanreplay {

namespace fs = std::filesystem;

namespace {

std::atomic<int> g_stop_signal{0};

void on_stop_signal(int signal) { g_stop_signal.store(signal); }

void install_stop_handlers() {
  struct sigaction action {};
  action.sa_handler = on_stop_signal;
  sigemptyset(&action.sa_mask);
  sigaction(SIGINT, &action, nullptr);
  sigaction(SIGTERM, &action, nullptr);
}

bool color_wanted(int fd) { return std::getenv("NO_COLOR") == nullptr && isatty(fd); }

struct Command {
  const char* name;
  const char* summary;
  const char* example;
  int (*handler)(int argc, char** argv);
};

int run_main(int argc, char** argv);
int demo_main(int argc, char** argv);
int synth_main(int argc, char** argv);
int version_main(int argc, char** argv);

const std::vector<Command>& command_table() {
  static const std::vector<Command> table = {
      {"run", "replay every step of a bundle with probes; write report.json and trace.h5",
       "nanreplay run incident-bundle/ --out triage/", run_main},
      {"demo", "write a built-in incident bundle (one attention head overflows) and replay it",
       "nanreplay demo ./nanreplay-demo", demo_main},
      {"synth", "write a synthetic bundle from a named preset (for tests and training)",
       "nanreplay synth head-overflow ./bundle", synth_main},
      {"version", "print the version", "nanreplay version", version_main},
  };
  return table;
}

std::string usage_text() {
  std::ostringstream out;
  out << "nanreplay " << NANREPLAY_VERSION
      << ": replay the steps around a training run's NaN and name where it began\n\n"
      << "usage: nanreplay <command> [options]   (nanreplay <command> --help for details)\n\ncommands:\n";
  for (const Command& c : command_table()) {
    out << "  " << c.name << std::string(10 - std::string(c.name).size(), ' ') << c.summary << "\n";
  }
  out << "\nexample:\n  " << command_table().front().example << "\n"
      << "\nexit status: 0 nothing non-finite and no error finding, 1 a non-finite origin or an\n"
      << "error finding was named, 2 bad usage or bad input, 3 internal error, 130 interrupted\n";
  return out.str();
}

size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diagonal = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t above = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diagonal = above;
    }
  }
  return row[b.size()];
}

cxxopts::ParseResult parse_or_usage(cxxopts::Options& options, int argc, char** argv) {
  try {
    return options.parse(argc, argv);
  } catch (const cxxopts::exceptions::exception& e) {
    throw UsageError(std::string(e.what()) + " (see nanreplay " + options.program().substr(10) + " --help)");
  }
}

std::optional<std::set<int64_t>> parse_step_list(const std::string& text) {
  if (text.empty()) return std::nullopt;
  std::set<int64_t> steps;
  std::stringstream items(text);
  std::string item;
  while (std::getline(items, item, ',')) {
    try {
      const size_t dash = item.find('-', 1);
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
      throw UsageError("--steps: '" + item + "' is not a step or a range like 100-105");
    }
  }
  return steps;
}

// Progress on stderr when it is a terminal: step, rank, micro-batch, elapsed, estimate.
class ProgressLine {
 public:
  explicit ProgressLine(bool enabled) : enabled_(enabled), start_(std::chrono::steady_clock::now()) {}
  void update(const ReplayProgress& p) {
    if (!enabled_) return;
    const double elapsed = seconds();
    const double done = static_cast<double>(p.step_index);
    const std::string eta =
        done > 0 ? std::to_string(static_cast<int>(elapsed / done * (p.step_count - done))) + "s" : "?";
    std::fprintf(stderr, "\r\033[K  replaying step %lld (%zu/%zu), rank %d, micro-batch %d  %.1fs elapsed, ~%s left",
                 static_cast<long long>(p.step), p.step_index + 1, p.step_count, p.rank, p.micro_batch,
                 elapsed, eta.c_str());
    std::fflush(stderr);
    shown_ = true;
  }
  void clear() {
    if (shown_) std::fprintf(stderr, "\r\033[K");
    shown_ = false;
  }
  double seconds() const {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  }

 private:
  bool enabled_;
  bool shown_ = false;
  std::chrono::steady_clock::time_point start_;
};

struct RunSettings {
  fs::path bundle;
  fs::path out;
  bool force = false;
  bool probes = true;
  bool quiet = false;
  bool json = false;
  int threads = 0;
  std::optional<std::set<int64_t>> steps;
};

// Replays, writes the outputs whole or not at all, prints the verdict.
ReplayReport replay_and_write(const RunSettings& settings) {
  set_compute_threads(settings.threads);
  const Bundle bundle(settings.bundle);
  OutputDir out(settings.out, bundle.root(), settings.force, {"report.json", "trace.h5"});

  install_stop_handlers();
  ProgressLine progress(!settings.quiet && isatty(STDERR_FILENO));
  ReplayOptions options;
  options.probes = settings.probes;
  options.only_steps = settings.steps;
  options.tool_version = NANREPLAY_VERSION;
  options.on_progress = [&](const ReplayProgress& p) { progress.update(p); };
  options.should_stop = [] { return g_stop_signal.load() != 0; };
  ReplayReport report;
  try {
    report = replay_bundle(bundle, options);
  } catch (const ReplayInterrupted& stop) {
    progress.clear();
    out.abandon();
    std::fprintf(stderr, "nanreplay: interrupted after %zu of %zu steps; nothing was written\n",
                 stop.steps_done, bundle.steps().size());
    std::exit(static_cast<int>(ExitStatus::kInterrupted));
  }
  progress.clear();

  std::vector<TraceStepRow> rows;
  for (const StepOutcome& s : report.steps) {
    rows.push_back({s.step, s.replayed ? s.loss : std::nan(""),
                    s.logged_loss ? *s.logged_loss : std::nan(""),
                    s.replayed ? s.grad_norm : std::nan(""), s.replayed && s.finite});
  }
  TraceHeader header{report.bundle, NANREPLAY_VERSION, compute_name(report.precision),
                     arch_name(report.arch), {}};
  write_trace(out.staging_path("trace.h5").string(), header, report.probes, rows);
  out.write_text("report.json", report_to_json(report).dump(2) + "\n");
  out.commit();
  return report;
}

int run_main(int argc, char** argv) {
  cxxopts::Options options("nanreplay run", "Replay every step of an incident bundle, forward and "
                                            "backward, with numeric probes on every tensor.\n"
                                            "Example: nanreplay run incident-bundle/ --out triage/");
  options.add_options()
      ("bundle", "incident bundle directory", cxxopts::value<std::string>())
      ("o,out", "output directory for report.json and trace.h5", cxxopts::value<std::string>()->default_value("nanreplay-out"))
      ("force", "replace results already in --out")
      ("steps", "only these steps, e.g. 104,105 or 100-105", cxxopts::value<std::string>()->default_value(""))
      ("no-probes", "loss and gradient norm only (faster, no trace detail)")
      ("threads", "compute threads (0: all cores)", cxxopts::value<int>()->default_value("0"))
      ("json", "print report.json to stdout instead of the verdict")
      ("q,quiet", "print nothing but errors")
      ("h,help", "show this help");
  options.parse_positional({"bundle"});
  options.positional_help("BUNDLE");
  const auto args = parse_or_usage(options, argc, argv);
  if (args.count("help")) {
    std::cout << options.help() << "\nexit status: 0 clean, 1 non-finite origin or error finding named, "
              << "2 bad input, 3 internal error, 130 interrupted\n";
    return 0;
  }
  if (!args.count("bundle")) throw UsageError("run: missing BUNDLE (see nanreplay run --help)");
  RunSettings settings;
  settings.bundle = args["bundle"].as<std::string>();
  settings.out = args["out"].as<std::string>();
  settings.force = args.count("force") > 0;
  settings.probes = args.count("no-probes") == 0;
  settings.quiet = args.count("quiet") > 0;
  settings.json = args.count("json") > 0;
  settings.threads = args["threads"].as<int>();
  settings.steps = parse_step_list(args["steps"].as<std::string>());
  const ReplayReport report = replay_and_write(settings);
  if (settings.json) {
    std::cout << report_to_json(report).dump(2) << "\n";
  } else if (!settings.quiet) {
    std::cout << render_verdict(report, {color_wanted(STDOUT_FILENO)});
    std::cout << "\nwrote " << (settings.out / "report.json").string() << " and "
              << (settings.out / "trace.h5").string() << "\n";
  }
  return exit_status_for(report);
}

int demo_main(int argc, char** argv) {
  cxxopts::Options options("nanreplay demo",
                           "Write a built-in incident bundle (a llama model in fp16 whose layer 2, "
                           "head 3 overflows at step 105) and replay it.\n"
                           "Example: nanreplay demo ./nanreplay-demo");
  options.add_options()
      ("dir", "where to put the bundle and the report", cxxopts::value<std::string>()->default_value("nanreplay-demo"))
      ("q,quiet", "print nothing but errors")
      ("h,help", "show this help");
  options.parse_positional({"dir"});
  options.positional_help("[DIR]");
  const auto args = parse_or_usage(options, argc, argv);
  if (args.count("help")) {
    std::cout << options.help();
    return 0;
  }
  const fs::path dir = args["dir"].as<std::string>();
  const bool quiet = args.count("quiet") > 0;
  const SyntheticSpec spec = synthetic_preset("demo");
  const fs::path bundle = dir / "bundle";
  std::error_code ec;
  if (!fs::exists(bundle / "manifest.json", ec)) {
    if (!quiet) std::cout << "writing the demo incident bundle to " << bundle.string() << " ...\n";
    write_synthetic_bundle(bundle, spec);
  }
  RunSettings settings;
  settings.bundle = bundle;
  settings.out = dir / "report";
  settings.force = true;
  settings.quiet = quiet;
  const ReplayReport report = replay_and_write(settings);
  const bool named = report.first_nonfinite && report.first_nonfinite->step == spec.fault.step &&
                     report.first_nonfinite->site == "layers." + std::to_string(spec.fault.layer) +
                                                         ".attn.scores" &&
                     report.first_nonfinite->head == spec.fault.head;
  if (!quiet) {
    std::cout << render_verdict(report, {color_wanted(STDOUT_FILENO)}) << "\n"
              << "The demo planted an fp16 overflow in layers." << spec.fault.layer << ".attn.scores, head "
              << spec.fault.head << ", at step " << spec.fault.step << ": "
              << (named ? "nanreplay named it." : "nanreplay did NOT name it (a bug).") << "\n"
              << "report: " << (settings.out / "report.json").string()
              << "   trace: " << (settings.out / "trace.h5").string() << "\n";
  }
  return named ? 0 : static_cast<int>(ExitStatus::kInternal);
}

int synth_main(int argc, char** argv) {
  std::string presets;
  for (const std::string& name : synthetic_preset_names()) presets += (presets.empty() ? "" : ", ") + name;
  cxxopts::Options options("nanreplay synth", "Write a synthetic bundle from a preset: " + presets +
                                                   ".\nPrints what was injected as JSON.\n"
                                                   "Example: nanreplay synth bit-flip ./bundle");
  options.add_options()
      ("preset", "preset name", cxxopts::value<std::string>())
      ("dir", "bundle directory to create", cxxopts::value<std::string>())
      ("arch", "llama or gpt2", cxxopts::value<std::string>()->default_value("llama"))
      ("h,help", "show this help");
  options.parse_positional({"preset", "dir"});
  options.positional_help("PRESET DIR");
  const auto args = parse_or_usage(options, argc, argv);
  if (args.count("help")) {
    std::cout << options.help();
    return 0;
  }
  if (!args.count("preset") || !args.count("dir")) throw UsageError("synth: need PRESET and DIR");
  SyntheticSpec spec;
  try {
    spec = synthetic_preset(args["preset"].as<std::string>());
  } catch (const std::invalid_argument& e) {
    throw UsageError(std::string(e.what()) + "; presets: " + presets);
  }
  const fs::path dir = args["dir"].as<std::string>();
  std::error_code ec;
  if (fs::exists(dir, ec) && !fs::is_empty(dir, ec)) {
    throw UsageError(dir.string() + " exists and is not empty");
  }
  const SyntheticOutcome outcome = write_synthetic_bundle(dir, spec);
  nlohmann::json info = {{"bundle", dir.string()},
                         {"fault_step", outcome.fault_step},
                         {"fault_param", outcome.fault_param},
                         {"fault_element", outcome.fault_element},
                         {"zero_token", outcome.zero_token},
                         {"zero_position", outcome.zero_position},
                         {"first_sample", outcome.first_sample},
                         {"fault_layer", spec.fault.layer},
                         {"fault_head", spec.fault.head}};
  std::cout << info.dump() << "\n";
  return 0;
}

int version_main(int, char**) {
  std::cout << "nanreplay " << NANREPLAY_VERSION << "\n";
  return 0;
}

int dispatch(int argc, char** argv) {
  if (argc < 2 || std::string(argv[1]) == "--help" || std::string(argv[1]) == "-h" ||
      std::string(argv[1]) == "help") {
    std::cout << usage_text();
    return argc < 2 ? static_cast<int>(ExitStatus::kBadInput) : 0;
  }
  const std::string name = argv[1];
  if (name == "--version") return version_main(argc - 1, argv + 1);
  for (const Command& command : command_table()) {
    if (name == command.name) return command.handler(argc - 1, argv + 1);
  }
  std::string suggestion;
  size_t best = 3;
  for (const Command& command : command_table()) {
    const size_t d = edit_distance(name, command.name);
    if (d < best) {
      best = d;
      suggestion = command.name;
    }
  }
  throw UsageError("unknown command '" + name + "'" +
                   (suggestion.empty() ? "" : "; did you mean '" + suggestion + "'?") +
                   " (see nanreplay --help)");
}

}  // namespace

int run_cli(int argc, char** argv) {
  try {
    return dispatch(argc, argv);
  } catch (const InputError& e) {
    std::cerr << "nanreplay: error: " << e.what() << "\n";
    return static_cast<int>(ExitStatus::kBadInput);
  } catch (const UsageError& e) {
    std::cerr << "nanreplay: error: " << e.what() << "\n";
    return static_cast<int>(ExitStatus::kBadInput);
  } catch (const std::exception& e) {
    std::cerr << "nanreplay: internal error: " << e.what() << "\n";
    return static_cast<int>(ExitStatus::kInternal);
  }
}

}  // namespace nanreplay
