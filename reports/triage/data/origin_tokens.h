// The tokens at the first non-finite value: the input token at its position,
// and every token of its sample up to there whose embedding row is an outlier
// of the embedding matrix (row norms of the origin step's checkpoint against
// their own median and spread). A token with an extreme row is poisoned data.
#pragma once

#include <vector>

#include <torch/types.h>

#include "loaders/bundle/bundle.h"
#include "reports/results/report.h"
#include "reports/results/triage_thresholds.h"

namespace nanreplay {

// Empty when the origin names no sample and position. Sets origin.token.
// `embedding`: the token embedding the origin step started from, [vocab, hidden].
std::vector<OriginToken> origin_tokens(const Bundle& bundle, FirstNonfinite& origin, const torch::Tensor& embedding,
                                       const TriageThresholds& t);

}  // namespace nanreplay
