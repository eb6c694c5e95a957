// The masked non-finite scores of one query's row; see masked_row.h.
#include "replay/probing/masked_row.h"

#include "replay/probing/device_stats.h"

namespace nanreplay {

std::optional<MaskedScore> masked_score_in_row(const torch::Tensor& scores, const std::vector<int64_t>& element,
                                               const AttentionSpan& span, AttentionMask mask, bool soft_capped) {
  if (scores.dim() != 4 || scores.size(2) != scores.size(3) || element.size() != 4) return std::nullopt;
  torch::NoGradGuard no_grad;
  const int64_t b = element[0], h = element[1], query = element[2], T = scores.size(3);
  const torch::Tensor row = scores.detach()[b][h][query].to(torch::kCPU, torch::kFloat64);  // (T)
  const torch::Tensor hidden = visible_keys(T, span, torch::kCPU)[query].logical_not();
  const torch::Tensor keys = (torch::isfinite(row).logical_not() & hidden).nonzero().reshape({-1});
  if (keys.numel() == 0) return std::nullopt;
  MaskedScore masked;
  masked.batch_row = b;
  masked.head = static_cast<int>(h);
  masked.query = query;
  masked.key_count = keys.numel();
  for (int64_t i = 0; i < keys.numel() && masked.keys.size() < kMaskedKeysListed; ++i) {
    masked.keys.push_back(keys[i].item<int64_t>());
  }
  masked.raw_score = row[masked.keys.front()].item<double>();
  masked.mask = mask;
  masked.soft_capped = soft_capped;
  return masked;
}

}  // namespace nanreplay
