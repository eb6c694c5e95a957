#include "reports/triage/provenance_note.h"

#include <string>

#include "loaders/bundle/provenance.h"

namespace nanreplay {
namespace {

bool is_non_reproduction(FindingCode code) {
  return code == FindingCode::kBundleDoesNotReproduce || code == FindingCode::kSystemNotReproducible;
}

void append_sentence(std::string& text, const std::string& sentence) {
  if (!text.empty() && text.back() != '.') text += '.';
  text += sentence;
}

}  // namespace

void note_on_reproduction_gaps(ReplayReport& report, const std::string& sentence) {
  for (Finding& f : report.findings) {
    if (is_non_reproduction(f.code)) append_sentence(f.message, sentence);
  }
  if (report.root_cause && report.root_cause->code && is_non_reproduction(*report.root_cause->code)) {
    append_sentence(report.root_cause->summary, sentence);
  }
}

void note_defaulted_values(ReplayReport& report) {
  if (report.defaulted.empty()) return;
  note_on_reproduction_gaps(report, " The bundle's writer defaulted values that change the math (no checkpoint, "
                                    "config or flag gave them): " + describe_defaulted(report.defaulted) +
                                    ". Check these before the machine.");
}

}  // namespace nanreplay
