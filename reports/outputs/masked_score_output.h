// What the mask did to the origin's row (probes/masked_score.h), as every
// renderer shows it (docs/report-format.md, "masked_score"): report.json's
// optional "masked_score" object on the origin, and one sentence for the
// terminal and report.md. Every string here is made from numbers and fixed words.
#pragma once

#include <string>

#include <nlohmann/json.hpp>

#include "reports/results/report.h"

namespace nanreplay {

// Null when the origin has none.
nlohmann::json masked_score_json(const FirstNonfinite& origin);

// "Masked score: layer 0, head 0, sample 0, query position 1 scored +inf at masked key 7
// (attention_mask additive_neg_inf): +inf + (-inf) = NaN: the additive -inf mask made ..."; empty without one.
std::string masked_score_sentence(const FirstNonfinite& origin);

}  // namespace nanreplay
