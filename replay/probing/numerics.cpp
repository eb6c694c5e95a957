// Autocast emulation by rounding; see numerics.h for the rules.
#include "replay/probing/numerics.h"

#include <algorithm>
#include <cmath>

#include <torch/torch.h>

namespace nanreplay {

namespace {

struct Fp8Format {
  int mantissa_bits;
  int min_normal_exponent;
  double max_finite;
};

Fp8Format fp8_format(const std::string& name) {
  if (name == "e4m3") return {3, -6, 448.0};
  if (name == "e5m2") return {2, -14, 57344.0};
  throw std::invalid_argument("unknown fp8 format " + name);
}

// Straight-through quantization: forward quantizes, backward passes the gradient.
struct Fp8StraightThrough : public torch::autograd::Function<Fp8StraightThrough> {
  static torch::Tensor forward(torch::autograd::AutogradContext*, const torch::Tensor& x,
                               double scale, const std::string& format) {
    return fp8_quantize_dequantize(x, scale, format);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext*,
                                                 torch::autograd::variable_list grads) {
    return {grads[0], torch::Tensor(), torch::Tensor()};
  }
};

// Identity forward; quantizes the gradient flowing back into the linear.
struct Fp8GradOutput : public torch::autograd::Function<Fp8GradOutput> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& y,
                               double scale, const std::string& format) {
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["format"] = format;
    return y.clone();
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const double scale = ctx->saved_data["scale"].toDouble();
    const std::string format = ctx->saved_data["format"].toStringRef();
    return {fp8_quantize_dequantize(grads[0], scale, format), torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace

torch::Tensor fp8_quantize_dequantize(const torch::Tensor& x, double scale, const std::string& format) {
  torch::NoGradGuard no_grad;
  const Fp8Format f = fp8_format(format);
  const torch::Tensor v = x * scale;
  // The spacing of representable values around v: 2^(exponent - mantissa bits),
  // with the exponent clamped at the smallest normal (subnormals share its spacing).
  const torch::Tensor exponent =
      torch::clamp_min(std::get<1>(torch::frexp(v)).to(torch::kFloat32) - 1, f.min_normal_exponent);
  const torch::Tensor spacing = torch::pow(2.0, exponent - f.mantissa_bits);
  torch::Tensor q = torch::round(v / spacing) * spacing;  // round half to even
  q = torch::clamp(q, -f.max_finite, f.max_finite);
  q = torch::where(torch::isfinite(v), q, v);
  return q / scale;
}

Numerics::Numerics(Compute compute)
    : compute_(compute),
      reduced_(compute == Compute::kBf16 || compute == Compute::kFp16),
      low_type_(compute == Compute::kBf16   ? torch::kBFloat16
                : compute == Compute::kFp16 ? torch::kHalf
                                            : torch::kFloat32) {}

Numerics::Numerics(Compute compute, const Fp8Config& fp8,
                   const std::map<std::string, Fp8ModuleScales>* scales)
    : Numerics(compute) {
  fp8_ = fp8;
  fp8_scales_ = scales;
}

bool Numerics::fp32_layer(int layer) const {
  const std::vector<int>& layers = overrides_.fp32_layers;
  return layer >= 0 && std::find(layers.begin(), layers.end(), layer) != layers.end();
}

Numerics Numerics::plain_fp32() const {
  Numerics plain(Compute::kFp32);
  plain.overrides_ = overrides_;
  return plain;
}

Numerics Numerics::in_layer(int layer) const { return fp32_layer(layer) ? plain_fp32() : *this; }

Numerics Numerics::for_router() const { return overrides_.router_fp32 ? plain_fp32() : *this; }

bool Numerics::rounds_site(const SiteRef& ref) const {
  const bool a_loss = ref.id == SiteId::kLoss || ref.id == SiteId::kMtpLoss;
  // An MTP block's embedding and logits are the model's embedding and head, outside the block fp32-layers names.
  const bool model_part = ref.id == SiteId::kMtpEmbed || ref.id == SiteId::kMtpLogits;
  if (!reduced_ || a_loss || ref.id == SiteId::kMlpRouterProbs || (fp32_layer(ref.layer) && !model_part)) return false;
  if (overrides_.router_fp32 && ref.id == SiteId::kMlpRouter) return false;
  return !(overrides_.stable_softmax && ref.id == SiteId::kAttnScores);
}

torch::Tensor Numerics::to_low(const torch::Tensor& x) const {
  return reduced_ ? x.to(low_type_) : x;
}

torch::Tensor Numerics::round(const torch::Tensor& x) const {
  return reduced_ ? x.to(low_type_).to(torch::kFloat32) : x;
}

torch::Tensor Numerics::linear(const torch::Tensor& x, const torch::Tensor& weight,
                               const torch::Tensor& bias, const std::string& module) const {
  if (compute_ == Compute::kFp8 && fp8_scales_ != nullptr) {
    const auto found = fp8_scales_->find(module);
    if (found != fp8_scales_->end()) {
      // A scale the job did not record is taken as 1 (Transformer Engine's initial scale).
      const Fp8ModuleScales& s = found->second;
      const torch::Tensor xq = Fp8StraightThrough::apply(x, s.input.value_or(1.0), fp8_.fwd);
      const torch::Tensor wq = Fp8StraightThrough::apply(weight, s.weight.value_or(1.0), fp8_.fwd);
      const torch::Tensor y = torch::nn::functional::linear(xq, wq, bias);
      return Fp8GradOutput::apply(y, s.grad_output.value_or(1.0), fp8_.bwd);
    }
  }
  if (native_) {
    const torch::Tensor b = bias.defined() ? to_low(bias) : bias;
    return torch::nn::functional::linear(to_low(x), to_low(weight), b).to(torch::kFloat32);
  }
  const torch::Tensor b = bias.defined() ? round(bias) : bias;
  return torch::nn::functional::linear(round(x), round(weight), b);
}

torch::Tensor Numerics::matmul(const torch::Tensor& a, const torch::Tensor& b) const {
  if (native_) return torch::matmul(to_low(a), to_low(b)).to(torch::kFloat32);
  return torch::matmul(a, b);
}

torch::Tensor Numerics::attention_scores(const torch::Tensor& q, const torch::Tensor& k,
                                         const std::optional<double>& query_pre_attn_scalar) const {
  if (query_pre_attn_scalar) {  // Gemma: times query_pre_attn_scalar ** -0.5
    const double scaling = std::pow(*query_pre_attn_scalar, -0.5);
    if (overrides_.stable_softmax) return torch::matmul(q, k.transpose(-2, -1)) * scaling;
    return round(round(matmul(q, k.transpose(-2, -1))) * scaling);
  }
  // Divided, not multiplied by the reciprocal, as eager PyTorch code writes it.
  const double divisor = std::sqrt(static_cast<double>(q.size(-1)));
  // A fused kernel keeps the product in its fp32 accumulators: no rounding.
  if (overrides_.stable_softmax) return torch::matmul(q, k.transpose(-2, -1)) / divisor;
  return round(round(matmul(q, k.transpose(-2, -1))) / divisor);
}

}  // namespace nanreplay
