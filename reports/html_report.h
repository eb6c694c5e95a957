// report.html: one self-contained page (inline CSS, inline SVG, one tiny
// inline script; nothing fetched from the network) that walks a person from
// the verdict through the triage, per-step heatmaps of log10 max|x| by layer
// and site, the propagation path, the loss chart and the offending tokens.
// Pure: renders a ReplayReport to text; every string is HTML-escaped.
#pragma once

#include <string>

#include "reports/report.h"

namespace nanreplay {

std::string render_html(const ReplayReport& report);

}  // namespace nanreplay
