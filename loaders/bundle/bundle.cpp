// Opening a bundle: manifest first, then every path it names is resolved
// inside the bundle and checked to exist before any replay starts.
#include "loaders/bundle/bundle.h"

#include <algorithm>
#include <fstream>

#include "loaders/bundle/bundle_paths.h"
#include "loaders/base/error.h"

namespace nanreplay {

namespace fs = std::filesystem;

std::string StepFiles::label(const std::string& leaf) const {
  std::string dir_text = dir_label;
  while (!dir_text.empty() && dir_text.back() == '/') dir_text.pop_back();
  return dir_text + "/" + leaf;
}

std::string read_text_file(const fs::path& path, const std::string& label, size_t max_bytes) {
  std::error_code ec;
  if (!fs::exists(path, ec)) throw InputError(label, "", "file does not exist");
  if (!fs::is_regular_file(path, ec)) throw InputError(label, "", "not a regular file");
  const auto size = fs::file_size(path, ec);
  if (ec) throw InputError(label, "", "cannot read size: " + ec.message());
  if (size > max_bytes) {
    throw InputError(label, "", "file is " + std::to_string(size) + " bytes, more than the " +
                                    std::to_string(max_bytes) + " allowed");
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) throw InputError(label, "", "cannot open for reading");
  // Read in chunks and stop past the limit: a file growing after the size
  // check (still being copied in, or hostile) cannot make this read unbounded.
  std::string text;
  text.reserve(static_cast<size_t>(size));
  char chunk[1 << 16];
  while (in.read(chunk, sizeof chunk) || in.gcount() > 0) {
    text.append(chunk, static_cast<size_t>(in.gcount()));
    if (text.size() > max_bytes) {
      throw InputError(label, "", "file grew past the " + std::to_string(max_bytes) +
                                      " bytes allowed while it was being read");
    }
  }
  return text;
}

fs::path enclosing_bundle(const fs::path& path) {
  std::error_code ec;
  fs::path existing = fs::absolute(path, ec);
  if (ec) return {};
  while (!fs::exists(existing, ec)) {
    if (!existing.has_relative_path()) return {};
    existing = existing.parent_path();
  }
  const fs::path start = fs::canonical(existing, ec);
  if (ec) return {};
  for (fs::path dir = start;; dir = dir.parent_path()) {
    const fs::path manifest = dir / "manifest.json";
    std::error_code missing;
    if (fs::is_regular_file(manifest, missing)) {
      try {
        if (read_text_file(manifest, manifest.string()).find("\"nanreplay.bundle\"") != std::string::npos) return dir;
      } catch (const InputError&) {
        // Unreadable or huge: not a bundle this tool could have made.
      }
    }
    if (!dir.has_relative_path()) break;
  }
  return {};
}

namespace {

// Whether an optional file is there; something else under its name is an error.
bool optional_regular_file(const fs::path& path, const std::string& label) {
  std::error_code ec;
  const fs::file_status status = fs::status(path, ec);
  if (!fs::exists(status)) return false;
  if (!fs::is_regular_file(status)) {
    throw InputError(label, "",
                     std::string("expected a regular file, found ") +
                         (fs::is_directory(status) ? "a directory" : fs::is_fifo(status) ? "a FIFO" : "a special file"));
  }
  return true;
}

}  // namespace

Bundle::Bundle(const fs::path& root) {
  std::error_code ec;
  if (!fs::exists(root, ec)) throw InputError(root.string(), "", "bundle directory does not exist");
  if (!fs::is_directory(root, ec)) throw InputError(root.string(), "", "bundle is not a directory");
  root_ = fs::canonical(root, ec);
  if (ec) throw InputError(root.string(), "", "cannot resolve: " + ec.message());

  const std::string manifest_label = "manifest.json";
  // Resolved like every other path: a manifest.json symlinked outside the
  // bundle must not make the tool read (and quote) a file elsewhere.
  const fs::path manifest_path = resolve_in_bundle(root_, manifest_label, manifest_label, "");
  if (!fs::exists(manifest_path, ec)) {
    throw InputError(manifest_label, "",
                     "missing: " + root.string() + " is not a nanreplay bundle (no manifest.json)");
  }
  manifest_ = parse_manifest(read_text_file(manifest_path, manifest_label), manifest_label);

  for (size_t i = 0; i < manifest_.steps.size(); ++i) {
    const StepEntry& entry = manifest_.steps[i];
    const std::string key = "steps[" + std::to_string(i) + "].dir";
    StepFiles files;
    files.step = entry.step;
    files.dir_label = entry.dir;
    files.dir = resolve_in_bundle(root_, entry.dir, manifest_label, key);
    if (!fs::is_directory(files.dir, ec)) {
      throw InputError(manifest_label, key, "step directory '" + entry.dir + "' does not exist");
    }
    files.model = resolve_in_bundle(root_, files.label("model.safetensors"), manifest_label, key);
    files.optimizer =
        resolve_in_bundle(root_, files.label("optimizer.safetensors"), manifest_label, key);
    files.state = resolve_in_bundle(root_, files.label("state.json"), manifest_label, key);
    if (!fs::is_regular_file(files.state, ec)) {
      throw InputError(files.label("state.json"), "", "missing: every step needs its state.json");
    }
    // Optional (model.safetensors in every step but the first: the replay rolls
    // forward), but when something has its name it must be the file: a FIFO
    // or a directory is a broken bundle, not a step without that file.
    files.has_model = optional_regular_file(files.model, files.label("model.safetensors"));
    if (!files.has_model && i == 0) {
      throw InputError(files.label("model.safetensors"), "",
                       "missing: the bundle's first step needs its model checkpoint (later steps may be derived "
                       "from it)");
    }
    optional_regular_file(files.optimizer, files.label("optimizer.safetensors"));
    steps_.push_back(std::move(files));
  }

  tokens_ = std::make_unique<TokenStream>(root_, manifest_.data.shards, manifest_label);
  num_samples_ = tokens_->num_samples(manifest_.data.seq_len);
  if (num_samples_ <= 0) {
    throw InputError(manifest_label, "data.shards",
                     "the shards hold " + std::to_string(tokens_->total_tokens()) +
                         " tokens, too few for one sample of seq_len + 1 = " +
                         std::to_string(manifest_.data.seq_len + 1));
  }
  sampler_ = std::make_unique<StepSampler>(manifest_, num_samples_, manifest_label);
}

const StepFiles& Bundle::step_files(int64_t step) const {
  for (const StepFiles& files : steps_) {
    if (files.step == step) return files;
  }
  throw InputError("manifest.json", "steps", "no step " + std::to_string(step) + " in the bundle");
}

StepState Bundle::load_state(const StepFiles& files) const {
  const std::string label = files.label("state.json");
  StepState state = parse_step_state(read_text_file(files.state, label), label);
  if (state.step != files.step) {
    throw InputError(label, "step",
                     "says step " + std::to_string(state.step) + " but the manifest lists it as step " +
                         std::to_string(files.step));
  }
  return state;
}

bool Bundle::has_optimizer(const StepFiles& files) const {
  std::error_code ec;
  return fs::is_regular_file(files.optimizer, ec);
}

bool Bundle::rolls_forward() const {
  return std::any_of(steps_.begin(), steps_.end(), [](const StepFiles& f) { return !f.has_model; });
}

const StepFiles* Bundle::find_step_files(int64_t step) const {
  for (const StepFiles& files : steps_) {
    if (files.step == step) return &files;
  }
  return nullptr;
}

}  // namespace nanreplay
