// steps/<step>/state.json parsed into a StepState. Key constraint: this file
// records a run that went wrong, so non-finite values ("nan", "inf" strings or
// a broken loss scale) are data to replay, not input errors; only wrong types,
// a missing `step` and a negative learning rate are refused.
#include "loaders/step_state.h"

#include <cmath>

#include "loaders/error.h"
#include "loaders/json_util.h"

namespace nanreplay {
namespace {

std::vector<double> number_list(const JsonReader& reader, const std::string& key) {
  std::vector<double> numbers;
  if (!reader.has(key)) return numbers;
  const nlohmann::json& list = reader.array(key);
  for (size_t i = 0; i < list.size(); ++i) {
    const std::string path = reader.key_path(key) + "[" + std::to_string(i) + "]";
    numbers.push_back(json_number(list[i], reader.file(), path));
  }
  return numbers;
}

// A NaN or +inf rate may be what broke the run, so it is kept for the replay;
// a negative rate cannot come from any scheduler and means a corrupt file.
std::optional<double> parse_lr(const JsonReader& root) {
  const std::optional<double> lr = root.optional_number("lr");
  if (lr && *lr < 0) {
    throw InputError(root.file(), "lr",
                     "expected a number >= 0, got " +
                         (std::isfinite(*lr) ? nlohmann::json(*lr).dump() : "-inf"));
  }
  return lr;
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

LoggedMetrics parse_logged(const std::optional<JsonReader>& logged) {
  LoggedMetrics metrics;
  if (!logged) return metrics;
  metrics.loss = logged->optional_number("loss");
  metrics.grad_norm = logged->optional_number("grad_norm");
  metrics.rank_losses = number_list(*logged, "rank_losses");
  metrics.rank_grad_norms = number_list(*logged, "rank_grad_norms");
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
  state.lr = parse_lr(root);
  state.loss_scale = root.optional_number("loss_scale").value_or(1.0);
  state.fp8_scales = parse_fp8_scales(root.optional_object("fp8_scales"));
  state.logged = parse_logged(root.optional_object("logged"));
  state.skipped = root.optional_boolean("skipped");
  return state;
}

}  // namespace nanreplay
