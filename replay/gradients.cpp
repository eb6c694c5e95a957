// Forward and backward over every rank's micro-batches of one step, the way
// DDP with gradient accumulation and a loss scaler computes them.
#include "replay/gradients.h"

#include <torch/torch.h>

#include "replay/numerics.h"
#include "replay/probe_session.h"

namespace nanreplay {

namespace {

// (rows, seq_len + 1) token ids of the given samples.
torch::Tensor gather_tokens(const TokenStream& tokens, const int64_t* ids, int64_t rows,
                            int64_t seq_len) {
  torch::Tensor out = torch::empty({rows, seq_len + 1}, torch::TensorOptions().dtype(torch::kLong));
  int64_t* dst = out.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) {
    tokens.read(ids[r] * seq_len, seq_len + 1, dst + r * (seq_len + 1));
  }
  return out;
}

}  // namespace

double total_grad_norm(const std::vector<torch::Tensor>& grads) {
  if (grads.empty()) return 0.0;
  std::vector<torch::Tensor> norms;
  norms.reserve(grads.size());
  for (const torch::Tensor& g : grads) norms.push_back(g.norm(2));
  return torch::stack(norms).norm(2).item<double>();
}

Numerics step_numerics(const Manifest& manifest, const std::map<std::string, Fp8ModuleScales>* fp8_scales) {
  return manifest.precision.compute == Compute::kFp8
             ? Numerics(Compute::kFp8, manifest.precision.fp8.value_or(Fp8Config{}), fp8_scales)
             : Numerics(manifest.precision.compute);
}

PassOutput replay_pass(const ModelConfig& model, const TokenStream& tokens, int64_t seq_len,
                       const PassInput& input, ParamMap& params, const Numerics& numerics,
                       const ProbeScope& scope, const std::function<void()>& before_backward) {
  const std::vector<int64_t>& ids = input.context.sample_ids;
  const auto rows = static_cast<int64_t>(ids.size());
  const torch::Tensor window = gather_tokens(tokens, ids.data(), rows, seq_len);
  const torch::Tensor inputs = window.narrow(1, 0, seq_len);
  const torch::Tensor targets = window.narrow(1, 1, seq_len);
  ProbeSession probes(input.context, numerics, scope, model);
  const ForwardResult forward = forward_loss(model, params, inputs, targets, numerics, probes);
  PassOutput out;
  out.loss = forward.loss.item<double>();
  if (forward.sample_loss.defined()) {
    for (int64_t row = 0; row < rows; ++row) {
      out.sample_losses.push_back({ids[static_cast<size_t>(row)], input.context.rank, input.context.micro_batch,
                                   forward.sample_loss[row].item<double>()});
    }
  }
  if (before_backward) before_backward();
  (forward.loss * input.backward_scale).backward();
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
    rank_grads.push_back(grad * inv_scale);
    // DDP averages: each rank's contribution divided by the world size, then summed.
    torch::Tensor share = rank_grads.back() / world_size;
    step_grads[i] = step_grads[i].defined() ? step_grads[i] + share : share;
  }
  return rank_grads;
}

StepGradients compute_step_gradients(const Manifest& manifest, const TokenStream& tokens,
                                     int64_t step, const StepBatch& batch, ParamMap& params,
                                     const std::vector<std::string>& order,
                                     const StepComputeOptions& options) {
  const DataConfig& data = manifest.data;
  const Numerics numerics = step_numerics(manifest, options.fp8_scales);
  const int world = static_cast<int>(data.world_size);
  const int accum = static_cast<int>(data.grad_accum_steps);
  const int64_t rows = data.micro_batch_size;
  const double inv_scale = 1.0 / options.loss_scale;  // as GradScaler.unscale_ multiplies
  const ProbeScope scope{options.probes ? ProbeLevel::kFull : ProbeLevel::kOff, {}};

  StepGradients result;
  result.grads.assign(order.size(), torch::Tensor());
  double loss_sum = 0.0;
  for (int rank = 0; rank < world; ++rank) {
    clear_gradients(params, order);
    double rank_loss = 0.0;
    for (int micro = 0; micro < accum; ++micro) {
      if (options.before_pass) options.before_pass(rank, micro, "forward");
      const int64_t* ids = batch.samples.at(static_cast<size_t>(rank)).data() + micro * rows;
      PassInput pass{{step, micro, rank, std::vector<int64_t>(ids, ids + rows)},
                     // The rank's micro-batch loss / grad_accum_steps, times the loss scale.
                     options.loss_scale / accum};
      PassOutput out = replay_pass(manifest.model, tokens, data.seq_len, pass, params, numerics, scope,
                                   [&] { if (options.before_pass) options.before_pass(rank, micro, "backward"); });
      rank_loss += out.loss;
      result.sample_losses.insert(result.sample_losses.end(), out.sample_losses.begin(), out.sample_losses.end());
      result.norm_checks.insert(result.norm_checks.end(), out.norm_checks.begin(), out.norm_checks.end());
      result.probes.insert(result.probes.end(), std::make_move_iterator(out.probes.begin()),
                           std::make_move_iterator(out.probes.end()));
    }
    rank_loss /= accum;
    result.rank_losses.push_back(rank_loss);
    loss_sum += rank_loss;
    result.rank_grad_norms.push_back(total_grad_norm(add_rank_gradients(params, order, inv_scale, world, result.grads)));
  }
  clear_gradients(params, order);
  result.loss = loss_sum / world;
  result.grad_norm = total_grad_norm(result.grads);
  return result;
}

}  // namespace nanreplay
