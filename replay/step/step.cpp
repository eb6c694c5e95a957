// One step, every caller; see step.h. Every value the step reports stays
// where it was computed until the step ends and is read back in one go, so
// on a GPU a step synchronises once (kFlags with stop_at_first_bad reads each
// pass's flags as it ends: that is what decides whether to go on).
#include "replay/step/step.h"

#include <algorithm>
#include <cmath>
#include <memory>
#include <optional>

#include <torch/torch.h>

#include "probes/nan_max.h"
#include "probes/sites.h"
#include "replay/arch/expert_activation_max.h"
#include "replay/arch/head_logit_max.h"
#include "replay/arch/router_logit_max.h"
#include "replay/optim/optimizer.h"
#include "replay/probing/cuda_probe_stats.h"
#include "replay/probing/device_stats.h"
#include "replay/step/step_maxima.h"
#include "replay/step/step_model.h"

namespace nanreplay {

namespace {

// One pass whose values are still where they were computed.
struct PendingPass {
  int rank = 0, micro = 0;
  std::vector<int64_t> rows;
  std::unique_ptr<ProbeSession> probes;
  torch::Tensor loss;
  torch::Tensor sample_loss;  // kFull
};

// The parameter gradients' records: every one at kFull, the non-finite ones at kFlags.
void add_gradient_records(StepResult& result, int64_t step, const std::vector<std::string>& order, ProbeLevel level) {
  for (size_t i = 0; i < result.grads.size(); ++i) {
    const torch::Tensor grad = result.grads[i];
    if (level == ProbeLevel::kFlags && torch::isfinite(grad).all().item<bool>()) continue;
    for (ProbeRecord& record : describe_tensor(grad.to(torch::kCPU), nullptr, {})) {
      record.step = step;
      record.phase = Phase::kGrad;
      record.order = static_cast<int>(i);
      record.param = order[i];
      record.layer = layer_of_parameter(record.param);
      result.probes.push_back(std::move(record));
    }
  }
}

// A rolled-forward step that logs its bias and was also given a derived one:
// max |derived - logged| (evidence that the run's rule is another), else none.
std::optional<double> derived_score_bias_gap(const StepState& state, const ModelConfig& model) {
  if (state.router_score_bias.empty() || state.derived_router_score_bias.empty()) return std::nullopt;
  const std::map<int, std::vector<double>> logged = router_score_bias_of(state, model);
  double gap = 0.0;
  for (const auto& [layer, derived] : state.derived_router_score_bias) {
    const std::vector<double>& row = logged.at(layer);
    for (size_t e = 0; e < derived.size() && e < row.size(); ++e) {
      fold_nan_max(gap, std::fabs(derived[e] - row[e]));
    }
  }
  return gap;
}

}  // namespace

StepArithmetic::StepArithmetic(const Manifest& m, const StepState& state, const StepOverrides& overrides, bool native)
    : model(m.model),
      fp8_scales(overrides.fp8_scales ? *overrides.fp8_scales : state.fp8_scales),
      numerics(step_numerics(m, &fp8_scales)),
      loss_scale(is_fp16(m) ? state.loss_scale : 1.0) {
  // DeepSeek-V3's correction bias: the step's own, logged or derived (a what-if may replace it),
  // its logits in fp32.
  if (model.moe) model.moe->step_score_bias = router_score_bias_of(state, m.model);
  if (overrides.change_model) overrides.change_model(model);
  if (model.moe && model.moe->router == RouterKind::kSigmoidGrouped && model.moe->score_bias) {
    score_bias = RouterScoreBias{model.moe->step_score_bias, router_score_bias_derived(state),
                                 derived_score_bias_gap(state, m.model)};
  }
  NumericsOverrides arithmetic = overrides.numerics;
  if (model.moe && model.moe->router == RouterKind::kSigmoidGrouped) arithmetic.router_fp32 = true;
  numerics.set_overrides(arithmetic);
  numerics.set_native(native);
}

std::vector<int64_t> micro_batch_rows(const StepBatch& batch, const DataConfig& data, int rank, int micro,
                                      const std::set<int64_t>& dropped) {
  const std::vector<int64_t>& all = batch.samples.at(static_cast<size_t>(rank));
  const auto begin = all.begin() + micro * data.micro_batch_size;
  std::vector<int64_t> rows;
  std::copy_if(begin, begin + data.micro_batch_size, std::back_inserter(rows),
               [&](int64_t sample) { return dropped.count(sample) == 0; });
  return rows;
}

namespace {

// What every pass of one step reads.
struct PassLoop {
  const StepInputs& in;
  StepModel& model;
  const StepRequest& request;
  const StepArithmetic& arithmetic;
  std::shared_ptr<CudaProbeStats> kernel;  // the CUDA statistics kernel's results of every pass
  bool settle_early;  // kFlags with stop_at_first_bad: read each pass's flags as it ends
};

// One micro-batch of one rank, forward and backward with its probes; nothing
// when a what-if dropped every row. A settle-early step takes its flags now.
void run_pass(const PassLoop& loop, int rank, int micro, StepResult& result, int& settled_at,
              std::vector<PendingPass>& passes) {
  const DataConfig& data = loop.in.manifest.data;
  const StepRequest& request = loop.request;
  PendingPass pass{rank, micro, micro_batch_rows(loop.in.batch, data, rank, micro, request.overrides.dropped_samples),
                   nullptr, {}, {}};
  if (pass.rows.empty()) return;
  if (request.before_pass) request.before_pass(rank, micro, "forward");
  const torch::Tensor window = sample_windows(loop.in.tokens, pass.rows, data.seq_len);
  pass.probes = std::make_unique<ProbeSession>(BatchContext{loop.in.step, micro, rank, pass.rows, request.locate_largest},
                                               loop.arithmetic.numerics, ProbeScope{request.probes, {}},
                                               loop.arithmetic.model, request.defer_host_probes);
  pass.probes->share_kernel(loop.kernel);
  // The rank's micro-batch loss / grad_accum_steps, times the loss scale.
  const ForwardResult forward = loop.model.forward_backward(
      loop.arithmetic.model, loop.arithmetic.numerics, *pass.probes, window.narrow(1, 0, data.seq_len),
      window.narrow(1, 1, data.seq_len), loop.arithmetic.loss_scale / data.grad_accum_steps,
      [&] {
        if (request.before_pass) request.before_pass(rank, micro, "backward");
      },
      [&](int layer, const char* phase) {
        if (request.on_block) request.on_block(rank, micro, layer, phase);
      });
  pass.loss = forward.loss;
  pass.sample_loss = forward.sample_loss;
  ++result.passes;
  result.rows_of_pass[{micro, rank}] = pass.rows;
  if (loop.settle_early) {
    const bool fp16 = is_fp16(loop.in.manifest);
    for (ProbeRecord& flag : pass.probes->take_records()) {
      if (!fp16 || flag.phase == Phase::kForward) settled_at = std::min(settled_at, micro);
      result.probes.push_back(std::move(flag));
    }
  }
  passes.push_back(std::move(pass));
}

// Every pass the request asks for, rank by rank; returns each complete rank's
// gradient norm (still on the device).
std::vector<torch::Tensor> run_passes(const PassLoop& loop, StepResult& result, std::vector<PendingPass>& passes) {
  const DataConfig& data = loop.in.manifest.data;
  const int world = static_cast<int>(data.world_size);
  const int accum = static_cast<int>(data.grad_accum_steps);
  const std::optional<PassRef>& only = loop.request.only_pass;
  std::vector<torch::Tensor> rank_norms;
  int settled_at = accum;  // the earliest micro-batch whose flags settle that the step is bad
  loop.model.begin_step(/*whole_step=*/!only && !loop.settle_early);
  for (int rank = 0; rank < world; ++rank) {
    if (only && rank != only->rank) continue;
    loop.model.begin_rank(rank);
    bool rank_complete = !only;  // one pass has no step gradients
    for (int micro = 0; micro < accum; ++micro) {
      if (only && micro != only->micro_batch) continue;
      if (loop.settle_early && micro > settled_at) {
        rank_complete = false;
        break;
      }
      run_pass(loop, rank, micro, result, settled_at, passes);
    }
    if (!rank_complete) {
      result.complete = false;
      continue;
    }
    rank_norms.push_back(loop.model.end_rank(1.0 / loop.arithmetic.loss_scale, world));
  }
  loop.model.end_ranks();
  return rank_norms;
}

// Per-rank losses (each the mean of its micro-batches) and the step's (the
// mean over ranks), from the passes' losses at the front of `values`.
void unpack_losses(const std::vector<PendingPass>& passes, const std::vector<double>& values, int world,
                   size_t& next, StepResult& result) {
  std::vector<double> rank_sum(static_cast<size_t>(world), 0.0);
  std::vector<int> rank_passes(static_cast<size_t>(world), 0);
  result.micro_batch_losses.resize(static_cast<size_t>(world));
  for (const PendingPass& p : passes) {
    result.micro_batch_losses[static_cast<size_t>(p.rank)].push_back(values[next]);
    rank_sum[static_cast<size_t>(p.rank)] += values[next++];
    ++rank_passes[static_cast<size_t>(p.rank)];
  }
  double loss_sum = 0.0;
  int ranks_with_loss = 0;
  for (int rank = 0; rank < world; ++rank) {
    if (rank_passes[static_cast<size_t>(rank)] == 0) continue;
    result.rank_losses.push_back(rank_sum[static_cast<size_t>(rank)] / rank_passes[static_cast<size_t>(rank)]);
    loss_sum += result.rank_losses.back();
    ++ranks_with_loss;
  }
  result.loss = ranks_with_loss > 0 ? loss_sum / ranks_with_loss : std::nan("");
}

// The one synchronisation: losses, norms, per-sample losses, then every
// pass's probe statistics (the CUDA kernel's come in its own copy).
void read_back_step(const PassLoop& loop, std::vector<PendingPass>& passes, const std::vector<torch::Tensor>& rank_norms,
                    StepResult& result) {
  const int world = static_cast<int>(loop.in.manifest.data.world_size);
  std::vector<torch::Tensor> scalars;
  for (const PendingPass& p : passes) scalars.push_back(p.loss);
  scalars.insert(scalars.end(), rank_norms.begin(), rank_norms.end());
  // One rank: the global gradient is that rank's, and so is its norm.
  if (result.complete) scalars.push_back(world == 1 ? rank_norms.front() : loop.model.step_grad_norm());
  for (const PendingPass& p : passes) {
    if (p.sample_loss.defined()) scalars.push_back(p.sample_loss);
  }
  for (const PendingPass& p : passes) p.probes->add_readback(scalars);
  const std::vector<double> values = read_back(scalars);
  const std::vector<TensorStats> kernel_results = loop.kernel->collect();
  size_t next = 0;
  unpack_losses(passes, values, world, next, result);
  for (size_t r = 0; r < rank_norms.size(); ++r) result.rank_grad_norms.push_back(values[next++]);
  result.grad_norm = result.complete ? values[next++] : std::nan("");
  for (const PendingPass& p : passes) {
    if (!p.sample_loss.defined()) continue;
    for (int64_t sample : p.rows) result.sample_losses.push_back({sample, p.rank, p.micro, values[next++]});
  }
  for (PendingPass& p : passes) p.probes->resolve_from(values, next, kernel_results);
  for (PendingPass& p : passes) {
    std::vector<NormCheck> norms = p.probes->take_norm_checks();
    result.norm_checks.insert(result.norm_checks.end(), norms.begin(), norms.end());
    if (loop.settle_early) continue;  // already taken
    std::vector<ProbeRecord> records = p.probes->take_records();
    result.probes.insert(result.probes.end(), std::make_move_iterator(records.begin()),
                         std::make_move_iterator(records.end()));
  }
}

}  // namespace

StepResult replay_step(const StepInputs& in, StepModel& model, const std::vector<std::string>& order,
                       const StepRequest& request) {
  const StepArithmetic arithmetic(in.manifest, in.state, request.overrides, request.native_low_precision);
  const PassLoop loop{in, model, request, arithmetic, std::make_shared<CudaProbeStats>(),
                      request.stop_at_first_bad && request.probes == ProbeLevel::kFlags};
  StepResult result;
  std::vector<PendingPass> passes;
  // One row per layer with sites: the decoder's, then model.mtp's blocks (MuonClip clips theirs too,
  // and rolling forward moves their routers' bias).
  const int recorded_layers = layers_with_sites(arithmetic.model);
  std::optional<HeadLogitRecorder> logit_max;  // MuonClip reads the step's per-head maxima
  if (request.attn_logit_max || (in.manifest.optimizer && uses_qk_clip(*in.manifest.optimizer))) {
    logit_max.emplace(recorded_layers, arithmetic.model.num_heads);
  }
  // report.json's and a spike incident's router evidence; the tokens rolling forward moves the bias by.
  std::optional<RouterLogitRecorder> router_max;
  const std::optional<MoeConfig>& moe = arithmetic.model.moe;
  if (moe && (request.router_logit_max || moe->score_bias_update)) {
    router_max.emplace(recorded_layers, moe->num_experts);
  }
  std::optional<ExpertActivationRecorder> expert_max;  // report.json's per-expert activations
  if (request.expert_activation_max && arithmetic.model.moe) {
    expert_max.emplace(recorded_layers, arithmetic.model.moe->num_experts);
  }
  const std::vector<torch::Tensor> rank_norms = run_passes(loop, result, passes);
  read_back_step(loop, passes, rank_norms, result);
  if (logit_max) result.attn_logit_max = logit_max->maxima();
  if (router_max) {
    result.router_logit_max = router_max->maxima();
    result.router_tokens = router_max->tokens();
  }
  if (expert_max) result.expert_activation_max = expert_max->maxima();
  result.score_bias = arithmetic.score_bias;
  // --nproc: every process's, which MuonClip (in every process) reads as one process would have seen them
  combine_step_maxima(result, logit_max.has_value(), request.expert_activation_max, router_max.has_value());
  if (result.complete) {
    // The system checks read the gradients on the host; a cheap pass only
    // looks for non-finite ones, where they are.
    result.grads = model.step_gradients(request.probes == ProbeLevel::kFlags);
    if (request.probes != ProbeLevel::kOff) add_gradient_records(result, in.step, order, request.probes);
  }
  return result;
}

StepResult replay_step(const StepInputs& inputs, ParamMap& params, const std::vector<std::string>& order,
                       const StepRequest& request) {
  const std::unique_ptr<StepModel> model = in_memory_model(params, order);
  return replay_step(inputs, *model, order, request);
}

StepResult replay_step(const StepInputs& inputs, ModelCheckpoint& checkpoint, const ComputePlacement& placement,
                       const StepRequest& request) {
  StepRequest placed = request;
  placed.native_low_precision = placement.native_low_precision;
  const std::unique_ptr<StepModel> model = checkpoint_model(checkpoint, inputs.manifest.model, placement);
  return replay_step(inputs, *model, checkpoint.order(), placed);
}

StepJudgement judge_step(const StepResult& result, Compute compute) {
  auto earliest = [&](bool forward_only) {
    const ProbeRecord* best = nullptr;
    for (const ProbeRecord& r : result.probes) {
      if (!is_whole(r) || r.stats.all_finite()) continue;
      if (forward_only && r.phase != Phase::kForward) continue;
      if (best == nullptr || execution_key(r) < execution_key(*best)) best = &r;
    }
    return best;
  };
  StepJudgement j;
  const ProbeRecord* any = earliest(false);
  j.scaler_skips = compute == Compute::kFp16 && result.complete && !std::isfinite(result.grad_norm);
  // fp16: GradScaler skips a step whose gradients hold a non-finite value.
  // Overflow confined to the backward of such a step is handled, not the incident.
  j.handled_overflow = j.scaler_skips && earliest(true) == nullptr && std::isfinite(result.loss);
  j.bad = any != nullptr && !j.handled_overflow;
  (j.bad ? j.first : j.handled_first) = any;
  return j;
}

}  // namespace nanreplay
