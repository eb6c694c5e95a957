// Autocast emulation by rounding; see numerics.h for the rules.
#include "replay/numerics.h"

#include <cmath>

#include <torch/torch.h>

namespace nanreplay {

Numerics::Numerics(Compute compute)
    : compute_(compute),
      reduced_(compute == Compute::kBf16 || compute == Compute::kFp16),
      low_type_(compute == Compute::kBf16   ? torch::kBFloat16
                : compute == Compute::kFp16 ? torch::kHalf
                                            : torch::kFloat32) {}

torch::Tensor Numerics::to_low(const torch::Tensor& x) const {
  return reduced_ ? x.to(low_type_) : x;
}

torch::Tensor Numerics::round(const torch::Tensor& x) const {
  return reduced_ ? x.to(low_type_).to(torch::kFloat32) : x;
}

torch::Tensor Numerics::linear(const torch::Tensor& x, const torch::Tensor& weight,
                               const torch::Tensor& bias) const {
  const torch::Tensor b = bias.defined() ? round(bias) : bias;
  return torch::nn::functional::linear(round(x), round(weight), b);
}

torch::Tensor Numerics::attention_scores(const torch::Tensor& q, const torch::Tensor& k) const {
  // Divided, not multiplied by the reciprocal, as eager PyTorch code writes it.
  const double divisor = std::sqrt(static_cast<double>(q.size(-1)));
  return round(round(torch::matmul(q, k.transpose(-2, -1))) / divisor);
}

}  // namespace nanreplay
