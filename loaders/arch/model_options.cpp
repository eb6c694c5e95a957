// The families and the reader's and writer's walk over their option rows;
// see model_options.h.
#include "loaders/arch/model_options.h"

#include "loaders/arch/manifest_values.h"
#include "loaders/base/error.h"

namespace nanreplay {

namespace {

// nanoGPT's gpt2 takes no option: its layout is fixed (LayerNorm, biases,
// learned positions, tied head).
const std::vector<ModelOption>& gpt2_options() {
  static const std::vector<ModelOption> none;
  return none;
}

// The first family that lists `key`.
const ModelFamily* owner_of(const std::string& key) {
  for (const ModelFamily& family : model_families()) {
    for (const ModelOption& option : family.options) {
      if (key == option.key) return &family;
    }
  }
  return nullptr;
}

bool family_takes(const ModelFamily& family, const std::string& key) {
  for (const ModelOption& option : family.options) {
    if (key == option.key) return true;
  }
  return false;
}

}  // namespace

const std::vector<ModelFamily>& model_families() {
  static const std::vector<ModelFamily> families = {
      {Arch::kLlama, "llama", "llama has none", llama_options()},
      {Arch::kGpt2, "gpt2", "gpt2 (nanoGPT's model) has none", gpt2_options()},
  };
  return families;
}

const ModelFamily& model_family(Arch arch) {
  for (const ModelFamily& family : model_families()) {
    if (family.arch == arch) return family;
  }
  throw std::logic_error("no model family for this arch");
}

const char* arch_name(Arch arch) { return model_family(arch).name; }

Arch read_arch(const JsonReader& model) {
  std::vector<const char*> names;
  for (const ModelFamily& family : model_families()) names.push_back(family.name);
  const std::string name = one_of(model, "arch", names);
  for (const ModelFamily& family : model_families()) {
    if (name == family.name) return family.arch;
  }
  throw std::logic_error("one_of returned a name no family has");
}

void refuse_foreign_options(const JsonReader& model, Arch arch) {
  const ModelFamily& family = model_family(arch);
  for (const ModelFamily& other : model_families()) {
    for (const ModelOption& option : other.options) {
      if (!model.has(option.key) || family_takes(family, option.key)) continue;
      throw InputError(model.file(), model.key_path(option.key),
                       std::string("is a ") + owner_of(option.key)->name + "-family option; " + family.refusal +
                           ", got " + json_describe(model.json().at(option.key)));
    }
  }
}

void parse_model_options(const JsonReader& model, ModelConfig& config) {
  for (const ModelOption& option : model_family(config.arch).options) {
    // Absent and null both mean the default (JsonReader::has is false for null).
    if (model.has(option.key)) option.parse(model, config);
  }
}

void write_model_options(const ModelConfig& config, nlohmann::json& model) {
  for (const ModelFamily& family : model_families()) {
    for (const ModelOption& option : family.options) option.write(config, model);
  }
}

}  // namespace nanreplay
