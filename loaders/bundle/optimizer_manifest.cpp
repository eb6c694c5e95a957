// See optimizer_manifest.h. One table of hyper-parameter names per kind; the
// readers below check each value as its class's constructor does.
#include "loaders/bundle/optimizer_manifest.h"

#include <algorithm>
#include <cmath>
#include <set>

#include "loaders/arch/manifest_values.h"
#include "loaders/base/error.h"
#include "loaders/base/glob_match.h"

namespace nanreplay {
namespace {

struct optim_KindRow {
  OptimizerKind kind;
  const char* name;
  const char* class_name;
  std::vector<const char*> keys;  // its keyword arguments the replay reads
};

const std::vector<optim_KindRow>& optim_kind_rows() {
  static const std::vector<optim_KindRow> rows = {
      {OptimizerKind::kAdamW, "adamw", "torch.optim.AdamW", {"betas", "eps", "weight_decay", "amsgrad", "maximize"}},
      {OptimizerKind::kAdam, "adam", "torch.optim.Adam",
       {"betas", "eps", "weight_decay", "amsgrad", "maximize", "decoupled_weight_decay"}},
      {OptimizerKind::kAdafactor, "adafactor", "torch.optim.Adafactor",
       {"beta2_decay", "eps", "d", "weight_decay", "maximize"}},
      {OptimizerKind::kAdafactorHf, "adafactor_hf", "transformers.optimization.Adafactor",
       {"eps", "clip_threshold", "decay_rate", "beta1", "weight_decay", "scale_parameter", "relative_step",
        "warmup_init"}},
      {OptimizerKind::kMuon, "muon", "torch.optim.Muon",
       {"weight_decay", "momentum", "nesterov", "ns_coefficients", "eps", "ns_steps", "adjust_lr_fn", "use_addmm",
        "qk_clip"}},
  };
  return rows;
}

const optim_KindRow& optim_row_of(OptimizerKind kind) {
  for (const optim_KindRow& row : optim_kind_rows()) {
    if (row.kind == kind) return row;
  }
  throw std::logic_error("optimizer kind without a row");
}

OptimizerKind optim_read_kind(const JsonReader& reader, OptimizerKind fallback) {
  if (!reader.has("kind")) return fallback;
  std::vector<const char*> names;
  for (const optim_KindRow& row : optim_kind_rows()) names.push_back(row.name);
  const std::string name = one_of(reader, "kind", names);
  for (const optim_KindRow& row : optim_kind_rows()) {
    if (name == row.name) return row.kind;
  }
  return fallback;
}

// The class's defaults (its constructor's keyword arguments).
OptimizerRule optim_class_defaults(OptimizerKind kind) {
  OptimizerRule rule;
  rule.kind = kind;
  switch (kind) {
    case OptimizerKind::kAdamW: break;
    case OptimizerKind::kAdam: rule.weight_decay = 0.0; break;
    case OptimizerKind::kAdafactor: rule.weight_decay = 0.0; break;
    case OptimizerKind::kAdafactorHf: rule.weight_decay = 0.0; break;
    case OptimizerKind::kMuon:
      rule.weight_decay = 0.1;
      rule.eps = 1e-7;
      break;
  }
  return rule;
}

// A hyper-parameter another class has and this one does not: refused, since
// the replay would otherwise drop a value that changes the run's math.
void optim_refuse_foreign_keys(const JsonReader& reader, const optim_KindRow& row) {
  std::set<std::string> all;
  for (const optim_KindRow& other : optim_kind_rows()) all.insert(other.keys.begin(), other.keys.end());
  for (const std::string& key : all) {
    if (!reader.has(key)) continue;
    const bool own = std::any_of(row.keys.begin(), row.keys.end(), [&](const char* k) { return key == k; });
    if (!own) {
      throw InputError(reader.file(), reader.key_path(key),
                       std::string("is not a hyper-parameter of ") + row.class_name + " (optimizer kind \"" +
                           row.name + "\")");
    }
  }
}

double optim_number_in(const nlohmann::json& value, const std::string& file, const std::string& path, double low,
                 double high, bool high_inclusive, const std::string& range) {
  const double number = number_from_json(value, file, path);
  const bool in = std::isfinite(number) && number >= low && (high_inclusive ? number <= high : number < high);
  if (!in) throw InputError(file, path, "expected " + range + ", got " + exact_number_text(number));
  return number;
}

const nlohmann::json& optim_array_of(const JsonReader& reader, const std::string& key, size_t size) {
  const nlohmann::json& array = reader.array(key);
  if (array.size() != size) {
    throw InputError(reader.file(), reader.key_path(key),
                     "expected an array of " + std::to_string(size) + " numbers, got " + std::to_string(array.size()));
  }
  return array;
}

std::string optim_item_path(const JsonReader& reader, const std::string& key, size_t i) {
  return reader.key_path(key) + "[" + std::to_string(i) + "]";
}

void optim_read_betas(const JsonReader& r, OptimizerRule& rule) {
  if (!r.has("betas")) return;
  const nlohmann::json& betas = optim_array_of(r, "betas", 2);
  rule.beta1 = optim_number_in(betas[0], r.file(), optim_item_path(r, "betas", 0), 0, 1, false, "a number in [0, 1)");
  rule.beta2 = optim_number_in(betas[1], r.file(), optim_item_path(r, "betas", 1), 0, 1, false, "a number in [0, 1)");
}

bool optim_read_flag(const JsonReader& r, const std::string& key, bool fallback) {
  return r.optional_boolean(key).value_or(fallback);
}

void optim_read_adam(const JsonReader& r, OptimizerRule& rule) {
  optim_read_betas(r, rule);
  if (r.has("eps")) rule.eps = finite_number_above(r, "eps", 0, false);
  if (r.has("weight_decay")) rule.weight_decay = finite_number_above(r, "weight_decay", 0, true);
  rule.amsgrad = optim_read_flag(r, "amsgrad", rule.amsgrad);
  rule.maximize = optim_read_flag(r, "maximize", rule.maximize);
  rule.decoupled_weight_decay = optim_read_flag(r, "decoupled_weight_decay", rule.decoupled_weight_decay);
}

void optim_read_adafactor(const JsonReader& r, OptimizerRule& rule) {
  if (r.has("beta2_decay")) {
    rule.beta2_decay = optim_number_in(r.json().at("beta2_decay"), r.file(), r.key_path("beta2_decay"), -HUGE_VAL, 0, true,
                                 "a finite number <= 0");
  }
  if (r.has("eps")) {
    const nlohmann::json& eps = optim_array_of(r, "eps", 2);
    if (!eps[0].is_null()) {
      rule.eps1 = optim_number_in(eps[0], r.file(), optim_item_path(r, "eps", 0), 0, HUGE_VAL, false, "null or a finite number >= 0");
    }
    rule.eps2 = optim_number_in(eps[1], r.file(), optim_item_path(r, "eps", 1), 0, HUGE_VAL, false, "a finite number >= 0");
  }
  if (r.has("d")) rule.d = finite_number_above(r, "d", 1, true);
  if (r.has("weight_decay")) rule.weight_decay = finite_number_above(r, "weight_decay", 0, true);
  rule.maximize = optim_read_flag(r, "maximize", rule.maximize);
}

void optim_read_adafactor_hf(const JsonReader& r, OptimizerRule& rule) {
  if (r.has("eps")) {
    const nlohmann::json& eps = optim_array_of(r, "eps", 2);
    rule.eps1 = optim_number_in(eps[0], r.file(), optim_item_path(r, "eps", 0), 0, HUGE_VAL, false, "a finite number >= 0");
    rule.eps2 = optim_number_in(eps[1], r.file(), optim_item_path(r, "eps", 1), 0, HUGE_VAL, false, "a finite number >= 0");
  }
  if (r.has("clip_threshold")) rule.clip_threshold = finite_number_above(r, "clip_threshold", 0, false);
  if (r.has("decay_rate")) {
    rule.decay_rate = optim_number_in(r.json().at("decay_rate"), r.file(), r.key_path("decay_rate"), -HUGE_VAL, 0, true,
                                "a finite number <= 0");
  }
  if (r.has("beta1")) {
    rule.hf_beta1 = optim_number_in(r.json().at("beta1"), r.file(), r.key_path("beta1"), 0, 1, false,
                              "null or a number in [0, 1)");
  }
  if (r.has("weight_decay")) rule.weight_decay = finite_number_above(r, "weight_decay", 0, true);
  rule.scale_parameter = optim_read_flag(r, "scale_parameter", rule.scale_parameter);
  rule.relative_step = optim_read_flag(r, "relative_step", rule.relative_step);
  rule.warmup_init = optim_read_flag(r, "warmup_init", rule.warmup_init);
  if (rule.warmup_init && !rule.relative_step) {
    throw InputError(r.file(), r.key_path("warmup_init"), "true requires relative_step true (as the class requires)");
  }
}

void optim_read_qk_clip(const JsonReader& r, OptimizerRule& rule) {
  const std::optional<JsonReader> clip = r.optional_object("qk_clip");
  if (!clip) return;
  rule.qk_clip_tau = finite_number_above(*clip, "tau", 0, false);
}

void optim_read_muon(const JsonReader& r, OptimizerRule& rule) {
  if (r.has("weight_decay")) rule.weight_decay = finite_number_above(r, "weight_decay", 0, true);
  if (r.has("momentum")) rule.momentum = finite_number_above(r, "momentum", 0, true);
  rule.nesterov = optim_read_flag(r, "nesterov", rule.nesterov);
  if (r.has("ns_coefficients")) {
    const nlohmann::json& c = optim_array_of(r, "ns_coefficients", 3);
    double* slots[3] = {&rule.ns_a, &rule.ns_b, &rule.ns_c};
    for (size_t i = 0; i < 3; ++i) {
      *slots[i] = optim_number_in(c[i], r.file(), optim_item_path(r, "ns_coefficients", i), -HUGE_VAL, HUGE_VAL, false,
                            "a finite number");
    }
  }
  if (r.has("eps")) rule.eps = finite_number_above(r, "eps", 0, true);
  if (r.has("ns_steps")) {
    rule.ns_steps = r.integer("ns_steps");
    if (rule.ns_steps < 0 || rule.ns_steps >= 100) {
      throw InputError(r.file(), r.key_path("ns_steps"),
                       "expected an integer in [0, 100), got " + std::to_string(rule.ns_steps));
    }
  }
  if (r.has("adjust_lr_fn")) rule.adjust_lr_fn = one_of(r, "adjust_lr_fn", {"original", "match_rms_adamw"});
  rule.use_addmm = optim_read_flag(r, "use_addmm", rule.use_addmm);
  optim_read_qk_clip(r, rule);
}

// The rule `reader` describes, starting from `base` (the class's defaults,
// or the top level's settings for a group of the same kind).
OptimizerRule optim_read_rule(const JsonReader& reader, OptimizerRule rule) {
  optim_refuse_foreign_keys(reader, optim_row_of(rule.kind));
  switch (rule.kind) {
    case OptimizerKind::kAdamW:
    case OptimizerKind::kAdam: optim_read_adam(reader, rule); break;
    case OptimizerKind::kAdafactor: optim_read_adafactor(reader, rule); break;
    case OptimizerKind::kAdafactorHf: optim_read_adafactor_hf(reader, rule); break;
    case OptimizerKind::kMuon: optim_read_muon(reader, rule); break;
  }
  return rule;
}

std::vector<std::string> optim_string_list(const JsonReader& reader, const std::string& key) {
  std::vector<std::string> strings;
  const nlohmann::json& list = reader.array(key);
  for (size_t i = 0; i < list.size(); ++i) {
    if (!list[i].is_string()) {
      throw InputError(reader.file(), optim_item_path(reader, key, i), "expected a string, got " + json_describe(list[i]));
    }
    strings.push_back(list[i].get<std::string>());
  }
  return strings;
}

// A group of the top level's kind starts from the top level's settings (as a
// PyTorch param group takes the constructor's); another kind from its class's defaults.
OptimizerGroup optim_read_group(const JsonReader& group, const OptimizerRule& top, std::set<std::string>& names) {
  OptimizerGroup out;
  out.name = group.string("name");
  if (out.name.empty() || out.name == "default" || !names.insert(out.name).second) {
    throw InputError(group.file(), group.key_path("name"),
                     "expected a unique group name other than \"default\" (the top level's), got " +
                         json_describe(out.name));
  }
  out.params = optim_string_list(group, "params");
  const OptimizerKind kind = optim_read_kind(group, top.kind);
  out.rule = optim_read_rule(group, kind == top.kind ? top : optim_class_defaults(kind));
  return out;
}

std::vector<OptimizerGroup> optim_read_groups(const JsonReader& optimizer, const OptimizerRule& top) {
  std::vector<OptimizerGroup> groups;
  if (!optimizer.has("groups")) return groups;
  const nlohmann::json& list = optimizer.array("groups");
  std::set<std::string> names;
  for (size_t i = 0; i < list.size(); ++i) {
    groups.push_back(optim_read_group(JsonReader(list[i], optimizer.file(), optim_item_path(optimizer, "groups", i)), top, names));
  }
  return groups;
}

nlohmann::json optim_rule_json(const OptimizerRule& r) {
  nlohmann::json j = {{"kind", optim_row_of(r.kind).name}};
  auto or_null = [](const std::optional<double>& v) { return v ? nlohmann::json(*v) : nlohmann::json(nullptr); };
  switch (r.kind) {
    case OptimizerKind::kAdam: j["decoupled_weight_decay"] = r.decoupled_weight_decay; [[fallthrough]];
    case OptimizerKind::kAdamW:
      j.update({{"betas", {r.beta1, r.beta2}}, {"eps", r.eps}, {"weight_decay", r.weight_decay},
                {"amsgrad", r.amsgrad}, {"maximize", r.maximize}});
      break;
    case OptimizerKind::kAdafactor:
      j.update({{"beta2_decay", r.beta2_decay}, {"eps", {or_null(r.eps1), r.eps2}}, {"d", r.d},
                {"weight_decay", r.weight_decay}, {"maximize", r.maximize}});
      break;
    case OptimizerKind::kAdafactorHf:
      j.update({{"eps", {r.eps1.value_or(1e-30), r.eps2}}, {"clip_threshold", r.clip_threshold},
                {"decay_rate", r.decay_rate}, {"beta1", or_null(r.hf_beta1)}, {"weight_decay", r.weight_decay},
                {"scale_parameter", r.scale_parameter}, {"relative_step", r.relative_step},
                {"warmup_init", r.warmup_init}});
      break;
    case OptimizerKind::kMuon:
      j.update({{"weight_decay", r.weight_decay}, {"momentum", r.momentum}, {"nesterov", r.nesterov},
                {"ns_coefficients", {r.ns_a, r.ns_b, r.ns_c}}, {"eps", r.eps}, {"ns_steps", r.ns_steps},
                {"adjust_lr_fn", r.adjust_lr_fn}, {"use_addmm", r.use_addmm}});
      if (r.qk_clip_tau) j["qk_clip"] = {{"tau", *r.qk_clip_tau}};
      break;
  }
  return j;
}

}  // namespace

const char* optimizer_kind_name(OptimizerKind kind) { return optim_row_of(kind).name; }
const char* optimizer_class_name(OptimizerKind kind) { return optim_row_of(kind).class_name; }

OptimizerConfig parse_optimizer_config(const JsonReader& optimizer) {
  OptimizerConfig config;
  const OptimizerKind kind = optim_read_kind(optimizer, OptimizerKind::kAdamW);
  static_cast<OptimizerRule&>(config) = optim_read_rule(optimizer, optim_class_defaults(kind));
  if (optimizer.has("grad_clip")) config.grad_clip = finite_number_above(optimizer, "grad_clip", 0, false);
  if (optimizer.has("no_decay")) config.no_decay = optim_string_list(optimizer, "no_decay");
  config.groups = optim_read_groups(optimizer, config);
  return config;
}

nlohmann::json optimizer_config_json(const OptimizerConfig& config) {
  nlohmann::json j = optim_rule_json(config);
  j["no_decay"] = config.no_decay;
  if (config.grad_clip) j["grad_clip"] = *config.grad_clip;
  if (!config.groups.empty()) {
    nlohmann::json groups = nlohmann::json::array();
    for (const OptimizerGroup& g : config.groups) {
      nlohmann::json one = optim_rule_json(g.rule);
      one["name"] = g.name;
      one["params"] = g.params;
      groups.push_back(one);
    }
    j["groups"] = groups;
  }
  return j;
}

ParamRule rule_of_param(const OptimizerConfig& config, const std::string& name) {
  for (const OptimizerGroup& group : config.groups) {
    for (const std::string& pattern : group.params) {
      if (glob_match(pattern, name)) return {&group.rule, group.name};
    }
  }
  return {&config, "default"};
}

bool uses_qk_clip(const OptimizerConfig& config) {
  if (config.qk_clip_tau) return true;
  return std::any_of(config.groups.begin(), config.groups.end(),
                     [](const OptimizerGroup& g) { return g.rule.qk_clip_tau.has_value(); });
}

}  // namespace nanreplay
