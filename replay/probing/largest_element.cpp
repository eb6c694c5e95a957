// See largest_element.h. Non-finite and masked elements count as -1, below
// every |x|, so the located element is the one max_abs reports.
#include "replay/probing/largest_element.h"

#include "replay/probing/device_stats.h"
#include "replay/probing/probe_session.h"

namespace nanreplay {

namespace {

// |x| as float64 with non-finite elements at -1.
torch::Tensor finite_magnitudes(const torch::Tensor& tensor) {
  const torch::Tensor x = tensor.detach().to(torch::kFloat64).abs();
  return torch::where(torch::isfinite(x), x, torch::full({}, -1.0, x.options()));
}

// Sample and position of row-major element `index` of a tensor of `shape`.
void name_element(ProbeRecord& record, int64_t index, const std::vector<int64_t>& shape, const SiteDef& def,
                  const std::vector<int64_t>& sample_ids) {
  if (def.layout == SiteLayout::kScalar || shape.size() < 3) return;
  const std::vector<int64_t> at = unravel(index, shape);
  if (at[0] < static_cast<int64_t>(sample_ids.size())) record.largest_sample = sample_ids[static_cast<size_t>(at[0])];
  record.largest_position = def.layout == SiteLayout::kTokens ? at[1] : at[2];
}

}  // namespace

void locate_largest(std::vector<ProbeRecord>& records, const torch::Tensor& tensor, const SiteDef& def,
                    const std::vector<int64_t>& sample_ids, const AttentionSpan& span) {
  if (records.empty() || tensor.numel() == 0) return;
  torch::NoGradGuard no_grad;
  torch::Tensor magnitudes = finite_magnitudes(tensor);
  const std::vector<int64_t> shape = tensor.sizes().vec();
  const bool per_head = records.size() > 1 && tensor.dim() == 4;
  if (per_head && def.causal && shape[2] == shape[3]) {
    const torch::Tensor hidden = visible_keys(shape[2], span, magnitudes.device()).logical_not();
    magnitudes = magnitudes.masked_fill(hidden, -1.0);
  }
  name_element(records[0], magnitudes.reshape({-1}).argmax().item<int64_t>(), shape, def, sample_ids);
  if (!per_head) return;
  // Per head: the head's own largest element, as a row-major index of the whole tensor.
  const int64_t batch = shape[0], heads = shape[1], inner = shape[2] * shape[3];
  const torch::Tensor by_head = magnitudes.transpose(0, 1).reshape({heads, batch * inner}).argmax(1).cpu();
  for (size_t r = 1; r < records.size(); ++r) {
    const int64_t h = records[r].head;
    if (h < 0 || h >= heads) continue;
    const int64_t flat = by_head[h].item<int64_t>();
    name_element(records[r], (flat / inner) * heads * inner + h * inner + flat % inner, shape, def, sample_ids);
  }
}

void locate_largest_routed(std::vector<ProbeRecord>& records, const torch::Tensor& tensor,
                           const ExpertRouting& routing, const std::vector<int64_t>& sample_ids) {
  if (records.empty() || tensor.numel() == 0 || routing.seq_len <= 0) return;
  torch::NoGradGuard no_grad;
  const torch::Tensor row_max = finite_magnitudes(tensor).amax(1).cpu();  // per routed row
  auto name_row = [&](ProbeRecord& record, int64_t first, int64_t last) {
    if (last <= first) return;
    const int64_t row = first + row_max.narrow(0, first, last - first).argmax().item<int64_t>();
    const int64_t token = routing.tokens.at(static_cast<size_t>(row));
    const int64_t batch_row = token / routing.seq_len;
    if (batch_row < static_cast<int64_t>(sample_ids.size())) record.largest_sample = sample_ids[static_cast<size_t>(batch_row)];
    record.largest_position = token % routing.seq_len;
  };
  name_row(records[0], 0, routing.rows());
  for (size_t r = 1; r < records.size(); ++r) {
    const int e = records[r].expert;
    if (e < 0 || static_cast<size_t>(e) + 1 >= routing.offsets.size()) continue;
    name_row(records[r], routing.offsets[static_cast<size_t>(e)], routing.offsets[static_cast<size_t>(e) + 1]);
  }
}

}  // namespace nanreplay
