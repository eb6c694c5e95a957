// See counterfactual_output.h.
#include "reports/outputs/counterfactual_output.h"

#include "reports/results/number_text.h"
#include "reports/results/report.h"

namespace nanreplay {

namespace {

nlohmann::json counterfactual_values_json(const CounterfactualValues& v) {
  return {{"previous", json_number(v.previous)},
          {"spike", json_number(v.spike)},
          {"spike_batch_previous_weights", json_number(v.spike_batch_previous_weights)},
          {"previous_batch_spike_weights", json_number(v.previous_batch_spike_weights)}};
}

std::string counterfactual_values_text(const CounterfactualValues& v, const Counterfactuals& c) {
  const std::string s = std::to_string(c.step), p = std::to_string(c.previous_step);
  return "batch " + p + " on weights " + p + ": " + format_number(v.previous) + " | batch " + s + " on weights " + s +
         ": " + format_number(v.spike) + " | batch " + s + " on weights " + p + ": " +
         format_number(v.spike_batch_previous_weights) + " | batch " + p + " on weights " + s + ": " +
         format_number(v.previous_batch_spike_weights);
}

}  // namespace

nlohmann::json counterfactuals_json(const std::optional<Counterfactuals>& c) {
  if (!c) return nullptr;
  nlohmann::json loss = counterfactual_values_json(c->loss);
  loss["logged"] = c->logged_loss ? json_number(*c->logged_loss) : nlohmann::json(nullptr);
  loss["logged_previous"] = c->logged_previous_loss ? json_number(*c->logged_previous_loss) : nlohmann::json(nullptr);
  nlohmann::json site = nullptr;
  if (c->site_values) {
    site = counterfactual_values_json(*c->site_values);
    site["site"] = c->site;
    site["head"] = optional_index(c->head);
    site["expert"] = optional_index(c->expert);
    site["statistic"] = c->statistic;
  }
  return {{"step", c->step},
          {"previous_step", c->previous_step},
          {"loss", loss},
          {"site", site},
          {"conclusion", c->conclusion},
          {"decided_by", c->decided_by.empty() ? nlohmann::json(nullptr) : nlohmann::json(c->decided_by)},
          {"sentence", c->sentence},
          {"update", {{"into_step", c->step},
                      {"outcome", c->update},
                      {"code", c->update_code.empty() ? nlohmann::json(nullptr) : nlohmann::json(c->update_code)}}}};
}

std::vector<std::string> counterfactual_lines(const std::optional<Counterfactuals>& c) {
  if (!c) return {};
  std::vector<std::string> lines;
  lines.push_back("Counterfactuals: " + c->sentence);
  std::string logged = "loss: " + counterfactual_values_text(c->loss, *c);
  if (c->logged_loss || c->logged_previous_loss) {
    logged += " (logged: step " + std::to_string(c->previous_step) + " " +
              (c->logged_previous_loss ? format_number(*c->logged_previous_loss) : std::string("-")) + ", step " +
              std::to_string(c->step) + " " + (c->logged_loss ? format_number(*c->logged_loss) : std::string("-")) + ")";
  }
  lines.push_back(logged);
  if (c->site_values) lines.push_back(c->site + " " + c->statistic + ": " + counterfactual_values_text(*c->site_values, *c));
  const std::string into = "the update into step " + std::to_string(c->step) + ", re-derived by the update check: ";
  if (c->update == "corrupted") {
    lines.push_back(into + "does not match (" + c->update_code + "): a corrupted update");
  } else if (c->update == "computed") {
    lines.push_back(into + "matches: a computed update");
  } else {
    lines.push_back("the update into step " + std::to_string(c->step) + " was not re-derived (no checkpoint pair to compare)");
  }
  return lines;
}

}  // namespace nanreplay
