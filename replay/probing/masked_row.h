// Finds, in one query's row of a layer's attention scores, the non-finite
// scores at keys the query may not see: what probes/masked_score.h explains.
// Read once per pass at most, for the row of the pass's first non-finite
// element, while the scores are at hand.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include <torch/types.h>

#include "kernels/attention_span.h"
#include "probes/masked_score.h"

namespace nanreplay {

// `scores`: [batch, heads, T, T] as attn.scores holds them; `element`: the
// coordinates [batch row, head, query, key] of an element of that layout (the
// origin's). None when the query's row holds no non-finite score at a key
// outside `span`'s causal view. `sample` of the result is left -1.
std::optional<MaskedScore> masked_score_in_row(const torch::Tensor& scores, const std::vector<int64_t>& element,
                                               const AttentionSpan& span, AttentionMask mask, bool soft_capped);

}  // namespace nanreplay
