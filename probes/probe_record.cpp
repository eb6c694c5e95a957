// Names of the probe phases as they appear in the trace, the report and on the
// terminal; one switch so every output spells them the same way.
#include "probes/probe_record.h"

namespace nanreplay {

const char* phase_name(Phase phase) {
  switch (phase) {
    case Phase::kForward: return "forward";
    case Phase::kBackward: return "backward";
    case Phase::kGrad: return "grad";
  }
  return "unknown";
}

std::string probe_name(Phase phase, const SiteRef& site, const std::string& param) {
  return phase == Phase::kGrad ? param : site_name(site);
}

}  // namespace nanreplay
