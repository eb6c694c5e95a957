// `nanreplay synth PRESET DIR`: write a synthetic bundle from a named preset
// and print what was planted as one JSON line.
#include "cli/synth_command.h"

#include <algorithm>

#include <nlohmann/json.hpp>

#include "cli/cli_support.h"
#include "cli/command_table.h"
#include "loaders/bundle/bundle.h"
#include "loaders/base/error.h"
#include "loaders/base/json_util.h"
#include "loaders/bundle/optimizer_manifest.h"
#include "loaders/bundle/step_state.h"

namespace nanreplay {

namespace fs = std::filesystem;

namespace {

cxxopts::Options synth_options() {
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
      ("checkpoint-every", "roll forward: a full checkpoint only every N steps from the first (and where the "
       "fault edits one); the steps between hold only state.json", cxxopts::value<int64_t>(), "N")
      ("optimizer", "train with the manifest \"optimizer\" section in FILE (docs/optimizers.md) instead of the "
       "preset's AdamW", cxxopts::value<std::string>(), "FILE")
      ("lr", "the learning rate of every step: a number, or a JSON object of optimizer group names "
       "(\"default\": the top level)", cxxopts::value<std::string>(), "LR")
      ("steps", "train N steps (default: the preset's)", cxxopts::value<int64_t>(), "N")
      ("json", "what was planted, as one JSON object (synth always prints it so; accepted as every command takes it)")
      ("h,help", "show this help");
  options.parse_positional({"preset", "dir"});
  options.positional_help("PRESET DIR");
  return options;
}

std::string preset_listing() {
  size_t width = 0;  // the longest name, so every description starts in one column
  for (const SyntheticPreset& p : synthetic_presets()) width = std::max(width, std::string(p.name).size());
  std::string listing;
  for (const SyntheticPreset& p : synthetic_presets()) {
    const std::string name(p.name);
    listing += "  " + name + std::string(width + 2 - name.size(), ' ') + p.plants + "\n";
  }
  return listing;
}

SyntheticSpec preset_spec(const std::string& name) {
  try {
    return synthetic_preset(name);
  } catch (const std::invalid_argument& e) {
    std::string names;
    for (const SyntheticPreset& p : synthetic_presets()) names += (names.empty() ? "" : ", ") + std::string(p.name);
    throw UsageError(std::string(e.what()) + "; presets: " + names);
  }
}

void read_corpus(const std::string& path, SyntheticSpec& spec) {
  const std::string bytes = read_text_file(path, path, size_t{64} << 20);
  if (bytes.size() < static_cast<size_t>(4 * spec.seq_len)) throw InputError(path, "", "too short for a corpus");
  spec.corpus.assign(bytes.begin(), bytes.end());
}

nlohmann::json planted_json(const fs::path& dir, const SyntheticSpec& spec, const SyntheticOutcome& outcome) {
  return {{"bundle", dir.string()},
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
          {"fault_head", spec.fault.head},
          {"fault_expert", spec.fault.expert}};
}

// --optimizer FILE, --lr and --steps: the run trained with another optimizer.
void read_training_flags(const cxxopts::ParseResult& parsed, SyntheticSpec& spec) {
  if (parsed.count("optimizer")) {
    const std::string path = parsed["optimizer"].as<std::string>();
    const nlohmann::json section = parse_json_guarded(read_text_file(path, path, size_t{1} << 20), path);
    spec.optimizer = parse_optimizer_config(JsonReader(section, path, ""));
  }
  if (parsed.count("lr")) {
    const std::string text = parsed["lr"].as<std::string>();
    const nlohmann::json state = {{"step", 0}, {"lr", parse_json_guarded(text, "--lr")}};
    const StepState parsed_lr = parse_step_state(state.dump(), "--lr");
    spec.lr = parsed_lr.lr.value_or(spec.lr);
    spec.lr_by_group = parsed_lr.lr_by_group;
  }
  if (parsed.count("steps")) {
    spec.num_steps = parsed["steps"].as<int64_t>();
    if (spec.num_steps < 1 || spec.num_steps > 1000) throw UsageError("synth: --steps must be in [1, 1000]");
  }
}

}  // namespace

void refuse_inside_a_bundle(const fs::path& dir) {
  const fs::path enclosing = enclosing_bundle(dir);
  if (!enclosing.empty()) {
    throw UsageError(dir.string() + " is inside the bundle " + enclosing.string() +
                     "; nanreplay never writes into a bundle, choose another directory");
  }
}

SyntheticOutcome write_bundle_for_user(const fs::path& dir, const SyntheticSpec& spec) {
  std::error_code ec;
  const bool existed = fs::exists(dir, ec);
  const StopDeferral writing;
  const SyntheticOutcome outcome = write_synthetic_bundle(dir, spec);
  if (stop_requested()) {
    fs::remove_all(dir, ec);
    if (existed) fs::create_directory(dir, ec);  // the empty directory the user made
    throw Interrupted("interrupted; nothing was written");
  }
  return outcome;
}

int synth_command(const CommandArgs& args, CommandIo& io) {
  cxxopts::Options options = synth_options();
  const auto parsed = parse_or_usage(options, args);
  if (parsed.count("help")) {
    // The preset listing stays last: scripts read the presets from the lines after "presets:".
    io.out << options.help() << exit_status_help("synth") << "\npresets:\n" << preset_listing();
    return 0;
  }
  if (!parsed.count("preset") || !parsed.count("dir")) throw UsageError("synth: need PRESET and DIR");
  SyntheticSpec spec = preset_spec(parsed["preset"].as<std::string>());
  if (parsed.count("corpus")) read_corpus(parsed["corpus"].as<std::string>(), spec);
  read_training_flags(parsed, spec);
  if (parsed.count("checkpoint-every")) {
    spec.checkpoint_every = parsed["checkpoint-every"].as<int64_t>();
    if (spec.checkpoint_every < 1) throw UsageError("synth: --checkpoint-every must be at least 1");
  }
  const fs::path dir = parsed["dir"].as<std::string>();
  refuse_inside_a_bundle(dir);
  std::error_code ec;
  if (fs::exists(dir, ec) && !fs::is_empty(dir, ec)) throw UsageError(dir.string() + " exists and is not empty");
  const SyntheticOutcome outcome = write_bundle_for_user(dir, spec);
  io.out << planted_json(dir, spec, outcome).dump() << "\n";
  return 0;
}

}  // namespace nanreplay
