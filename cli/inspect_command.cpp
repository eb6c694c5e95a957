// `nanreplay inspect BUNDLE`: validate what `run` validates before it replays
// and summarize the bundle (text or --json); exit 2 when it is invalid.
#include <optional>

#include "cli/cli_support.h"
#include "cli/command_table.h"
#include "loaders/bundle/bundle.h"
#include "loaders/base/error.h"
#include "loaders/base/mapped_file.h"
#include "replay/step/bundle_structure.h"
#include "reports/outputs/bundle_summary.h"

namespace nanreplay {

namespace {

cxxopts::Options inspect_options() {
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
  return options;
}

void print_inspect_help(const cxxopts::Options& options, CommandIo& io) {
  io.out << options.help()
         << "\nValid means `nanreplay run` will not reject the bundle for its structure. Whether the bundle\n"
            "faithfully records the run is not checked: only a replay that reproduces the logged losses\n"
            "shows that.\n"
         << exit_status_help("inspect");
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

}  // namespace

int inspect_command(const CommandArgs& args, CommandIo& io) {
  cxxopts::Options options = inspect_options();
  const auto parsed = parse_or_usage(options, args);
  if (parsed.count("help")) {
    print_inspect_help(options, io);
    return 0;
  }
  if (!parsed.count("bundle")) throw UsageError("inspect: missing BUNDLE (see nanreplay inspect --help)");
  const Bundle bundle(parsed["bundle"].as<std::string>());
  // What `run` checks before it replays, with the same messages.
  validate_bundle_structure(bundle);
  nlohmann::json summary = summarize_bundle(bundle);
  throw_if_mapped_file_changed();
  const bool valid = summary["valid"].get<bool>();
  std::optional<CommandFailure> invalid;
  if (!valid) {
    invalid = failure_of(ExitStatus::kBadInput, FailureKind::kBadInput, checksum_mismatch_line(summary));
    invalid->names_input = true;
    invalid->file = printable(parsed["bundle"].as<std::string>());
    invalid->key = "data.shards";
    // Under --json the summary is the one object on stdout: it carries the error as every command's does.
    summary["error"] = nlohmann::json::parse(failure_json(*invalid))["error"];
  }
  io.out << (parsed.count("json") ? summary.dump(2) + "\n" : render_bundle_summary(summary));
  if (invalid) {
    io.err << "nanreplay: error: " << invalid->message << "\n";
    return invalid->exit_status;
  }
  return 0;
}

}  // namespace nanreplay
