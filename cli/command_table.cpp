// The table of subcommands, the usage text it generates, dispatch with "did
// you mean", and `nanreplay version`; see command_table.h.
#include "cli/command_table.h"

#include <algorithm>
#include <sstream>

#include "cli/cli_support.h"
#include "loaders/error.h"
#include "nanreplay_version.h"
#include "replay/runtime.h"

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
      << "\nexit status: 0 nothing non-finite and no error finding, 1 a non-finite origin or an\n"
      << "error finding was named, 2 bad usage or bad input, 3 internal error, 130 interrupted\n";
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

const std::vector<Command>& command_table() {
  static const std::vector<Command> table = {
      {"run", "replay every step of a bundle with probes; write report.{json,md,html} and trace.h5",
       "nanreplay run incident-bundle/ --out triage/", run_command},
      {"bisect", "find the first non-finite value with fewer replays (step, layer, site, samples); what-ifs",
       "nanreplay bisect incident-bundle/ --json --what-if stable-softmax", bisect_command},
      {"minimize", "write the smallest bundle that still fails the same way (steps, samples, layers)",
       "nanreplay minimize incident-bundle/ --out incident-min/", minimize_command},
      {"demo", "write a built-in incident bundle (one attention head overflows) and replay it",
       "nanreplay demo ./nanreplay-demo", demo_command},
      {"scan-data", "scan every token shard for poisoned samples without replaying (prints GB/s)",
       "nanreplay scan-data incident-bundle/ --json", scan_data_command},
      {"synth", "write a synthetic bundle from a named preset (for tests and training)",
       "nanreplay synth head-overflow ./bundle", synth_command},
      {"inspect", "validate and summarize a bundle without replaying (model, steps, shards, sampler)",
       "nanreplay inspect incident-bundle/ --json", inspect_command},
      {"import", "write a bundle from a checkpoint you have (Hugging Face, torch.save, DCP), the data and the log",
       "nanreplay import --checkpoint ckpt/ --data train.bin ... --steps 5000:5010 --out incident/", import_command},
      {"trace", "query a trace.h5 in the terminal: filter by step, phase, site, head; sort; first NaN/Inf",
       "nanreplay trace triage/trace.h5 --first-nonfinite", trace_command},
      {"version", "print the version", "nanreplay version", version_command},
      {"completion", "print a shell completion script: bash, zsh or fish",
       "source <(nanreplay completion bash)", completion_command},
  };
  return table;
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
  if (args.size() > 1 && (args[1] == "--help" || args[1] == "-h")) {
    io.out << "Print the version of nanreplay and the BLAS its matrix products run on "
              "(worth attaching to a ticket).\nExample: nanreplay version\n";
    return 0;
  }
  const BlasInUse blas = blas_in_use();
  io.out << "nanreplay " << NANREPLAY_VERSION << "\n"
         << "BLAS: " << blas.description << " (threads: " << blas.threading << ")"
         << (blas.path.empty() ? "" : ", " + blas.path) << "\n";
  return 0;
}

}  // namespace nanreplay
