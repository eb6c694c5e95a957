// How the replay computes in the bundle's precision. fp32 computes plainly;
// bf16 and fp16 emulate autocast on CPU by rounding (bundle spec, precision):
// matmul inputs and weights are rounded to the compute type and accumulated in
// fp32, every probe-site tensor is rounded when produced, and gradients passing
// a rounding point are rounded too, because rounding is a cast pair
// (fp32 -> low -> fp32) whose autograd casts the gradient the same way.
// fp8 computes in fp32 except the linear modules listed in the step's
// fp8_scales: their inputs and weights are quantized (e4m3 by default,
// straight-through backward) and the gradient reaching them (e5m2).
// What-if replays may change two things here (NumericsOverrides); without
// overrides every computation is exactly the bundle's.
#pragma once

#include <map>
#include <optional>
#include <string>
#include <vector>

#include <torch/types.h>

#include "loaders/bundle/manifest.h"
#include "loaders/bundle/step_state.h"
#include "probes/sites.h"

namespace nanreplay {

// What-if changes to the arithmetic (docs/bisect-and-what-if.md). Default: none.
struct NumericsOverrides {
  // Layers computed entirely in fp32: their sites are not rounded to the
  // compute type and their linears neither round nor fp8-quantize.
  std::vector<int> fp32_layers;
  // Attention as a fused kernel computes it: q k^T accumulated, scaled and
  // softmaxed in fp32 and never rounded to the compute type (probs still are,
  // before probs @ v).
  bool stable_softmax = false;
  // A mixture of experts' router matmul (and so its logits) in fp32, never
  // rounded; its softmax is fp32 anyway.
  bool router_fp32 = false;
};

// dequant(saturate(round_to_nearest_even_fp8(x * scale))) / scale in fp32;
// NaN and +-inf pass through, so a non-finite scale propagates.
torch::Tensor fp8_quantize_dequantize(const torch::Tensor& x, double scale, const std::string& format);

class Numerics {
 public:
  explicit Numerics(Compute compute);
  // fp8: the manifest's formats and this step's per-module scales (must outlive this).
  Numerics(Compute compute, const Fp8Config& fp8, const std::map<std::string, Fp8ModuleScales>* scales);

  Compute compute() const { return compute_; }
  // Native: bf16/fp16 matmuls run in the low type itself (tensor cores on a
  // GPU, fp32 accumulation inside) and their output is the rounded result;
  // everything else, and every rounding point, stays as emulated.
  void set_native(bool native) { native_ = native && reduced_; }
  bool native() const { return native_; }
  bool reduced() const { return reduced_; }
  torch::ScalarType low_type() const { return low_type_; }

  void set_overrides(NumericsOverrides overrides) { overrides_ = std::move(overrides); }
  const NumericsOverrides& overrides() const { return overrides_; }
  // The arithmetic inside block `layer`: plain fp32 when a what-if says so,
  // otherwise this object's.
  Numerics in_layer(int layer) const;
  // The arithmetic of a mixture of experts' router: plain fp32 with the
  // router_fp32 override, otherwise this object's.
  Numerics for_router() const;
  // Whether a site's tensor is held in the compute type (rounded when produced).
  // The loss never is: cross-entropy is fp32 from the rounded logits; nor are
  // a router's probabilities (fp32 softmax, as Hugging Face's Qwen3-MoE).
  bool rounds_site(const SiteRef& ref) const;

  // The value as the compute type holds it (an autograd-visible cast pair).
  torch::Tensor round(const torch::Tensor& x) const;
  // The low-precision tensor itself (for probes and gradient hooks).
  torch::Tensor to_low(const torch::Tensor& x) const;
  // y = x W^T (+ b) with rounded inputs, weight and bias, fp32 accumulation.
  // `module` is the linear's key prefix ("model.layers.0.self_attn.q_proj"),
  // which selects its fp8 scales.
  torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& weight,
                       const torch::Tensor& bias, const std::string& module) const;
  // Scaled attention scores round(round(q k^T) / sqrt(head_dim)), or in plain
  // fp32 with the stable_softmax override; probed by the caller.
  // `scaling` (Gemma's query_pre_attn_scalar ** -0.5): multiplied in place of the division, as Gemma's
  // eager attention writes it.
  torch::Tensor attention_scores(const torch::Tensor& q, const torch::Tensor& k,
                                 const std::optional<double>& query_pre_attn_scalar = std::nullopt) const;
  // a @ b of already-rounded operands: fp32, or in the low type when native.
  torch::Tensor matmul(const torch::Tensor& a, const torch::Tensor& b) const;

 private:
  Compute compute_;
  bool reduced_;
  bool native_ = false;
  torch::ScalarType low_type_;
  Fp8Config fp8_;
  const std::map<std::string, Fp8ModuleScales>* fp8_scales_ = nullptr;
  NumericsOverrides overrides_;

  bool fp32_layer(int layer) const;
  // This object's overrides on plain fp32 arithmetic (no rounding, no fp8).
  Numerics plain_fp32() const;
};

}  // namespace nanreplay
