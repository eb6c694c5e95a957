// report.json rendering. Field names and meanings follow report-v1; keys this
// project adds are documented in docs/report-format.md.
#include "reports/outputs/report_json.h"

#include <algorithm>
#include <cmath>

#include "reports/outputs/counterfactual_output.h"
#include "reports/outputs/damage_output.h"
#include "reports/outputs/masked_score_output.h"
#include "reports/outputs/next_step.h"
#include "reports/outputs/outlier_output.h"
#include "reports/outputs/spike_output.h"

namespace nanreplay {

namespace {

nlohmann::json first_to_json(const FirstNonfinite& first) {
  nlohmann::json out = {
      {"step", first.step},
      {"phase", phase_name(first.phase)},
      {"site", first.name()},
      {"layer", optional_index(first.layer)},
      {"head", optional_index(first.head)},
      {"expert", optional_index(first.expert)},
      {"kind", nonfinite_kind_name(first.kind)},
      {"rank", optional_index(first.rank)},
      {"micro_batch", optional_index(first.micro_batch)},
      {"sample", optional_index(first.sample)},
      {"position", optional_index(first.position)},
      {"index", first.index},
      {"shape", first.shape},
      {"producer", first.contaminated_params.empty()},
  };
  if (!first.contaminated_params.empty()) out["checkpoint_nonfinite_params"] = first.contaminated_params;
  out["token"] = optional_index(first.token);
  if (first.original_sample) out["original_sample"] = *first.original_sample;
  if (first.original_offset) out["original_offset"] = *first.original_offset;
  if (first.damage) out["damage"] = damage_json(first.damage);
  if (first.masked_score) out["masked_score"] = masked_score_json(first);
  return out;
}

nlohmann::json trajectory_json(const ReproductionCheck::Trajectory& t) {
  return {{"checked_steps", t.checked_steps},
          {"tolerance", t.tolerance},
          {"max_relative_gap", t.max_gap},
          {"diverged_at", t.diverged_at ? nlohmann::json(*t.diverged_at) : nlohmann::json(nullptr)}};
}

nlohmann::json reproduction_json(const ReproductionCheck& r) {
  return {{"checked_steps", r.checked_steps},
          {"matching_steps", r.matching_steps},
          {"tolerance", r.tolerance},
          {"max_relative_gap", r.max_gap},
          {"reproduces", r.reproduces ? nlohmann::json(*r.reproduces) : nlohmann::json(nullptr)},
          {"trajectory", r.trajectory ? trajectory_json(*r.trajectory) : nlohmann::json(nullptr)}};
}


nlohmann::json what_if_outcome_json(const WhatIfOutcome& w) {
  return {{"what_if", w.what_if},
          {"step", w.step ? nlohmann::json(*w.step) : nlohmann::json(nullptr)},
          {"change", w.change},
          {"first_nonfinite_before", first_nonfinite_json(w.before)},
          {"first_nonfinite_after", first_nonfinite_json(w.after)},
          {"resolved", w.resolved ? nlohmann::json(*w.resolved) : nlohmann::json(nullptr)},
          {"loss_after", w.loss_after ? json_number(*w.loss_after) : nlohmann::json(nullptr)},
          {"scaler_skipped", w.scaler_skipped},
          {"replays", w.replays}};
}

nlohmann::json probe_summary_json(const ProbeSummary& p) {
  if (!p.probed) return nullptr;
  return {{"forward_max_abs", json_number(p.forward_max_abs)},
          {"backward_max_abs", json_number(p.backward_max_abs)},
          {"nonfinite_records", p.nonfinite_records}};
}

// steps[].attn_logit_max: [layer][head], null where the head was not seen.
nlohmann::json logit_max_json(const std::vector<std::vector<double>>& maxima) {
  nlohmann::json layers = nlohmann::json::array();
  for (const std::vector<double>& row : maxima) {
    nlohmann::json heads = nlohmann::json::array();
    for (double v : row) heads.push_back(v == -INFINITY ? nlohmann::json(nullptr) : json_number(v));
    layers.push_back(heads);
  }
  return layers;
}

// steps[].expert_activation_max: [layer][expert] {input, output}; null for a
// layer without experts, nulls for an expert nothing was routed to.
nlohmann::json expert_activation_json(const std::vector<std::optional<std::vector<ExpertActivationMax>>>& maxima) {
  nlohmann::json layers = nlohmann::json::array();
  for (const auto& layer : maxima) {
    if (!layer) {
      layers.push_back(nullptr);
      continue;
    }
    nlohmann::json experts = nlohmann::json::array();
    for (const ExpertActivationMax& e : *layer) {
      const bool seen = e.rows > 0;
      experts.push_back({{"input", seen ? json_number(e.input) : nlohmann::json(nullptr)},
                         {"output", seen ? json_number(e.output) : nlohmann::json(nullptr)}});
    }
    layers.push_back(experts);
  }
  return layers;
}

// steps[].router_logit_max: [layer][expert], null for a layer without a router.
nlohmann::json router_logit_max_json(const std::vector<std::vector<double>>& maxima) {
  nlohmann::json layers = nlohmann::json::array();
  for (const std::vector<double>& row : maxima) {
    const bool routed = std::any_of(row.begin(), row.end(), [](double v) { return v != -INFINITY; });
    if (!routed) {
      layers.push_back(nullptr);
      continue;
    }
    nlohmann::json experts = nlohmann::json::array();
    for (double v : row) experts.push_back(json_number(v));
    layers.push_back(experts);
  }
  return layers;
}

// steps[].router_score_bias {"<layer>": [E]}, with _source and _derived_gap beside it.
void add_router_score_bias(nlohmann::json& out, const RouterScoreBias& bias) {
  nlohmann::json layers = nlohmann::json::object();
  for (const auto& [layer, values] : bias.by_layer) {
    nlohmann::json row = nlohmann::json::array();
    for (double v : values) row.push_back(json_number(v));
    layers[std::to_string(layer)] = row;
  }
  out["router_score_bias"] = layers;
  out["router_score_bias_source"] = bias.derived ? "derived" : "logged";
  out["router_score_bias_derived_gap"] = bias.derived_gap ? json_number(*bias.derived_gap) : nlohmann::json(nullptr);
}

nlohmann::json step_to_json(const StepOutcome& step) {
  nlohmann::json out = {
      {"step", step.step},
      {"loss", step.replayed ? json_number(step.loss) : nlohmann::json(nullptr)},
      {"logged_loss", step.logged_loss ? json_number(*step.logged_loss) : nlohmann::json(nullptr)},
      {"grad_norm", step.replayed ? json_number(step.grad_norm) : nlohmann::json(nullptr)},
      {"logged_grad_norm",
       step.logged_grad_norm ? json_number(*step.logged_grad_norm) : nlohmann::json(nullptr)},
      {"finite", step.replayed && step.finite},
      {"replayed", step.replayed},
      {"params", step.derived ? "derived" : "checkpoint"},
      {"loss_scale", json_number(step.loss_scale)},
      {"scaler_skipped", step.scaler_skipped},
      {"handled_overflow", step.handled_overflow},
  };
  if (!step.replayed) out["not_replayed_reason"] = step.not_replayed_reason;
  nlohmann::json rank_losses = nlohmann::json::array();
  for (double value : step.rank_losses) rank_losses.push_back(json_number(value));
  nlohmann::json rank_norms = nlohmann::json::array();
  for (double value : step.rank_grad_norms) rank_norms.push_back(json_number(value));
  out["rank_losses"] = rank_losses;
  out["rank_grad_norms"] = rank_norms;
  out["probe_summary"] = probe_summary_json(step.probe_summary);
  if (!step.expert_tokens.empty()) out["expert_tokens"] = step.expert_tokens;
  if (!step.attn_logit_max.empty()) out["attn_logit_max"] = logit_max_json(step.attn_logit_max);
  if (!step.expert_activation_max.empty()) out["expert_activation_max"] = expert_activation_json(step.expert_activation_max);
  if (!step.router_logit_max.empty()) out["router_logit_max"] = router_logit_max_json(step.router_logit_max);
  if (!step.mtp_losses.empty()) {  // model.mtp: each depth's loss, unscaled
    nlohmann::json depths = nlohmann::json::array();
    for (const double loss : step.mtp_losses) depths.push_back(json_number(loss));
    out["mtp_loss"] = depths;
  }
  if (step.router_score_bias) add_router_score_bias(out, *step.router_score_bias);
  return out;
}

}  // namespace

nlohmann::json first_nonfinite_json(const std::optional<FirstNonfinite>& first) {
  return first ? first_to_json(*first) : nlohmann::json(nullptr);
}

nlohmann::json what_if_json(const std::vector<WhatIfOutcome>& outcomes) {
  nlohmann::json out = nlohmann::json::array();
  for (const WhatIfOutcome& w : outcomes) out.push_back(what_if_outcome_json(w));
  return out;
}

nlohmann::json origin_tokens_json(const std::vector<OriginToken>& tokens) {
  nlohmann::json out = nlohmann::json::array();
  for (const OriginToken& t : tokens) {
    out.push_back({{"token", t.token}, {"position", t.position}, {"embedding_norm", json_number(t.norm)},
                   {"typical_norm", t.typical_norm}, {"outlier", t.outlier}});
  }
  return out;
}

namespace {

nlohmann::json propagation_json(const std::vector<PropagationEntry>& propagation) {
  nlohmann::json path = nlohmann::json::array();
  for (const PropagationEntry& p : propagation) {
    path.push_back({{"phase", phase_name(p.phase)}, {"site", p.name()},
                    {"layer", optional_index(p.layer)}, {"head", optional_index(p.head)},
                    {"expert", optional_index(p.expert)},
                    {"kind", nonfinite_kind_name(p.kind)}, {"nan_count", p.nan_count},
                    {"inf_count", p.inf_count}});
  }
  return path;
}

nlohmann::json determinism_json(const DeterminismCheck& d) {
  if (!d.checked) return nullptr;
  return {{"step", d.step},
          {"replayed", d.whole_step ? "step" : "micro_batch"},
          {"rank", optional_index(d.whole_step ? -1 : d.rank)},
          {"micro_batch", optional_index(d.whole_step ? -1 : d.micro_batch)},
          {"bitwise_identical", d.identical},
          {"probes_compared", d.probes_compared},
          {"first_difference", d.first_difference}};
}

nlohmann::json cross_check_json(const CrossDeviceCheck& c) {
  nlohmann::json check = {{"devices", {c.device_a, c.device_b}}, {"step", c.step},
                          {"bitwise_identical", c.identical}, {"probes_compared", c.probes_compared},
                          {"first_difference", nullptr}};
  if (!c.identical) {
    check["first_difference"] = {{"probe", c.first_difference}, {"rank", c.where.rank},
                                 {"micro_batch", c.where.micro_batch}, {"head", optional_index(c.where.head)},
                                 {"expert", optional_index(c.where.expert)},
                                 {"max_abs", {json_number(c.max_abs_a), json_number(c.max_abs_b)}},
                                 {"sum", {json_number(c.sum_a), json_number(c.sum_b)}}};
  }
  return check;
}

nlohmann::json defaulted_values_json(const std::vector<ValueSource>& defaulted) {
  nlohmann::json out = nlohmann::json::array();
  for (const ValueSource& v : defaulted) {
    out.push_back({{"key", v.key}, {"detail", v.detail},
                   {"value", v.value.empty() ? nlohmann::json(nullptr) : nlohmann::json::parse(v.value)}});
  }
  return out;
}

}  // namespace

nlohmann::json findings_json(const std::vector<Finding>& findings) {
  nlohmann::json out = nlohmann::json::array();
  for (const Finding& finding : findings) {
    out.push_back({{"layer", triage_layer_name(finding.layer())},
                   {"code", finding.name()},
                   {"severity", severity_name(finding.severity)},
                   {"message", finding.message},
                   {"evidence", evidence_json(finding.evidence)}});
  }
  return out;
}

namespace {

nlohmann::json optional_update_number_json(const std::optional<double>& value) {
  return value ? json_number(*value) : nlohmann::json(nullptr);
}

// Each measured update, per tensor: derived, or between checkpoints (docs/report-format.md).
nlohmann::json update_stats_json(const std::vector<StepUpdateStats>& updates) {
  nlohmann::json out = nlohmann::json::array();
  for (const StepUpdateStats& step : updates) {
    nlohmann::json tensors = nlohmann::json::array();
    for (const TensorUpdateStats& t : step.tensors) {
      tensors.push_back({{"param", t.param},
                         {"update_rms", json_number(t.update_rms)},
                         {"g2_over_v", optional_update_number_json(t.g2_over_v)},
                         {"g2_over_v_max", optional_update_number_json(t.g2_over_v_max)},
                         {"g2_over_v_rms", optional_update_number_json(t.g2_over_v_rms)}});
      if (t.outside_optimizer) tensors.back()["outside_optimizer"] = true;
    }
    out.push_back({{"step", step.step}, {"tensors", tensors}});
  }
  return out;
}

}  // namespace

nlohmann::json report_to_json(const ReplayReport& report) {
  nlohmann::json out;
  out["version"] = 1;
  out["tool"] = {{"name", "nanreplay"}, {"version", report.tool_version}};
  out["bundle"] = report.bundle;
  out["arch"] = arch_name(report.arch);
  out["precision"] = compute_name(report.precision);
  if (report.mtp) {  // docs/report-format.md: multi-token prediction replayed, or left out by the bundle's writer
    nlohmann::json mtp = {{"replayed", report.mtp->replayed}};
    if (report.mtp->replayed) {
      mtp["num_layers"] = report.mtp->num_layers;
      mtp["loss_scale"] = json_number(report.mtp->loss_scale);
    }
    if (!report.mtp->detail.empty()) mtp["detail"] = report.mtp->detail;
    out["multi_token_prediction"] = mtp;
  }
  if (!report.loss_terms.empty()) {  // docs/report-format.md: what the replayed loss adds to the cross-entropy
    nlohmann::json terms = nlohmann::json::array();
    for (const LossTerm& t : report.loss_terms) {
      terms.push_back({{"term", t.term}, {"coefficient", json_number(t.coefficient)},
                       {"in_logged_loss", t.in_logged_loss}, {"source", t.source}});
    }
    out["loss_terms"] = terms;
  }
  out["reproduced"] = report.reproduced;
  out["first_nonfinite"] = first_nonfinite_json(report.first_nonfinite);
  out["spike"] = spike_json(report.spike);
  out["counterfactuals"] = counterfactuals_json(report.counterfactuals);
  out["spike_check"] = spike_check_json(report.spike);
  out["head_logit_growth"] = head_logit_growth_json(report.window_outliers);
  out["expert_outliers"] = expert_outliers_json(report.window_outliers);
  out["reproduction"] = reproduction_json(report.reproduction);
  out["origin_tokens"] = origin_tokens_json(report.origin_tokens);
  nlohmann::json steps = nlohmann::json::array();
  for (const StepOutcome& step : report.steps) steps.push_back(step_to_json(step));
  out["steps"] = steps;
  out["findings"] = findings_json(report.findings);
  out["propagation"] = propagation_json(report.propagation);
  if (report.root_cause) {
    out["root_cause"] = {{"layer", triage_layer_name(report.root_cause->layer)},
                         {"code", root_cause_code(*report.root_cause, report.reproduced)},
                         {"summary", report.root_cause->summary}};
  }
  // Commands name trace.h5 as it lies beside report.json.
  const NextStep next = decide_next_step(report);
  out["next_step"] = next_step_json(next);
  out["runbook"] = runbook_json(next.runbook);  // docs/report-format.md#the-runbook
  out["determinism"] = determinism_json(report.determinism);
  out["devices"] = report.devices;
  out["low_precision"] = report.low_precision;
  if (report.cross_check) out["cross_check"] = cross_check_json(*report.cross_check);
  if (report.incident) {
    out["incident"] = {{"step", report.incident->step ? nlohmann::json(*report.incident->step)
                                                      : nlohmann::json(nullptr)},
                       {"symptom", report.incident->symptom}};
  }
  if (!report.defaulted.empty()) out["defaulted_values"] = defaulted_values_json(report.defaulted);
  if (report.what_if) out["what_if"] = what_if_json(*report.what_if);
  if (!report.update_stats.empty()) out["update_stats"] = update_stats_json(report.update_stats);
  out["replays"] = {{"steps", report.step_replays},
                    {"checks", report.check_replays},
                    {"total", report.step_replays + report.check_replays}};
  out["elapsed_seconds"] = report.elapsed_seconds;
  out["timings"] = timings_json(report.timings);
  return out;
}

}  // namespace nanreplay
