// The robust statistics every outlier rule shares: the median, and the
// median absolute deviation scaled to estimate a standard deviation, so a
// robust z-score reads like an ordinary one on normal data and one outlier
// cannot move its own baseline.
#pragma once

#include <algorithm>
#include <cstddef>
#include <utility>
#include <vector>

namespace nanreplay {

// MAD x this estimates sigma for normally distributed values (1 / Phi^-1(3/4)).
inline constexpr double kMadToSigma = 1.4826;

// The median (the mean of the two middle values for an even count); 0 for none.
inline double median_of(std::vector<double> values) {
  if (values.empty()) return 0.0;
  const size_t mid = values.size() / 2;
  std::nth_element(values.begin(), values.begin() + static_cast<std::ptrdiff_t>(mid), values.end());
  const double upper = values[mid];
  if (values.size() % 2 == 1) return upper;
  return (*std::max_element(values.begin(), values.begin() + static_cast<std::ptrdiff_t>(mid)) + upper) / 2;
}

// The robust scale of `values` about `center`: kMadToSigma x median |v - center|.
inline double robust_sigma(const std::vector<double>& values, double center) {
  std::vector<double> deviations;
  deviations.reserve(values.size());
  for (double v : values) deviations.push_back(v < center ? center - v : v - center);
  return kMadToSigma * median_of(std::move(deviations));
}

}  // namespace nanreplay
