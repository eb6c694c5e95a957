// See spike_counterfactual.h.
#include "reports/triage/spike_counterfactual.h"

#include <cmath>

#include "reports/results/number_text.h"

namespace nanreplay {

namespace {

// Whether `value` lies at least halfway, in log, from `low` to `high`; a non-finite value spikes.
bool reaches_spike(double value, double low, double high) {
  if (std::isnan(value)) return false;
  if (!std::isfinite(value)) return true;
  if (value <= 0.0) return false;
  return std::log(value / low) >= 0.5 * std::log(high / low);
}

std::string counterfactual_sentence(const Counterfactuals& c) {
  const std::string s = std::to_string(c.step), p = std::to_string(c.previous_step);
  if (c.conclusion == "data") {
    return "data: step " + s + "'s batch spikes on step " + p + "'s weights too, and step " + p +
           "'s batch does not on step " + s + "'s weights: the batch carries the spike";
  }
  if (c.conclusion == "model_state") {
    return "model state: step " + p + "'s batch spikes on step " + s + "'s weights, and step " + s +
           "'s batch does not on step " + p + "'s weights: the weights carry the spike";
  }
  if (c.conclusion == "both") return "both: either step " + s + "'s batch or its weights alone spike";
  if (c.conclusion == "interaction") {
    return "neither alone: only step " + s + "'s batch on step " + s + "'s weights spikes";
  }
  return "undecided: neither the loss nor the spike's site jumps between step " + p + " and step " + s;
}

}  // namespace

std::optional<CounterfactualSpikes> judge_counterfactual(const CounterfactualValues& v) {
  const bool finite = std::isfinite(v.previous) && std::isfinite(v.spike) && v.previous > 0.0 && v.spike > 0.0;
  if (!finite || v.spike < kCounterfactualMinJump * v.previous) return std::nullopt;
  return CounterfactualSpikes{reaches_spike(v.spike_batch_previous_weights, v.previous, v.spike),
                              reaches_spike(v.previous_batch_spike_weights, v.previous, v.spike)};
}

void conclude_counterfactuals(Counterfactuals& c, const std::vector<Finding>& findings, bool update_checked) {
  std::optional<CounterfactualSpikes> judged = judge_counterfactual(c.loss);
  c.decided_by = judged ? "loss" : "";
  if (!judged && c.site_values) {
    judged = judge_counterfactual(*c.site_values);
    if (judged) c.decided_by = "site";
  }
  if (!judged) {
    c.conclusion = "undecided";
  } else if (judged->spike_batch && judged->spike_weights) {
    c.conclusion = "both";
  } else if (judged->spike_batch) {
    c.conclusion = "data";
  } else if (judged->spike_weights) {
    c.conclusion = "model_state";
  } else {
    c.conclusion = "interaction";
  }
  c.sentence = counterfactual_sentence(c);
  if (c.decided_by == "site") c.sentence += " (by " + c.site + "'s " + c.statistic + "; the loss does not jump)";
  c.update = update_checked ? "computed" : "not_checked";
  for (const Finding& f : findings) {
    const bool update_fault = f.code == FindingCode::kSystemBitFlip || f.code == FindingCode::kSystemUpdateMismatch;
    if (update_fault && f.evidence.integer(EvidenceKey::kStep) == c.step) {
      c.update = "corrupted";
      c.update_code = f.name();
      break;
    }
  }
}

}  // namespace nanreplay
