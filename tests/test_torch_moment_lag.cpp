// g^2 / v_hat of update_stats.h for every rule that keeps a second moment
// (replay/optim/second_moment_lag.h), against the definitions written out
// here: Adam's bias-corrected exp_avg_sq, and Adafactor's factored moment
// outer(row, col) / mean(row) under PyTorch's names (row_var [n, 1], col_var
// [1, m]) and Hugging Face's (exp_avg_sq_row [n], exp_avg_sq_col [m]).
#include <catch2/catch.hpp>

#include <cmath>

#include <torch/torch.h>

#include "replay/optim/second_moment_lag.h"

using namespace nanreplay;

namespace {

OptimizerRule rule_of(OptimizerKind kind) {
  OptimizerRule rule;
  rule.kind = kind;
  return rule;
}

TensorUpdateStats lag_of(const torch::Tensor& param, const torch::Tensor& grad, const ParamState& state,
                         const OptimizerRule& rule) {
  MomentLagSums sums;
  fold_second_moment_lag(param, grad, state, rule, /*decay=*/true, sums);
  TensorUpdateStats stats;
  sums.finish(stats);
  return stats;
}

void check_ratios(const TensorUpdateStats& got, const torch::Tensor& g, const torch::Tensor& v_hat) {
  const torch::Tensor g2 = g.to(torch::kFloat64).square(), v = v_hat.to(torch::kFloat64);
  REQUIRE(got.g2_over_v);
  CHECK(*got.g2_over_v == Approx((g2.mean() / v.mean()).item<double>()).epsilon(1e-12));
  CHECK(*got.g2_over_v_max == Approx((g2 / v).max().item<double>()).epsilon(1e-12));
  CHECK(*got.g2_over_v_rms == Approx((g2 / v).square().mean().sqrt().item<double>()).epsilon(1e-12));
}

}  // namespace

TEST_CASE("Adafactor's g^2 / v reads the factored moment, under PyTorch's and Hugging Face's names", "[torch][optim]") {
  torch::manual_seed(7);
  const torch::Tensor param = torch::randn({6, 5}), grad = torch::randn({6, 5});
  const torch::Tensor row = torch::rand({6}) + 0.1, col = torch::rand({5}) + 0.1;
  const torch::Tensor row64 = row.to(torch::kFloat64), col64 = col.to(torch::kFloat64);
  const torch::Tensor want = torch::outer(row64, col64) / row64.mean();  // v_hat = outer(row, col) / mean(row)

  ParamState torch_state;
  torch_state.step = 3;
  torch_state.tensors = {{"row_var", row.reshape({6, 1})}, {"col_var", col.reshape({1, 5})}};
  const TensorUpdateStats torch_lag = lag_of(param, grad, torch_state, rule_of(OptimizerKind::kAdafactor));
  check_ratios(torch_lag, grad, want);

  ParamState hf_state;
  hf_state.step = 3;
  hf_state.tensors = {{"exp_avg_sq_row", row}, {"exp_avg_sq_col", col}};
  const TensorUpdateStats hf_lag = lag_of(param, grad, hf_state, rule_of(OptimizerKind::kAdafactorHf));
  check_ratios(hf_lag, grad, want);

  // PyTorch floors mean(row_var) at eps1 (fp32's epsilon unless set), as its update does.
  torch_state.tensors["row_var"] = torch::full({6, 1}, 1e-9);
  const TensorUpdateStats floored = lag_of(param, grad, torch_state, rule_of(OptimizerKind::kAdafactor));
  const torch::Tensor tiny = torch::full({6, 1}, 1e-9).to(torch::kFloat64);
  check_ratios(floored, grad, tiny.matmul(col64.reshape({1, 5})) / 1.1920928955078125e-07);
}

TEST_CASE("a vector's Adafactor moment is its own; nothing before the first update or for Muon", "[torch][optim]") {
  const torch::Tensor param = torch::ones({4}), grad = torch::tensor({1.0, -2.0, 3.0, 0.5});
  const torch::Tensor variance = torch::tensor({0.5, 1.0, 2.0, 4.0});
  ParamState state;
  state.step = 1;
  state.tensors = {{"variance", variance}};
  check_ratios(lag_of(param, grad, state, rule_of(OptimizerKind::kAdafactor)), grad, variance);
  state.tensors = {{"exp_avg_sq", variance}};
  check_ratios(lag_of(param, grad, state, rule_of(OptimizerKind::kAdafactorHf)), grad, variance);
  state.step = 0;
  CHECK_FALSE(lag_of(param, grad, state, rule_of(OptimizerKind::kAdafactorHf)).g2_over_v);
  state.step = 5;
  state.tensors = {{"momentum_buffer", variance}};
  CHECK_FALSE(lag_of(param, grad, state, rule_of(OptimizerKind::kMuon)).g2_over_v);
}

TEST_CASE("Adam's g^2 / v is bias-corrected and folds slice by slice as it does whole", "[torch][optim]") {
  torch::manual_seed(3);
  const torch::Tensor param = torch::randn({8, 3}), grad = torch::randn({8, 3});
  const torch::Tensor exp_avg_sq = torch::rand({8, 3}) * 0.01;
  const OptimizerRule rule = rule_of(OptimizerKind::kAdamW);
  ParamState whole;
  whole.step = 4;
  whole.tensors = {{"exp_avg", torch::zeros({8, 3})}, {"exp_avg_sq", exp_avg_sq}};
  const TensorUpdateStats all = lag_of(param, grad, whole, rule);
  check_ratios(all, grad, exp_avg_sq.to(torch::kFloat64) / (1.0 - std::pow(rule.beta2, 4.0)));
  MomentLagSums sums;
  for (int64_t row : {0, 5}) {
    const int64_t count = row == 0 ? 5 : 3;
    ParamState slice;
    slice.step = 4;
    slice.tensors = {{"exp_avg_sq", exp_avg_sq.narrow(0, row, count)}};
    fold_second_moment_lag(param.narrow(0, row, count), grad.narrow(0, row, count), slice, rule, true, sums);
  }
  TensorUpdateStats sliced;
  sums.finish(sliced);
  CHECK(*sliced.g2_over_v == Approx(*all.g2_over_v).epsilon(1e-12));
  CHECK(*sliced.g2_over_v_max == Approx(*all.g2_over_v_max).epsilon(1e-12));
  CHECK(*sliced.g2_over_v_rms == Approx(*all.g2_over_v_rms).epsilon(1e-12));
}
