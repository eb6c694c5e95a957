// steps/<step>/state.json parsed into a StepState. Key constraint: this file
// records a run that went wrong, so non-finite logged values and fp8 scales
// ("nan", "inf" strings) are data to replay, not input errors. The two scalars
// the replay itself computes with are not: a learning rate outside
// (0, kMaxLearningRate] or a loss scale that is not a positive finite number
// would replay silently into numbers no run produced, so they are refused
// with the file and key, as are wrong types and a missing `step`.
#include "loaders/bundle/step_state.h"

#include <algorithm>
#include <cmath>

#include "loaders/base/error.h"
#include "loaders/base/json_util.h"

namespace nanreplay {
namespace {

std::vector<double> number_list(const JsonReader& reader, const std::string& key) {
  std::vector<double> numbers;
  if (!reader.has(key)) return numbers;
  const nlohmann::json& list = reader.array(key);
  for (size_t i = 0; i < list.size(); ++i) {
    const std::string path = reader.key_path(key) + "[" + std::to_string(i) + "]";
    numbers.push_back(number_from_json(list[i], reader.file(), path));
  }
  return numbers;
}

// Above any rate AdamW trains with (typical rates are 1e-5..1e-2): a value
// this large is a corrupt or mis-scaled file, not a schedule.
constexpr double kMaxLearningRate = 1e3;

std::string number_text(double value) {
  if (std::isnan(value)) return "nan";
  if (std::isinf(value)) return value > 0 ? "inf" : "-inf";
  return nlohmann::json(value).dump();
}

double checked_lr(double lr, const std::string& file, const std::string& key) {
  if (!(lr > 0 && lr <= kMaxLearningRate)) {
    throw InputError(file, key,
                     "expected a learning rate in (0, 1e3], got " + number_text(lr) +
                         " (a run cannot have trained with it; the file is corrupt or was written wrongly)");
  }
  return lr;
}

// lr as an object: one learning rate per optimizer group name.
std::map<std::string, double> parse_lr_by_group(const JsonReader& root) {
  std::map<std::string, double> by_group;
  if (!root.has("lr") || !root.json().at("lr").is_object()) return by_group;
  const JsonReader lr = root.object("lr");
  for (const auto& item : root.json().at("lr").items()) {
    by_group[item.key()] = checked_lr(lr.number(item.key()), root.file(), lr.key_path(item.key()));
  }
  if (by_group.empty()) throw InputError(root.file(), "lr", "expected a number or a non-empty object of group names");
  return by_group;
}

std::optional<double> parse_lr(const JsonReader& root, const std::map<std::string, double>& by_group) {
  if (!by_group.empty()) {
    const auto it = by_group.find("default");
    if (it != by_group.end()) return it->second;
    double largest = 0;
    for (const auto& [group, lr] : by_group) largest = std::max(largest, lr);
    return largest;
  }
  const std::optional<double> lr = root.optional_number("lr");
  if (lr) checked_lr(*lr, root.file(), "lr");
  return lr;
}

double parse_loss_scale(const JsonReader& root) {
  const double scale = root.optional_number("loss_scale").value_or(1.0);
  if (!(scale > 0 && std::isfinite(scale))) {
    throw InputError(root.file(), "loss_scale",
                     "expected a positive finite loss scale, got " + number_text(scale) +
                         " (a loss scaler's scale never is)");
  }
  return scale;
}

Fp8ModuleScales parse_module_scales(const JsonReader& module) {
  Fp8ModuleScales scales;
  scales.input = module.optional_number("input");
  scales.weight = module.optional_number("weight");
  scales.grad_output = module.optional_number("grad_output");
  return scales;
}

std::map<std::string, Fp8ModuleScales> parse_fp8_scales(const std::optional<JsonReader>& fp8) {
  std::map<std::string, Fp8ModuleScales> scales;
  if (!fp8) return scales;
  for (const auto& [module, value] : fp8->json().items()) {
    // Module prefixes contain dots, so the key path quotes them.
    const std::string path = "fp8_scales[\"" + module + "\"]";
    if (module.empty()) throw InputError(fp8->file(), path, "expected a module name, got \"\"");
    scales[module] = parse_module_scales(JsonReader(value, fp8->file(), path));
  }
  return scales;
}

// router_score_bias: buffer name -> a list of numbers ("nan" and "inf" allowed: a bias gone
// non-finite is the run's own value to replay).
std::map<std::string, std::vector<double>> parse_router_score_bias(const std::optional<JsonReader>& biases) {
  std::map<std::string, std::vector<double>> by_name;
  if (!biases) return by_name;
  for (const auto& [name, value] : biases->json().items()) {
    const std::string path = "router_score_bias[\"" + name + "\"]";
    if (!value.is_array() || value.empty()) {
      throw InputError(biases->file(), path, "expected a non-empty list of numbers (one per expert)");
    }
    std::vector<double>& numbers = by_name[name];
    for (size_t i = 0; i < value.size(); ++i) {
      numbers.push_back(number_from_json(value[i], biases->file(), path + "[" + std::to_string(i) + "]"));
    }
  }
  return by_name;
}

// A statistic of a site: finite and >= 0 (max |x| and rms are magnitudes of
// finite elements, so anything else is a corrupt file, not a fault to replay).
double site_statistic(const JsonReader& pair, const std::string& key) {
  const double value = pair.number(key);
  if (!(std::isfinite(value) && value >= 0)) {
    throw InputError(pair.file(), pair.key_path(key),
                     "expected a finite number >= 0 (a statistic of the finite elements), got " + number_text(value));
  }
  return value;
}

LoggedSiteStat site_stat_pair(const JsonReader& pair) {
  return {site_statistic(pair, "max_abs"), site_statistic(pair, "rms")};
}

std::vector<LoggedSiteStat> site_stat_list(const JsonReader& site, const std::string& key) {
  std::vector<LoggedSiteStat> pairs;
  if (!site.has(key)) return pairs;
  const nlohmann::json& list = site.array(key);
  for (size_t i = 0; i < list.size(); ++i) {
    pairs.push_back(site_stat_pair(JsonReader(list[i], site.file(), site.key_path(key) + "[" + std::to_string(i) + "]")));
  }
  return pairs;
}

std::map<std::string, LoggedSiteStats> parse_site_stats(const std::optional<JsonReader>& stats) {
  std::map<std::string, LoggedSiteStats> sites;
  if (!stats) return sites;
  for (const auto& [name, value] : stats->json().items()) {
    // Site names contain dots, so the key path quotes them.
    const std::string path = "logged.site_stats[\"" + name + "\"]";
    if (name.empty()) throw InputError(stats->file(), path, "expected a site name, got \"\"");
    const JsonReader site(value, stats->file(), path);
    sites[name] = LoggedSiteStats{site_stat_pair(site), site_stat_list(site, "per_head"),
                                  site_stat_list(site, "per_expert")};
  }
  return sites;
}

LoggedMetrics parse_logged(const std::optional<JsonReader>& logged) {
  LoggedMetrics metrics;
  if (!logged) return metrics;
  metrics.loss = logged->optional_number("loss");
  metrics.grad_norm = logged->optional_number("grad_norm");
  metrics.rank_losses = number_list(*logged, "rank_losses");
  metrics.rank_grad_norms = number_list(*logged, "rank_grad_norms");
  metrics.site_stats = parse_site_stats(logged->optional_object("site_stats"));
  return metrics;
}

}  // namespace

StepState parse_step_state(const std::string& json_text, const std::string& file_label) {
  const nlohmann::json document = parse_json_guarded(json_text, file_label);
  const JsonReader root(document, file_label, "");

  StepState state;
  state.step = root.integer("step");
  if (state.step < 0) {
    throw InputError(file_label, "step",
                     "expected a non-negative integer, got " + std::to_string(state.step));
  }
  state.lr_by_group = parse_lr_by_group(root);
  state.lr = parse_lr(root, state.lr_by_group);
  state.loss_scale = parse_loss_scale(root);
  state.loss_scale_given = root.has("loss_scale");
  state.fp8_scales = parse_fp8_scales(root.optional_object("fp8_scales"));
  state.router_score_bias = parse_router_score_bias(root.optional_object("router_score_bias"));
  state.file = file_label;
  state.logged = parse_logged(root.optional_object("logged"));
  state.skipped = root.optional_boolean("skipped");
  return state;
}

std::string router_score_bias_key(int layer) {
  return "model.layers." + std::to_string(layer) + ".mlp.gate.e_score_correction_bias";
}

bool router_score_bias_derived(const StepState& state) {
  return state.router_score_bias.empty() && !state.derived_router_score_bias.empty();
}

std::map<int, std::vector<double>> router_score_bias_of(const StepState& state, const ModelConfig& model) {
  if (router_score_bias_derived(state)) return state.derived_router_score_bias;
  std::map<int, std::vector<double>> by_layer;
  const bool needed = model.moe && model.moe->router == RouterKind::kSigmoidGrouped && model.moe->score_bias;
  // model.mtp's blocks follow the decoder's layers, and those with experts have a bias too.
  const int64_t layers = model.num_layers + (model.mtp ? model.mtp->num_layers : 0);
  for (const auto& [name, numbers] : state.router_score_bias) {
    int layer = 0;
    while (layer < layers && (router_score_bias_key(layer) != name || !model.moe_layer(layer))) ++layer;
    if (!needed || layer == layers) {
      throw InputError(state.file, "router_score_bias[\"" + name + "\"]",
                       needed ? "names no layer with experts of this model (expected model.layers.<layer with "
                                "experts>.mlp.gate.e_score_correction_bias)"
                              : "the model's router adds no correction bias (model.moe.router \"sigmoid_grouped\" "
                                "with router_score_bias true does)");
    }
    if (static_cast<int64_t>(numbers.size()) != model.moe->num_experts) {
      throw InputError(state.file, "router_score_bias[\"" + name + "\"]",
                       "expected one number per expert (" + std::to_string(model.moe->num_experts) + "), got " +
                           std::to_string(numbers.size()));
    }
    by_layer[layer] = numbers;
  }
  for (int layer = 0; needed && layer < layers; ++layer) {
    if (!model.moe_layer(layer) || by_layer.count(layer) != 0) continue;
    throw InputError(state.file, "router_score_bias[\"" + router_score_bias_key(layer) + "\"]",
                     "required: layer " + std::to_string(layer) +
                         "'s router (sigmoid_grouped) chooses its experts by its scores plus this step's "
                         "e_score_correction_bias, a buffer the job updates each step (not a parameter); a step "
                         "without it is not replayed, unless it is rolled forward and the manifest's "
                         "model.moe.score_bias_update names the job's rule to derive it from the step before");
  }
  return by_layer;
}

}  // namespace nanreplay
