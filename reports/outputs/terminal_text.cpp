// Terminal rendering of a ReplayReport. Pure: returns the text, never prints.
#include "reports/outputs/terminal_text.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <sstream>

#include "loaders/base/error.h"
#include "reports/outputs/counterfactual_output.h"
#include "reports/outputs/outlier_output.h"
#include "reports/outputs/damage_output.h"
#include "reports/outputs/masked_score_output.h"
#include "reports/outputs/next_step.h"
#include "reports/outputs/spike_output.h"

namespace nanreplay {

std::string paint(const TextStyle& style, const char* code, const std::string& text) {
  return style.color ? std::string("\033[") + code + "m" + text + "\033[0m" : text;
}

std::string pad(const std::string& text, size_t width) {
  return text.size() >= width ? text : text + std::string(width - text.size(), ' ');
}

std::string render_what_ifs(const std::vector<WhatIfOutcome>& outcomes, const TextStyle& style) {
  std::ostringstream out;
  if (outcomes.empty()) return "";
  const std::optional<int64_t> step = outcomes.front().step;
  out << "what-if";
  if (step && outcomes.front().before) {
    out << "  step " << *step << " replayed with one change each (before: " << phase_name(outcomes.front().before->phase)
        << " " << outcomes.front().before->name() << ")";
  }
  out << "\n";
  size_t width = 0;
  for (const WhatIfOutcome& w : outcomes) width = std::max(width, w.what_if.size());
  for (const WhatIfOutcome& w : outcomes) {
    out << "  " << pad(printable(w.what_if), width + 2);
    if (!w.resolved) {
      out << "not replayed: nothing went non-finite\n";
      continue;
    }
    if (*w.resolved) {
      out << paint(style, "1;32", "RESOLVED") << "      loss " << format_number(w.loss_after.value_or(0.0))
          << (w.scaler_skipped ? " (the scaler still skips the step)" : "");
    } else {
      const FirstNonfinite& a = *w.after;
      out << paint(style, "1;31", "NOT RESOLVED") << "  first non-finite: " << phase_name(a.phase) << " " << a.name();
      if (a.head >= 0) out << " head " << a.head;
      if (a.expert >= 0) out << " expert " << a.expert;
      out << ", sample " << or_dash(a.sample) << ", position " << or_dash(a.position);
    }
    out << "  (" << w.replays << " replays)\n    " << printable(w.change) << "\n";
  }
  return out.str();
}



namespace {

std::string original_text(const FirstNonfinite& f) {
  if (f.original_sample) return " (run's sample " + std::to_string(*f.original_sample) + ")";
  if (f.original_offset) return " (run's offset " + std::to_string(*f.original_offset) + ")";
  return "";
}

// Rolling forward: where the derived steps stop following the logged losses.
std::string trajectory_line(const ReplayReport& report, const TextStyle& style) {
  const auto& t = report.reproduction.trajectory;
  if (!t || !t->diverged_at) return "";
  return paint(style, "1;33", "ROLL-FORWARD DIVERGED") + "  from step " + std::to_string(*t->diverged_at) +
         " the derived steps miss the logged loss (tolerance " + format_number(t->tolerance) +
         "): what follows is the replay's own trajectory; see SYSTEM_TRAJECTORY_DIVERGED\n";
}

// Leads the verdict when the healthy steps do not replay to what the job logged.
std::string reproduction_line(const ReplayReport& report, const TextStyle& style) {
  const ReproductionCheck& r = report.reproduction;
  if (!r.reproduces) {
    return report.steps.empty() ? "" : "  (not checked against the run: no healthy step has a logged loss)\n" +
                                           trajectory_line(report, style);
  }
  if (*r.reproduces) return trajectory_line(report, style);
  std::ostringstream out;
  out << paint(style, "1;31", "DOES NOT REPRODUCE THE RUN") << "  " << (r.checked_steps - r.matching_steps) << " of "
      << r.checked_steps << " healthy step(s) miss what the job logged (up to " << format_percent(r.max_gap)
      << " off, tolerance " << format_number(r.tolerance) << "): every verdict below is about another model "
      << "or data order; see BUNDLE_DOES_NOT_REPRODUCE\n";
  return out.str();
}

std::string token_lines(const ReplayReport& report) {
  std::ostringstream out;
  for (const OriginToken& t : report.origin_tokens) {
    out << "  token " << t.token << " at position " << t.position << ": embedding row norm " << format_number(t.norm)
        << " (typical " << format_number(t.typical_norm) << ")" << (t.outlier ? ", an OUTLIER" : "") << "\n";
  }
  return out.str();
}

// The findings by triage layer, at most 8 a layer (report.json has them all).
std::string triage_lines(const ReplayReport& report, const TextStyle& style) {
  std::ostringstream out;
  out << "\ntriage\n";
  for (TriageLayer layer : {TriageLayer::kData, TriageLayer::kNumeric, TriageLayer::kSystem}) {
    size_t count = 0;
    for (const Finding& finding : report.findings) count += finding.layer() == layer;
    out << "  " << paint(style, "1", pad(triage_layer_name(layer), 8))
        << (count ? std::to_string(count) + " finding(s)" : "nothing found") << "\n";
    size_t shown = 0;
    for (const Finding& finding : report.findings) {
      if (finding.layer() != layer) continue;
      if (++shown > 8) {
        out << "    ... " << (count - 8) << " more in report.json\n";
        break;
      }
      const char* color = finding.severity == Severity::kError     ? "31"
                          : finding.severity == Severity::kWarning ? "33"
                                                                   : "36";
      out << "    " << paint(style, color, pad(severity_name(finding.severity), 8)) << finding.name()
          << ": " << printable(finding.message) << "\n";  // may quote bundle text
    }
  }
  return out.str();
}

// The root cause (or, in a clean window, what is worth a look) and what to do next.
std::string verdict_close(const ReplayReport& report, const TextStyle& style) {
  std::ostringstream out;
  if (report.root_cause) {
    const RootCause& cause = *report.root_cause;
    const bool named = verdict_names_a_cause(report);
    out << "\n" << paint(style, "1", named ? "most likely root cause" : "clean window");
    if (named || cause.code) out << " (" << triage_layer_name(cause.layer) << ")";
    out << ": " << printable(cause.summary) << "\n";
  }
  const std::string out_dir = style.out_dir.empty() ? "OUT" : style.out_dir;
  const std::string trace = (std::filesystem::path(out_dir) / "trace.h5").string();
  const NextStep next = decide_next_step(report, trace);
  out << paint(style, "1", "Next:") << " " << printable(next.text) << "\n";
  if (next.runbook) out << paint(style, "1", "Runbook:") << " " << printable(runbook_text(*next.runbook)) << "\n";
  return out.str();
}

}  // namespace

std::string render_verdict(const ReplayReport& report, const TextStyle& style) {
  std::ostringstream out;
  // A spike the replay does not reproduce is said before anything else.
  if (report.spike && !report.spike->reproduced) {
    out << paint(style, "1;31", "SPIKE NOT REPRODUCED") << "  "
        << printable(spike_sentence(*report.spike).substr(std::string("SPIKE NOT REPRODUCED: ").size())) << "\n";
  }
  out << "bundle  " << printable(report.bundle) << "  (" << arch_name(report.arch) << ", "
      << compute_name(report.precision) << ", " << report.steps.size() << " steps)\n";
  if (report.mtp) {  // multi-token prediction: what the replayed gradients include (docs/bundle-format.md)
    out << "mtp     "
        << (report.mtp->replayed ? "the gradients include the MTP layers' loss (" + std::to_string(report.mtp->num_layers) +
                                       " depth(s)); the loss shown is the LM loss, as Megatron-LM logs it"
                                 : std::string("the checkpoint's MTP layers were left out of the replayed loss"))
        << "\n";
  }
  out << reproduction_line(report, style);
  if (report.spike && report.spike->reproduced) {
    out << paint(style, "1;33", "SPIKE") << "  "
        << printable(spike_sentence(*report.spike).substr(std::string("SPIKE: ").size())) << "\n";
  }
  if (report.first_nonfinite) {
    const FirstNonfinite& f = *report.first_nonfinite;
    out << paint(style, "1;31", "REPRODUCED") << "  first non-finite value: step " << f.step << ", "
        << phase_name(f.phase) << ", " << paint(style, "1", f.name()) << "\n";
    out << "  kind " << nonfinite_kind_name(f.kind) << " | layer " << or_dash(f.layer) << " | head "
        << or_dash(f.head) << (f.expert >= 0 ? " | expert " + std::to_string(f.expert) : "") << " | rank " << or_dash(f.rank) << " | micro-batch "
        << or_dash(f.micro_batch) << " | sample " << or_dash(f.sample) << original_text(f) << " | position "
        << or_dash(f.position) << "\n";
    out << token_lines(report);
    if (f.masked_score) out << "  " << printable(masked_score_sentence(f)) << "\n";
  } else {
    out << paint(style, "1;32", "NOT REPRODUCED") << "  every replayed value is finite\n";
  }
  if (const ShownDamage damage = shown_damage(report); damage.damage) out << "  " << printable(damage_sentence(damage)) << "\n";
  for (const std::string& line : counterfactual_lines(report.counterfactuals)) out << "  " << printable(line) << "\n";
  for (const std::string& line : window_outlier_lines(report.window_outliers)) out << "  " << printable(line) << "\n";
  out << "\n  " << pad("step", 8) << pad("loss", 14) << pad("logged loss", 14) << pad("grad norm", 14)
      << "finite\n";
  const std::vector<size_t> rows = steps_worth_listing(report);
  for (size_t k = 0; k < rows.size(); ++k) {
    const StepOutcome& step = report.steps[rows[k]];
    if (k > 0 && rows[k] != rows[k - 1] + 1) out << "  ... " << (rows[k] - rows[k - 1] - 1) << " steps (report.json)\n";
    const bool first = report.first_nonfinite && report.first_nonfinite->step == step.step;
    // A step whose only overflow is the loss scaler's business reads as handled.
    const bool handled = step.scaler_skipped && !first && std::isfinite(step.loss);
    std::string finite = !step.replayed ? "not replayed: " + step.not_replayed_reason
                         : handled      ? "no (fp16 overflow, scaler skips)"
                         : step.finite  ? "yes"
                                        : "NO";
    if (first) finite += "  <- first non-finite";
    out << "  " << pad(std::to_string(step.step) + (step.derived ? "*" : ""), 8)
        << pad(step.replayed ? format_number(step.loss) : "-", 14)
        << pad(step.logged_loss ? format_number(*step.logged_loss) : "-", 14)
        << pad(step.replayed ? format_number(step.grad_norm) : "-", 14)
        << (first || (!step.finite && step.replayed && !handled) ? paint(style, "31", finite)
                                                                             : finite)
        << "\n";
  }
  if (std::any_of(report.steps.begin(), report.steps.end(), [](const StepOutcome& s) { return s.derived; })) {
    out << "  * derived: rolled forward by the tool's own update from the step before (no checkpoint)\n";
  }
  if (!report.propagation.empty()) {
    out << "\n  spread after the origin: ";
    const size_t shown = std::min<size_t>(report.propagation.size(), 6);
    for (size_t i = 0; i < shown; ++i) {
      out << (i ? " -> " : "") << report.propagation[i].name();
    }
    if (report.propagation.size() > shown) out << " -> ... (" << report.propagation.size() << " sites)";
    out << "\n";
  }
  out << triage_lines(report, style);
  if (report.determinism.checked) {
    out << "  determinism: " << determinism_scope(report.determinism) << " replayed twice, "
        << (report.determinism.identical ? "bitwise identical"
                                         : "DIFFERENT at " + report.determinism.first_difference)
        << " (" << report.determinism.probes_compared << " probes)\n";
  }
  if (report.what_if) out << "\n" << render_what_ifs(*report.what_if, style);
  out << verdict_close(report, style);
  return out.str();
}

}  // namespace nanreplay
