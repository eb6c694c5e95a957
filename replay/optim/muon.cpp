// torch.optim.Muon (torch/optim/_muon.py, _single_tensor_muon): momentum as
// buf.lerp_(grad, 1 - momentum), Nesterov's grad.lerp(buf, momentum), the
// Newton-Schulz orthogonalisation (on the transpose of a tall matrix), the
// learning-rate adjustment ("original": sqrt(max(1, A/B)); "match_rms_adamw":
// 0.2 * sqrt(max(A, B))), decoupled decay by lr * weight_decay, then
// param -= adjusted_lr * O.
#include <algorithm>
#include <cmath>

#include <torch/torch.h>

#include "replay/optim/rules.h"

namespace nanreplay {

namespace {

torch::Tensor to_bf16(const torch::Tensor& t) { return t.to(torch::kBFloat16); }
torch::Tensor as_fp32(const torch::Tensor& t) { return t.to(torch::kFloat32); }

// A matmul of bf16 operands accumulated in fp32, its result rounded to bf16.
torch::Tensor bf16_matmul(const torch::Tensor& a, const torch::Tensor& b) { return to_bf16(torch::matmul(as_fp32(a), as_fp32(b))); }
// An elementwise op on bf16 tensors: computed in fp32, rounded to bf16.
torch::Tensor bf16_scale(const torch::Tensor& a, double s) { return to_bf16(as_fp32(a) * s); }
torch::Tensor bf16_add(const torch::Tensor& a, const torch::Tensor& b) { return to_bf16(as_fp32(a) + as_fp32(b)); }

double adjusted_lr(double lr, const OptimizerRule& rule, const torch::Tensor& param) {
  const double rows = static_cast<double>(param.size(0)), cols = static_cast<double>(param.size(1));
  if (rule.adjust_lr_fn == "match_rms_adamw") return lr * (0.2 * std::sqrt(std::max(rows, cols)));
  return lr * std::sqrt(std::max(1.0, rows / cols));
}

}  // namespace

torch::Tensor newton_schulz_bf16(const torch::Tensor& update, const OptimizerRule& rule) {
  const bool tall = update.size(0) > update.size(1);
  torch::Tensor x = to_bf16(update);
  if (tall) x = x.t();
  // Spectral norm at most 1: divide by the Frobenius norm (an fp32 reduction
  // rounded to bf16), clamped below by eps.
  const torch::Tensor norm = to_bf16(as_fp32(x).norm());
  const torch::Tensor norm_floor = to_bf16(torch::clamp_min(as_fp32(norm), rule.eps));
  x = to_bf16(as_fp32(x) / as_fp32(norm_floor));
  for (int64_t i = 0; i < rule.ns_steps; ++i) {
    const torch::Tensor gram = bf16_matmul(x, x.t());
    if (rule.use_addmm) {
      // addmm: beta * input + alpha * (m1 @ m2) in fp32, rounded once.
      const torch::Tensor gram_update =
          to_bf16(as_fp32(gram) * rule.ns_b + torch::matmul(as_fp32(gram), as_fp32(gram)) * rule.ns_c);
      x = to_bf16(as_fp32(x) * rule.ns_a + torch::matmul(as_fp32(gram_update), as_fp32(x)));
    } else {
      // Python reads `b * G + c * G @ G` as b*G + (c*G) @ G: `*` and `@` bind alike, left to right.
      const torch::Tensor gram_update = bf16_add(bf16_scale(gram, rule.ns_b), bf16_matmul(bf16_scale(gram, rule.ns_c), gram));
      x = bf16_add(bf16_scale(x, rule.ns_a), bf16_matmul(gram_update, x));
    }
  }
  return tall ? x.t() : x;
}

void muon_update(torch::Tensor& param, const torch::Tensor& grad, ParamState& state, double lr,
                 const OptimizerRule& rule, bool decay) {
  torch::NoGradGuard no_grad;
  torch::Tensor& buf = state.tensors.at("momentum_buffer");
  buf.lerp_(grad, 1.0 - rule.momentum);
  const torch::Tensor update = rule.nesterov ? grad.lerp(buf, rule.momentum) : buf;
  const torch::Tensor ortho = newton_schulz_bf16(update, rule);
  if (decay) param.mul_(1.0 - lr * rule.weight_decay);
  param.add_(as_fp32(ortho), -adjusted_lr(lr, rule, param));
}

}  // namespace nanreplay
