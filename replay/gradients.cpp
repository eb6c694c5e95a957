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

StepGradients compute_step_gradients(const Manifest& manifest, const TokenStream& tokens,
                                     int64_t step, const StepBatch& batch, ParamMap& params,
                                     const std::vector<std::string>& order,
                                     const StepComputeOptions& options) {
  const DataConfig& data = manifest.data;
  const Numerics numerics =
      manifest.precision.compute == Compute::kFp8
          ? Numerics(Compute::kFp8, manifest.precision.fp8.value_or(Fp8Config{}), options.fp8_scales)
          : Numerics(manifest.precision.compute);
  const int world = static_cast<int>(data.world_size);
  const int accum = static_cast<int>(data.grad_accum_steps);
  const int64_t rows = data.micro_batch_size;
  const double inv_scale = 1.0 / options.loss_scale;  // as GradScaler.unscale_ multiplies

  StepGradients result;
  result.grads.assign(order.size(), torch::Tensor());
  double loss_sum = 0.0;
  for (int rank = 0; rank < world; ++rank) {
    for (const std::string& name : order) params.at(name).mutable_grad() = torch::Tensor();
    double rank_loss = 0.0;
    for (int micro = 0; micro < accum; ++micro) {
      if (options.before_pass) options.before_pass(rank, micro, "forward");
      const int64_t* ids = batch.samples.at(static_cast<size_t>(rank)).data() + micro * rows;
      const torch::Tensor window = gather_tokens(tokens, ids, rows, data.seq_len);
      const torch::Tensor inputs = window.narrow(1, 0, data.seq_len);
      const torch::Tensor targets = window.narrow(1, 1, data.seq_len);
      BatchContext context{step, micro, rank, std::vector<int64_t>(ids, ids + rows)};
      ProbeSession probes(std::move(context), numerics, options.probes, manifest.model);
      const ForwardResult forward = forward_loss(manifest.model, params, inputs, targets, numerics, probes);
      const torch::Tensor& loss = forward.loss;
      rank_loss += loss.item<double>();
      if (forward.sample_loss.defined()) {
        for (int64_t row = 0; row < rows; ++row) {
          result.sample_losses.push_back(
              {ids[row], rank, micro, forward.sample_loss[row].item<double>()});
        }
      }
      if (options.before_pass) options.before_pass(rank, micro, "backward");
      // The rank's micro-batch loss / grad_accum_steps, times the loss scale.
      (loss * (options.loss_scale / accum)).backward();
      std::vector<NormCheck> norms = probes.take_norm_checks();
      result.norm_checks.insert(result.norm_checks.end(), norms.begin(), norms.end());
      std::vector<ProbeRecord> records = probes.take_records();
      result.probes.insert(result.probes.end(), std::make_move_iterator(records.begin()),
                           std::make_move_iterator(records.end()));
    }
    rank_loss /= accum;
    result.rank_losses.push_back(rank_loss);
    loss_sum += rank_loss;

    // Multiplying by 1 and dividing by 1 are exact, so they are skipped: a
    // whole pass over the parameters each, for bit-identical results.
    std::vector<torch::Tensor> rank_grads;
    rank_grads.reserve(order.size());
    for (size_t i = 0; i < order.size(); ++i) {
      torch::Tensor grad = params.at(order[i]).grad();
      if (!grad.defined()) grad = torch::zeros_like(params.at(order[i]));
      rank_grads.push_back(inv_scale == 1.0 ? grad : grad * inv_scale);
      // DDP averages: each rank's contribution divided by the world size, then summed.
      torch::Tensor share = world == 1 ? rank_grads.back() : rank_grads.back() / world;
      result.grads[i] = result.grads[i].defined() ? result.grads[i] + share : share;
    }
    result.rank_grad_norms.push_back(total_grad_norm(rank_grads));
  }
  // The autograd .grad tensors now belong to result.grads (one rank) or were
  // only read; detaching them keeps the next step's accumulation fresh.
  for (const std::string& name : order) params.at(name).mutable_grad() = torch::Tensor();
  result.loss = loss_sum / world;
  // One rank: the global gradient is that rank's, and so is its norm.
  result.grad_norm = world == 1 ? result.rank_grad_norms.front() : total_grad_norm(result.grads);
  return result;
}

}  // namespace nanreplay
