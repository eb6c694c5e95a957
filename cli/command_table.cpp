// The table of subcommands, the usage text it generates, dispatch with "did
// you mean", and `nanreplay version`; see command_table.h.
#include "cli/command_table.h"

#include <algorithm>
#include <sstream>

#include <nlohmann/json.hpp>

#include "cli/cli_support.h"
#include "loaders/base/error.h"
#include "nanreplay_version.h"
#include "replay/step/runtime.h"

namespace nanreplay {

namespace {

std::string usage_text() {
  std::ostringstream out;
  out << "nanreplay " << NANREPLAY_VERSION
      << ": replay the steps around a training run's NaN and name where it began\n\n"
      << "usage: nanreplay <command> [options]   (nanreplay help <command> for details)\n\ncommands:\n";
  for (const Command& c : command_table()) {
    out << "  " << c.name << std::string(12 - std::string(c.name).size(), ' ') << c.summary << "\n";
  }
  out << "\nexample:\n  " << command_table().front().example << "\n"
      << "\nexit status, the same in every command: 0 done, the plain answer (run and bisect: nothing\n"
      << "non-finite; minimize: MIN written); 1 done, the other answer, never an error (run and bisect: an\n"
      << "origin or an error finding; scan-data: data flagged; minimize: nothing to minimize); 2 bad usage or\n"
      << "bad input; 3 internal error; 130 interrupted (nanreplay help <command> says what each means for it).\n"
      << "Every command takes --json: one object on stdout, {\"error\": {...}} when it fails.\n";
  return out.str();
}

UsageError unknown_command(const std::string& name) {
  std::vector<std::string> names;
  for (const Command& command : command_table()) names.push_back(command.name);
  const std::string suggestion = nearest_name(name, names);
  return UsageError("unknown command '" + name + "'" +
                    (suggestion.empty() ? "" : "; did you mean '" + suggestion + "'?") + " (see nanreplay --help)");
}

}  // namespace

// 2, 3 and 130 mean the same everywhere; 0 and 1 are both answers, never errors.
#define NANREPLAY_FAILURES "2 bad usage or bad input, 3 internal error, 130 interrupted"

const std::vector<Command>& command_table() {
  static const std::vector<Command> table = {
      {"run", "replay every step of a bundle with probes; write report.{json,md,html} and trace.h5",
       "nanreplay run incident-bundle/ --out triage/", run_command,
       "0 replayed: nothing non-finite and no error finding, 1 replayed: a non-finite origin or an error finding "
       "named (a replay that does not reproduce the logged run included), " NANREPLAY_FAILURES},
      {"bisect", "find the first non-finite value with fewer replays (step, layer, site, samples); what-ifs",
       "nanreplay bisect incident-bundle/ --json --what-if stable-softmax", bisect_command,
       "0 nothing non-finite and no error finding (bisect checks the shards, the samples, the last steps against "
       "the log and the update into the last checkpoint; checks that need every step are run's), 1 an origin or "
       "an error finding named, a step that could not be replayed, or a non-finite loss the job logged that the "
       "replay does not reproduce (run exits 1 on each), " NANREPLAY_FAILURES},
      {"minimize", "write the smallest bundle that still fails the same way (steps, samples, layers)",
       "nanreplay minimize incident-bundle/ --out incident-min/", minimize_command,
       "0 MIN written (it names the same origin or flipped bit), 1 nothing to minimize: nothing written, the "
       "reason printed, 2 bad usage or bad input, 3 internal error (no candidate reproduced), 130 interrupted"},
      {"demo", "write a built-in incident bundle (one attention head overflows) and replay it",
       "nanreplay demo ./nanreplay-demo", demo_command,
       "0 replayed and the planted head named, 2 bad usage or bad input, 3 internal error (the planted head not "
       "named is a bug), 130 interrupted"},
      {"scan-data", "scan every token shard for poisoned samples without replaying (prints GB/s)",
       "nanreplay scan-data incident-bundle/ --json", scan_data_command,
       "0 nothing flagged, 1 poisoned data or a shard checksum mismatch flagged, " NANREPLAY_FAILURES},
      {"synth", "write a synthetic bundle from a named preset (for tests and training)",
       "nanreplay synth head-overflow ./bundle", synth_command, "0 written, " NANREPLAY_FAILURES},
      {"inspect", "validate and summarize a bundle without replaying (model, steps, shards, sampler)",
       "nanreplay inspect incident-bundle/ --json", inspect_command,
       "0 valid, 2 bad usage or an invalid bundle (a shard checksum mismatch included), 3 internal error, "
       "130 interrupted"},
      {"import", "write a bundle from a checkpoint you have (Hugging Face, torch.save, DCP), the data and the log",
       "nanreplay import --checkpoint ckpt/ --data train.bin ... --steps 5000:5010 --out incident/", import_command,
       "0 written and valid, 2 bad usage or bad input (nothing written), 3 internal error, 130 interrupted"},
      {"trace", "query a trace.h5 in the terminal: filter by step, phase, site, head; sort; first NaN/Inf",
       "nanreplay trace triage/trace.h5 --first-nonfinite", trace_command,
       "0 rows printed (or none matched), 2 bad usage (a --step the trace does not hold included) or a bad file, "
       "3 internal error, 130 interrupted"},
      {"version", "print the version", "nanreplay version", version_command, "0 printed, " NANREPLAY_FAILURES},
      {"completion", "print a shell completion script: bash, zsh or fish",
       "source <(nanreplay completion bash)", completion_command, "0 printed, " NANREPLAY_FAILURES},
  };
  return table;
}

#undef NANREPLAY_FAILURES

std::string exit_status_help(const std::string& name) {
  for (const Command& command : command_table()) {
    if (name == command.name) return std::string("\nexit status: ") + command.exit_status + "\n";
  }
  return "";
}

int dispatch_command(const CommandArgs& args, CommandIo& io) {
  if (args.size() >= 2 && args[0] == "help") return dispatch_command({args[1], "--help"}, io);  // help CMD
  if (args.empty() || args[0] == "--help" || args[0] == "-h" || args[0] == "help") {
    io.out << usage_text();
    return args.empty() ? static_cast<int>(ExitStatus::kBadInput) : 0;
  }
  if (args[0] == "--version") return version_command(args, io);
  for (const Command& command : command_table()) {
    if (args[0] != command.name) continue;
    return command.handler(args, io);
  }
  throw unknown_command(args[0]);
}

int version_command(const CommandArgs& args, CommandIo& io) {
  cxxopts::Options options("nanreplay version", "Print the version of nanreplay and the BLAS its matrix products "
                                                "run on (worth attaching to a ticket).\nExample: nanreplay version");
  options.add_options()
      ("json", "print {\"version\", \"blas\": {\"description\", \"threading\", \"path\"}}")
      ("h,help", "show this help");
  CommandArgs words = args;
  words[0] = "version";  // `nanreplay --version` comes here too
  const auto parsed = parse_or_usage(options, words);
  if (parsed.count("help")) {
    io.out << options.help() << exit_status_help("version");
    return 0;
  }
  const BlasInUse blas = blas_in_use();
  if (parsed.count("json")) {
    const nlohmann::json blas_json = {{"description", blas.description}, {"threading", blas.threading},
                                      {"path", blas.path}};
    io.out << nlohmann::json{{"version", NANREPLAY_VERSION}, {"blas", blas_json}}.dump(2) << "\n";
    return 0;
  }
  io.out << "nanreplay " << NANREPLAY_VERSION << "\n"
         << "BLAS: " << blas.description << " (threads: " << blas.threading << ")"
         << (blas.path.empty() ? "" : ", " + blas.path) << "\n";
  return 0;
}

}  // namespace nanreplay
