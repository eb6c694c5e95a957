// Logged against replayed numbers, non-finite by kind; see logged_value.h.
#include "reports/results/logged_value.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace nanreplay {

ValueKind value_kind(double value) {
  if (std::isnan(value)) return ValueKind::kNan;
  if (std::isinf(value)) return value > 0 ? ValueKind::kPositiveInf : ValueKind::kNegativeInf;
  return ValueKind::kFinite;
}

double logged_gap(double logged, double replayed) {
  const ValueKind kind = value_kind(logged);
  if (kind != value_kind(replayed)) return std::numeric_limits<double>::infinity();
  if (kind != ValueKind::kFinite) return 0.0;
  return std::fabs(replayed - logged) / std::max(std::fabs(logged), 1e-12);
}

bool logged_agrees(double logged, double replayed, double relative_tolerance) {
  return logged_gap(logged, replayed) <= relative_tolerance;
}

}  // namespace nanreplay
