// The shared flags of `run` and `bisect`; see replay_flags.h.
#include "cli/replay_flags.h"

#include <sstream>
#include <string>
#include <vector>

#include "loaders/base/error.h"

namespace nanreplay {

namespace {

// "cuda:0,cuda:1" -> {"cuda:0", "cuda:1"}.
std::vector<std::string> split_devices(const std::string& text) {
  std::vector<std::string> devices;
  std::stringstream in(text);
  for (std::string item; std::getline(in, item, ',');) devices.push_back(item);
  return devices;
}

// Every --what-if in the order given. A plain string option, read back from
// arguments(): a vector option would split "drop-samples=12,40" at its comma.
std::vector<WhatIf> parse_what_ifs(const cxxopts::ParseResult& args) {
  std::vector<WhatIf> what_ifs;
  for (const cxxopts::KeyValue& kv : args.arguments()) {
    if (kv.key() == "what-if") what_ifs.push_back(parse_what_if(kv.value()));
  }
  return what_ifs;
}

}  // namespace

void add_replay_flags(cxxopts::Options& options, const char* json_help, bool cross_check, bool what_if) {
  options.add_options()
      ("threads", "compute threads, LibTorch's and OpenBLAS's (0: all cores)", cxxopts::value<int>()->default_value("0"))
      ("device", "cpu, cuda:N, or two devices (cuda:0,cuda:1) to split the layers across",
       cxxopts::value<std::string>()->default_value("cpu"));
  if (cross_check) {
    options.add_options()
        ("cross-check", "with two devices: replay the step of interest on each and compare every probe bit for bit");
  }
  options.add_options()
      ("emulate-low-precision", "on a GPU, emulate bf16/fp16 by rounding fp32 as on CPU instead of computing natively")
      ("max-memory", "refuse a replay estimated to need more than SIZE (8G, 512M, 1.5GiB or bytes; "
                     "default: 80% of the available memory)", cxxopts::value<std::string>(), "SIZE")
      ("stream", "replay layer by layer from the mapped checkpoint, the gradients on scratch files "
                 "(automatic when only that fits the memory limit)")
      ("scratch", "where a layer-streamed replay puts its scratch directory (removed at the end; "
                  "default: beside --out for run, the temporary directory for bisect)",
       cxxopts::value<std::string>(), "DIR")
      ("json", json_help)
      ("q,quiet", "print nothing but errors");
  add_progress_flag(options);
  options.add_options()("h,help", "show this help");
  if (what_if) {
    options.add_options()("what-if", "replay the first non-finite step with one change (repeatable; see below)",
                          cxxopts::value<std::string>(), "SPEC");
  }
  add_launch_flags(options);
}

ReplayFlags parse_replay_flags(const cxxopts::ParseResult& args, bool probes) {
  ReplayFlags flags;
  IncidentSettings& incident = flags.incident;
  incident.threads = args["threads"].as<int>();
  incident.devices = process_devices(split_devices(args["device"].as<std::string>()));  // cuda:$LOCAL_RANK
  incident.cross_check = args.count("cross-check") > 0;
  incident.native_low_precision = args.count("emulate-low-precision") == 0;
  incident.probes = probes;
  incident.what_ifs = parse_what_ifs(args);  // malformed specs fail before any work
  if (!incident.what_ifs.empty() && !probes) {
    throw UsageError("--what-if replays the first non-finite step, which only probes find: drop --no-probes");
  }
  if (args.count("max-memory")) {
    const std::string size = args["max-memory"].as<std::string>();
    incident.max_memory = MemoryLimit{parse_memory_size(size), "--max-memory " + size};
  }
  incident.stream = args.count("stream") > 0;
  if (args.count("scratch")) incident.scratch = args["scratch"].as<std::string>();
  flags.json = args.count("json") > 0;
  flags.quiet = args.count("quiet") > 0;
  flags.progress = progress_mode(args, flags.quiet);
  flags.launch = parse_launch_flags(args);
  if (!incident.devices.empty()) flags.launch.device = incident.devices.front();
  if (args.count("split")) {
    const std::string split = args["split"].as<std::string>();
    if (split != "layers" && split != "ranks") throw UsageError("--split " + split + ": layers or ranks");
    incident.split = split == "layers" ? ProcessSplit::kLayers : ProcessSplit::kRanks;
  }
  return flags;
}

}  // namespace nanreplay
