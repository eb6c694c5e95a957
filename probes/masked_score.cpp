// What a mask makes of a non-finite score at a masked key; see masked_score.h.
#include "probes/masked_score.h"

#include <cmath>

namespace nanreplay {

namespace {

// How the arithmetic writes a non-finite score.
std::string nonfinite_spelling(double score) {
  if (std::isnan(score)) return "NaN";
  return score > 0 ? "+inf" : "-inf";
}

// The additive masks: the score plus -inf or plus fp32's finfo.min.
MaskEffect added_mask_effect(const std::string& score, const std::string& added, const std::string& mask_words) {
  if (score == "-inf") {
    return {"-inf + " + added + " = -inf", "the masked score stays -inf, which the softmax weighs 0: no effect on the row",
            false};
  }
  if (score == "NaN") {
    return {"NaN + " + added + " = NaN",
            "no mask removes a NaN score once it is added: the softmax spread it over the row", true};
  }
  if (added == "(-inf)") {
    return {"+inf + (-inf) = NaN", "the " + mask_words + " made the masked score NaN and the softmax spread it over the row",
            true};
  }
  return {"+inf + " + added + " = +inf",
          "the " + mask_words + " left the masked score +inf: the row's maximum is +inf, and the softmax's "
          "+inf - (+inf) = NaN made the whole row NaN",
          true};
}

}  // namespace

MaskEffect mask_effect(AttentionMask mask, double raw_score, bool soft_capped) {
  const std::string score = nonfinite_spelling(raw_score);
  if (soft_capped && std::isinf(raw_score)) {
    return {"cap * tanh(" + score + " / cap) = " + (raw_score > 0 ? "+cap" : "-cap"),
            "the soft cap made the masked score finite before the mask: no effect on the row", false};
  }
  switch (mask) {
    case AttentionMask::kExclude:
      return {score + " excluded", "the mask leaves the masked key out of the softmax: no effect on the row", false};
    case AttentionMask::kFillFinfoMin:
      return {score + " replaced by finfo.min",
              "the mask replaced the masked score by finfo.min, which the softmax weighs 0: no effect on the row", false};
    case AttentionMask::kAdditiveNegInf: return added_mask_effect(score, "(-inf)", "additive -inf mask");
    case AttentionMask::kAdditiveFinfoMin: return added_mask_effect(score, "finfo.min", "additive finfo.min mask");
  }
  return {score, "", false};
}

}  // namespace nanreplay
