// The fold every per-step maximum shares (a head's logits, a router's, an
// expert's activations, across micro-batches and processes): the largest
// value seen, where a NaN, once seen, wins, so the maximum still says that
// something went non-finite.
#pragma once

#include <cmath>

namespace nanreplay {

inline void fold_nan_max(double& into, double value) {
  if (std::isnan(value) || value > into) into = value;
}

}  // namespace nanreplay
