// What the causal mask did to one query's row of attention scores when a
// score at a key the query may not see (a future key, or one outside its
// window or chunk) was not finite (docs/report-format.md, "masked_score").
// Excluded or filled, such a score is harmless; added to -inf or finfo.min it
// makes the row NaN, as PyTorch computes it. Plain data: no LibTorch; the
// replay finds the row while the scores are at hand
// (replay/probing/masked_row.h).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "loaders/arch/model_config.h"

namespace nanreplay {

// How many masked key positions a MaskedScore lists (key_count counts them all).
constexpr size_t kMaskedKeysListed = 8;

struct MaskedScore {
  int64_t batch_row = -1;
  int64_t sample = -1;             // dataset index of the batch row, -1: unknown
  int head = -1;
  int64_t query = -1;              // the query's position
  std::vector<int64_t> keys;       // masked key positions whose raw score is not finite, first kMaskedKeysListed
  int64_t key_count = 0;
  double raw_score = 0.0;          // the first of them, as attn.scores holds it (before any soft cap or mask)
  AttentionMask mask = AttentionMask::kExclude;
  bool soft_capped = false;        // attn_logit_softcap ran between the score and the mask
};

// What the mask made of one non-finite masked score, for people.
struct MaskEffect {
  std::string arithmetic;  // "+inf + (-inf) = NaN"
  std::string effect;      // "the additive -inf mask made the masked score NaN and the softmax spread it over the row"
  bool poisons_row = false;
};
MaskEffect mask_effect(AttentionMask mask, double raw_score, bool soft_capped = false);

}  // namespace nanreplay
