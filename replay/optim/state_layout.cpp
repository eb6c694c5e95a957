// See state_layout.h.
#include "replay/optim/state_layout.h"

namespace nanreplay {

namespace {

std::vector<int64_t> with_one_at(std::vector<int64_t> shape, size_t from_end) {
  shape[shape.size() - from_end] = 1;
  return shape;
}

std::vector<int64_t> without_dim(std::vector<int64_t> shape, size_t from_end) {
  shape.erase(shape.end() - static_cast<std::ptrdiff_t>(from_end));
  return shape;
}

}  // namespace

StateLayout state_layout(const OptimizerRule& rule, const std::vector<int64_t>& shape) {
  switch (rule.kind) {
    case OptimizerKind::kAdamW:
    case OptimizerKind::kAdam:
      if (rule.amsgrad) return {{"exp_avg", shape}, {"exp_avg_sq", shape}, {"max_exp_avg_sq", shape}};
      return {{"exp_avg", shape}, {"exp_avg_sq", shape}};
    case OptimizerKind::kAdafactor:
      if (shape.size() > 1) return {{"row_var", with_one_at(shape, 1)}, {"col_var", with_one_at(shape, 2)}};
      return {{"variance", shape}};
    case OptimizerKind::kAdafactorHf: {
      StateLayout layout;
      if (rule.hf_beta1) layout.push_back({"exp_avg", shape});
      if (shape.size() >= 2) {
        layout.push_back({"exp_avg_sq_row", without_dim(shape, 1)});
        layout.push_back({"exp_avg_sq_col", without_dim(shape, 2)});
      } else {
        layout.push_back({"exp_avg_sq", shape});
      }
      return layout;
    }
    case OptimizerKind::kMuon: return {{"momentum_buffer", shape}};
  }
  return {};
}

}  // namespace nanreplay
