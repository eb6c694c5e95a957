// The replay of a bundle as a sequence of named stages: check the bundle
// (checksums, non-finite checkpoints), replay each step (its batch's data
// checks, every pass with probes, which value came first, its numeric and
// system findings, the update to the next checkpoint), look at what the steps
// found together (stray tokens, fp8 scale jumps, the origin's tokens), check
// the replay against itself, and settle the verdict. Steps are independent:
// each starts from its own checkpoint.
#include "replay/workflows/replay_engine.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <future>
#include <optional>
#include <set>

#include <torch/torch.h>

#include "loaders/base/error.h"
#include "loaders/bundle/provenance.h"
#include "replay/arch/multi_token_prediction.h"
#include "replay/probing/probe_retention.h"
#include "replay/step/checkpoint_update.h"
#include "replay/step/layer_stream.h"
#include "replay/step/step.h"
#include "replay/step/step_scan.h"
#include "replay/step/trajectory.h"
#include "replay/workflows/counterfactual.h"
#include "reports/triage/data/origin_tokens.h"
#include "reports/triage/numeric/numeric_rules.h"
#include "reports/triage/spike_origin.h"
#include "reports/triage/window_outliers.h"
#include "reports/triage/system/self_checks.h"
#include "reports/triage/triage.h"

namespace nanreplay {

using K = EvidenceKey;

namespace {

// Asks the kernel to read `file` into the page cache in the background
// (the next step's checkpoint, while this step computes); best effort.
void read_ahead(const std::filesystem::path& file) {
  const int fd = ::open(file.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return;
  (void)::posix_fadvise(fd, 0, 0, POSIX_FADV_WILLNEED);
  ::close(fd);
}

const char* low_precision_name(Compute compute, const ComputePlacement& placement) {
  if (compute == Compute::kFp32) return "fp32";
  if (compute == Compute::kFp8) return "fp8";
  return placement.native_low_precision ? "native" : "emulated";
}

class BundleReplay {
 public:
  BundleReplay(const Bundle& bundle, const ReplayOptions& options)
      : bundle_(bundle),
        m_(bundle.manifest()),
        options_(options),
        thresholds_(options.thresholds.value_or(default_thresholds(m_.precision.compute))),
        // With --cross-check the replay runs on the first device; the second
        // replays the step of interest again for the comparison.
        placement_(streamed_if(placement_for(options.cross_check ? std::vector<std::string>{options.devices.front()}
                                                                 : options.devices,
                                             options.native_low_precision, m_.precision.compute),
                               options.stream_scratch)) {
    report_.bundle = bundle.root().string();
    report_.tool_version = options.tool_version;
    report_.arch = m_.model.arch;
    report_.moe_top_k = m_.model.moe ? m_.model.moe->top_k : 0;
    report_.precision = m_.precision.compute;
    report_.incident = m_.incident;
    report_.minimized = m_.minimized;
    report_.defaulted = defaulted_values(m_.provenance);
    report_.devices = options.devices;
    report_.low_precision = low_precision_name(m_.precision.compute, placement_);
    for (const StepFiles& files : bundle.steps()) {
      if (!options.only_steps || options.only_steps->count(files.step)) todo_.push_back(&files);
    }
    refuse_window_without_checkpoint();
    plan_spike_incident();
    trajectory_.measure_updates();
  }

  // --steps choosing a window whose first step holds no checkpoint (a rolled-forward step's state.json
  // only): nothing to roll it forward from. Named with the checkpoint to start from instead.
  void refuse_window_without_checkpoint() const {
    if (todo_.empty() || todo_.front()->has_model) return;
    const int64_t first = todo_.front()->step;
    std::optional<int64_t> before;
    for (const StepFiles& files : bundle_.steps()) {
      if (files.has_model && files.step < first) before = files.step;
    }
    throw UsageError("--steps: step " + std::to_string(first) + " holds no checkpoint (only state.json: the replay "
                     "rolls it forward from the step before), so a window cannot start there" +
                     (before ? "; start it at " + std::to_string(*before) + ", the checkpoint before it" : ""));
  }

  // Before any replay: the shards against their checksums, the checkpoints for non-finite values.
  void check_bundle() {
    const PhaseTimer timer(report_.timings, TimedPhase::kDataChecks);
    const std::vector<Finding> found = triage_bundle({bundle_.tokens().verify_checksums(), &bundle_});
    add(found);
    for (const Finding& f : found) {
      if (f.code == FindingCode::kCheckpointNonfinite) contaminated_.push_back(f);
    }
    baseline_ = data_baseline(bundle_.tokens(), m_.data.seq_len, thresholds_.data.baseline_samples);
  }

  void replay_steps() {
    for (size_t index = 0; index < todo_.size(); ++index) replay_one(*todo_[index], index);
    next_host_step_ = {};  // an interrupted replay's next step, still being prepared
    retention_.finish();
  }

  // What the steps found together.
  void after_steps() {
    const PhaseTimer timer(report_.timings, TimedPhase::kDataChecks);
    add(triage_window({bundle_, batch_samples_, states_, &updates_, incident_step()}, thresholds_));
    if (first_) {
      report_.origin_tokens = origin_tokens(bundle_, *first_, origin_embedding(), thresholds_);
      if (first_->sample >= 0 && first_->sample < bundle_.num_samples()) {
        report_.offending_tokens = bundle_.tokens().sample_tokens(first_->sample, m_.data.seq_len);
        report_.offending_tokens_start = first_->sample * m_.data.seq_len;
      }
    }
    report_.first_nonfinite = first_;
    report_.reproduced = first_.has_value();
    report_.update_stats = updates_;
    report_.spike = judge_spike(spike_plan_, report_.steps,
                                spike_locator_ ? spike_locator_->origin() : std::optional<SpikeOrigin>{});
    if (outliers_ && report_.spike) {
      report_.window_outliers = outliers_->summary(report_.spike->step);
      if (report_.spike->origin) report_.spike->mechanism = outliers_->logit_growth(*report_.spike->origin);
    }
  }

  // A spike's step and the one before, each step's batch on the other's weights (counterfactual.h).
  void replay_counterfactuals() {
    if (!counterfactuals_ || !report_.spike || !report_.spike->step) return;
    const PhaseTimer timer(report_.timings, TimedPhase::kReplay);
    report_.counterfactuals = counterfactuals_->run(bundle_, *report_.spike, report_.steps, report_.findings,
                                                    updates_checked_.count(*report_.spike->step) > 0, placement_);
    counterfactuals_.reset();  // the weights kept for it
  }

  // The failing step (or the last one) replayed again: on this machine, and on the second device.
  void check_replay() {
    const StepFiles* files = step_to_recheck();
    if (files == nullptr || !options_.probes) return;
    // Determinism replays what decides the verdict again (one micro-batch, or
    // the whole step); the cross-check, the whole step.
    const int64_t whole_step = m_.data.world_size * m_.data.grad_accum_steps;
    if (options_.check_determinism) {
      report_.check_replays += deciding_pass() ? 1 : whole_step;
      const PhaseTimer timer(report_.timings, TimedPhase::kDeterminism);
      report_.determinism =
          check_determinism(bundle_, recheck_input(*files), report_.probes, placement_, deciding_pass());
    }
    if (options_.cross_check) {
      report_.check_replays += whole_step;
      const PhaseTimer timer(report_.timings, TimedPhase::kCrossCheck);
      ComputePlacement second =
          placement_for({options_.devices.back()}, options_.native_low_precision, m_.precision.compute);
      second.stream = placement_.stream;
      report_.cross_check = check_across_devices(bundle_, recheck_input(*files), report_.probes, second,
                                                 options_.devices.front(),
                                                 options_.devices.back());
    }
    add(triage_recheck({files->step, options_.check_determinism ? &report_.determinism : nullptr,
                        report_.cross_check ? &*report_.cross_check : nullptr}));
  }

  ReplayReport finish(std::chrono::steady_clock::time_point started) {
    triage_verdict(report_, thresholds_, m_);
    report_.elapsed_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
    return std::move(report_);
  }

 private:
  // A spike incident is known from the manifest and the logged series before any
  // replay: its steps then also locate each site's largest element.
  void plan_spike_incident() {
    std::vector<StepState> logged;
    for (const StepFiles* files : todo_) logged.push_back(bundle_.load_state(*files));
    spike_plan_ = plan_spike(m_.incident, logged, options_.spike);
    if (spike_plan_.active) spike_locator_.emplace(spike_plan_.thresholds);
    if (spike_plan_.active && options_.probes) outliers_.emplace();
    if (spike_plan_.active && spike_plan_.step && options_.probes) counterfactuals_.emplace(*spike_plan_.step);
  }

  void add(const std::vector<Finding>& more) { report_.findings.insert(report_.findings.end(), more.begin(), more.end()); }

  void replay_one(const StepFiles& files, size_t index) {
    const double replay_before = report_.timings.of(TimedPhase::kReplay);
    {
      const PhaseTimer timer(report_.timings, TimedPhase::kReplay);
      replay_timed(files, index);
    }
    report_.timings.step_seconds.emplace_back(files.step, report_.timings.of(TimedPhase::kReplay) - replay_before);
  }

  // The host's share of a step that no earlier step decides: its logged
  // state, batch and data findings. A replay on a GPU prepares the next
  // step's on a worker thread while the device computes this one, and has
  // the next checkpoint read into the page cache meanwhile.
  struct HostStep {
    StepState logged;
    StepBatch batch;
    HostStepFindings found;
  };

  HostStep prepare_host_step(const StepFiles& files) const {
    const StepEntry& entry = step_entry(m_, files.step);
    HostStep host{bundle_.load_state(files), StepBatch{bundle_.sampler().samples_for(entry)}, {}};
    host.found = triage_host_step({bundle_, entry, host.batch, &baseline_, thresholds_.data});
    if (files.has_model && prepares_ahead()) read_ahead(files.model);
    return host;
  }

  bool prepares_ahead() const {
    if (options_.prepare_ahead) return *options_.prepare_ahead;
    return std::any_of(placement_.devices.begin(), placement_.devices.end(),
                       [](const torch::Device& d) { return !d.is_cpu(); });
  }

  // Step `index`'s host share (prepared ahead, or now), and the next one's started.
  HostStep take_host_step(size_t index) {
    HostStep host = next_host_step_.valid() ? next_host_step_.get() : prepare_host_step(*todo_[index]);
    if (prepares_ahead() && index + 1 < todo_.size()) {
      const StepFiles* next = todo_[index + 1];
      next_host_step_ = std::async(std::launch::async, [this, next] { return prepare_host_step(*next); });
    }
    return host;
  }

  void replay_timed(const StepFiles& files, size_t index) {
    std::optional<PhaseTimer> data_timer(std::in_place, report_.timings, TimedPhase::kDataChecks);
    HostStep host = take_host_step(index);
    const StepState& logged = host.logged;
    const StepState state = trajectory_.with_derived_score_bias(with_loss_scale(logged, loss_scales_.of(logged)), files);
    states_.push_back(state);
    StepOutcome outcome;
    outcome.step = files.step;
    outcome.derived = !files.has_model;
    outcome.logged_loss = state.logged.loss;
    outcome.logged_grad_norm = state.logged.grad_norm;
    outcome.loss_scale = m_.precision.compute == Compute::kFp16 ? state.loss_scale : 1.0;
    add(host.found.sampler);
    const StepBatch& batch = host.batch;
    for (const auto& rank_samples : batch.samples) batch_samples_.insert(rank_samples.begin(), rank_samples.end());
    const std::vector<Finding>& bad_tokens = host.found.bad_tokens;
    if (!bad_tokens.empty() || (outcome.derived && !trajectory_ok_)) {
      outcome.finite = false;
      outcome.not_replayed_reason = !bad_tokens.empty() ? "token id out of range in the batch"
                                                        : "derived from a step that could not be replayed";
      add(bad_tokens);
      report_.steps.push_back(outcome);
      trajectory_ok_ = false;  // no gradients: the next derived step has no update to start from
      loss_scales_.step_done(false);
      return;
    }
    add(host.found.profile);
    data_timer.reset();

    ModelCheckpoint checkpoint = files.has_model ? ModelCheckpoint(files, m_.model) : trajectory_.checkpoint();
    StepRequest request;
    request.probes = options_.probes ? ProbeLevel::kFull : ProbeLevel::kOff;
    request.before_pass = [&](int rank, int micro, const char* phase) {
      if (options_.should_stop && options_.should_stop()) throw Interrupted(interrupted_after_steps(index, todo_.size()));
      if (options_.on_progress) options_.on_progress({index, todo_.size(), files.step, rank, micro, phase});
    };
    request.on_block = [&](int rank, int micro, int layer, const char* phase) {
      if (options_.should_stop && options_.should_stop()) throw Interrupted(interrupted_after_steps(index, todo_.size()));
      if (options_.on_progress) {
        options_.on_progress({index, todo_.size(), files.step, rank, micro, phase, layer, static_cast<int>(m_.model.num_layers)});
      }
    };
    request.locate_largest = spike_locator_.has_value();
    request.router_logit_max = outliers_.has_value() || options_.probes;  // report.json's too
    request.attn_logit_max = request.expert_activation_max = options_.probes;  // report.json's per-step maxima
    std::optional<MtpLossRecorder> mtp_losses;  // model.mtp: steps[].mtp_loss
    if (m_.model.mtp) mtp_losses.emplace();
    StepResult step =
        replay_step({m_, bundle_.tokens(), files.step, state, batch}, checkpoint, placement_, request);
    if (mtp_losses) outcome.mtp_losses = mtp_losses->means();
    mtp_losses.reset();
    report_.step_replays += m_.data.world_size * m_.data.grad_accum_steps;  // every pass, in whichever process
    if (spike_locator_) spike_locator_->step_done(files.step, step.probes, spike_plan_.step);
    if (outliers_) outliers_->step_done(files.step, step.probes, step.router_logit_max, spike_plan_.step);
    if (counterfactuals_ && counterfactuals_->wants(files.step)) {  // before rolling forward moves the weights on
      counterfactuals_->keep(files, state, batch, step.probes,
                             outcome.derived ? std::optional(trajectory_.snapshot()) : std::nullopt);
    }
    record_step(files, state, checkpoint, step, outcome);
    const bool last = report_.steps.size() + 1 == todo_.size();
    if (outcome.derived && ((last && !first_) || (first_ && first_->step == files.step))) {
      recheck_params_ = trajectory_.snapshot();  // the self-checks replay this step again
    }
    roll_forward(files, state, step, outcome);
    loss_scales_.step_done(outcome.scaler_skipped);
    outcome.probe_summary = summarize_probes(step.probes);
    report_.steps.push_back(outcome);
    if (options_.on_step_probes) {
      {
        const PhaseTimer timer(report_.timings, TimedPhase::kTrace);
        options_.on_step_probes(step.probes);
      }
      retention_.step_done(files.step, std::move(step.probes), first_ ? std::optional(first_->step) : std::nullopt);
    } else {
      report_.probes.insert(report_.probes.end(), std::make_move_iterator(step.probes.begin()),
                            std::make_move_iterator(step.probes.end()));
    }
    step = StepResult{};
    return_freed_memory();
  }

  // When the next step has no checkpoint, this step's update gives its
  // parameters; when a derived step is followed by a checkpoint, the update
  // is compared with what the run really held there.
  void roll_forward(const StepFiles& files, const StepState& state, const StepResult& step,
                    const StepOutcome& outcome) {
    const StepFiles* next = find_files(files.step + 1);
    if (next == nullptr) return measure_last_update(state, step, outcome);
    if (next->has_model && files.has_model) return;
    if (files.has_model) trajectory_.start(bundle_, files, placement_.stream);
    trajectory_.advance(step, state, outcome.scaler_skipped);
    record_update();
    trajectory_ok_ = true;
    const bool predictable = std::isfinite(step.grad_norm) || outcome.scaler_skipped;
    if (next->has_model && options_.check_updates && predictable) {
      const PhaseTimer timer(report_.timings, TimedPhase::kUpdateChecks);
      add(triage_update({bundle_, files, *next, trajectory_.checkpoint(), nullptr, *state.lr}));
      updates_checked_.insert(next->step);
    }
  }

  // The update statistics of the step just derived from (NUMERIC_UPDATE_SPIKE reads them).
  void record_update() {
    if (!trajectory_.last_update().tensors.empty()) updates_.push_back(trajectory_.last_update());
  }

  // The last step of a rolled-forward window gives no parameters, but its own
  // update is what a spike at that step makes jump: computed for the statistics alone.
  void measure_last_update(const StepState& state, const StepResult& step, const StepOutcome& outcome) {
    if (!outcome.derived || !trajectory_ok_ || !trajectory_.started() || !std::isfinite(step.grad_norm)) return;
    for (const ParamSpec& spec : expected_parameters(m_.model)) {
      if (!state.lr_of(rule_of_param(*m_.optimizer, spec.name).group)) return;
    }
    const PhaseTimer timer(report_.timings, TimedPhase::kUpdateChecks);
    trajectory_.advance(step, state, outcome.scaler_skipped);
    record_update();
  }

  // The incident's step: the first non-finite value's, or the spike's.
  std::optional<int64_t> incident_step() const {
    if (first_) return first_->step;
    if (spike_plan_.active) return spike_plan_.step;  // none when the plan names no step
    return std::nullopt;
  }

  // The step's outcome, whether it holds the origin, and its findings (triage_step, then the update check).
  void record_step(const StepFiles& files, const StepState& state, const ModelCheckpoint& checkpoint,
                   const StepResult& step, StepOutcome& outcome) {
    outcome.replayed = true;
    outcome.loss = step.loss;
    outcome.grad_norm = step.grad_norm;
    outcome.rank_losses = step.rank_losses;
    outcome.micro_batch_losses = step.micro_batch_losses;
    outcome.rank_grad_norms = step.rank_grad_norms;
    const bool probes_finite = std::all_of(step.probes.begin(), step.probes.end(),
                                           [](const ProbeRecord& r) { return r.stats.all_finite(); });
    outcome.finite = std::isfinite(step.loss) && std::isfinite(step.grad_norm) && probes_finite;
    const StepJudgement judged = judge_step(step, m_.precision.compute);
    outcome.scaler_skipped = judged.scaler_skips;
    outcome.handled_overflow = judged.handled_overflow;
    if (judged.first != nullptr && !first_) {
      first_ = first_nonfinite_of(*judged.first);
      first_->contaminated_params = contaminated_params(files.step);
      report_.propagation = propagation_after(step.probes, *judged.first);
    }
    StepTriage triage = triage_step({outcome, state, step.probes, step.norm_checks, step.sample_losses,
                                     judged.handled_first, m_.model, m_.precision.compute,
                                     [this](int64_t sample, int64_t position) -> int64_t {  // the finding's token
                                       if (sample >= bundle_.num_samples() || position >= m_.data.seq_len) return -1;
                                       return bundle_.tokens().sample_tokens(sample, m_.data.seq_len).at(
                                           static_cast<size_t>(position));
                                     },
                                     &report_.steps},
                                    thresholds_);
    add(triage.findings);
    outcome.expert_tokens = std::move(triage.expert_tokens);
    outcome.attn_logit_max = step.attn_logit_max;
    outcome.expert_activation_max = step.expert_activation_max;
    if (options_.probes) outcome.router_logit_max = step.router_logit_max;
    outcome.router_score_bias = step.score_bias;
    outcome.rank_norms_logged_global = triage.rank_norms_logged_global;
    // System layer: does the next checkpoint follow from this one by AdamW?
    const StepFiles* next = find_files(files.step + 1);
    const bool predictable = std::isfinite(step.grad_norm) || outcome.scaler_skipped;
    std::vector<Finding> update_found;
    if (options_.check_updates && next != nullptr && next->has_model && files.has_model && m_.optimizer && state.lr &&
        predictable && bundle_.has_optimizer(files)) {
      const PhaseTimer timer(report_.timings, TimedPhase::kUpdateChecks);
      update_found = triage_update({bundle_, files, *next, checkpoint, &step, *state.lr, outcome.scaler_skipped});
      add(update_found);
      updates_checked_.insert(next->step);
    }
    if (files.has_model && (next == nullptr || next->has_model)) {
      measure_checkpoint_update({&files, next, &checkpoint, &step, &state, outcome.scaler_skipped}, update_found);
    }
  }

  // A step between two checkpoints (or the last one): its update as the
  // checkpoints hold it (checkpoint_update.h). A tensor the update check found
  // changed outside the optimizer is marked: its jump is not an update's.
  void measure_checkpoint_update(const CheckpointUpdateInput& input, const std::vector<Finding>& update_found) {
    const PhaseTimer timer(report_.timings, TimedPhase::kUpdateChecks);
    StepUpdateStats measured = checkpoint_update_stats(bundle_, input);
    if (measured.tensors.empty()) return;
    std::set<std::string> rewritten;
    for (const Finding& f : update_found) {
      if (f.code == FindingCode::kSystemBitFlip || f.code == FindingCode::kSystemUpdateMismatch) {
        rewritten.insert(f.evidence.text(K::kParam).value_or(""));
      }
    }
    for (TensorUpdateStats& t : measured.tensors) t.outside_optimizer = rewritten.count(t.param) > 0;
    updates_.push_back(std::move(measured));
  }

  // Parameters already non-finite in `step`'s checkpoint: the origin only propagates them.
  std::vector<std::string> contaminated_params(int64_t step) const {
    std::vector<std::string> names;
    for (const Finding& f : contaminated_) {
      const std::vector<int64_t>* steps = f.evidence.integers(K::kSteps);
      const bool holds = steps != nullptr && std::find(steps->begin(), steps->end(), step) != steps->end();
      if (holds && f.evidence.text(K::kTensor) == "parameter") names.push_back(f.evidence.text(K::kParam).value_or(""));
    }
    return names;
  }

  // The step the self-checks replay again, with the state and parameters its first replay had.
  RecheckInput recheck_input(const StepFiles& files) const {
    size_t i = 0;
    while (todo_[i]->step != files.step) ++i;
    return {files, states_.at(i), files.has_model ? nullptr : &*recheck_params_};
  }

  // The origin step's token embedding: from its checkpoint, or the derived copy.
  torch::Tensor origin_embedding() const {
    const StepFiles& files = bundle_.step_files(first_->step);
    const std::string key = expected_parameters(m_.model).front().name;
    if (!files.has_model) return recheck_params_->param(key).detach();
    return ModelCheckpoint(files, m_.model).param(key).detach().clone();
  }

  const StepFiles* find_files(int64_t step) const {
    for (const StepFiles& files : bundle_.steps()) {
      if (files.step == step) return &files;
    }
    return nullptr;
  }

  // What decides the verdict, replayed again by the determinism check: the
  // origin's micro-batch, or the first one of the step when there is no
  // origin; the whole step when the origin is a parameter gradient.
  std::optional<PassRef> deciding_pass() const {
    if (!first_) return PassRef{0, 0};
    if (first_->phase == Phase::kGrad) return std::nullopt;
    return PassRef{first_->rank, first_->micro_batch};
  }

  // The step the self-checks replay again: the origin's, or the last one; only if it was replayed.
  const StepFiles* step_to_recheck() const {
    if (report_.steps.empty()) return nullptr;
    const int64_t step = first_ ? first_->step : report_.steps.back().step;
    const bool replayed = std::any_of(report_.steps.begin(), report_.steps.end(),
                                      [&](const StepOutcome& s) { return s.step == step && s.replayed; });
    return replayed ? find_files(step) : nullptr;
  }

  const Bundle& bundle_;
  const Manifest& m_;
  const ReplayOptions& options_;
  const TriageThresholds thresholds_;
  const ComputePlacement placement_;
  std::vector<const StepFiles*> todo_;
  ReplayReport report_;
  std::vector<Finding> contaminated_;
  DataBaseline baseline_;
  std::optional<FirstNonfinite> first_;
  std::vector<StepState> states_;
  std::set<int64_t> batch_samples_;  // every sample a replayed step's batch holds
  // Rolling forward: the parameters and AdamW state carried to the next
  // step, whether they could be (every step before replayed), each step's
  // fp16 loss scale, and a copy of the derived step the self-checks replay again.
  Trajectory trajectory_;
  bool trajectory_ok_ = true;
  LossScales loss_scales_{bundle_.rolls_forward()};
  std::optional<ModelCheckpoint> recheck_params_;
  std::vector<StepUpdateStats> updates_;  // each update's statistics (derived or between checkpoints), in step order
  ProbeRetention retention_{report_.probes};  // with on_step_probes
  std::future<HostStep> next_host_step_;  // prepare_ahead: the next step's host share
  SpikePlan spike_plan_;
  std::optional<SpikeLocator> spike_locator_;  // a spike incident only
  std::optional<OutlierTracker> outliers_;     // a spike incident with probes: what changed over the window
  // A spike incident: its step and the one before, replayed again crosswise (counterfactual.h).
  std::optional<SpikeCounterfactuals> counterfactuals_;
  std::set<int64_t> updates_checked_;  // steps whose checkpoint the update check re-derived
};

}  // namespace

ReplayReport replay_bundle(const Bundle& bundle, const ReplayOptions& options) {
  const auto started = std::chrono::steady_clock::now();
  validate_devices(options.devices, options.cross_check);
  BundleReplay replay(bundle, options);
  replay.check_bundle();
  replay.replay_steps();
  replay.after_steps();
  replay.replay_counterfactuals();
  replay.check_replay();
  return replay.finish(started);
}

std::string interrupted_after_steps(size_t steps_done, size_t step_count) {
  return "interrupted after " + std::to_string(steps_done) + " of " + std::to_string(step_count) +
         " steps; nothing was written";
}

}  // namespace nanreplay
