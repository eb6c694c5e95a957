// manifest.json's "optimizer" section (docs/optimizers.md): the top-level
// update rule, its parameter groups, grad_clip and no_decay. Each kind reads
// its class's keyword arguments under their own names with that class's
// defaults; a hyper-parameter of another class, an unknown kind or a value
// out of the class's range throws InputError naming the key.
#pragma once

#include <string>

#include <nlohmann/json.hpp>

#include "loaders/base/json_util.h"
#include "loaders/bundle/manifest.h"

namespace nanreplay {

OptimizerConfig parse_optimizer_config(const JsonReader& optimizer);

// The section as parse_optimizer_config reads it back (every hyper-parameter written).
nlohmann::json optimizer_config_json(const OptimizerConfig& config);

// The class a kind names, for messages: "torch.optim.Muon".
const char* optimizer_class_name(OptimizerKind kind);

// The rule and the group name ("default" for the top level) of parameter `name`.
struct ParamRule {
  const OptimizerRule* rule = nullptr;
  std::string group;
};
ParamRule rule_of_param(const OptimizerConfig& config, const std::string& name);

// True when the top level or a group asks for MuonClip (qk_clip).
bool uses_qk_clip(const OptimizerConfig& config);

}  // namespace nanreplay
