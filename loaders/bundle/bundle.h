// An opened incident bundle: the validated manifest, the token stream, the
// sampler and the location of every step's files. Opening reads only the
// manifest and maps the shards; checkpoints are opened one step at a time.
// Nothing here ever writes into the bundle.
#pragma once

#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "loaders/bundle/manifest.h"
#include "loaders/bundle/sampler.h"
#include "loaders/bundle/step_state.h"
#include "loaders/bundle/token_shards.h"

namespace nanreplay {

struct StepFiles {
  int64_t step = 0;
  std::filesystem::path dir;
  std::filesystem::path model;      // required in the first step, optional after it
  bool has_model = true;            // false: the replay derives this step's parameters
  std::filesystem::path optimizer;  // may not exist
  std::filesystem::path state;      // required
  std::string label(const std::string& leaf) const;  // "steps/105/model.safetensors"
  std::string dir_label;                              // as the manifest lists it
};

class Bundle {
 public:
  // Throws InputError naming the file and key on any problem with the manifest,
  // a step directory or a shard.
  explicit Bundle(const std::filesystem::path& root);

  const std::filesystem::path& root() const { return root_; }
  const Manifest& manifest() const { return manifest_; }
  const TokenStream& tokens() const { return *tokens_; }
  const StepSampler& sampler() const { return *sampler_; }
  int64_t num_samples() const { return num_samples_; }
  const std::vector<StepFiles>& steps() const { return steps_; }
  const StepFiles& step_files(int64_t step) const;

  StepState load_state(const StepFiles& files) const;
  bool has_optimizer(const StepFiles& files) const;
  // Some step has no model checkpoint: the replay rolls forward from the first
  // step's (docs/bundle-format.md, "Rolling forward").
  bool rolls_forward() const;
  const StepFiles* find_step_files(int64_t step) const;  // null: not listed

 private:
  std::filesystem::path root_;
  Manifest manifest_;
  std::unique_ptr<TokenStream> tokens_;
  std::unique_ptr<StepSampler> sampler_;
  int64_t num_samples_ = 0;
  std::vector<StepFiles> steps_;
};

// The bundle `path` is, or would lie inside once created: the nearest existing
// ancestor of `path` or one of its parents that holds a manifest.json naming
// the format "nanreplay.bundle". Empty when there is none. For the commands
// that create directories (synth, demo): they never write into a bundle.
std::filesystem::path enclosing_bundle(const std::filesystem::path& path);

// Reads a small text file whole (JSON), refusing files over `max_bytes`.
std::string read_text_file(const std::filesystem::path& path, const std::string& label,
                           size_t max_bytes = 64u << 20);

}  // namespace nanreplay
