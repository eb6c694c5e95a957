// The subcommands of nanreplay, one table that drives dispatch, the listing
// in `nanreplay --help` and "did you mean" suggestions. Each handler parses
// its own options, calls the core library and renders at the edge.
#include "cli/commands.h"

#include <unistd.h>

#include <algorithm>
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

#include "cli/cli_support.h"
#include "cli/openmp_wait.h"
#include "loaders/bundle.h"
#include "loaders/error.h"
#include "loaders/mapped_file.h"
#include "probes/data_checks.h"
#include "nanreplay_version.h"
#include "replay/bundle_structure.h"
#include "replay/memory_estimate.h"
#include "replay/replay_engine.h"
#include "synth/synthetic_bundle.h"
#include "reports/html_report.h"
#include "reports/markdown_report.h"
#include "reports/bundle_summary.h"
#include "reports/trace_query.h"
#include "reports/output_dir.h"
#include "reports/report.h"
#include "reports/terminal_text.h"
#include "reports/trace_writer.h"

namespace nanreplay {

namespace fs = std::filesystem;

namespace {

struct Command {
  const char* name;
  const char* summary;
  const char* example;
  int (*handler)(int argc, char** argv);
  bool replays = false;  // runs forward/backward passes: wants the short OpenMP spin
};

int run_main(int argc, char** argv);
int demo_main(int argc, char** argv);
int synth_main(int argc, char** argv);
int scan_data_main(int argc, char** argv);
int version_main(int argc, char** argv);
int inspect_main(int argc, char** argv);
int trace_main(int argc, char** argv);

const std::vector<Command>& command_table() {
  static const std::vector<Command> table = {
      {"run", "replay every step of a bundle with probes; write report.{json,md,html} and trace.h5",
       "nanreplay run incident-bundle/ --out triage/", run_main, true},
      {"bisect", "find the first non-finite value with fewer replays (step, layer, site, samples); what-ifs",
       "nanreplay bisect incident-bundle/ --json --what-if stable-softmax", bisect_main, true},
      {"demo", "write a built-in incident bundle (one attention head overflows) and replay it",
       "nanreplay demo ./nanreplay-demo", demo_main, true},
      {"scan-data", "scan every token shard for poisoned samples without replaying (prints GB/s)",
       "nanreplay scan-data incident-bundle/ --json", scan_data_main},
      {"synth", "write a synthetic bundle from a named preset (for tests and training)",
       "nanreplay synth head-overflow ./bundle", synth_main, true},
      {"inspect", "validate and summarize a bundle without replaying (model, steps, shards, sampler)",
       "nanreplay inspect incident-bundle/ --json", inspect_main},
      {"trace", "query a trace.h5 in the terminal: filter by step, phase, site, head; sort; first NaN/Inf",
       "nanreplay trace triage/trace.h5 --first-nonfinite", trace_main},
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
    std::fprintf(stderr, "\r\033[K  replaying step %lld (%zu/%zu), rank %d, micro-batch %d, %s  %.1fs elapsed, ~%s left",
                 static_cast<long long>(p.step), p.step_index + 1, p.step_count, p.rank, p.micro_batch,
                 p.phase.c_str(), elapsed, eta.c_str());
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
  bool replace_existing = true;  // --no-clobber: refuse an --out that holds results
  bool probes = true;
  bool quiet = false;
  bool json = false;
  int threads = 0;
  std::optional<std::set<int64_t>> steps;
  std::optional<MemoryLimit> max_memory;  // unset: default_memory_limit()
  std::vector<std::string> devices{"cpu"};
  bool cross_check = false;
  bool emulate_low_precision = false;
  std::vector<WhatIf> what_ifs;           // replayed at the first non-finite step
};


// Test hook (tests/test_cli_faults.cpp): NANREPLAY_TEST_PAUSE_AT_STEP=N stops
// this process with SIGSTOP when the replay first reports step N, so a test
// can change a bundle file while it is mapped, at a known point, and SIGCONT
// it. It writes nothing and has no effect unless set.
void pause_for_test_at(const ReplayProgress& p) {
  static const char* const wanted = std::getenv("NANREPLAY_TEST_PAUSE_AT_STEP");
  static bool paused = false;
  if (wanted == nullptr || paused || std::to_string(p.step) != wanted) return;
  paused = true;
  std::raise(SIGSTOP);
}

// Replays, writes the outputs whole or not at all. Until the output directory
// exists a stop signal ends the process at once; from then on it is polled.
ReplayReport replay_and_write(const RunSettings& settings) {
  install_stop_handlers();
  set_compute_threads(settings.threads);
  validate_devices(settings.devices, settings.cross_check);
  tune_heap_for_replay();
  const Bundle bundle(settings.bundle);
  check_what_ifs(settings.what_ifs, bundle.manifest());
  size_t steps_to_replay = 0;
  for (const StepFiles& files : bundle.steps()) {
    if (!settings.steps || settings.steps->count(files.step)) ++steps_to_replay;
  }
  // Refused before any checkpoint is opened or any output directory created.
  require_memory_fits(estimate_replay_memory(bundle.manifest(), steps_to_replay, settings.probes),
                      settings.max_memory ? *settings.max_memory : default_memory_limit());
  // Every structural fault `inspect` reports, before any work or output.
  validate_bundle_structure(bundle);
  const StopDeferral staged_output;  // destroyed after `out`: its cleanup runs first
  OutputDir out(settings.out, bundle.root(), settings.replace_existing,
                {"report.json", "trace.h5", "report.md", "report.html"});

  ProgressLine progress(!settings.quiet && isatty(STDERR_FILENO));
  ReplayOptions options;
  options.probes = settings.probes;
  options.only_steps = settings.steps;
  options.tool_version = NANREPLAY_VERSION;
  options.on_progress = [&](const ReplayProgress& p) {
    pause_for_test_at(p);
    progress.update(p);
  };
  options.devices = settings.devices;
  options.cross_check = settings.cross_check;
  options.native_low_precision = !settings.emulate_low_precision;
  options.should_stop = stop_or_changed_bundle;
  ReplayReport report;
  try {
    report = replay_bundle(bundle, options);
    if (!settings.what_ifs.empty()) {
      report.what_if = evaluate_what_ifs(
          bundle, report.first_nonfinite, settings.what_ifs,
          [&] { if (stop_or_changed_bundle()) throw ReplayInterrupted{steps_to_replay}; },
          {settings.devices.front()}, !settings.emulate_low_precision);
    }
    // The checks after the last pass read checkpoints too.
    throw_if_mapped_file_changed();
  } catch (const ReplayInterrupted& stop) {
    progress.clear();
    out.abandon();
    exit_interrupted("interrupted after " + std::to_string(stop.steps_done) + " of " +
                     std::to_string(steps_to_replay) + " steps; nothing was written");
  } catch (...) {
    progress.clear();
    throw;
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
  write_trace(out.staging_path("trace.h5").string(), header, report.probes, rows, out.display_path("trace.h5"));
  out.write_text("report.json", report_to_json(report).dump(2) + "\n");
  out.write_text("report.md", render_markdown(report));
  out.write_text("report.html", render_html(report));
  if (stop_requested()) {  // arrived while the outputs were written: keep none of them
    out.abandon();
    exit_interrupted("interrupted after all " + std::to_string(steps_to_replay) +
                     " steps, while writing the outputs; nothing was written");
  }
  throw_if_mapped_file_changed();
  out.commit();
  const std::string committed = "interrupted; the results in " + settings.out.string() + " are complete";
  set_interrupted_message(committed);
  if (stop_requested()) exit_interrupted(committed);
  return report;
}

int run_main(int argc, char** argv) {
  cxxopts::Options options("nanreplay run", "Replay every step of an incident bundle, forward and "
                                            "backward, with numeric probes on every tensor.\n"
                                            "Example: nanreplay run incident-bundle/ --out triage/");
  options.add_options()
      ("bundle", "incident bundle directory", cxxopts::value<std::string>())
      ("o,out", "output directory for report.json, report.md, report.html and trace.h5", cxxopts::value<std::string>()->default_value("nanreplay-out"))
      ("no-clobber", "refuse an --out that already holds results (by default a run replaces them, "
                     "each file whole, and a run that fails leaves them as they were)")
      ("force", "replace results already in --out (the default; kept for older scripts)")
      ("steps", "only these steps, e.g. 104,105 or 100-105", cxxopts::value<std::string>()->default_value(""))
      ("no-probes", "loss and gradient norm only (faster, no trace detail)")
      ("threads", "compute threads, LibTorch's and OpenBLAS's (0: all cores)", cxxopts::value<int>()->default_value("0"))
      ("device", "cpu, cuda:N, or two devices (cuda:0,cuda:1) to split the layers across",
       cxxopts::value<std::string>()->default_value("cpu"))
      ("cross-check", "with two devices: replay the step of interest on each and compare every probe bit for bit")
      ("emulate-low-precision", "on a GPU, emulate bf16/fp16 by rounding fp32 as on CPU instead of computing natively")
      ("max-memory", "refuse a replay estimated to need more than SIZE (8G, 512M, 1.5GiB or bytes; "
                     "default: 80% of the available memory)", cxxopts::value<std::string>(), "SIZE")
      ("json", "print report.json to stdout instead of the verdict")
      ("q,quiet", "print nothing but errors")
      ("h,help", "show this help");
  add_what_if_option(options);
  options.parse_positional({"bundle"});
  options.positional_help("BUNDLE");
  const auto args = parse_or_usage(options, argc, argv);
  if (args.count("help")) {
    std::cout << options.help() << "\n" << what_if_help()
              << "  e.g. nanreplay run incident-bundle/ --what-if stable-softmax --what-if fp32-layers=2,3\n"
              << "  report.json then holds a `what_if` list: resolved or not, and the first non-finite value after\n"
              << "\nexit status: 0 clean, 1 non-finite origin or error finding named, "
              << "2 bad input, 3 internal error, 130 interrupted\n";
    return 0;
  }
  if (!args.count("bundle")) throw UsageError("run: missing BUNDLE (see nanreplay run --help)");
  RunSettings settings;
  settings.bundle = args["bundle"].as<std::string>();
  settings.out = args["out"].as<std::string>();
  if (args.count("no-clobber") && args.count("force")) {
    throw UsageError("run: --no-clobber and --force contradict each other");
  }
  settings.replace_existing = args.count("no-clobber") == 0;
  settings.probes = args.count("no-probes") == 0;
  settings.quiet = args.count("quiet") > 0;
  settings.json = args.count("json") > 0;
  settings.threads = args["threads"].as<int>();
  settings.steps = parse_step_list(args["steps"].as<std::string>());
  settings.devices = split_devices(args["device"].as<std::string>());
  settings.cross_check = args.count("cross-check") > 0;
  settings.emulate_low_precision = args.count("emulate-low-precision") > 0;
  settings.what_ifs = parse_what_if_options(args);
  if (!settings.what_ifs.empty() && !settings.probes) {
    throw UsageError("--what-if replays the first non-finite step, which only probes find: drop --no-probes");
  }
  if (args.count("max-memory")) {
    const std::string size = args["max-memory"].as<std::string>();
    settings.max_memory = MemoryLimit{parse_memory_size(size), "--max-memory " + size};
  }
  const ReplayReport report = replay_and_write(settings);
  if (settings.json) {
    std::cout << report_to_json(report).dump(2) << "\n";
  } else if (!settings.quiet) {
    std::cout << render_verdict(report, {color_wanted(STDOUT_FILENO)});
    std::cout << "\nwrote " << (settings.out / "report.json").string() << ", report.md, report.html and "
              << (settings.out / "trace.h5").string() << "\n";
  }
  return exit_status_for(report);
}

// synth and demo create directories: never inside an existing bundle.
void refuse_inside_a_bundle(const fs::path& dir) {
  const fs::path enclosing = enclosing_bundle(dir);
  if (!enclosing.empty()) {
    throw UsageError(dir.string() + " is inside the bundle " + enclosing.string() +
                     "; nanreplay never writes into a bundle, choose another directory");
  }
}

// Writes a synthetic bundle into `dir` (absent or empty). A stop signal waits
// for the writer, which builds the bundle under a temporary name, and then
// removes what it wrote: nothing half-written.
SyntheticOutcome write_bundle_for_user(const fs::path& dir, const SyntheticSpec& spec) {
  std::error_code ec;
  const bool existed = fs::exists(dir, ec);
  const StopDeferral writing;
  const SyntheticOutcome outcome = write_synthetic_bundle(dir, spec);
  if (stop_requested()) {
    fs::remove_all(dir, ec);
    if (existed) fs::create_directory(dir, ec);  // the empty directory the user made
    exit_interrupted("interrupted; nothing was written");
  }
  return outcome;
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
  refuse_inside_a_bundle(dir);
  std::error_code ec;
  if (!fs::exists(bundle / "manifest.json", ec)) {
    if (!quiet) std::cout << "writing the demo incident bundle to " << bundle.string() << " ...\n";
    write_bundle_for_user(bundle, spec);
  }
  RunSettings settings;
  settings.bundle = bundle;
  settings.out = dir / "report";
  settings.quiet = quiet;
  const ReplayReport report = replay_and_write(settings);
  const bool named = report.first_nonfinite && report.first_nonfinite->step == spec.fault.step &&
                     report.first_nonfinite->site == SiteRef{SiteId::kAttnScores, spec.fault.layer} &&
                     report.first_nonfinite->head == spec.fault.head;
  if (!quiet) {
    std::cout << render_verdict(report, {color_wanted(STDOUT_FILENO)}) << "\n"
              << "The demo's model has a head (layer " << spec.fault.layer << ", head " << spec.fault.head
              << ") that amplifies one rare token, first read at step " << spec.fault.step
              << ": its q k^T overflows fp16 in layers." << spec.fault.layer << ".attn.scores, head "
              << spec.fault.head << ". "
              << (named ? "nanreplay named it." : "nanreplay did NOT name it (a bug).") << "\n"
              << "open " << (settings.out / "report.html").string() << " in a browser; also report.md, report.json and trace.h5 there\n";
  }
  return named ? 0 : static_cast<int>(ExitStatus::kInternal);
}

int synth_main(int argc, char** argv) {
  std::string listing, names;
  for (const SyntheticPreset& p : synthetic_presets()) {
    listing += "  " + std::string(p.name) + std::string(std::max<size_t>(2, 21 - std::string(p.name).size()), ' ') +
               p.plants + "\n";
    names += (names.empty() ? "" : ", ") + std::string(p.name);
  }
  cxxopts::Options options("nanreplay synth", "Write a synthetic bundle from a preset (a tiny llama trained for "
                                              "a few steps; every checkpoint is AdamW applied to the one before, "
                                              "unless the fault is an edit between two).\n"
                                              "Prints what was planted as JSON.\n"
                                              "Example: nanreplay synth bit-flip ./bundle");
  options.add_options()
      ("preset", "preset name", cxxopts::value<std::string>())
      ("dir", "bundle directory to create", cxxopts::value<std::string>())
      ("corpus", "train on the bytes of FILE (byte-level tokens) instead of random tokens",
       cxxopts::value<std::string>(), "FILE")
      ("h,help", "show this help");
  options.parse_positional({"preset", "dir"});
  options.positional_help("PRESET DIR");
  const auto args = parse_or_usage(options, argc, argv);
  if (args.count("help")) {
    std::cout << options.help() << "\npresets:\n" << listing;
    return 0;
  }
  if (!args.count("preset") || !args.count("dir")) throw UsageError("synth: need PRESET and DIR");
  SyntheticSpec spec;
  try {
    spec = synthetic_preset(args["preset"].as<std::string>());
  } catch (const std::invalid_argument& e) {
    throw UsageError(std::string(e.what()) + "; presets: " + names);
  }
  if (args.count("corpus")) {
    const std::string path = args["corpus"].as<std::string>();
    const std::string bytes = read_text_file(path, path, size_t{64} << 20);
    if (bytes.size() < static_cast<size_t>(4 * spec.seq_len)) throw InputError(path, "", "too short for a corpus");
    spec.corpus.assign(bytes.begin(), bytes.end());
  }
  const fs::path dir = args["dir"].as<std::string>();
  refuse_inside_a_bundle(dir);
  std::error_code ec;
  if (fs::exists(dir, ec) && !fs::is_empty(dir, ec)) {
    throw UsageError(dir.string() + " exists and is not empty");
  }
  const SyntheticOutcome outcome = write_bundle_for_user(dir, spec);
  nlohmann::json info = {{"bundle", dir.string()},
                         {"fault_step", outcome.fault_step},
                         {"fault_param", outcome.fault_param},
                         {"fault_element", outcome.fault_element},
                         {"zero_token", outcome.zero_token},
                         {"zero_position", outcome.zero_position},
                         {"first_sample", outcome.first_sample},
                         {"fault_sample", outcome.fault_sample},
                         {"fault_token", outcome.fault_token},
                         {"fault_position", outcome.fault_position},
                         {"fault_layer", spec.fault.layer},
                         {"fault_head", spec.fault.head}};
  std::cout << info.dump() << "\n";
  return 0;
}

int scan_data_main(int argc, char** argv) {
  cxxopts::Options options("nanreplay scan-data",
                           "Scan every token shard of a bundle for out-of-range ids, long repeated runs and "
                           "low-entropy samples, streaming through the mappings on all cores.\n"
                           "Example: nanreplay scan-data incident-bundle/ --json");
  options.add_options()
      ("bundle", "incident bundle directory", cxxopts::value<std::string>())
      ("threads", "scan threads (0: all cores)", cxxopts::value<int>()->default_value("0"))
      ("repeat-run-min", "flag runs of one token at least this long (0: seq_len/4 in [8, 64])",
       cxxopts::value<int64_t>()->default_value("0"))
      ("low-entropy-z", "robust z-score below the typical sample's entropy", cxxopts::value<double>()->default_value("6"))
      ("low-entropy-ratio", "and below this fraction of the median entropy", cxxopts::value<double>()->default_value("0.6"))
      ("json", "print the result as JSON")
      ("q,quiet", "print nothing but errors")
      ("h,help", "show this help");
  options.parse_positional({"bundle"});
  options.positional_help("BUNDLE");
  const auto args = parse_or_usage(options, argc, argv);
  if (args.count("help")) {
    std::cout << options.help()
              << "\nexit status: 0 nothing flagged, 1 poisoned data or a shard checksum mismatch found, 2 bad input\n";
    return 0;
  }
  if (!args.count("bundle")) throw UsageError("scan-data: missing BUNDLE (see nanreplay scan-data --help)");
  const Bundle bundle(args["bundle"].as<std::string>());
  const Manifest& m = bundle.manifest();
  DataCheckOptions checks;
  checks.repeat_run_min = args["repeat-run-min"].as<int64_t>();
  checks.low_entropy_z = args["low-entropy-z"].as<double>();
  checks.low_entropy_ratio = args["low-entropy-ratio"].as<double>();
  const bool show_progress = !args.count("quiet") && !args.count("json") && isatty(STDERR_FILENO);
  const DataScanResult scan = scan_token_stream(
      bundle.tokens(), m.data.seq_len, m.model.vocab_size, checks, args["threads"].as<int>(),
      [&](double fraction) {
        if (show_progress) std::fprintf(stderr, "\r\033[K  scanning %.0f%%", fraction * 100);
      });
  if (show_progress) std::fprintf(stderr, "\r\033[K");
  // A checksum mismatch is a finding like poisoned data (exit 1): the shard is not what was captured.
  const std::vector<ChecksumMismatch> mismatches = bundle.tokens().verify_checksums();
  throw_if_mapped_file_changed();
  const double gb_per_s = scan.seconds > 0 ? static_cast<double>(scan.bytes) / scan.seconds / 1e9 : 0.0;
  const bool flagged = scan.out_of_range_count > 0 || !scan.repeat_runs.empty() || !scan.low_entropy.empty() ||
                       !mismatches.empty();
  if (args.count("json")) {
    nlohmann::json out = {{"tokens", scan.tokens}, {"bytes", scan.bytes}, {"samples", scan.samples},
                          {"seconds", scan.seconds}, {"gb_per_s", gb_per_s},
                          {"out_of_range_count", scan.out_of_range_count},
                          {"entropy_median", scan.baseline.median}, {"entropy_mad", scan.baseline.mad},
                          {"out_of_range", nlohmann::json::array()}, {"repeat_runs", nlohmann::json::array()},
                          {"low_entropy", nlohmann::json::array()},
                          {"checksum_mismatches", nlohmann::json::array()}};
    for (const ChecksumMismatch& bad : mismatches) {
      out["checksum_mismatches"].push_back(
          {{"shard", printable(bad.shard)}, {"expected", bad.expected}, {"actual", bad.actual}});
    }
    for (const OutOfRangeToken& t : scan.out_of_range) {
      out["out_of_range"].push_back({{"shard", bundle.tokens().spec(t.shard).path}, {"offset", t.offset}, {"token", t.token}});
    }
    for (const SampleProfile& p : scan.repeat_runs) {
      out["repeat_runs"].push_back({{"sample", p.sample}, {"position", p.run_position}, {"length", p.longest_run}, {"token", p.run_token}});
    }
    for (const SampleProfile& p : scan.low_entropy) {
      out["low_entropy"].push_back({{"sample", p.sample}, {"entropy_bits", p.entropy_bits}});
    }
    std::cout << out.dump(2) << "\n";
  } else if (!args.count("quiet")) {
    std::printf("scanned %lld tokens (%.1f MB, %lld samples) in %.3fs: %.2f GB/s\n",
                static_cast<long long>(scan.tokens), static_cast<double>(scan.bytes) / 1e6,
                static_cast<long long>(scan.samples), scan.seconds, gb_per_s);
    std::printf("typical sample entropy %.3f bits (MAD %.3f)\n", scan.baseline.median, scan.baseline.mad);
    std::printf("shard checksums: %s\n", mismatches.empty() ? "ok (or none declared)" : "MISMATCH");
    for (const ChecksumMismatch& bad : mismatches) {
      std::printf("  %s: sha256 is %s, the manifest says %s\n", printable(bad.shard).c_str(), bad.actual.c_str(),
                  bad.expected.c_str());
    }
    std::printf("out-of-range token ids: %lld\n", static_cast<long long>(scan.out_of_range_count));
    for (const OutOfRangeToken& t : scan.out_of_range) {
      std::printf("  %s offset %lld: token %lld\n", bundle.tokens().spec(t.shard).path.c_str(),
                  static_cast<long long>(t.offset), static_cast<long long>(t.token));
    }
    std::printf("samples with a repeated run >= %lld: %zu\n",
                static_cast<long long>(checks.repeat_threshold(m.data.seq_len)), scan.repeat_runs.size());
    for (size_t i = 0; i < std::min<size_t>(scan.repeat_runs.size(), 20); ++i) {
      const SampleProfile& p = scan.repeat_runs[i];
      std::printf("  sample %lld: token %lld x%lld from position %lld\n", static_cast<long long>(p.sample),
                  static_cast<long long>(p.run_token), static_cast<long long>(p.longest_run),
                  static_cast<long long>(p.run_position));
    }
    std::printf("low-entropy samples: %zu\n", scan.low_entropy.size());
    for (size_t i = 0; i < std::min<size_t>(scan.low_entropy.size(), 20); ++i) {
      std::printf("  sample %lld: %.3f bits\n", static_cast<long long>(scan.low_entropy[i].sample),
                  scan.low_entropy[i].entropy_bits);
    }
  }
  return flagged ? static_cast<int>(ExitStatus::kFound) : static_cast<int>(ExitStatus::kClean);
}

// "data/shard_000.bin: sha256 is ..., the manifest says ..." for the first
// mismatching shard of an inspect summary, and how many more there are.
std::string checksum_mismatch_line(const nlohmann::json& summary) {
  std::vector<const nlohmann::json*> bad;
  for (const nlohmann::json& shard : summary["data"]["shards"]) {
    if (shard["checksum"] == "mismatch") bad.push_back(&shard);
  }
  if (bad.empty()) return "the bundle is invalid";
  const nlohmann::json& first = *bad.front();
  std::string line = first["path"].get<std::string>() + ": sha256 is " + first["actual_sha256"].get<std::string>() +
                     ", the manifest says " + first["sha256"].get<std::string>();
  if (bad.size() > 1) line += " (and " + std::to_string(bad.size() - 1) + " more shard(s) differ)";
  return line;
}

int inspect_main(int argc, char** argv) {
  cxxopts::Options options("nanreplay inspect",
                           "Validate an incident bundle and summarize it without replaying: model and parameter "
                           "count, precision, steps (optimizer state, logged loss), shards (checksums verified), "
                           "sampler, incident.\n"
                           "Example: nanreplay inspect incident-bundle/ --json");
  options.add_options()
      ("bundle", "incident bundle directory", cxxopts::value<std::string>())
      ("json", "print the summary as JSON")
      ("h,help", "show this help");
  options.parse_positional({"bundle"});
  options.positional_help("BUNDLE");
  const auto args = parse_or_usage(options, argc, argv);
  if (args.count("help")) {
    std::cout << options.help()
              << "\nValid means `nanreplay run` will not reject the bundle for its structure. Whether the bundle\n"
                 "faithfully records the run is not checked: only a replay that reproduces the logged losses\n"
                 "shows that.\n"
              << "\nexit status: 0 valid, 2 bad input (a checksum mismatch included)\n";
    return 0;
  }
  if (!args.count("bundle")) throw UsageError("inspect: missing BUNDLE (see nanreplay inspect --help)");
  const Bundle bundle(args["bundle"].as<std::string>());
  // What `run` checks before it replays, with the same messages.
  validate_bundle_structure(bundle);
  const nlohmann::json summary = summarize_bundle(bundle);
  throw_if_mapped_file_changed();
  std::cout << (args.count("json") ? summary.dump(2) + "\n" : render_bundle_summary(summary));
  if (!summary["valid"].get<bool>()) {
    std::cerr << "nanreplay: error: " << checksum_mismatch_line(summary) << "\n";
    return static_cast<int>(ExitStatus::kBadInput);
  }
  return 0;
}

int trace_main(int argc, char** argv) {
  cxxopts::Options options("nanreplay trace",
                           "Query the probes of a trace.h5 written by `nanreplay run`.\n"
                           "Example: nanreplay trace triage/trace.h5 --step 105 --phase forward "
                           "--site 'layers.2.*' --sort max_abs");
  options.add_options()
      ("trace", "trace.h5 file", cxxopts::value<std::string>())
      ("step", "only this step", cxxopts::value<int64_t>())
      ("phase", "forward, backward or grad", cxxopts::value<std::string>())
      ("site", "site glob ('*' matches any run), e.g. 'layers.*.attn.scores'", cxxopts::value<std::string>())
      ("head", "only this head (-1: whole-tensor rows)", cxxopts::value<int>())
      ("sort", "max_abs: largest max|x| first", cxxopts::value<std::string>())
      ("first-nonfinite", "only the first row holding NaN/Inf in execution order (with --limit N: the first N)")
      ("nonfinite", "every row holding NaN/Inf, in execution order (up to --limit)")
      ("limit", "at most N rows (default 50; 1 with --first-nonfinite)", cxxopts::value<size_t>())
      ("json", "print the rows as JSON")
      ("h,help", "show this help");
  options.parse_positional({"trace"});
  options.positional_help("TRACE.h5");
  const auto args = parse_or_usage(options, argc, argv);
  if (args.count("help")) {
    std::cout << options.help() << "\nexit status: 0 rows printed (or none matched), 2 bad usage or bad file\n";
    return 0;
  }
  if (!args.count("trace")) throw UsageError("trace: missing TRACE.h5 (see nanreplay trace --help)");
  TraceQuery query;
  if (args.count("step")) query.step = args["step"].as<int64_t>();
  if (args.count("phase")) {
    query.phase = parse_phase(args["phase"].as<std::string>());
    if (!query.phase) throw UsageError("--phase: expected forward, backward or grad");
  }
  if (args.count("site")) query.site_pattern = args["site"].as<std::string>();
  if (args.count("head")) query.head = args["head"].as<int>();
  if (args.count("sort")) {
    if (args["sort"].as<std::string>() != "max_abs") throw UsageError("--sort: only max_abs is supported");
    query.sort_by_max_abs = true;
  }
  const bool first_only = args.count("first-nonfinite") > 0;
  if (first_only && args.count("nonfinite")) {
    throw UsageError("trace: --first-nonfinite and --nonfinite contradict each other (see nanreplay trace --help)");
  }
  query.only_nonfinite = first_only || args.count("nonfinite") > 0;
  query.limit = args.count("limit") ? args["limit"].as<size_t>() : first_only ? 1 : 50;
  const TraceContents trace = read_trace(args["trace"].as<std::string>());
  const TraceSelection selection = select_probes(trace.probes, query);
  std::cout << (args.count("json") ? trace_selection_json(selection).dump(2) + "\n" : render_trace_table(selection));
  return 0;
}

int version_main(int argc, char** argv) {
  if (argc > 1 && (std::string(argv[1]) == "--help" || std::string(argv[1]) == "-h")) {
    std::cout << "Print the version of nanreplay.\nExample: nanreplay version\n";
    return 0;
  }
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
    if (name != command.name) continue;
    if (command.replays) reexec_with_short_openmp_spin(argv);
    return command.handler(argc - 1, argv + 1);
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
  // First: a stop signal at any time ends in exit 130 (cli_support.h).
  install_stop_handlers();
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
