// Chunked attention's visible keys (LibTorch's mask and the CPU kernel's
// causal statistics agree), and the row reader behind report.json's
// masked_score (replay/probing/masked_row.h).
#include <catch2/catch.hpp>

#include <limits>

#include <torch/torch.h>

#include "kernels/tensor_stats.h"
#include "replay/probing/device_stats.h"
#include "replay/probing/masked_row.h"

namespace {

using nanreplay::AttentionSpan;
constexpr float kInfF32 = std::numeric_limits<float>::infinity();

}  // namespace

TEST_CASE("chunked attention: query i sees key j iff j <= i and i / C == j / C", "[probes][chunked]") {
  const int64_t T = 10, C = 4;
  const torch::Tensor visible = nanreplay::visible_keys(T, AttentionSpan::chunked(C), torch::kCPU);
  for (int64_t i = 0; i < T; ++i) {
    for (int64_t j = 0; j < T; ++j) {
      INFO("query " << i << ", key " << j);
      CHECK(visible[i][j].item<bool>() == (j <= i && i / C == j / C));
    }
  }
  // The CPU kernel counts the same keys, and skips the NaN placed on every hidden one.
  torch::Tensor scores = torch::randn({2, 3, T, T});
  scores.masked_fill_(visible.logical_not(), std::nan(""));
  const auto stats = nanreplay::compute_head_stats(scores.data_ptr(), nanreplay::ElemType::kF32, 2, 3, T, T, true,
                                                   AttentionSpan::chunked(C));
  for (const nanreplay::TensorStats& head : stats) {
    CHECK(head.count == 2 * visible.sum().item<int64_t>());
    CHECK(head.nan_count == 0);
  }
  const auto causal = nanreplay::compute_head_stats(scores.data_ptr(), nanreplay::ElemType::kF32, 2, 3, T, T, true);
  CHECK(causal[0].nan_count > 0);  // plain causal statistics see the other chunks' keys
  // The device reductions agree with the kernel.
  const torch::Tensor rows = nanreplay::device_stats_rows(scores, true, true, AttentionSpan::chunked(C));
  CHECK(rows[0][0].item<double>() == static_cast<double>(stats[0].count));
}

TEST_CASE("masked_score_in_row finds the non-finite scores at masked keys of the origin's row", "[probes][masked-score]") {
  torch::Tensor scores = torch::zeros({2, 2, 6, 6});
  scores[1][0][1][4] = kInfF32;   // a future key of query 1
  scores[1][0][1][5] = -kInfF32;
  scores[1][0][3][2] = kInfF32;   // a visible key: not masked
  const auto found = nanreplay::masked_score_in_row(scores, {1, 0, 1, 0}, AttentionSpan{},
                                                    nanreplay::AttentionMask::kAdditiveNegInf, false);
  REQUIRE(found.has_value());
  CHECK(found->batch_row == 1);
  CHECK(found->head == 0);
  CHECK(found->query == 1);
  CHECK(found->keys == std::vector<int64_t>({4, 5}));
  CHECK(found->key_count == 2);
  CHECK(found->raw_score == std::numeric_limits<double>::infinity());
  CHECK(found->sample == -1);
  // Query 3's row has its inf at a key it sees: nothing masked to explain.
  CHECK_FALSE(nanreplay::masked_score_in_row(scores, {1, 0, 3, 2}, AttentionSpan{},
                                             nanreplay::AttentionMask::kAdditiveNegInf, false));
  // With chunks of 3, key 2 is outside query 3's chunk: masked.
  const auto chunked = nanreplay::masked_score_in_row(scores, {1, 0, 3, 2}, AttentionSpan::chunked(3),
                                                      nanreplay::AttentionMask::kAdditiveFinfoMin, false);
  REQUIRE(chunked.has_value());
  CHECK(chunked->keys == std::vector<int64_t>({2}));
}
