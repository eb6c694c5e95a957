// The model option table: one row per key of the manifest's model object that
// a family may set beyond the dimensions every model has (docs/bundle-format.md,
// "Model options"). The manifest reader parses and refuses by it, the writer
// writes by it, and tests compare the capture and import helpers' key lists
// with it. Each family's rows live in their own file (llama_options.cpp).
#pragma once

#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "loaders/arch/model_config.h"
#include "loaders/base/json_util.h"

namespace nanreplay {

struct ModelOption {
  const char* key;  // in the manifest's model object: "qk_norm"
  // Reads the key, present and not null, into `config`, which holds the
  // model's dimensions already. Errors name the file and "model.<key>...".
  void (*parse)(const JsonReader& model, ModelConfig& config);
  // Adds the key to the model object, only when `config` differs from the default.
  void (*write)(const ModelConfig& config, nlohmann::json& model);
};

struct ModelFamily {
  Arch arch;
  const char* name;     // the manifest's "arch"
  // How a refusal names the family and what it takes: "gpt2 (nanoGPT's model) has none".
  const char* refusal;
  // The options it takes, in the order they are parsed (the first bad one is reported).
  const std::vector<ModelOption>& options;
};

const std::vector<ModelOption>& llama_options();  // loaders/arch/llama_options.cpp

// Every family, llama first.
const std::vector<ModelFamily>& model_families();
const ModelFamily& model_family(Arch arch);

// The manifest's "arch": one of the families' names.
Arch read_arch(const JsonReader& model);
// A key another family owns set in a model of `arch`: refused by name, as it
// describes another model than the one that would be replayed.
void refuse_foreign_options(const JsonReader& model, Arch arch);
// Every option `config.arch`'s family takes, in its order.
void parse_model_options(const JsonReader& model, ModelConfig& config);
// Every option that differs from its default, whichever family owns it (so a
// model that sets another family's option is written as it is, and refused
// when read back rather than silently changed).
void write_model_options(const ModelConfig& config, nlohmann::json& model);

}  // namespace nanreplay
