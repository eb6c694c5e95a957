// Forward and backward over every rank's micro-batches of one step, the way
// DDP with gradient accumulation and a loss scaler computes them.
#include "replay/gradients.h"

#include <memory>

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

namespace {

// clip_grad_norm_'s total norm as a 0-dim tensor on the first gradient's
// device (gradients of a split model sit on two devices).
torch::Tensor total_grad_norm_tensor(const std::vector<torch::Tensor>& grads) {
  std::vector<torch::Tensor> norms;
  norms.reserve(grads.size());
  for (const torch::Tensor& g : grads) norms.push_back(g.norm(2).to(grads.front().device()));
  return torch::stack(norms).norm(2);
}

// Small tensors (any devices) to one float64 host vector, one copy per device.
std::vector<double> read_back(const std::vector<torch::Tensor>& parts) {
  std::vector<torch::Tensor> host;
  size_t begin = 0;
  while (begin < parts.size()) {
    size_t end = begin;
    while (end < parts.size() && parts[end].device() == parts[begin].device()) ++end;
    std::vector<torch::Tensor> run;
    for (size_t i = begin; i < end; ++i) run.push_back(parts[i].detach().reshape({-1}).to(torch::kFloat64));
    host.push_back(torch::cat(run).to(torch::kCPU));
    begin = end;
  }
  const torch::Tensor all = torch::cat(host).contiguous();
  return std::vector<double>(all.data_ptr<double>(), all.data_ptr<double>() + all.numel());
}

}  // namespace

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
    // Multiplying by 1 and dividing by 1 are exact, so they are skipped: a
    // whole pass over the parameters each, for bit-identical results.
    rank_grads.push_back(inv_scale == 1.0 ? grad : grad * inv_scale);
    // DDP averages: each rank's contribution divided by the world size, then summed.
    torch::Tensor share = world_size == 1 ? rank_grads.back() : rank_grads.back() / world_size;
    step_grads[i] = step_grads[i].defined() ? step_grads[i] + share : share;
  }
  return rank_grads;
}

StepGradients compute_step_gradients(const Manifest& manifest, const TokenStream& tokens,
                                     int64_t step, const StepBatch& batch, ParamMap& params,
                                     const std::vector<std::string>& order,
                                     const StepComputeOptions& options) {
  const DataConfig& data = manifest.data;
  Numerics numerics = step_numerics(manifest, options.fp8_scales);
  numerics.set_native(options.native_low_precision);
  const int world = static_cast<int>(data.world_size);
  const int accum = static_cast<int>(data.grad_accum_steps);
  const int64_t rows = data.micro_batch_size;
  const double inv_scale = 1.0 / options.loss_scale;  // as GradScaler.unscale_ multiplies
  const ProbeScope scope{options.probes ? ProbeLevel::kFull : ProbeLevel::kOff, {}};

  // Every value the step reports stays where it was computed until the step
  // ends and is read back in one go: on a GPU the step synchronises once.
  std::vector<std::unique_ptr<ProbeSession>> sessions;
  std::vector<torch::Tensor> micro_losses;  // [rank * accum + micro]
  std::vector<torch::Tensor> sample_losses;
  std::vector<const int64_t*> sample_ids;
  std::vector<torch::Tensor> rank_norms;
  StepGradients result;
  result.grads.assign(order.size(), torch::Tensor());
  for (int rank = 0; rank < world; ++rank) {
    clear_gradients(params, order);
    for (int micro = 0; micro < accum; ++micro) {
      if (options.before_pass) options.before_pass(rank, micro, "forward");
      const int64_t* ids = batch.samples.at(static_cast<size_t>(rank)).data() + micro * rows;
      const torch::Tensor window = gather_tokens(tokens, ids, rows, data.seq_len);
      const torch::Tensor inputs = window.narrow(1, 0, data.seq_len);
      const torch::Tensor targets = window.narrow(1, 1, data.seq_len);
      BatchContext context{step, micro, rank, std::vector<int64_t>(ids, ids + rows)};
      sessions.push_back(std::make_unique<ProbeSession>(std::move(context), numerics, scope, manifest.model));
      const ForwardResult forward =
          forward_loss(manifest.model, params, inputs, targets, numerics, *sessions.back());
      micro_losses.push_back(forward.loss.detach());
      if (forward.sample_loss.defined()) {
        sample_losses.push_back(forward.sample_loss);
        sample_ids.push_back(ids);
      }
      if (options.before_pass) options.before_pass(rank, micro, "backward");
      // The rank's micro-batch loss / grad_accum_steps, times the loss scale.
      (forward.loss * (options.loss_scale / accum)).backward();
    }
    rank_norms.push_back(total_grad_norm_tensor(add_rank_gradients(params, order, inv_scale, world, result.grads)));
  }
  clear_gradients(params, order);

  // The one synchronisation: losses, per-sample losses, norms, then probes.
  std::vector<torch::Tensor> scalars = micro_losses;
  scalars.insert(scalars.end(), rank_norms.begin(), rank_norms.end());
  // One rank: the global gradient is that rank's, and so is its norm.
  scalars.push_back(world == 1 ? rank_norms.front() : total_grad_norm_tensor(result.grads));
  scalars.insert(scalars.end(), sample_losses.begin(), sample_losses.end());
  const std::vector<double> values = read_back(scalars);
  size_t next = 0;
  double loss_sum = 0.0;
  for (int rank = 0; rank < world; ++rank) {
    double rank_loss = 0.0;
    for (int micro = 0; micro < accum; ++micro) rank_loss += values[next++];
    rank_loss /= accum;
    result.rank_losses.push_back(rank_loss);
    loss_sum += rank_loss;
  }
  for (int rank = 0; rank < world; ++rank) result.rank_grad_norms.push_back(values[next++]);
  result.grad_norm = values[next++];
  for (size_t pass = 0; pass < sample_ids.size(); ++pass) {
    const size_t rank = pass / static_cast<size_t>(accum);
    const size_t micro = pass % static_cast<size_t>(accum);
    for (int64_t row = 0; row < rows; ++row) {
      result.sample_losses.push_back({sample_ids[pass][row], static_cast<int>(rank), static_cast<int>(micro),
                                      values[next++]});
    }
  }
  result.loss = loss_sum / world;
  for (std::unique_ptr<ProbeSession>& session : sessions) {
    std::vector<NormCheck> norms = session->take_norm_checks();
    result.norm_checks.insert(result.norm_checks.end(), norms.begin(), norms.end());
    std::vector<ProbeRecord> records = session->take_records();
    result.probes.insert(result.probes.end(), std::make_move_iterator(records.begin()),
                         std::make_move_iterator(records.end()));
  }
  // The system checks and parameter-gradient probes read the gradients on the host.
  for (torch::Tensor& grad : result.grads) grad = grad.to(torch::kCPU);
  return result;
}

}  // namespace nanreplay
