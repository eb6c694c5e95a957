// See masked_score_output.h.
#include "reports/outputs/masked_score_output.h"

#include <cmath>
#include <sstream>

namespace nanreplay {

namespace {

// "key 7", "keys 7, 9", "keys 7, 9, ... (12 in all)".
std::string masked_keys_text(const MaskedScore& m) {
  std::ostringstream out;
  out << (m.key_count == 1 ? "key " : "keys ");
  for (size_t i = 0; i < m.keys.size(); ++i) out << (i ? ", " : "") << m.keys[i];
  if (m.key_count > static_cast<int64_t>(m.keys.size())) out << ", ... (" << m.key_count << " in all)";
  return out.str();
}

}  // namespace

nlohmann::json masked_score_json(const FirstNonfinite& origin) {
  if (!origin.masked_score) return nullptr;
  const MaskedScore& m = *origin.masked_score;
  const MaskEffect effect = mask_effect(m.mask, m.raw_score, m.soft_capped);
  return {{"layer", optional_index(origin.layer)},
          {"head", m.head},
          {"sample", optional_index(m.sample)},
          {"batch_row", m.batch_row},
          {"query_position", m.query},
          {"masked_key_positions", m.keys},
          {"masked_key_count", m.key_count},
          {"raw_score", json_number(m.raw_score)},
          {"attention_mask", attention_mask_name(m.mask)},
          {"soft_capped", m.soft_capped},
          {"arithmetic", effect.arithmetic},
          {"effect", effect.effect},
          {"poisons_row", effect.poisons_row}};
}

std::string masked_score_sentence(const FirstNonfinite& origin) {
  if (!origin.masked_score) return "";
  const MaskedScore& m = *origin.masked_score;
  const MaskEffect effect = mask_effect(m.mask, m.raw_score, m.soft_capped);
  std::ostringstream out;
  out << "Masked score: layer " << origin.layer << ", head " << m.head << ", sample ";
  if (m.sample >= 0) {
    out << m.sample;
  } else {
    out << "(batch row " << m.batch_row << ")";
  }
  out << ", query position " << m.query << " scored " << (std::isnan(m.raw_score) ? "NaN" : m.raw_score > 0 ? "+inf" : "-inf")
      << " at masked " << masked_keys_text(m) << " (attention_mask " << attention_mask_name(m.mask)
      << "): " << effect.arithmetic << ": " << effect.effect;
  return out.str();
}

}  // namespace nanreplay
