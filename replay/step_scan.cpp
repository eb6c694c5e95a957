// Pass-by-pass replay of one step; see step_scan.h. The rule that decides
// whether a step is bad mirrors replay_bundle's exactly: the earliest
// non-finite value in execution order (micro-batch, phase, site, rank), the
// parameter gradients after every pass, except that in fp16 a step whose
// forward stayed finite and whose gradient norm is non-finite is handled by
// the loss scaler, not the incident.
#include "replay/step_scan.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>

#include <torch/torch.h>

#include "replay/probe_session.h"

namespace nanreplay {

namespace {

const StepEntry& manifest_entry(const Manifest& m, int64_t step) {
  for (const StepEntry& entry : m.steps) {
    if (entry.step == step) return entry;
  }
  throw std::logic_error("no manifest entry for step " + std::to_string(step));
}

bool is_fp16(const Manifest& m) { return m.precision.compute == Compute::kFp16; }

// The arithmetic of a step under `overrides`: model config, fp8 scales, numerics.
struct StepArithmetic {
  ModelConfig model;
  std::map<std::string, Fp8ModuleScales> fp8_scales;
  Numerics numerics;
  double loss_scale = 1.0;

  StepArithmetic(const Manifest& m, const StepState& state, const StepOverrides& overrides, bool native)
      : model(m.model),
        fp8_scales(overrides.fp8_scales ? *overrides.fp8_scales : state.fp8_scales),
        numerics(step_numerics(m, &fp8_scales)),
        loss_scale(is_fp16(m) ? state.loss_scale : 1.0) {
    if (overrides.norm_eps) model.norm_eps = *overrides.norm_eps;
    numerics.set_overrides(overrides.numerics);
    numerics.set_native(native);
  }
  StepArithmetic(const StepArithmetic&) = delete;  // numerics points into fp8_scales
  StepArithmetic& operator=(const StepArithmetic&) = delete;
};

// The rows of one rank's micro-batch, less the dropped samples.
std::vector<int64_t> micro_batch_rows(const StepBatch& batch, const DataConfig& data, int rank, int micro,
                                      const std::set<int64_t>& dropped) {
  const std::vector<int64_t>& all = batch.samples.at(static_cast<size_t>(rank));
  const auto begin = all.begin() + micro * data.micro_batch_size;
  std::vector<int64_t> rows;
  std::copy_if(begin, begin + data.micro_batch_size, std::back_inserter(rows),
               [&](int64_t sample) { return dropped.count(sample) == 0; });
  return rows;
}

bool earlier(const ProbeRecord& a, const ProbeRecord& b) { return execution_key(a) < execution_key(b); }

bool all_finite(const std::vector<torch::Tensor>& grads) {
  return std::all_of(grads.begin(), grads.end(), [](const torch::Tensor& g) {
    return !g.defined() || torch::isfinite(g).all().item<bool>();
  });
}

// The flag of the first parameter gradient holding a non-finite value, if any.
std::optional<size_t> first_nonfinite_grad(const std::vector<torch::Tensor>& grads) {
  for (size_t i = 0; i < grads.size(); ++i) {
    if (grads[i].defined() && !torch::isfinite(grads[i]).all().item<bool>()) return i;
  }
  return std::nullopt;
}

}  // namespace

StepBatch batch_of_step(const Bundle& bundle, int64_t step) {
  return StepBatch{bundle.sampler().samples_for(manifest_entry(bundle.manifest(), step))};
}

std::optional<std::string> unreplayable_reason(const Bundle& bundle, const StepBatch& batch) {
  const Manifest& m = bundle.manifest();
  const int64_t seq = m.data.seq_len;
  std::vector<int64_t> window(static_cast<size_t>(seq + 1));
  for (const std::vector<int64_t>& rank_samples : batch.samples) {
    for (int64_t sample : rank_samples) {
      bundle.tokens().read(sample * seq, seq + 1, window.data());
      for (int64_t pos = 0; pos <= seq; ++pos) {
        const int64_t token = window[static_cast<size_t>(pos)];
        if (token < m.model.vocab_size) continue;
        return "token id " + std::to_string(token) + " >= vocab_size " + std::to_string(m.model.vocab_size) +
               " in sample " + std::to_string(sample) + " at position " + std::to_string(pos);
      }
    }
  }
  return std::nullopt;
}

LoadedStep::LoadedStep(const Bundle& bundle, int64_t step, const ComputePlacement& placement)
    : bundle_(bundle),
      files_(bundle.step_files(step)),
      state_(bundle.load_state(files_)),
      batch_(batch_of_step(bundle, step)),
      checkpoint_(files_, bundle.manifest().model),
      native_(placement.native_low_precision) {
  checkpoint_.place(placement, static_cast<int>(bundle.manifest().model.num_layers));
}

std::vector<int64_t> LoadedStep::samples() const {
  std::vector<int64_t> all;
  for (const std::vector<int64_t>& rank_samples : batch_.samples) {
    all.insert(all.end(), rank_samples.begin(), rank_samples.end());
  }
  return all;
}

std::vector<std::string> LoadedStep::nonfinite_params() const {
  std::vector<std::string> names;
  for (const std::string& name : checkpoint_.order()) {
    if (!torch::isfinite(checkpoint_.params().at(name)).all().item<bool>()) names.push_back(name);
  }
  return names;
}

StepScan scan_step(LoadedStep& step, const StepOverrides& overrides, bool stop_at_first_bad,
                   const PassHook& before_pass) {
  const Manifest& m = step.bundle().manifest();
  const DataConfig& data = m.data;
  const StepArithmetic arithmetic(m, step.state(), overrides, step.native_low_precision());
  const int world = static_cast<int>(data.world_size);
  const int accum = static_cast<int>(data.grad_accum_steps);
  ParamMap& params = step.checkpoint().compute_params();
  const std::vector<std::string>& order = step.checkpoint().order();
  // In fp16 a backward overflow alone may be the scaler's business; only a
  // forward flag settles that the step is bad. Elsewhere any flag does.
  const bool fp16 = is_fp16(m);

  StepScan scan;
  scan.step = step.step();
  std::vector<torch::Tensor> grads(order.size());
  std::vector<ProbeRecord> flags;
  std::map<std::pair<int, int>, std::vector<int64_t>> rows_of_pass;  // (micro-batch, rank)
  int settled_at = accum;  // the earliest micro-batch whose flags settle that the step is bad
  bool complete = true;
  double loss_sum = 0.0;
  int ranks_with_loss = 0;
  for (int rank = 0; rank < world; ++rank) {
    clear_gradients(params, order);
    double rank_loss = 0.0;
    int passes_with_loss = 0;
    bool rank_complete = true;
    for (int micro = 0; micro < accum; ++micro) {
      if (stop_at_first_bad && micro > settled_at) {
        rank_complete = false;
        break;
      }
      std::vector<int64_t> rows = micro_batch_rows(step.batch(), data, rank, micro, overrides.dropped_samples);
      if (rows.empty()) continue;  // every row dropped by a what-if
      if (before_pass) before_pass();
      const PassInput input{{step.step(), micro, rank, rows}, arithmetic.loss_scale / accum};
      PassOutput out = replay_pass(arithmetic.model, step.bundle().tokens(), data.seq_len, input, params,
                                   arithmetic.numerics, {ProbeLevel::kFlags, {}});
      ++scan.passes;
      rank_loss += out.loss;
      ++passes_with_loss;
      rows_of_pass[{micro, rank}] = std::move(rows);
      for (ProbeRecord& flag : out.probes) {
        if (!fp16 || flag.phase == Phase::kForward) settled_at = std::min(settled_at, micro);
        flags.push_back(std::move(flag));
      }
    }
    if (!rank_complete) {
      complete = false;
      continue;
    }
    if (passes_with_loss > 0) {
      loss_sum += rank_loss / passes_with_loss;
      ++ranks_with_loss;
    }
    add_rank_gradients(params, order, 1.0 / arithmetic.loss_scale, world, grads);
  }
  clear_gradients(params, order);
  if (complete) {
    scan.complete = true;
    scan.loss = ranks_with_loss > 0 ? loss_sum / ranks_with_loss : std::nan("");
    scan.grad_norm = total_grad_norm(grads);
    scan.scaler_skips = fp16 && !std::isfinite(scan.grad_norm);
  }

  auto earliest_up_to = [&](int last_micro) {
    const ProbeRecord* best = nullptr;
    for (const ProbeRecord& flag : flags) {
      if (flag.micro_batch <= last_micro && (best == nullptr || earlier(flag, *best))) best = &flag;
    }
    return best;
  };
  if (settled_at < accum) {
    scan.bad = true;
    scan.first = *earliest_up_to(settled_at);
  } else if (!flags.empty()) {  // fp16, flags in the backward only: bad unless the scaler skips
    scan.handled_overflow = scan.scaler_skips;
    scan.bad = !scan.scaler_skips;
    if (scan.bad) scan.first = *earliest_up_to(accum);
  } else if (const std::optional<size_t> i = first_nonfinite_grad(grads)) {
    scan.handled_overflow = fp16;  // fp16: non-finite gradients are exactly what the scaler skips
    scan.bad = !fp16;
    if (scan.bad) {
      ProbeRecord flag;
      flag.step = step.step();
      flag.phase = Phase::kGrad;
      flag.order = static_cast<int>(*i);
      flag.site = order[*i];
      flag.layer = layer_of_parameter(flag.site);
      scan.first = flag;
      scan.first_grad = grads[*i];
    }
  }
  if (scan.first && scan.first->phase != Phase::kGrad) {
    scan.first_pass_samples = rows_of_pass.at({scan.first->micro_batch, scan.first->rank});
  }
  return scan;
}

FirstNonfinite locate_first(LoadedStep& step, const StepOverrides& overrides, const StepScan& scan,
                            int64_t& passes, const PassHook& before_pass) {
  if (!scan.first) throw std::logic_error("locate_first: the scan found nothing to locate");
  const ProbeRecord& flag = *scan.first;
  if (flag.phase == Phase::kGrad) {  // already computed by the scan: describe it, no pass
    ProbeRecord record = describe_tensor(scan.first_grad, nullptr, {}).front();
    record.step = flag.step;
    record.phase = flag.phase;
    record.order = flag.order;
    record.site = flag.site;
    record.layer = flag.layer;
    return first_nonfinite_of(record);
  }
  const Manifest& m = step.bundle().manifest();
  const StepArithmetic arithmetic(m, step.state(), overrides, step.native_low_precision());
  ParamMap& params = step.checkpoint().compute_params();
  if (before_pass) before_pass();
  const PassInput input{{step.step(), flag.micro_batch, flag.rank, scan.first_pass_samples},
                        arithmetic.loss_scale / static_cast<double>(m.data.grad_accum_steps)};
  // Full statistics on the flagged block only; the rest of the pass computes as always.
  const PassOutput out = replay_pass(arithmetic.model, step.bundle().tokens(), m.data.seq_len, input, params,
                                     arithmetic.numerics, {ProbeLevel::kFull, flag.layer});
  clear_gradients(params, step.checkpoint().order());
  ++passes;
  const ProbeRecord* best = nullptr;
  for (const ProbeRecord& record : out.probes) {
    if (record.head != -1 || record.layer != flag.layer || record.stats.all_finite()) continue;
    if (best == nullptr || earlier(record, *best)) best = &record;
  }
  if (best == nullptr || best->phase != flag.phase || best->site != flag.site) {
    throw std::runtime_error("step " + std::to_string(step.step()) + ": full probes of " +
                             std::string(phase_name(flag.phase)) + " " + flag.site +
                             " disagree with the any-non-finite pass (is the replay deterministic?)");
  }
  return first_nonfinite_of(*best);
}

bool pass_fails(LoadedStep& step, const std::vector<int64_t>& samples, const PassHook& before_pass) {
  const Manifest& m = step.bundle().manifest();
  const StepArithmetic arithmetic(m, step.state(), {}, step.native_low_precision());
  ParamMap& params = step.checkpoint().compute_params();
  const std::vector<std::string>& order = step.checkpoint().order();
  if (before_pass) before_pass();
  clear_gradients(params, order);
  const PassInput input{{step.step(), 0, 0, samples},
                        arithmetic.loss_scale / static_cast<double>(m.data.grad_accum_steps)};
  const PassOutput out = replay_pass(arithmetic.model, step.bundle().tokens(), m.data.seq_len, input, params,
                                     arithmetic.numerics, {ProbeLevel::kFlags, {}});
  std::vector<torch::Tensor> grads;
  add_rank_gradients(params, order, 1.0 / arithmetic.loss_scale, 1, grads);
  clear_gradients(params, order);
  const bool forward_flag = std::any_of(out.probes.begin(), out.probes.end(),
                                        [](const ProbeRecord& r) { return r.phase == Phase::kForward; });
  if (forward_flag) return true;
  if (!is_fp16(m)) return !out.probes.empty() || !all_finite(grads);
  const bool anything = !out.probes.empty() || !all_finite(grads);
  return anything && std::isfinite(total_grad_norm(grads));  // the scaler skips a non-finite norm
}

}  // namespace nanreplay
