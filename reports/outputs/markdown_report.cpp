// Markdown rendering of a ReplayReport (report.md). Pure: returns the text.
// Tables use only pipe syntax, which GitHub and Jira's markdown import share;
// every string from the bundle goes through escape_markdown.
#include "reports/outputs/markdown_report.h"

#include <algorithm>
#include <cmath>
#include <sstream>

#include "loaders/base/error.h"
#include "reports/triage/numeric/expert_load.h"
#include "reports/outputs/counterfactual_output.h"
#include "reports/outputs/outlier_output.h"
#include "reports/outputs/damage_output.h"
#include "reports/outputs/masked_score_output.h"
#include "reports/outputs/next_step.h"
#include "reports/outputs/spike_output.h"
#include "reports/outputs/terminal_text.h"

namespace nanreplay {

namespace {


// One line of text safe inside a table cell or a paragraph: control bytes as
// \xNN, and every character that could open Markdown or HTML syntax
// (emphasis, links, images, tags, entities, headings, table pipes) behind a
// backslash, which CommonMark and GitHub render as the character itself.
std::string escape_markdown(const std::string& text) {
  std::string out;
  for (char c : printable(text)) {
    if (std::string("\\`*_[]<>|#&~!").find(c) != std::string::npos) out += '\\';
    out += c;
  }
  return out;
}

// A code span for identifiers (site names, codes); backticks cannot occur in
// it. Text that could read as HTML ('<', '>', '&': a bundle path or a
// checkpoint key) is written as escaped plain text instead: a code span
// keeps it literal only in renderers that follow CommonMark.
std::string code(const std::string& text) {
  if (text.find_first_of("<>&") != std::string::npos) return escape_markdown(text);
  std::string clean = printable(text);
  std::replace(clean.begin(), clean.end(), '`', '\'');
  std::replace(clean.begin(), clean.end(), '|', '/');
  return "`" + clean + "`";
}


std::string origin_coordinates(const FirstNonfinite& f) {
  std::ostringstream out;
  out << "step " << f.step << ", " << phase_name(f.phase) << ", " << code(f.name()) << " (" << nonfinite_kind_name(f.kind)
      << "): layer " << or_dash(f.layer) << ", head " << or_dash(f.head)
      << (f.expert >= 0 ? ", expert " + std::to_string(f.expert) : "") << ", rank " << or_dash(f.rank)
      << ", micro-batch " << or_dash(f.micro_batch) << ", sample " << or_dash(f.sample);
  if (f.original_sample) out << " (the run's sample " << *f.original_sample << ")";
  if (f.original_offset) out << " (the run's token offset " << *f.original_offset << ")";
  out << ", position " << or_dash(f.position);
  return out.str();
}

// Leads the page when the healthy steps do not replay to what the job logged.
void write_reproduction(std::ostringstream& out, const ReplayReport& report) {
  const ReproductionCheck& r = report.reproduction;
  if (!r.reproduces || *r.reproduces) return;
  out << "# nanreplay: DOES NOT REPRODUCE THE RUN\n\n**The replay does not reproduce the run.** "
      << (r.checked_steps - r.matching_steps) << " of " << r.checked_steps
      << " healthy step(s) miss what the job logged (up to " << format_percent(r.max_gap) << " off, tolerance "
      << format_number(r.tolerance) << "): every verdict below is about another model or data order. See "
      << code("BUNDLE_DOES_NOT_REPRODUCE") << " under Findings for the gaps and what to check.\n\n";
}

// Rolling forward: where the derived steps stop following the logged losses.
void write_trajectory(std::ostringstream& out, const ReplayReport& report) {
  const auto& t = report.reproduction.trajectory;
  if (!t || !t->diverged_at) return;
  out << "**The roll-forward diverged from the run at step " << *t->diverged_at
      << ":** from there the derived steps miss the logged loss (tolerance " << format_number(t->tolerance)
      << "), so what the replay shows is its own trajectory. See " << code("SYSTEM_TRAJECTORY_DIVERGED")
      << ".\n\n";
}

// The advice of next_step.h, its commands as code spans (trace.h5 lies beside report.md).
void write_next_step(std::ostringstream& out, const ReplayReport& report) {
  const NextStep next = decide_next_step(report);
  const std::vector<std::string> pieces = split_code_spans(next.text);
  out << "\n**Next:** ";
  for (size_t i = 0; i < pieces.size(); ++i) out << (i % 2 ? code(pieces[i]) : escape_markdown(pieces[i]));
  out << "\n";
  if (!next.runbook) return;
  const std::vector<std::string> book = split_code_spans(runbook_text(*next.runbook));
  out << "\n**Runbook:** ";
  for (size_t i = 0; i < book.size(); ++i) out << (i % 2 ? code(book[i]) : escape_markdown(book[i]));
  out << "\n";
}

// A spike incident: not reproduced leads the page; reproduced follows the reproduction check.
void write_spike(std::ostringstream& out, const ReplayReport& report, bool reproduced) {
  if (!report.spike || report.spike->reproduced != reproduced) return;
  out << "**" << escape_markdown(spike_sentence(*report.spike)) << "**\n\n";
}

void write_verdict(std::ostringstream& out, const ReplayReport& report) {
  write_spike(out, report, false);
  write_reproduction(out, report);
  write_spike(out, report, true);
  write_trajectory(out, report);
  if (report.first_nonfinite) {
    const FirstNonfinite& f = *report.first_nonfinite;
    out << "# nanreplay: REPRODUCED at step " << f.step << ", " << code(f.name()) << "\n\n"
        << "**Verdict: reproduced.** First non-finite value: " << origin_coordinates(f) << ".\n";
    for (const OriginToken& t : report.origin_tokens) {
      out << "\nToken " << t.token << " at position " << t.position << ": embedding row norm "
          << format_number(t.norm) << " (typical " << format_number(t.typical_norm) << ")"
          << (t.outlier ? ", **an outlier**" : "") << ".\n";
    }
    if (!f.contaminated_params.empty()) {
      out << "\nThe checkpoint of step " << f.step << " already held non-finite parameters (";
      for (size_t i = 0; i < f.contaminated_params.size(); ++i) {
        out << (i ? ", " : "") << code(f.contaminated_params[i]);
      }
      out << "): this site propagated them, it did not produce them.\n";
    }
  } else {
    out << "# nanreplay: NOT REPRODUCED\n\n**Verdict: not reproduced.** Every replayed value is finite.\n";
  }
  if (report.first_nonfinite && report.first_nonfinite->masked_score) {
    out << "\n**" << escape_markdown(masked_score_sentence(*report.first_nonfinite)) << "**\n";
  }
  out << damage_markdown(report);
  const std::vector<std::string> counterfactuals = counterfactual_lines(report.counterfactuals);
  for (size_t i = 0; i < counterfactuals.size(); ++i) {
    out << (i == 0 ? "\n**" : "- ") << escape_markdown(counterfactuals[i]) << (i == 0 ? "**\n\n" : "\n");
  }
  const std::vector<std::string> outliers = window_outlier_lines(report.window_outliers);
  if (!outliers.empty()) out << "\n";
  for (const std::string& line : outliers) out << "- " << escape_markdown(line) << "\n";
  if (report.root_cause) {
    // A clean window has no cause to name, only what is worth a look.
    out << "\n**" << (verdict_names_a_cause(report) ? "Root cause" : "Clean window") << "** ("
        << triage_layer_name(report.root_cause->layer) << ", "
        << code(root_cause_code(*report.root_cause, report.reproduced)) << "): " << escape_markdown(report.root_cause->summary) << "\n";
  }
  write_next_step(out, report);
  out << "\nBundle " << code(report.bundle) << ": " << arch_name(report.arch) << ", "
      << compute_name(report.precision) << ", " << report.steps.size() << " steps";
  if (report.incident) {
    out << "; incident";
    if (report.incident->step) out << " at step " << *report.incident->step;
    if (!report.incident->symptom.empty()) out << ": " << escape_markdown(report.incident->symptom);
  }
  out << ".\n";
  if (report.minimized) {
    out << "\nThis is a minimized bundle (`nanreplay minimize`) of " << code(report.minimized->bundle)
        << "; its `minimized` block in manifest.json says what was kept and why.\n";
  }
  for (const LossTerm& t : report.loss_terms) {  // the router terms; MTP's own sentence follows
    if (t.term == "mtp_loss") continue;
    out << "\nThe replayed loss " << (t.coefficient == 0 ? "adds no " + code(t.term)
                                                           : "adds " + format_number(t.coefficient) + " x " + code(t.term))
        << " (" << escape_markdown(t.source) << ").\n";
  }
  if (report.mtp && report.mtp->replayed) {
    out << "\nThe replayed gradients include the multi-token prediction loss (" << report.mtp->num_layers
        << " MTP layers, scale " << report.mtp->loss_scale
        << ", as Megatron-LM adds it); the replayed loss is the LM loss alone, as Megatron-LM logs it.\n";
  } else if (report.mtp) {
    out << "\nThe checkpoint's multi-token prediction (MTP) layers were left out of the replayed loss"
        << (report.mtp->detail.empty() ? std::string() : " (" + escape_markdown(report.mtp->detail) + ")") << ".\n";
  }
}

void write_steps(std::ostringstream& out, const ReplayReport& report) {
  out << "\n## Steps\n\n| step | replayed loss | logged loss | grad norm | finite |\n|---:|---:|---:|---:|:---|\n";
  const std::vector<size_t> rows = steps_worth_listing(report);
  for (size_t k = 0; k < rows.size(); ++k) {
    const StepOutcome& s = report.steps[rows[k]];
    if (k > 0 && rows[k] != rows[k - 1] + 1) out << "| ... | " << (rows[k] - rows[k - 1] - 1) << " steps in report.json | | | |\n";
    const bool first = report.first_nonfinite && report.first_nonfinite->step == s.step;
    std::string finite = !s.replayed   ? "not replayed: " + escape_markdown(s.not_replayed_reason)
                         : s.finite    ? "yes"
                         : s.scaler_skipped && std::isfinite(s.loss) ? "no (fp16 overflow, scaler skips)"
                                       : "**NO**";
    if (first) finite += " (first non-finite)";
    out << "| " << s.step << (s.derived ? " (derived)" : "") << " | " << (s.replayed ? format_number(s.loss) : "-") << " | "
        << (s.logged_loss ? format_number(*s.logged_loss) : "-") << " | "
        << (s.replayed ? format_number(s.grad_norm) : "-") << " | " << finite << " |\n";
  }
}


// The findings `keep` accepts as one table; false when there were none.
template <typename Keep>
bool write_finding_table(std::ostringstream& out, const ReplayReport& report, Keep keep) {
  bool any = false;
  for (const Finding& f : report.findings) {
    if (!keep(f)) continue;
    if (!any) out << "| severity | code | finding |\n|:---|:---|:---|\n";
    any = true;
    out << "| " << severity_name(f.severity) << " | " << code(f.name()) << " | " << escape_markdown(f.message)
        << " |\n";
  }
  return any;
}

void write_findings(std::ostringstream& out, const ReplayReport& report) {
  out << "\n## Findings\n";
  for (TriageLayer layer : {TriageLayer::kData, TriageLayer::kNumeric, TriageLayer::kSystem}) {
    out << "\n### " << triage_layer_name(layer) << "\n\n";
    const bool any =
        write_finding_table(out, report, [&](const Finding& f) { return f.layer() == layer && !is_consequence(f); });
    if (!any) out << "Nothing found.\n";
  }
  if (std::none_of(report.findings.begin(), report.findings.end(), is_consequence)) return;
  out << "\n### Consequences of the first non-finite value\n\nWhat followed from the origin; none of it is a cause.\n\n";
  write_finding_table(out, report, is_consequence);
}

void write_propagation(std::ostringstream& out, const ReplayReport& report) {
  if (report.propagation.empty()) return;
  out << "\n## Propagation\n\nAfter the origin, in execution order";
  if (report.propagation.size() > kPropagationShown) {
    out << " (first " << kPropagationShown << " of " << report.propagation.size() << " sites)";
  }
  out << ":\n\n";
  for (size_t i = 0; i < std::min(report.propagation.size(), kPropagationShown); ++i) {
    const PropagationEntry& p = report.propagation[i];
    out << i + 1 << ". " << phase_name(p.phase) << " " << code(p.name());
    if (p.head >= 0) out << " head " << p.head;
    if (p.expert >= 0) out << " expert " << p.expert;
    out << ": " << p.nan_count << " nan, " << p.inf_count << " inf\n";
  }
}

void write_expert_load(std::ostringstream& out, const ReplayReport& report) {
  const StepOutcome* step = expert_load_step(report);
  if (step == nullptr) return;
  const size_t experts = step->expert_tokens.front().size();
  out << "\n## Expert load\n\nTokens routed to each expert at step " << step->step
      << " (every rank and micro-batch), with the expert's share of the layer's tokens (balanced "
      << format_number(100.0 * static_cast<double>(report.moe_top_k) / static_cast<double>(experts)) << "%).\n\n| layer |";
  for (size_t e = 0; e < experts; ++e) out << " expert " << e << " |";
  out << "\n|---:|";
  for (size_t e = 0; e < experts; ++e) out << "---:|";
  out << "\n";
  for (size_t layer = 0; layer < step->expert_tokens.size(); ++layer) {
    const std::vector<int64_t>& row = step->expert_tokens[layer];
    out << "| " << layer << " |";
    for (size_t e = 0; e < row.size(); ++e) {
      out << " " << row[e] << " (" << format_number(100.0 * expert_share(row, static_cast<int64_t>(e), report.moe_top_k))
          << "%) |";
    }
    out << "\n";
  }
}

// DeepSeek-V3's correction bias where the replay derived it, or where a
// rolled-forward step's logged bias differs from the derived one
// (docs/rolling-forward.md, "The router's correction bias").
void write_router_score_bias(std::ostringstream& out, const ReplayReport& report) {
  std::vector<int64_t> derived;
  const StepOutcome* widest = nullptr;
  for (const StepOutcome& s : report.steps) {
    if (!s.router_score_bias) continue;
    if (s.router_score_bias->derived) derived.push_back(s.step);
    const std::optional<double>& gap = s.router_score_bias->derived_gap;
    if (gap && (widest == nullptr || !(*gap <= *widest->router_score_bias->derived_gap))) widest = &s;
  }
  if (derived.empty() && widest == nullptr) return;
  out << "\n## Router correction bias\n\n";
  if (!derived.empty()) {
    out << "Derived by `model.moe.score_bias_update` from the step before (state.json logs none) at step";
    out << (derived.size() > 1 ? "s" : "");
    for (size_t i = 0; i < derived.size(); ++i) out << (i == 0 ? " " : ", ") << derived[i];
    out << "; report.json `steps[].router_score_bias` holds each step's.\n";
  }
  if (widest == nullptr) return;
  const double gap = *widest->router_score_bias->derived_gap;
  out << (derived.empty() ? "" : "\n") << "Rolled-forward steps that log their bias were replayed with it; ";
  if (gap == 0) {
    out << "the bias `model.moe.score_bias_update` derives equals the logged one at every such step.\n";
    return;
  }
  out << "the bias `model.moe.score_bias_update` derives differs from the logged one by up to " << format_number(gap)
      << " (step " << widest->step << "): beyond the logged values' rounding, the run's balancing rule, rate or "
      << "token counts are not the manifest's.\n";
}

void write_what_ifs(std::ostringstream& out, const ReplayReport& report) {
  if (!report.what_if || report.what_if->empty()) return;
  out << "\n## What-if replays\n\n";
  const WhatIfOutcome& first = report.what_if->front();
  if (!first.step) {
    out << "Nothing went non-finite: no step to replay.\n";
    return;
  }
  out << "Step " << *first.step << " replayed once per what-if, each with one change.\n\n"
      << "| what-if | first non-finite value | loss after | change |\n|:---|:---|---:|:---|\n";
  for (const WhatIfOutcome& w : *report.what_if) {
    out << "| " << code(w.what_if) << " | "
        << (w.after ? "still there: " + origin_coordinates(*w.after) : std::string("**gone**"))
        << " | " << (w.loss_after ? format_number(*w.loss_after) : "-") << " | " << escape_markdown(w.change)
        << " |\n";
  }
}

void write_determinism_and_links(std::ostringstream& out, const ReplayReport& report) {
  out << "\n## Determinism\n\n";
  if (report.determinism.checked) {
    std::string scope = determinism_scope(report.determinism);
    scope[0] = 'S';  // "Step 105, rank 0 micro-batch 1" opens the section's sentence
    out << scope << " replayed twice: "
        << (report.determinism.identical ? "bitwise identical"
                                         : "**different** at " + code(report.determinism.first_difference))
        << " (" << report.determinism.probes_compared << " probes compared).\n";
  } else {
    out << "Not checked (no probes).\n";
  }
  out << "\n## Files\n\n[report.json](report.json) · [report.html](report.html) · [trace.h5](trace.h5)\n\n"
      << "_nanreplay " << escape_markdown(report.tool_version) << "_\n";
}

}  // namespace

std::string render_markdown(const ReplayReport& report) {
  std::ostringstream out;
  write_verdict(out, report);
  write_steps(out, report);
  write_findings(out, report);
  write_propagation(out, report);
  write_expert_load(out, report);
  write_router_score_bias(out, report);
  write_what_ifs(out, report);
  write_determinism_and_links(out, report);
  return out.str();
}

}  // namespace nanreplay
