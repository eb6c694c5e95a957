// report.md: the short summary of a replay for a ticket (GitHub or Jira
// markdown): verdict first, root cause, step table, findings by triage layer,
// propagation path, determinism and relative links to the other outputs.
// Pure: renders a ReplayReport to text; bundle text is escaped for markdown.
#pragma once

#include <string>

#include "reports/results/report.h"

namespace nanreplay {

std::string render_markdown(const ReplayReport& report);

}  // namespace nanreplay
