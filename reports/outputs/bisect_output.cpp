// JSON and terminal renderings of a BisectReport; pure, never prints.
// Keys are stable for runbooks; docs/bisect-and-what-if.md is their reference.
#include "reports/outputs/bisect_output.h"

#include <algorithm>
#include <sstream>

#include "loaders/base/error.h"
#include "loaders/base/message_text.h"
#include "reports/outputs/report_json.h"
#include "reports/outputs/spike_output.h"
#include "reports/results/number_text.h"

namespace nanreplay {

namespace {

// " (run's samples {46, 47})" or " (run's offsets {...})" beside ddmin's set, where the bundle records them.
std::string minimal_in_run_text(const BisectSampleStage& stage) {
  if (stage.minimal_in_run.empty()) return "";
  std::vector<int64_t> values;
  for (const OriginalSample& o : stage.minimal_in_run) values.push_back(o.value);
  return std::string(stage.minimal_in_run.front().is_offset ? " (run's offsets {" : " (run's samples {") +
         comma_list(values) + "})";
}

nlohmann::json step_stage_json(const BisectReport& r) {
  nlohmann::json tested = nlohmann::json::array();
  for (const BisectStepTest& t : r.step_tests) {
    nlohmann::json one = {{"step", t.step}, {"replayed", t.replayed}, {"bad", t.bad},
                          {"handled_overflow", t.handled_overflow}, {"replays", t.replays}};
    if (!t.replayed) one["not_replayed_reason"] = t.not_replayed_reason;
    tested.push_back(one);
  }
  return {{"probes", "any-nonfinite"},
          {"method", r.in_order ? "in_order" : "binary"},
          {"replays", r.step_replays()},
          {"first_bad_step", r.origin ? nlohmann::json(r.origin->step) : nlohmann::json(nullptr)},
          {"clean_predecessor", r.clean_predecessor ? nlohmann::json(*r.clean_predecessor) : nlohmann::json(nullptr)},
          {"tested", tested}};
}

nlohmann::json stages_json(const BisectReport& r) {
  nlohmann::json stages = {{"step", step_stage_json(r)}, {"layer", nullptr}, {"site", nullptr}, {"samples", nullptr}};
  if (!r.origin) return stages;
  const FirstNonfinite& o = *r.origin;
  stages["layer"] = {{"probes", "any-nonfinite"}, {"replays", 0},     {"layer", optional_index(o.layer)},
                     {"phase", phase_name(o.phase)}, {"micro_batch", optional_index(o.micro_batch)},
                     {"rank", optional_index(o.rank)}};
  stages["site"] = {{"probes", "full"},   {"replays", r.site_replays}, {"block", optional_index(o.layer)},
                    {"site", o.name()},   {"head", optional_index(o.head)},
                    {"expert", optional_index(o.expert)}, {"index", o.index}};
  if (r.samples.ran || !r.samples.note.empty()) {
    stages["samples"] = {{"method", "ddmin"},
                         {"replays", r.samples.replays},
                         {"candidates", r.samples.candidates},
                         {"minimal", r.samples.ran && r.samples.data_dependent.value_or(true)
                                         ? nlohmann::json(r.samples.minimal) : nlohmann::json(nullptr)},
                         {"data_dependent", r.samples.data_dependent ? nlohmann::json(*r.samples.data_dependent)
                                                                    : nlohmann::json(nullptr)},
                         {"note", r.samples.note}};
    // The run's numbering beside the bundle's, where the bundle records it.
    const std::vector<OriginalSample>& in_run = r.samples.minimal_in_run;
    if (!in_run.empty() && stages["samples"]["minimal"].is_array()) {
      std::vector<int64_t> values;
      for (const OriginalSample& o : in_run) values.push_back(o.value);
      stages["samples"][in_run.front().is_offset ? "minimal_original_offsets" : "minimal_original_samples"] = values;
    }
  }
  return stages;
}

std::string step_stage_text(const BisectReport& r) {
  std::string tested;
  for (const BisectStepTest& t : r.step_tests) {
    tested += (tested.empty() ? "" : ", ") + std::to_string(t.step) + " " +
              (!t.replayed ? "not replayable" : t.bad ? "bad" : t.handled_overflow ? "clean (scaler skips)" : "clean");
  }
  if (!r.origin) return "none bad (tested " + tested + ")";
  std::string text = "step " + std::to_string(r.origin->step) + " (tested " + tested + ")";
  if (r.clean_predecessor) text += "; " + std::to_string(*r.clean_predecessor) + " before it is clean";
  if (r.in_order) text += "; in order, as the roll-forward derives each step from the one before";
  return text;
}

}  // namespace

nlohmann::json bisect_to_json(const BisectReport& r) {
  nlohmann::json out;
  out["bisect_version"] = kBisectVersion;
  out["tool"] = {{"name", "nanreplay"}, {"version", r.tool_version}};
  out["bundle"] = r.bundle;
  out["arch"] = arch_name(r.arch);
  out["precision"] = compute_name(r.precision);
  out["reproduced"] = r.origin.has_value();
  out["origin"] = first_nonfinite_json(r.origin);
  out["origin_tokens"] = origin_tokens_json(r.origin_tokens);
  out["replay_unit"] = "pass";
  out["passes_per_step"] = r.passes_per_step;
  out["stages"] = stages_json(r);
  out["replays"] = {{"step", r.step_replays()},
                    {"layer", 0},
                    {"site", r.site_replays},
                    {"samples", r.samples.replays},
                    {"what_if", r.what_if_replays()},
                    {"checks", r.check_replays},
                    {"full_pass", r.full_pass_replays},
                    {"origin", r.origin_replays()},
                    {"total", r.total_replays()},
                    {"full_probe_pass", r.full_probe_pass_replays}};
  nlohmann::json skipped = nlohmann::json::array();
  for (const BisectStepTest& t : r.step_tests) {
    if (!t.replayed) skipped.push_back({{"step", t.step}, {"reason", t.not_replayed_reason}});
  }
  out["not_replayed"] = skipped;
  out["logged_nonfinite_steps"] = r.logged_nonfinite_steps;
  out["findings"] = findings_json(r.findings);
  out["spike"] = spike_json(r.spike);
  out["spike_check"] = spike_check_json(r.spike);
  out["root_cause"] = nullptr;
  if (r.root_cause) {
    out["root_cause"] = {{"layer", triage_layer_name(r.root_cause->layer)},
                         {"code", root_cause_code(*r.root_cause, r.origin.has_value())},
                         {"summary", r.root_cause->summary}};
  }
  if (r.what_if) out["what_if"] = what_if_json(*r.what_if);
  out["elapsed_seconds"] = r.elapsed_seconds;
  return out;
}

std::string render_bisect(const BisectReport& r, const TextStyle& style) {
  std::ostringstream out;
  out << "bisect  " << r.bundle << "  (" << arch_name(r.arch) << ", " << compute_name(r.precision) << ", "
      << r.steps_in_bundle << " steps; a step is " << r.passes_per_step << " replay(s): one per rank and micro-batch)\n";
  if (r.origin) {
    const FirstNonfinite& f = *r.origin;
    out << paint(style, "1;31", "ORIGIN") << "  step " << f.step << ", " << phase_name(f.phase) << ", "
        << paint(style, "1", f.name()) << "\n"
        << "  kind " << nonfinite_kind_name(f.kind) << " | layer " << or_dash(f.layer) << " | head " << or_dash(f.head)
        << (f.expert >= 0 ? " | expert " + std::to_string(f.expert) : "") << " | rank " << or_dash(f.rank)
        << " | micro-batch " << or_dash(f.micro_batch) << " | sample " << or_dash(f.sample) << run_numbering_note(f)
        << " | position " << or_dash(f.position) << " | index " << bracketed_list(f.index) << "\n";
    if (!f.contaminated_params.empty()) {
      out << "  the checkpoint of step " << f.step << " already holds non-finite values in "
          << f.contaminated_params.front() << (f.contaminated_params.size() > 1 ? " and others" : "")
          << ": this site propagates them\n";
    }
  } else {
    out << paint(style, "1;32", "NOT REPRODUCED") << "  no tested step holds a non-finite value\n";
    if (!r.logged_nonfinite_steps.empty()) {
      out << "  but the job logged a non-finite loss at step " << comma_list(r.logged_nonfinite_steps)
          << ": `nanreplay run` checks why the replay differs (SYSTEM_NOT_REPRODUCIBLE)\n";
    }
  }
  for (const BisectStepTest& t : r.step_tests) {
    if (!t.replayed) out << "  step " << t.step << " could not be replayed: " << printable(t.not_replayed_reason) << "\n";
  }
  if (r.spike) {
    const std::string sentence = spike_sentence(*r.spike);
    const bool reproduced = r.spike->reproduced;
    out << paint(style, reproduced ? "1;33" : "1;31", reproduced ? "SPIKE" : "SPIKE NOT REPRODUCED") << "  "
        << printable(sentence.substr(sentence.find(": ") == std::string::npos ? 0 : sentence.find(": ") + 2))
        << "  (run's full probe pass: " << r.full_pass_replays << " replays)\n";
  }
  // What `run` would name too, from the checks bisect makes (bisect_report.h).
  for (const Finding& f : r.findings) {
    out << "  " << paint(style, f.severity == Severity::kError ? "1;31" : "1;33", f.name()) << "  "
        << printable(f.message) << "\n";
  }
  if (r.root_cause) {
    out << paint(style, "1", "ROOT CAUSE") << "  " << printable(r.root_cause->summary) << "\n";
  }

  out << "\n  " << pad("stage", 10) << pad("replays", 9) << pad("probes", 16) << "found\n";
  out << "  " << pad("step", 10) << pad(std::to_string(r.step_replays()), 9) << pad("any-non-finite", 16)
      << step_stage_text(r) << "\n";
  if (r.origin) {
    const FirstNonfinite& f = *r.origin;
    const std::string block = f.layer >= 0 ? "layer " + std::to_string(f.layer) : "outside the layers";
    out << "  " << pad("layer", 10) << pad("0", 9) << pad("(step's flags)", 16) << block << ", "
        << phase_name(f.phase) << ", micro-batch " << or_dash(f.micro_batch) << ", rank " << or_dash(f.rank) << "\n";
    out << "  " << pad("site", 10) << pad(std::to_string(r.site_replays), 9) << pad("full, 1 block", 16) << f.name()
        << (f.head >= 0 ? ", head " + std::to_string(f.head) : "")
        << (f.expert >= 0 ? ", expert " + std::to_string(f.expert) : "") << ", element " << bracketed_list(f.index) << "\n";
    const bool skipped = !r.samples.ran && r.samples.note.empty();
    out << "  " << pad("samples", 10) << pad(skipped ? "-" : std::to_string(r.samples.replays), 9)
        << pad("any-non-finite", 16);
    if (skipped) {
      out << "skipped (--no-samples)\n";
    } else if (r.samples.ran && r.samples.data_dependent.value_or(true)) {
      out << "{" << comma_list(r.samples.minimal) << "}" << minimal_in_run_text(r.samples)
          << ": smallest set of the pass's " << r.samples.candidates.size() << " samples that still fails (ddmin)\n";
    } else {
      out << printable(r.samples.note) << "\n";
    }
  }
  out << "\n  replays: " << r.origin_replays() << (r.origin ? " to name the origin" : " to look for an origin");
  if (r.samples.replays) out << ", " << r.samples.replays << " for the samples";
  if (r.what_if_replays()) out << ", " << r.what_if_replays() << " for what-ifs";
  if (r.check_replays) out << ", " << r.check_replays << " for the update check";
  if (r.full_pass_replays) out << ", " << r.full_pass_replays << " for run's full probe pass (a spike or logged site statistics)";
  out << "; the full probe pass (nanreplay run) replays " << r.full_probe_pass_replays << "\n";
  if (r.what_if) out << "\n" << render_what_ifs(*r.what_if, style);
  return out.str();
}

}  // namespace nanreplay
