// How the replay computes in the bundle's precision. fp32 computes plainly;
// bf16 and fp16 emulate autocast on CPU by rounding (bundle spec, precision):
// matmul inputs and weights are rounded to the compute type and accumulated in
// fp32, every probe-site tensor is rounded when produced, and gradients passing
// a rounding point are rounded too, because rounding is a cast pair
// (fp32 -> low -> fp32) whose autograd casts the gradient the same way.
#pragma once

#include <string>

#include <torch/types.h>

#include "loaders/manifest.h"

namespace nanreplay {

class Numerics {
 public:
  explicit Numerics(Compute compute);

  Compute compute() const { return compute_; }
  bool reduced() const { return reduced_; }
  torch::ScalarType low_type() const { return low_type_; }

  // The value as the compute type holds it (an autograd-visible cast pair).
  torch::Tensor round(const torch::Tensor& x) const;
  // The low-precision tensor itself (for probes and gradient hooks).
  torch::Tensor to_low(const torch::Tensor& x) const;
  // y = x W^T (+ b) with rounded inputs, weight and bias, fp32 accumulation.
  torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& weight,
                       const torch::Tensor& bias = {}) const;
  // Scaled attention scores round(round(q k^T) / sqrt(head_dim)); probed by the caller.
  torch::Tensor attention_scores(const torch::Tensor& q, const torch::Tensor& k) const;

 private:
  Compute compute_;
  bool reduced_;
  torch::ScalarType low_type_;
};

}  // namespace nanreplay
