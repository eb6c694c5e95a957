// One pass, DDP's reduction and the gradient norm; see gradients.h.
#include "replay/step/gradients.h"

#include <memory>

#include <torch/torch.h>

#include "replay/probing/numerics.h"
#include "replay/probing/probe_session.h"
#include "replay/step/step_model.h"

namespace nanreplay {

torch::Tensor sample_windows(const TokenStream& tokens, const std::vector<int64_t>& ids, int64_t seq_len) {
  const auto rows = static_cast<int64_t>(ids.size());
  torch::Tensor out = torch::empty({rows, seq_len + 1}, torch::TensorOptions().dtype(torch::kLong));
  int64_t* dst = out.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) {
    tokens.read(ids[static_cast<size_t>(r)] * seq_len, seq_len + 1, dst + r * (seq_len + 1));
  }
  return out;
}

torch::Tensor total_grad_norm_tensor(const std::vector<torch::Tensor>& grads) {
  std::vector<torch::Tensor> norms;
  norms.reserve(grads.size());
  for (const torch::Tensor& g : grads) norms.push_back(g.norm(2).to(grads.front().device()));
  return torch::stack(norms).norm(2);
}


double total_grad_norm(const std::vector<torch::Tensor>& grads) {
  if (grads.empty()) return 0.0;
  return total_grad_norm_tensor(grads).item<double>();
}

Numerics step_numerics(const Manifest& manifest, const std::map<std::string, Fp8ModuleScales>* fp8_scales) {
  return manifest.precision.compute == Compute::kFp8
             ? Numerics(Compute::kFp8, manifest.precision.fp8.value_or(Fp8Config{}), fp8_scales)
             : Numerics(manifest.precision.compute);
}

PassOutput replay_pass(const ModelConfig& model, const TokenStream& tokens, int64_t seq_len,
                       const PassInput& input, StepModel& params, const Numerics& numerics,
                       const ProbeScope& scope, const std::function<void()>& before_backward) {
  const std::vector<int64_t>& ids = input.context.sample_ids;
  const auto rows = static_cast<int64_t>(ids.size());
  const torch::Tensor window = sample_windows(tokens, ids, seq_len);
  const torch::Tensor inputs = window.narrow(1, 0, seq_len);
  const torch::Tensor targets = window.narrow(1, 1, seq_len);
  ProbeSession probes(input.context, numerics, scope, model);
  const ForwardResult forward =
      params.forward_backward(model, numerics, probes, inputs, targets, input.backward_scale, before_backward);
  PassOutput out;
  out.loss = forward.loss.item<double>();
  if (forward.sample_loss.defined()) {
    for (int64_t row = 0; row < rows; ++row) {
      out.sample_losses.push_back({ids[static_cast<size_t>(row)], input.context.rank, input.context.micro_batch,
                                   forward.sample_loss[row].item<double>()});
    }
  }
  out.norm_checks = probes.take_norm_checks();
  out.probes = probes.take_records();
  return out;
}

void clear_gradients(ParamMap& params, const std::vector<std::string>& order) {
  for (const std::string& name : order) params.at(name).mutable_grad() = torch::Tensor();
}

std::vector<torch::Tensor> add_rank_gradients(const ParamMap& params, const std::vector<std::string>& order,
                                              double inv_scale, int64_t world_size,
                                              std::vector<torch::Tensor>& step_grads) {
  std::vector<torch::Tensor> rank_grads;
  rank_grads.reserve(order.size());
  step_grads.resize(order.size());
  for (size_t i = 0; i < order.size(); ++i) {
    torch::Tensor grad = params.at(order[i]).grad();
    if (!grad.defined()) grad = torch::zeros_like(params.at(order[i]));
    // Multiplying by 1 and dividing by 1 are exact, so they are skipped: a
    // whole pass over the parameters each, for bit-identical results.
    rank_grads.push_back(inv_scale == 1.0 ? grad : grad * inv_scale);
    // DDP averages: each rank's contribution divided by the world size, then summed.
    torch::Tensor share = world_size == 1 ? rank_grads.back() : rank_grads.back() / world_size;
    step_grads[i] = step_grads[i].defined() ? step_grads[i] + share : share;
  }
  return rank_grads;
}

}  // namespace nanreplay
