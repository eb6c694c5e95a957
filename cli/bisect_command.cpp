// `nanreplay bisect BUNDLE`: the origin `run` would name, found coarse to fine
// with fewer replays, plus optional what-if replays. Writes nothing; prints
// the stages (or one stable JSON object with --json). Exit status as `run`.
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <iostream>

#include "cli/cli_support.h"
#include "loaders/bundle.h"
#include "loaders/error.h"
#include "loaders/mapped_file.h"
#include "nanreplay_version.h"
#include "replay/bisect.h"
#include "replay/bundle_structure.h"
#include "replay/memory_estimate.h"
#include "replay/replay_engine.h"
#include "reports/bisect_report.h"

namespace nanreplay {

namespace {

const char* const kDescription =
    "Name the first non-finite value, as `nanreplay run` does, with fewer replays, coarse to fine:\n"
    "  step     binary search over the steps with a cheap any-non-finite pass (one flag per site)\n"
    "  layer    the first flagged block of that pass (no replay of its own)\n"
    "  site     full probes on that block of the one pass holding it: site, head, element\n"
    "  samples  delta debugging (ddmin) over that pass's samples: the smallest set that still fails\n"
    "A replay is one pass: forward and backward of one rank's micro-batch (or of a subset of samples).\n"
    "Assumes a step after the first bad one stays bad (true once parameters go non-finite).\n"
    "Example: nanreplay bisect incident-bundle/ --json --what-if stable-softmax --what-if drop-samples=212";

// Progress on stderr when it is a terminal: stage, step, passes so far.
void show_progress(const BisectProgress& p, bool enabled, const std::chrono::steady_clock::time_point& start) {
  if (!enabled) return;
  const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::fprintf(stderr, "\r\033[K  bisect: %s stage, step %lld, replay %lld  %.1fs elapsed", p.stage.c_str(),
               static_cast<long long>(p.step), static_cast<long long>(p.replays + 1), elapsed);
  std::fflush(stderr);
}

}  // namespace

int bisect_main(int argc, char** argv) {
  cxxopts::Options options("nanreplay bisect", kDescription);
  options.add_options()
      ("bundle", "incident bundle directory", cxxopts::value<std::string>())
      ("no-samples", "skip the samples stage (delta debugging)")
      ("device", "cpu, cuda:N, or two devices (cuda:0,cuda:1) to split the layers across",
       cxxopts::value<std::string>()->default_value("cpu"))
      ("emulate-low-precision", "on a GPU, emulate bf16/fp16 by rounding fp32 as on CPU instead of computing natively")
      ("threads", "compute threads, LibTorch's and OpenBLAS's (0: all cores)", cxxopts::value<int>()->default_value("0"))
      ("max-memory", "refuse a replay estimated to need more than SIZE (8G, 512M, 1.5GiB or bytes; "
                     "default: 80% of the available memory)", cxxopts::value<std::string>(), "SIZE")
      ("json", "print one JSON object (bisect_version 1) instead of the text")
      ("q,quiet", "print nothing but errors")
      ("h,help", "show this help");
  add_what_if_option(options);
  options.parse_positional({"bundle"});
  options.positional_help("BUNDLE");
  const auto args = parse_or_usage(options, argc, argv);
  if (args.count("help")) {
    std::cout << options.help() << "\n" << what_if_help()
              << "  e.g. nanreplay bisect incident-bundle/ --what-if fp32-layers=all --what-if norm-eps=1e-5\n"
              << "\nexit status: 0 nothing non-finite, 1 origin named (or a step could not be replayed), "
              << "2 bad input, 3 internal error, 130 interrupted\n";
    return 0;
  }
  if (!args.count("bundle")) throw UsageError("bisect: missing BUNDLE (see nanreplay bisect --help)");
  const std::vector<WhatIf> what_ifs = parse_what_if_options(args);  // malformed specs fail before any work
  const std::vector<std::string> devices = split_devices(args["device"].as<std::string>());
  validate_devices(devices, false);
  set_compute_threads(args["threads"].as<int>());
  const Bundle bundle(args["bundle"].as<std::string>());
  check_what_ifs(what_ifs, bundle.manifest());
  const MemoryLimit limit = args.count("max-memory")
                                ? MemoryLimit{parse_memory_size(args["max-memory"].as<std::string>()),
                                              "--max-memory " + args["max-memory"].as<std::string>()}
                                : default_memory_limit();
  require_memory_fits(estimate_replay_memory(bundle.manifest(), 1, true), limit);
  validate_bundle_structure(bundle);  // the structural faults `run` and `inspect` report

  const bool json = args.count("json") > 0;
  const bool quiet = args.count("quiet") > 0;
  const bool progress = !quiet && !json && isatty(STDERR_FILENO);
  const auto start = std::chrono::steady_clock::now();
  BisectOptions bisect;
  bisect.minimize_samples = args.count("no-samples") == 0;
  bisect.what_ifs = what_ifs;
  bisect.tool_version = NANREPLAY_VERSION;
  bisect.devices = devices;
  bisect.native_low_precision = args.count("emulate-low-precision") == 0;
  bisect.should_stop = stop_or_changed_bundle;
  bisect.on_progress = [&](const BisectProgress& p) { show_progress(p, progress, start); };
  BisectReport report;
  try {
    const StopDeferral polled;  // bisect prints its own line when stopped
    report = bisect_bundle(bundle, bisect);
    throw_if_mapped_file_changed();
  } catch (const ReplayInterrupted&) {
    if (progress) std::fprintf(stderr, "\r\033[K");
    std::fprintf(stderr, "nanreplay: bisect interrupted; nothing was printed\n");
    return static_cast<int>(ExitStatus::kInterrupted);
  }
  if (progress) std::fprintf(stderr, "\r\033[K");
  if (json) {
    std::cout << bisect_to_json(report).dump(2) << "\n";
  } else if (!quiet) {
    std::cout << render_bisect(report, {color_wanted(STDOUT_FILENO)});
  }
  return bisect_exit_status(report);
}

}  // namespace nanreplay
