// See damage_mask.h. The mask is made once per probed tensor; its indices
// are taken chunk by chunk, so a tensor whose every element is bad costs at
// most one chunk of indices besides the kept sample.
#include "replay/probing/damage_mask.h"

#include <cmath>
#include <string>

#include <torch/torch.h>

#include "replay/probing/device_stats.h"
#include "reports/results/number_text.h"

namespace nanreplay {

namespace {

constexpr int64_t kDamageChunk = int64_t{1} << 22;

// The layout a site's tensor has for the classifier; kFlat for none (the
// loss, per-expert rows).
std::optional<DamageLayout> damage_layout_of(const SiteRef& ref) {
  switch (site_def(ref.id).layout) {
    case SiteLayout::kTokens:
      if (ref.id == SiteId::kAttnQ || ref.id == SiteId::kAttnK || ref.id == SiteId::kAttnV) {
        return DamageLayout::kFusedHeads;
      }
      return DamageLayout::kTokens;
    case SiteLayout::kHeadsSquare:
    case SiteLayout::kHeadsDim: return DamageLayout::kHeads;
    default: return std::nullopt;
  }
}

// True where an element counts: every element, or a causal site's visible keys.
torch::Tensor considered_elements(const torch::Tensor& tensor, const SiteRef& ref, const AttentionSpan& span) {
  const auto shape = tensor.sizes();
  if (site_def(ref.id).causal && tensor.dim() == 4 && shape[2] == shape[3]) {
    return visible_keys(shape[2], span, tensor.device()).expand(shape);
  }
  return torch::ones_like(tensor, torch::TensorOptions().dtype(torch::kBool));
}

// Ascending flat indices of `mask`: every one up to kDamageIndexCap, else every k-th.
std::vector<int64_t> mask_indices(const torch::Tensor& mask, int64_t count) {
  const torch::Tensor flat = mask.reshape({-1});
  const int64_t stride = (count + kDamageIndexCap - 1) / kDamageIndexCap;
  std::vector<int64_t> out;
  int64_t rank = 0;
  for (int64_t start = 0; start < flat.numel(); start += kDamageChunk) {
    const int64_t length = std::min(kDamageChunk, flat.numel() - start);
    const torch::Tensor found = flat.narrow(0, start, length).nonzero().reshape({-1}).to(torch::kCPU).contiguous();
    const int64_t* p = found.data_ptr<int64_t>();
    for (int64_t i = 0; i < found.numel(); ++i, ++rank) {
      if (rank % stride == 0) out.push_back(start + p[i]);
    }
  }
  return out;
}

std::optional<DamageShape> classify_mask(const torch::Tensor& mask, const torch::Tensor& considered,
                                         const SiteRef& ref, int64_t head_dim, std::string criterion) {
  const int64_t count = mask.sum().item<int64_t>();
  if (count == 0) return std::nullopt;
  DamageInput input;
  input.shape = mask.sizes().vec();
  input.layout = *damage_layout_of(ref);
  input.head_dim = head_dim;
  input.considered = considered.sum().item<int64_t>();
  input.count = count;
  input.indices = mask_indices(mask, count);
  input.criterion = std::move(criterion);
  return classify_damage(input);
}

}  // namespace

std::optional<DamageShape> nonfinite_damage(const torch::Tensor& tensor, const SiteRef& ref, int64_t head_dim,
                                            const AttentionSpan& span) {
  if (!damage_layout_of(ref) || tensor.numel() == 0 || !tensor.device().is_cpu()) return std::nullopt;
  torch::NoGradGuard no_grad;
  const torch::Tensor considered = considered_elements(tensor, ref, span);
  const torch::Tensor mask = torch::isfinite(tensor.detach()).logical_not() & considered;
  return classify_mask(mask, considered, ref, head_dim, "non-finite");
}

std::optional<DamageShape> outlier_damage(const torch::Tensor& tensor, const SiteRef& ref, int64_t head_dim,
                                          const AttentionSpan& span) {
  if (!damage_layout_of(ref) || tensor.numel() == 0 || !tensor.device().is_cpu()) return std::nullopt;
  torch::NoGradGuard no_grad;
  const torch::Tensor considered = considered_elements(tensor, ref, span);
  const torch::Tensor x = tensor.detach().to(torch::kFloat32).abs();
  const torch::Tensor counted = torch::isfinite(x) & considered;
  const torch::Tensor values = torch::where(counted, x, torch::full({}, NAN, x.options())).reshape({-1});
  const int64_t step = std::max<int64_t>(1, values.numel() / kDamageIndexCap);
  const double median = values.slice(0, 0, values.numel(), step).nanmedian().item<double>();
  const double largest = torch::where(counted, x, torch::zeros({}, x.options())).max().item<double>();
  const double threshold = std::max(kOutlierMedianFactor * median, kOutlierMaxFraction * largest);
  if (!std::isfinite(threshold) || largest <= threshold) return std::nullopt;
  const torch::Tensor mask = counted & (x > threshold);
  return classify_mask(mask, considered, ref, head_dim,
                       "outlying (|x| > " + format_number(threshold) + ": above " + format_number(kOutlierMedianFactor) +
                           " x the median |x| and " + format_number(kOutlierMaxFraction) + " x the largest)");
}

}  // namespace nanreplay
