// What a causal mask makes of a non-finite score at a masked key
// (probes/masked_score.h), and how the report says it
// (reports/outputs/masked_score_output.h).
#include <catch2/catch.hpp>

#include <cmath>
#include <limits>
#include <memory>

#include "probes/masked_score.h"
#include "reports/outputs/masked_score_output.h"

namespace {

using nanreplay::AttentionMask;
using nanreplay::mask_effect;
constexpr double kScoreInf = std::numeric_limits<double>::infinity();
const double kNan = std::nan("");

}  // namespace

TEST_CASE("mask_effect: the additive masks poison the row with +inf or NaN, excluding and filling never do",
          "[probes][masked-score]") {
  const auto neg_inf = mask_effect(AttentionMask::kAdditiveNegInf, kScoreInf);
  CHECK(neg_inf.arithmetic == "+inf + (-inf) = NaN");
  CHECK(neg_inf.effect ==
        "the additive -inf mask made the masked score NaN and the softmax spread it over the row");
  CHECK(neg_inf.poisons_row);
  const auto finfo = mask_effect(AttentionMask::kAdditiveFinfoMin, kScoreInf);
  CHECK(finfo.arithmetic == "+inf + finfo.min = +inf");
  CHECK_THAT(finfo.effect, Catch::Matchers::Contains("+inf - (+inf) = NaN"));
  CHECK(finfo.poisons_row);
  for (AttentionMask additive : {AttentionMask::kAdditiveNegInf, AttentionMask::kAdditiveFinfoMin}) {
    CHECK_FALSE(mask_effect(additive, -kScoreInf).poisons_row);  // -inf stays -inf: weight 0
    CHECK(mask_effect(additive, kNan).poisons_row);         // no addition removes a NaN
  }
  CHECK(mask_effect(AttentionMask::kAdditiveNegInf, -kScoreInf).arithmetic == "-inf + (-inf) = -inf");
  CHECK(mask_effect(AttentionMask::kAdditiveFinfoMin, kNan).arithmetic == "NaN + finfo.min = NaN");
  for (double raw : {kScoreInf, -kScoreInf, kNan}) {
    const auto excluded = mask_effect(AttentionMask::kExclude, raw);
    const auto filled = mask_effect(AttentionMask::kFillFinfoMin, raw);
    CHECK_FALSE(excluded.poisons_row);
    CHECK_FALSE(filled.poisons_row);
    CHECK_THAT(excluded.effect, Catch::Matchers::Contains("no effect on the row"));
    CHECK_THAT(filled.effect, Catch::Matchers::Contains("no effect on the row"));
  }
  // A soft cap between the score and the mask makes an infinite score finite first.
  const auto capped = mask_effect(AttentionMask::kAdditiveNegInf, kScoreInf, true);
  CHECK_FALSE(capped.poisons_row);
  CHECK(capped.arithmetic == "cap * tanh(+inf / cap) = +cap");
  CHECK(mask_effect(AttentionMask::kAdditiveNegInf, kNan, true).poisons_row);
}

TEST_CASE("masked_score renders as report.json's object and one sentence", "[probes][masked-score][reports]") {
  nanreplay::FirstNonfinite origin;
  origin.layer = 0;
  CHECK(nanreplay::masked_score_json(origin).is_null());
  CHECK(nanreplay::masked_score_sentence(origin).empty());
  nanreplay::MaskedScore m;
  m.batch_row = 0, m.sample = 4, m.head = 2, m.query = 1, m.keys = {7}, m.key_count = 1, m.raw_score = kScoreInf;
  m.mask = AttentionMask::kAdditiveNegInf;
  origin.masked_score = std::make_shared<const nanreplay::MaskedScore>(m);
  const nlohmann::json j = nanreplay::masked_score_json(origin);
  CHECK(j["layer"] == 0);
  CHECK(j["head"] == 2);
  CHECK(j["sample"] == 4);
  CHECK(j["query_position"] == 1);
  CHECK(j["masked_key_positions"] == nlohmann::json({7}));
  CHECK(j["raw_score"] == "inf");
  CHECK(j["attention_mask"] == "additive_neg_inf");
  CHECK(j["arithmetic"] == "+inf + (-inf) = NaN");
  CHECK(j["poisons_row"] == true);
  CHECK(nanreplay::masked_score_sentence(origin) ==
        "Masked score: layer 0, head 2, sample 4, query position 1 scored +inf at masked key 7 (attention_mask "
        "additive_neg_inf): +inf + (-inf) = NaN: the additive -inf mask made the masked score NaN and the softmax "
        "spread it over the row");
}
