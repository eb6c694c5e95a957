// Bisection's and the what-ifs' view of one step; see step_scan.h. The
// cheap pass is replay_step at kFlags and judged by judge_step, the rule
// `run` uses too.
#include "replay/step/step_scan.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>

#include <torch/torch.h>

#include "replay/probing/probe_session.h"
#include "replay/step/trajectory.h"

namespace nanreplay {

namespace {

bool earlier(const ProbeRecord& a, const ProbeRecord& b) { return execution_key(a) < execution_key(b); }

bool all_finite(const GradientSet& grads) {
  for (size_t i = 0; i < grads.size(); ++i) {
    const torch::Tensor g = grads[i];
    if (g.defined() && !torch::isfinite(g).all().item<bool>()) return false;
  }
  return true;
}

}  // namespace

const StepEntry& step_entry(const Manifest& m, int64_t step) {
  for (const StepEntry& entry : m.steps) {
    if (entry.step == step) return entry;
  }
  throw std::logic_error("no manifest entry for step " + std::to_string(step));
}

StepBatch batch_of_step(const Bundle& bundle, int64_t step) {
  return StepBatch{bundle.sampler().samples_for(step_entry(bundle.manifest(), step))};
}

std::vector<BatchToken> out_of_range_in_batch(const Bundle& bundle, const StepBatch& batch, size_t max_listed) {
  const Manifest& m = bundle.manifest();
  const int64_t seq = m.data.seq_len;
  std::vector<BatchToken> found;
  std::vector<int64_t> window(static_cast<size_t>(seq + 1));
  for (size_t rank = 0; rank < batch.samples.size(); ++rank) {
    for (int64_t sample : batch.samples[rank]) {
      bundle.tokens().read(sample * seq, seq + 1, window.data());
      for (int64_t pos = 0; pos <= seq; ++pos) {
        const int64_t token = window[static_cast<size_t>(pos)];
        if (token < m.model.vocab_size) continue;
        if (found.size() == max_listed) return found;
        found.push_back({static_cast<int>(rank), sample, pos, token});
      }
    }
  }
  return found;
}

std::optional<std::string> unreplayable_reason(const Bundle& bundle, const StepBatch& batch) {
  const std::vector<BatchToken> bad = out_of_range_in_batch(bundle, batch, 1);
  if (bad.empty()) return std::nullopt;
  return "token id " + std::to_string(bad[0].token) + " >= vocab_size " +
         std::to_string(bundle.manifest().model.vocab_size) + " in sample " + std::to_string(bad[0].sample) +
         " at position " + std::to_string(bad[0].position);
}

namespace {

RolledStart start_of(const Bundle& bundle, int64_t step, const ComputePlacement& placement) {
  if (bundle.rolls_forward()) return roll_to(bundle, step, placement);
  const StepFiles& files = bundle.step_files(step);
  return {ModelCheckpoint(files, bundle.manifest().model), bundle.load_state(files)};
}

}  // namespace

LoadedStep::LoadedStep(const Bundle& bundle, int64_t step, const ComputePlacement& placement)
    : LoadedStep(bundle, step, start_of(bundle, step, placement), placement) {}

LoadedStep::LoadedStep(const Bundle& bundle, int64_t step, RolledStart start, const ComputePlacement& placement)
    : LoadedStep(bundle, step, std::move(start.checkpoint), std::move(start.state), placement) {}

LoadedStep::LoadedStep(const Bundle& bundle, int64_t step, ModelCheckpoint checkpoint, StepState state,
                       const ComputePlacement& placement)
    : bundle_(bundle),
      files_(bundle.step_files(step)),
      state_(std::move(state)),
      batch_(batch_of_step(bundle, step)),
      checkpoint_(std::move(checkpoint)),
      model_(checkpoint_model(checkpoint_, bundle.manifest().model, placement)),
      native_(placement.native_low_precision) {}

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
    if (!torch::isfinite(checkpoint_.param(name)).all().item<bool>()) names.push_back(name);
    checkpoint_.release(name);
  }
  return names;
}

StepResult replay_loaded_step(LoadedStep& step, const StepRequest& request) {
  StepRequest placed = request;
  placed.native_low_precision = step.native_low_precision();
  const StepInputs inputs{step.bundle().manifest(), step.bundle().tokens(), step.step(), step.state(), step.batch()};
  return replay_step(inputs, step.model(), step.checkpoint().order(), placed);
}

StepScan scan_step(LoadedStep& step, const StepOverrides& overrides, bool stop_at_first_bad,
                   const PassHook& before_pass, StepResult* kept) {
  StepRequest request;
  request.probes = ProbeLevel::kFlags;
  request.overrides = overrides;
  request.stop_at_first_bad = stop_at_first_bad;
  if (before_pass) request.before_pass = [&](int, int, const char* phase) {
    if (std::string(phase) == "forward") before_pass();  // once per pass
  };
  StepResult result = replay_loaded_step(step, request);
  const StepJudgement judged = judge_step(result, step.bundle().manifest().precision.compute);
  StepScan scan;
  scan.step = step.step();
  scan.passes = result.passes;
  scan.complete = result.complete;
  scan.loss = result.loss;
  scan.grad_norm = result.grad_norm;
  scan.scaler_skips = judged.scaler_skips;
  scan.handled_overflow = judged.handled_overflow;
  scan.bad = judged.bad;
  if (judged.first != nullptr) {
    scan.first = *judged.first;
    if (judged.first->phase != Phase::kGrad) {
      scan.first_pass_samples = result.rows_of_pass.at({judged.first->micro_batch, judged.first->rank});
    }
  }
  if (kept != nullptr) *kept = std::move(result);
  return scan;
}

FirstNonfinite locate_first(LoadedStep& step, const StepOverrides& overrides, const StepScan& scan,
                            int64_t& passes, const PassHook& before_pass) {
  if (!scan.first) throw std::logic_error("locate_first: the scan found nothing to locate");
  const ProbeRecord& flag = *scan.first;
  if (flag.phase == Phase::kGrad) return first_nonfinite_of(flag);  // described by the scan: no pass
  const Manifest& m = step.bundle().manifest();
  const StepArithmetic arithmetic(m, step.state(), overrides, step.native_low_precision());
  if (before_pass) before_pass();
  const PassInput input{{step.step(), flag.micro_batch, flag.rank, scan.first_pass_samples},
                        arithmetic.loss_scale / static_cast<double>(m.data.grad_accum_steps)};
  // Full statistics on the flagged block only; the rest of the pass computes as always.
  step.model().begin_step(/*whole_step=*/false);
  step.model().begin_rank(input.context.rank);
  const PassOutput out = replay_pass(arithmetic.model, step.bundle().tokens(), m.data.seq_len, input, step.model(),
                                     arithmetic.numerics, {ProbeLevel::kFull, flag.layer});
  step.model().end_ranks();
  ++passes;
  const ProbeRecord* best = nullptr;
  for (const ProbeRecord& record : out.probes) {
    if (!is_whole(record) || record.layer != flag.layer || record.stats.all_finite()) continue;
    if (best == nullptr || earlier(record, *best)) best = &record;
  }
  if (best == nullptr || best->phase != flag.phase || !(best->site == flag.site)) {
    throw std::runtime_error("step " + std::to_string(step.step()) + ": full probes of " +
                             std::string(phase_name(flag.phase)) + " " + probe_name(flag) +
                             " disagree with the any-non-finite pass (is the replay deterministic?)");
  }
  return first_nonfinite_of(*best);
}

bool pass_fails(LoadedStep& step, const std::vector<int64_t>& samples, const PassHook& before_pass) {
  const Manifest& m = step.bundle().manifest();
  const StepArithmetic arithmetic(m, step.state(), {}, step.native_low_precision());
  StepModel& model = step.model();
  if (before_pass) before_pass();
  model.begin_step(/*whole_step=*/false);
  model.begin_rank(0);
  const PassInput input{{step.step(), 0, 0, samples},
                        arithmetic.loss_scale / static_cast<double>(m.data.grad_accum_steps)};
  const PassOutput out = replay_pass(arithmetic.model, step.bundle().tokens(), m.data.seq_len, input, model,
                                     arithmetic.numerics, {ProbeLevel::kFlags, {}});
  const torch::Tensor norm = model.end_rank(1.0 / arithmetic.loss_scale, 1);
  model.end_ranks();
  const GradientSet grads = model.step_gradients(/*where_computed=*/true);
  const bool forward_flag = std::any_of(out.probes.begin(), out.probes.end(),
                                        [](const ProbeRecord& r) { return r.phase == Phase::kForward; });
  if (forward_flag) return true;
  if (!is_fp16(m)) return !out.probes.empty() || !all_finite(grads);
  const bool anything = !out.probes.empty() || !all_finite(grads);
  return anything && std::isfinite(norm.item<double>());  // the scaler skips a non-finite norm
}

}  // namespace nanreplay
