// Terminal rendering of a ReplayReport. Pure: returns the text, never prints.
#include "reports/terminal_text.h"

#include <cmath>
#include <cstdio>
#include <sstream>

namespace nanreplay {

namespace {

std::string paint(const TextStyle& style, const char* code, const std::string& text) {
  return style.color ? std::string("\033[") + code + "m" + text + "\033[0m" : text;
}

std::string or_dash(int64_t value) { return value >= 0 ? std::to_string(value) : "-"; }

std::string pad(const std::string& text, size_t width) {
  return text.size() >= width ? text : text + std::string(width - text.size(), ' ');
}

}  // namespace

std::string format_number(double value) {
  if (std::isnan(value)) return "nan";
  if (std::isinf(value)) return value > 0 ? "inf" : "-inf";
  char buffer[32];
  std::snprintf(buffer, sizeof(buffer), "%.6g", value);
  return buffer;
}

std::string render_verdict(const ReplayReport& report, const TextStyle& style) {
  std::ostringstream out;
  out << "bundle  " << report.bundle << "  (" << arch_name(report.arch) << ", "
      << compute_name(report.precision) << ", " << report.steps.size() << " steps)\n";
  if (report.first_nonfinite) {
    const FirstNonfinite& f = *report.first_nonfinite;
    out << paint(style, "1;31", "REPRODUCED") << "  first non-finite value: step " << f.step << ", "
        << phase_name(f.phase) << ", " << paint(style, "1", f.site) << "\n";
    out << "  kind " << nonfinite_kind_name(f.kind) << " | layer " << or_dash(f.layer) << " | head "
        << or_dash(f.head) << " | rank " << or_dash(f.rank) << " | micro-batch "
        << or_dash(f.micro_batch) << " | sample " << or_dash(f.sample) << " | position "
        << or_dash(f.position) << "\n";
  } else {
    out << paint(style, "1;32", "NOT REPRODUCED") << "  every replayed value is finite\n";
  }
  out << "\n  " << pad("step", 8) << pad("loss", 14) << pad("logged loss", 14) << pad("grad norm", 14)
      << "finite\n";
  for (const StepOutcome& step : report.steps) {
    const bool first = report.first_nonfinite && report.first_nonfinite->step == step.step;
    // A step whose only overflow is the loss scaler's business reads as handled.
    const bool handled = step.scaler_skipped && !first && std::isfinite(step.loss);
    std::string finite = !step.replayed ? "not replayed: " + step.not_replayed_reason
                         : handled      ? "no (fp16 overflow, scaler skips)"
                         : step.finite  ? "yes"
                                        : "NO";
    if (first) finite += "  <- first non-finite";
    out << "  " << pad(std::to_string(step.step), 8)
        << pad(step.replayed ? format_number(step.loss) : "-", 14)
        << pad(step.logged_loss ? format_number(*step.logged_loss) : "-", 14)
        << pad(step.replayed ? format_number(step.grad_norm) : "-", 14)
        << (first || (!step.finite && step.replayed && !handled) ? paint(style, "31", finite)
                                                                             : finite)
        << "\n";
  }
  if (!report.findings.empty()) {
    out << "\nfindings\n";
    for (const Finding& finding : report.findings) {
      const char* color = finding.severity == Severity::kError     ? "31"
                          : finding.severity == Severity::kWarning ? "33"
                                                                   : "36";
      out << "  " << paint(style, color, pad(severity_name(finding.severity), 8))
          << pad(triage_layer_name(finding.layer), 8) << finding.code << ": " << finding.message << "\n";
    }
  }
  return out.str();
}

}  // namespace nanreplay
