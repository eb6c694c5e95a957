// See number_text.h.
#include "reports/results/number_text.h"

#include <cmath>
#include <cstdio>

namespace nanreplay {

std::string format_number(double value) {
  if (std::isnan(value)) return "nan";
  if (std::isinf(value)) return value > 0 ? "inf" : "-inf";
  char buffer[32];
  std::snprintf(buffer, sizeof(buffer), "%.6g", value);
  return buffer;
}

std::string format_percent(double fraction) {
  if (!std::isfinite(fraction)) return format_number(fraction) + "%";
  char buffer[32];
  std::snprintf(buffer, sizeof(buffer), "%.3g%%", 100 * fraction);
  return buffer;
}

}  // namespace nanreplay
