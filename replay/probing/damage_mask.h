// The shape of the damage of a probed tensor, taken while the replay holds it
// (probes/damage_shape.h classifies; docs/triage.md): the non-finite elements
// of the first non-finite forward site of each pass, and on a spike incident
// the outlying elements of every forward site. Only the classification is
// kept, never the tensor: at most kDamageIndexCap indices exist at a time
// (an even sample beyond that), read in bounded chunks. Host tensors only.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>

#include <torch/types.h>

#include "kernels/attention_span.h"
#include "probes/damage_shape.h"
#include "probes/sites.h"

namespace nanreplay {

// What counts as an outlying element of a spike's site: |x| above both this
// many times the median finite |x| and this fraction of the largest.
constexpr double kOutlierMedianFactor = 10.0;
constexpr double kOutlierMaxFraction = 0.1;

// `head_dim`: the width of one head in attn.q / attn.k / attn.v; `span`: the
// layer's sliding window or chunk (causal sites count the keys each query sees).
// None when no element qualifies, or the site has no layout to read.
std::optional<DamageShape> nonfinite_damage(const torch::Tensor& tensor, const SiteRef& ref, int64_t head_dim,
                                            const AttentionSpan& span);
std::optional<DamageShape> outlier_damage(const torch::Tensor& tensor, const SiteRef& ref, int64_t head_dim,
                                          const AttentionSpan& span);

}  // namespace nanreplay
