// LibTorch reductions that reproduce the CPU statistics kernel's definitions
// (finite-only magnitudes and sums, causal masking, first non-finite index in
// row-major order) on any device. Sums are taken in float64 like the kernel's;
// their order differs, so sums may differ from it in the last bits.
#include "replay/probing/device_stats.h"

#include <atomic>
#include <limits>
#include <stdexcept>
#include <string>

#include <torch/torch.h>

namespace nanreplay {

namespace {
std::atomic<int64_t> readbacks{0};
}  // namespace

std::vector<double> read_back(const std::vector<torch::Tensor>& parts) {
  if (parts.empty()) return {};
  std::vector<torch::Tensor> host;
  size_t begin = 0;
  while (begin < parts.size()) {
    size_t end = begin;
    while (end < parts.size() && parts[end].device() == parts[begin].device()) ++end;
    std::vector<torch::Tensor> run;
    for (size_t i = begin; i < end; ++i) run.push_back(parts[i].detach().reshape({-1}).to(torch::kFloat64));
    host.push_back(torch::cat(run).to(torch::kCPU));
    readbacks.fetch_add(1, std::memory_order_relaxed);
    begin = end;
  }
  const torch::Tensor all = torch::cat(host).contiguous();
  return std::vector<double>(all.data_ptr<double>(), all.data_ptr<double>() + all.numel());
}

int64_t readback_count() { return readbacks.load(std::memory_order_relaxed); }

ElemType elem_type_of(const torch::Tensor& t) {
  switch (t.scalar_type()) {
    case torch::kFloat32: return ElemType::kF32;
    case torch::kBFloat16: return ElemType::kBF16;
    case torch::kHalf: return ElemType::kF16;
    default: throw std::logic_error("probe: unsupported dtype " + std::string(c10::toString(t.scalar_type())));
  }
}

torch::Tensor visible_keys(int64_t T, const AttentionSpan& span, const torch::Device& device) {
  const torch::Tensor ones = torch::ones({T, T}, torch::TensorOptions().dtype(torch::kBool).device(device));
  torch::Tensor visible = span.window > 0 ? ones.tril() & ones.triu(1 - span.window) : ones.tril();
  if (span.chunk > 0) {  // the query's chunk and the key's are the same one
    const torch::Tensor chunk_of = torch::arange(T, torch::TensorOptions().dtype(torch::kLong).device(device))
                                       .div(span.chunk, "floor");
    visible = visible & chunk_of.unsqueeze(1).eq(chunk_of.unsqueeze(0));
  }
  return visible;
}

torch::Tensor device_stats_rows(const torch::Tensor& t, bool per_head, bool causal, const AttentionSpan& span) {
  torch::NoGradGuard no_grad;
  const torch::Tensor x = t.detach().to(torch::kFloat64);
  if (x.numel() == 0) {  // no elements: zero counts, no first non-finite
    const int64_t rows = per_head && x.dim() == 4 ? x.size(1) : 1;
    torch::Tensor empty = torch::zeros({rows, kDeviceStatsColumns}, x.options());
    empty.select(1, 8).fill_(-1.0);
    return empty;
  }
  const auto i64 = torch::TensorOptions().dtype(torch::kLong).device(x.device());
  torch::Tensor values;  // (rows, n): one row per head, or the whole tensor
  torch::Tensor valid;   // (rows, n) bool, or undefined when every element counts
  int64_t heads = 1, batch = 1, per_batch = 0;
  if (per_head) {
    batch = x.size(0);
    heads = x.size(1);
    const int64_t rows = x.size(2), cols = x.size(3);
    per_batch = rows * cols;
    values = x.transpose(0, 1).reshape({heads, -1});  // (H, B*R*C), (b, r, c) order
    if (causal) {
      const torch::Tensor lower = visible_keys(rows, span, x.device());  // rows == cols
      valid = lower.reshape({1, 1, rows * cols}).expand({heads, batch, rows * cols}).reshape({heads, -1});
    }
  } else {
    values = x.reshape({1, -1});
  }
  torch::Tensor nan = values.isnan();
  torch::Tensor inf = values.isinf();
  if (valid.defined()) {
    nan = nan & valid;
    inf = inf & valid;
  }
  const torch::Tensor bad = nan | inf;
  torch::Tensor finite = ~bad;
  if (valid.defined()) finite = finite & valid;
  const torch::Tensor zeros = torch::zeros_like(values);
  const torch::Tensor kept = torch::where(finite, values, zeros);
  const torch::Tensor magnitude = kept.abs();
  const double inf_value = std::numeric_limits<double>::infinity();
  torch::Tensor min_nonzero =
      torch::where(magnitude > 0, magnitude, torch::full_like(magnitude, inf_value)).amin(1);
  min_nonzero = torch::where(min_nonzero.isinf(), torch::zeros_like(min_nonzero), min_nonzero);

  // First non-finite per row: argmax returns the first maximal index.
  const torch::Tensor any_bad = bad.any(1);
  const torch::Tensor first_in_row = bad.to(torch::kUInt8).argmax(1);  // (rows,)
  torch::Tensor first_index = first_in_row;
  if (per_head) {  // back to the full [B, H, R, C] row-major index
    const torch::Tensor head = torch::arange(heads, i64);
    const torch::Tensor b = first_in_row.div(per_batch, "floor");
    first_index = (b * heads + head) * per_batch + first_in_row.remainder(per_batch);
  }
  const torch::Tensor first_value = values.gather(1, first_in_row.unsqueeze(1)).squeeze(1);
  const torch::Tensor kind = torch::where(
      first_value.isnan(), torch::full_like(first_value, 1.0),
      torch::where(first_value > 0, torch::full_like(first_value, 2.0), torch::full_like(first_value, 3.0)));
  const torch::Tensor none = torch::zeros_like(first_value);

  const torch::Tensor count =
      valid.defined() ? valid.sum(1).to(torch::kFloat64)
                      : torch::full({heads}, static_cast<double>(values.size(1)), x.options());
  return torch::stack({count, finite.sum(1).to(torch::kFloat64), nan.sum(1).to(torch::kFloat64),
                       inf.sum(1).to(torch::kFloat64), magnitude.amax(1), min_nonzero, kept.sum(1),
                       (kept * kept).sum(1),
                       torch::where(any_bad, first_index.to(torch::kFloat64), torch::full_like(none, -1.0)),
                       torch::where(any_bad, kind, none)},
                      1);
}

TensorStats stats_from_row(const double* row) {
  TensorStats s;
  s.count = static_cast<int64_t>(row[0]);
  s.finite_count = static_cast<int64_t>(row[1]);
  s.nan_count = static_cast<int64_t>(row[2]);
  s.inf_count = static_cast<int64_t>(row[3]);
  s.max_abs = row[4];
  s.min_nonzero_abs = row[5];
  s.sum = row[6];
  s.sum_sq = row[7];
  s.first_nonfinite = static_cast<int64_t>(row[8]);
  const int kind = static_cast<int>(row[9]);
  s.first_kind = kind == 1   ? NonfiniteKind::kNan
                 : kind == 2 ? NonfiniteKind::kPosInf
                 : kind == 3 ? NonfiniteKind::kNegInf
                             : NonfiniteKind::kNone;
  return s;
}

std::vector<TensorStats> stats_from_rows(const torch::Tensor& host_rows) {
  const torch::Tensor rows = host_rows.to(torch::kCPU).to(torch::kFloat64).contiguous();
  std::vector<TensorStats> out;
  out.reserve(static_cast<size_t>(rows.size(0)));
  const double* data = rows.data_ptr<double>();
  for (int64_t r = 0; r < rows.size(0); ++r) out.push_back(stats_from_row(data + r * kDeviceStatsColumns));
  return out;
}

}  // namespace nanreplay
