// See outlier_output.h.
#include "reports/outputs/outlier_output.h"

#include <cmath>

#include "reports/results/number_text.h"
#include "reports/results/report.h"
#include "reports/triage/window_outliers.h"

namespace nanreplay {

namespace {

// NaN: the step did not probe it (the tracker keeps finite values only).
nlohmann::json series_json(const std::vector<double>& series) {
  nlohmann::json out = nlohmann::json::array();
  for (double v : series) out.push_back(std::isnan(v) ? nlohmann::json(nullptr) : json_number(v));
  return out;
}

nlohmann::json maybe_number(const std::optional<double>& v) { return v ? json_number(*v) : nlohmann::json(nullptr); }

std::string series_text(const std::vector<double>& series) {
  std::string text;
  for (double v : series) text += (text.empty() ? "" : ", ") + format_number(v);
  return text;
}

std::string steps_text(const std::vector<int64_t>& steps) {
  if (steps.size() == 1) return "step " + std::to_string(steps.front());
  return "steps " + std::to_string(steps.front()) + "-" + std::to_string(steps.back());
}

}  // namespace

nlohmann::json head_logit_growth_json(const std::optional<WindowOutliers>& w) {
  if (!w || w->heads.empty()) return nullptr;
  nlohmann::json heads = nlohmann::json::array();
  for (const HeadLogitSeries& h : w->heads) {
    heads.push_back({{"layer", h.layer},
                     {"head", h.head},
                     {"max_logit", series_json(h.max_logit)},
                     {"healthy_growth", maybe_number(h.healthy_growth)},
                     {"spike_jump", maybe_number(h.spike_jump)}});
  }
  return {{"steps", w->steps}, {"heads", heads}};
}

nlohmann::json expert_outliers_json(const std::optional<WindowOutliers>& w) {
  if (!w || w->experts.empty()) return nullptr;
  nlohmann::json experts = nlohmann::json::array();
  for (const ExpertOutlierSeries& e : w->experts) {
    experts.push_back({{"layer", e.layer},
                       {"expert", e.expert},
                       {"act_max", series_json(e.act_max)},
                       {"down_max", series_json(e.down_max)},
                       {"router_logit_max", series_json(e.router_logit_max)},
                       {"spike_jump", maybe_number(e.spike_jump)}});
  }
  return {{"steps", w->steps}, {"experts", experts}};
}

nlohmann::json mechanism_json(const std::optional<LogitGrowthMechanism>& m) {
  if (!m) return nullptr;
  return {{"name", "attention_logit_growth"},
          {"layer", m->layer},
          {"head", m->head},
          {"healthy_growth", json_number(m->healthy_growth)},
          {"spike_jump", json_number(m->spike_jump)},
          {"threshold", kLogitGrowthHealthyFactor}};
}

std::vector<std::string> window_outlier_lines(const std::optional<WindowOutliers>& w) {
  std::vector<std::string> lines;
  if (!w || w->steps.empty()) return lines;
  if (!w->heads.empty()) {
    const HeadLogitSeries& h = w->heads.front();
    std::string line = "Largest query-key logit (" + steps_text(w->steps) + "): layers." + std::to_string(h.layer) +
                       " head " + std::to_string(h.head) + ": " + series_text(h.max_logit);
    if (h.healthy_growth) line += "; " + format_number(*h.healthy_growth) + "x over the healthy steps";
    if (h.spike_jump) line += ", " + format_number(*h.spike_jump) + "x into the spike";
    lines.push_back(line);
  }
  if (!w->experts.empty()) {
    const ExpertOutlierSeries& e = w->experts.front();
    lines.push_back("Largest expert activation (" + steps_text(w->steps) + "): layers." + std::to_string(e.layer) +
                    " expert " + std::to_string(e.expert) + ": mlp.expert.act " + series_text(e.act_max) +
                    "; mlp.expert.down " + series_text(e.down_max) + "; router logit " +
                    series_text(e.router_logit_max));
  }
  return lines;
}

}  // namespace nanreplay
