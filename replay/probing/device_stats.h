// Probe statistics for tensors that live on an accelerator. The same numbers
// as the CPU kernel (kernels/tensor_stats.h) computed with LibTorch
// reductions where the tensor is, into a small float64 tensor that stays on
// the device: the replay reads all of a step's rows back in one copy, so
// probing costs no host synchronisation until the step ends.
#pragma once

#include <vector>

#include <torch/types.h>

#include "kernels/attention_span.h"
#include "kernels/tensor_stats.h"

namespace nanreplay {

// Columns of one row: count, finite_count, nan_count, inf_count, max_abs,
// min_nonzero_abs, sum, sum_sq, first_nonfinite, first_kind.
constexpr int64_t kDeviceStatsColumns = 10;

// (1, kDeviceStatsColumns) for the whole tensor, or (heads, kDeviceStatsColumns)
// for a per-head [batch, heads, rows, cols] tensor, float64 on t's device.
// With `causal`, elements with col > row are skipped, as the CPU kernel does.
// Indices are row-major over the full tensor.
// (T, T) true where query i sees key j: j <= i, and with a sliding window W
// (Mistral) also j > i - W, with chunks of C (Llama 4) also j / C == i / C.
// What attention reads and causal statistics count.
torch::Tensor visible_keys(int64_t T, const AttentionSpan& span, const torch::Device& device);

torch::Tensor device_stats_rows(const torch::Tensor& t, bool per_head, bool causal, const AttentionSpan& span = {});

// The statistics kernels' element type of an f32, bf16 or f16 tensor
// (std::logic_error for any other dtype: probes never see one).
ElemType elem_type_of(const torch::Tensor& t);

// Small tensors (any shape, dtype and devices) read back to the host as one
// float64 vector, in order: one copy per run of tensors on one device. Every
// readback of a step's values (losses, norms, probe statistics) goes through
// here, so a step reads back once however many sites it probes.
std::vector<double> read_back(const std::vector<torch::Tensor>& parts);
// The copies read_back has made in this process (the tests count them per
// step on the CPU, through the path device tensors take).
int64_t readback_count();

// One row read back to the host.
TensorStats stats_from_row(const double* row);
std::vector<TensorStats> stats_from_rows(const torch::Tensor& host_rows);

}  // namespace nanreplay
