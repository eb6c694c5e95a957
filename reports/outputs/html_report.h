// report.html: one self-contained page (inline CSS, inline SVG, one tiny
// inline script; nothing fetched from the network) that walks a person from
// the verdict and the origin site's max|x| against its type's limit through
// the triage (consequences folded away), the per-step strip and heatmaps of
// log10 max|x| by layer and site, the propagation path, loss and gradient
// norm over the window and the offending tokens.
// Pure: renders a ReplayReport to text; every string is HTML-escaped.
#pragma once

#include <string>

#include "reports/results/report.h"

namespace nanreplay {

std::string render_html(const ReplayReport& report);

}  // namespace nanreplay
