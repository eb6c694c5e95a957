// The four stages of bisection; see bisect.h. Only one checkpoint is open at a
// time: the binary search keeps the bad step's scan (its flags and the rows of
// the pass that holds the first one), not its checkpoint, and reopens it for
// the later stages. A rolled-forward bundle is walked in order instead, and
// the bad step's derived parameters are kept for the later stages.
#include "replay/workflows/bisect.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <map>
#include <memory>
#include <set>
#include <stdexcept>

#include <torch/torch.h>

#include "loaders/base/error.h"
#include "probes/damage_shape.h"
#include "replay/workflows/bisect_verdict.h"
#include "replay/workflows/ddmin.h"
#include "replay/step/layer_stream.h"
#include "reports/triage/data/origin_tokens.h"
#include "replay/workflows/replay_engine.h"
#include "replay/step/step_scan.h"
#include "replay/step/trajectory.h"
#include "reports/triage/triage.h"

namespace nanreplay {

namespace {

class Bisection {
 public:
  Bisection(const Bundle& bundle, const BisectOptions& options, BisectReport& report)
      : bundle_(bundle), options_(options), report_(report) {}

  // Stage 1: the first bad step, or none. Tests the last step first: most
  // bundles end at the failure, and a clean last step means a clean bundle.
  std::optional<int64_t> first_bad_step(const std::set<int64_t>& marked_by_log) {
    const std::vector<StepFiles>& steps = bundle_.steps();
    if (steps.empty()) return std::nullopt;
    if (bundle_.rolls_forward()) return first_bad_in_order();
    std::optional<size_t> bad = first_bad_of_last_or_marked(marked_by_log);
    if (!bad) return std::nullopt;
    size_t lo = 0, hi = *bad;  // steps[hi] is bad; every step before lo is clean
    while (lo < hi) {
      const size_t mid = lo + (hi - lo) / 2;
      if (test_step(mid)) {
        hi = mid;
      } else {
        lo = mid + 1;
      }
    }
    // lo only ever rose past a step tested clean, so steps[hi - 1] was tested.
    if (hi > 0) {
      for (const BisectStepTest& t : report_.step_tests) {
        if (t.step == steps[hi - 1].step && t.replayed && !t.bad) report_.clean_predecessor = t.step;
      }
    }
    if (!bad_scan_ || bad_scan_->step != steps[hi].step) throw std::logic_error("bisect: lost the bad step's scan");
    return steps[hi].step;
  }

  // The last step, when it is bad (most bundles end at the failure). When it
  // is clean the failure may have been transient (an fp16 step the scaler
  // skipped, training then went on): the first step the log marks (a
  // non-finite loss, or skipped) that is bad, tested in order.
  std::optional<size_t> first_bad_of_last_or_marked(const std::set<int64_t>& marked_by_log) {
    const std::vector<StepFiles>& steps = bundle_.steps();
    if (test_step(steps.size() - 1)) return steps.size() - 1;
    for (size_t i = 0; i + 1 < steps.size(); ++i) {
      if (marked_by_log.count(steps[i].step) && test_step(i)) return i;
    }
    return std::nullopt;
  }

  // Rolling forward: each step's parameters come from the update of the one
  // before, so the cheap pass walks the steps in order, advancing the
  // trajectory with every clean step's gradients, up to the first bad one.
  std::optional<int64_t> first_bad_in_order() {
    report_.in_order = true;
    const Manifest& m = bundle_.manifest();
    Trajectory trajectory;
    LossScales scales(true);
    bool derivable = true;  // every step since the last checkpoint was replayed
    const std::vector<StepFiles>& steps = bundle_.steps();
    for (size_t i = 0; i < steps.size(); ++i) {
      const StepFiles& files = steps[i];
      const bool next_derived = i + 1 < steps.size() && !steps[i + 1].has_model;
      BisectStepTest test;
      test.step = files.step;
      set_stage("step", test.step);
      std::optional<std::string> why = unreplayable_reason(bundle_, batch_of_step(bundle_, test.step));
      if (!why && !files.has_model && !derivable) why = "derived from a step that could not be replayed";
      if (why) {
        test.replayed = false;
        test.not_replayed_reason = *why;
        report_.step_tests.push_back(test);
        derivable = false;
        scales.step_done(false);
        continue;
      }
      const StepState logged = bundle_.load_state(files);
      const StepState state = trajectory.with_derived_score_bias(with_loss_scale(logged, scales.of(logged)), files);
      ModelCheckpoint checkpoint = files.has_model ? ModelCheckpoint(files, m.model) : trajectory.checkpoint();
      auto loaded = std::make_unique<LoadedStep>(bundle_, files.step, std::move(checkpoint), state, placement());
      StepResult result;
      // Settling early costs a clean step nothing (every pass runs, its
      // gradients roll the trajectory on) and spares the bad one the
      // micro-batches after the one that settles it: nothing is derived from it.
      StepScan scan = scan_step(*loaded, {}, /*stop_at_first_bad=*/true, hook(), &result);
      test.bad = scan.bad;
      test.handled_overflow = scan.handled_overflow;
      test.replays = scan.passes;
      report_.step_tests.push_back(test);
      if (scan.bad) {
        if (i > 0 && report_.step_tests[i - 1].replayed) report_.clean_predecessor = steps[i - 1].step;
        bad_scan_ = std::move(scan);
        bad_loaded_ = std::move(loaded);
        return files.step;
      }
      append_to(report_.findings, replayed_step_findings(files.step, state, result, scan));
      scales.step_done(scan.scaler_skips);
      derivable = true;
      if (!next_derived) continue;
      if (files.has_model) trajectory.start(bundle_, files, placement().stream);
      trajectory.advance(result, state, scan.scaler_skips);
    }
    return std::nullopt;
  }

  // Stages 3 and 4 on the bad step (stage 2 is the scan's flags).
  FirstNonfinite locate_and_minimize(int64_t step) {
    if (!bad_loaded_) bad_loaded_ = std::make_unique<LoadedStep>(bundle_, step, placement());
    LoadedStep& loaded = *bad_loaded_;
    const std::string embedding = expected_parameters(bundle_.manifest().model).front().name;
    origin_embedding_ = loaded.checkpoint().param(embedding).detach().to(torch::kCPU).clone();
    stage_ = "site";
    FirstNonfinite origin = locate_first(loaded, {}, *bad_scan_, report_.site_replays, hook());
    origin.contaminated_params = loaded.nonfinite_params();
    if (options_.minimize_samples) minimize_samples(loaded, origin);
    return origin;
  }

  // With no origin, what `run` would still find in what the search replayed
  // or cheaply can: the last two steps' per-rank losses, the scaler's skip
  // and their logged loss and norm, and the update into the last checkpoint
  // (the step before the last replayed too, unless the search already did).
  // Rolling forward, the walk in order triaged every step as it went.
  std::vector<Finding> clean_window_findings() {
    const std::vector<StepFiles>& steps = bundle_.steps();
    if (steps.empty()) return {};
    if (report_.in_order) return reproduction_findings();
    const size_t last = steps.size() - 1;
    if (last > 0) keep_for_update_check(last - 1);
    std::vector<Finding> findings;
    for (const auto& [step, kept] : kept_) append_to(findings, replayed_step_findings(step, kept.state, kept.result, kept.scan));
    if (last > 0) append_to(findings, last_update_findings(steps[last - 1], steps[last]));
    append_to(findings, reproduction_findings());
    return findings;
  }

  // Runs before every pass: interrupts and progress.
  std::function<void()> hook() {
    return [this] {
      if (options_.should_stop && options_.should_stop()) throw Interrupted("bisect interrupted; nothing was printed");
      if (options_.on_progress) options_.on_progress({stage_, current_step_, passes_});
      ++passes_;
    };
  }

  // Every pass computes where --device says.
  ComputePlacement placement() const {
    return streamed_if(
        placement_for(options_.devices, options_.native_low_precision, bundle_.manifest().precision.compute),
        options_.stream_scratch);
  }

  // The bad step's token embedding as its replay held it (checkpoint or derived).
  const torch::Tensor& origin_embedding() const { return origin_embedding_; }

  void set_stage(const std::string& stage, int64_t step) {
    stage_ = stage;
    current_step_ = step;
  }

 private:
  // Each step is replayed once; a second question about it reads the first answer.
  bool test_step(size_t index) {
    for (const BisectStepTest& t : report_.step_tests) {
      if (t.step == bundle_.steps()[index].step) return t.bad;
    }
    BisectStepTest test;
    test.step = bundle_.steps()[index].step;
    set_stage("step", test.step);
    if (const std::optional<std::string> why = unreplayable_reason(bundle_, batch_of_step(bundle_, test.step))) {
      test.replayed = false;  // as in `run`: no value of this step can be non-finite
      test.not_replayed_reason = *why;
      report_.step_tests.push_back(test);
      return false;
    }
    LoadedStep loaded(bundle_, test.step, placement());
    StepResult result;
    StepScan scan = scan_step(loaded, {}, /*stop_at_first_bad=*/true, hook(), &result);
    test.bad = scan.bad;
    test.handled_overflow = scan.handled_overflow;
    test.replays = scan.passes;
    report_.step_tests.push_back(test);
    // The clean-window checks read the last two steps' replays (clean_window_findings).
    if (!scan.bad && scan.complete && index + 2 >= bundle_.steps().size()) keep_clean(index, loaded, std::move(result), scan);
    if (scan.bad) bad_scan_ = std::move(scan);
    return test.bad;
  }

  // The step before the last, replayed for its gradients (the update check)
  // unless the search kept it; its passes count as checks, not as the search's.
  void keep_for_update_check(size_t index) {
    const StepFiles& files = bundle_.steps()[index];
    if (kept_.count(files.step) || unreplayable_reason(bundle_, batch_of_step(bundle_, files.step))) return;
    set_stage("step", files.step);
    LoadedStep loaded(bundle_, files.step, placement());
    StepResult result;
    const StepScan scan = scan_step(loaded, {}, /*stop_at_first_bad=*/true, hook(), &result);
    report_.check_replays += scan.passes;
    // A bad one here is a failure the log does not mark, which the search does not look for (bisect.h).
    if (!scan.bad && scan.complete) keep_clean(index, loaded, std::move(result), scan);
  }

  // Only what the checks read: the flag records never, the gradients only
  // of the step before the last (a model's worth of memory each).
  void keep_clean(size_t index, const LoadedStep& loaded, StepResult result, const StepScan& scan) {
    result.probes = {};
    if (index + 1 == bundle_.steps().size()) result.grads = GradientSet{};
    kept_.insert_or_assign(loaded.step(), KeptStep{loaded.state(), std::move(result), scan});
  }

  // A clean step's cheap replay as evidence for triage_step: per-rank losses
  // and norms, the scaler's skip. Not its flag records: the numeric rules
  // read full statistics, which only `run` computes. The outcome is kept
  // for reproduction_findings.
  std::vector<Finding> replayed_step_findings(int64_t step, const StepState& state, const StepResult& result,
                                              const StepScan& scan) {
    const Manifest& m = bundle_.manifest();
    StepOutcome outcome;
    outcome.step = step;
    outcome.derived = !bundle_.step_files(step).has_model;
    outcome.replayed = true;
    outcome.finite = std::isfinite(result.loss) && std::isfinite(result.grad_norm);
    outcome.logged_loss = state.logged.loss;
    outcome.logged_grad_norm = state.logged.grad_norm;
    outcome.loss = result.loss;
    outcome.grad_norm = result.grad_norm;
    outcome.rank_losses = result.rank_losses;
    outcome.micro_batch_losses = result.micro_batch_losses;
    outcome.rank_grad_norms = result.rank_grad_norms;
    outcome.scaler_skipped = scan.scaler_skips;
    outcome.handled_overflow = scan.handled_overflow;
    const std::vector<ProbeRecord> no_probes;
    const std::vector<NormCheck> no_norm_checks;
    const std::vector<SampleLoss> no_sample_losses;
    std::vector<Finding> findings = triage_step({outcome, state, no_probes, no_norm_checks, no_sample_losses,
                                                 nullptr, m.model, m.precision.compute, {}},
                                                default_thresholds(m.precision.compute))
                                        .findings;
    replayed_.push_back(std::move(outcome));
    return findings;
  }

  // Every step replayed_step_findings saw, against what the job logged.
  std::vector<Finding> reproduction_findings() const {
    std::vector<StepOutcome> steps = replayed_;
    std::sort(steps.begin(), steps.end(), [](const StepOutcome& a, const StepOutcome& b) { return a.step < b.step; });
    const Compute precision = bundle_.manifest().precision.compute;
    return triage_reproduction(steps, precision, default_thresholds(precision));
  }

  // The update into the last checkpoint, as `run` checks it: the step
  // before's gradients applied by AdamW (run's conditions for the check).
  std::vector<Finding> last_update_findings(const StepFiles& current, const StepFiles& next) const {
    const Manifest& m = bundle_.manifest();
    const auto kept = kept_.find(current.step);
    if (kept == kept_.end() || !current.has_model || !next.has_model || !m.optimizer || !kept->second.state.lr ||
        !bundle_.has_optimizer(current)) {
      return {};
    }
    const KeptStep& k = kept->second;
    if (!std::isfinite(k.result.grad_norm) && !k.scan.scaler_skips) return {};
    const ModelCheckpoint params(current, m.model);
    return triage_update({bundle_, current, next, params, &k.result, *k.state.lr, k.scan.scaler_skips});
  }

  static void append_to(std::vector<Finding>& to, const std::vector<Finding>& more) {
    to.insert(to.end(), more.begin(), more.end());
  }

  // Stage 4: ddmin over the samples of the pass that holds the origin. That
  // pass is known to fail as it stands, except for an fp16 backward origin
  // (the loss scaler's verdict depends on the whole step), which is tested.
  void minimize_samples(LoadedStep& loaded, const FirstNonfinite& origin) {
    BisectSampleStage& stage = report_.samples;
    set_stage("samples", loaded.step());
    if (origin.phase == Phase::kGrad) {
      stage.note = "not run: the origin is a parameter gradient, summed over every pass of the step";
      return;
    }
    if (!origin.contaminated_params.empty()) {
      stage.data_dependent = false;
      stage.note = "not data-dependent: the checkpoint already holds non-finite parameters, so every sample fails";
      return;
    }
    stage.candidates = bad_scan_->first_pass_samples;
    const std::function<void()> before_pass = hook();
    const bool own_forward = origin_in_own_forward(origin);
    bool some_subset_passed = false;
    const std::function<bool(const std::vector<int64_t>&)> fails = [&](const std::vector<int64_t>& subset) {
      // Known without a replay: the origin's sample computes its forward as in the whole pass.
      if (own_forward && std::find(subset.begin(), subset.end(), origin.sample) != subset.end()) return true;
      ++stage.replays;
      const bool failed = pass_fails(loaded, subset, before_pass);
      some_subset_passed = some_subset_passed || !failed;
      return failed;
    };
    const bool fp16_backward = bundle_.manifest().precision.compute == Compute::kFp16 && origin.phase != Phase::kForward;
    if (fp16_backward && !fails(stage.candidates)) {
      stage.note = "not run: the origin's pass does not fail on its own (the loss scaler absorbs it)";
      return;
    }
    stage.minimal = ddmin<int64_t>(stage.candidates, fails).minimal;
    stage.ran = true;
    const bool confined = own_forward && damage_in_one_sample(origin) && stage.minimal == std::vector<int64_t>{origin.sample};
    stage.data_dependent = some_subset_passed || confined || !others_fail_alone(stage, fails);
    if (!*stage.data_dependent) {
      stage.note = "not data-dependent: every subset tried fails, single samples included; no sample is to blame";
      stage.minimal.clear();
    }
  }

  // A forward origin in a model whose forward computes each sample on its
  // own (attention within the sample; no mixture of experts, whose routing
  // capacity couples samples; not fp8, whose scales come from the whole
  // batch; not the loss nor an MTP depth's mtp.loss, a mean over the batch): the origin's sample reaches
  // the origin as in the whole pass, so a subset holding it fails.
  bool origin_in_own_forward(const FirstNonfinite& origin) const {
    const Manifest& m = bundle_.manifest();
    return origin.phase == Phase::kForward && origin.sample >= 0 && origin.site.id != SiteId::kLoss &&
           origin.site.id != SiteId::kMtpLoss && !m.model.moe &&
           m.precision.compute != Compute::kFp8;
  }

  // The origin's non-finite elements all lie in one token row: every other
  // sample is finite where the origin's fails (the failure is that sample's).
  static bool damage_in_one_sample(const FirstNonfinite& origin) {
    return origin.damage && !origin.damage->sampled && origin.damage->rows_hit == 1 && origin.damage->batch_row >= 0;
  }

  // Whether samples outside the minimal set fail on their own too (up to
  // three, evenly spread): a failure every sample triggers is not the data's.
  static bool others_fail_alone(const BisectSampleStage& stage,
                                const std::function<bool(const std::vector<int64_t>&)>& fails) {
    std::vector<int64_t> others;
    for (int64_t s : stage.candidates) {
      if (std::find(stage.minimal.begin(), stage.minimal.end(), s) == stage.minimal.end()) others.push_back(s);
    }
    if (others.empty()) return false;
    const size_t tried = std::min<size_t>(3, others.size());
    for (size_t k = 0; k < tried; ++k) {
      if (!fails({others[k * others.size() / tried]})) return false;
    }
    return true;
  }

  // A clean step's replay, kept for the clean-window checks.
  struct KeptStep {
    StepState state;
    StepResult result;
    StepScan scan;
  };

  const Bundle& bundle_;
  const BisectOptions& options_;
  BisectReport& report_;
  std::map<int64_t, KeptStep> kept_;  // the last two steps, when tested clean
  std::vector<StepOutcome> replayed_;  // the steps triaged as replayed, for reproduction_findings
  std::optional<StepScan> bad_scan_;
  std::unique_ptr<LoadedStep> bad_loaded_;  // the bad step, when the in-order pass already holds it
  torch::Tensor origin_embedding_;
  std::string stage_ = "step";
  int64_t current_step_ = 0;
  int64_t passes_ = 0;
};

}  // namespace

BisectReport bisect_bundle(const Bundle& bundle, const BisectOptions& options) {
  const auto started = std::chrono::steady_clock::now();
  const Manifest& m = bundle.manifest();
  BisectReport report;
  report.bundle = bundle.root().string();
  report.tool_version = options.tool_version;
  report.arch = m.model.arch;
  report.precision = m.precision.compute;
  report.steps_in_bundle = static_cast<int64_t>(bundle.steps().size());
  report.passes_per_step = m.data.world_size * m.data.grad_accum_steps;
  // The checks `run` makes that read no replay, through the same triage: the
  // shards' checksums, each step's recorded samples and token ids.
  report.findings = triage_bundle({bundle.tokens().verify_checksums(), nullptr});
  std::set<int64_t> marked_by_log;  // a non-finite loss or a skipped step in state.json
  for (const StepFiles& files : bundle.steps()) {
    const StepBatch batch = batch_of_step(bundle, files.step);
    const HostStepFindings host = triage_host_step({bundle, step_entry(m, files.step), batch, nullptr, {}});
    report.findings.insert(report.findings.end(), host.sampler.begin(), host.sampler.end());
    report.findings.insert(report.findings.end(), host.bad_tokens.begin(), host.bad_tokens.end());
    if (!unreplayable_reason(bundle, batch)) {
      report.full_probe_pass_replays += report.passes_per_step;
    }
    const StepState state = bundle.load_state(files);
    const std::optional<double> logged = state.logged.loss;
    if (logged && !std::isfinite(*logged)) report.logged_nonfinite_steps.push_back(files.step);
    if ((logged && !std::isfinite(*logged)) || state.skipped.value_or(false)) marked_by_log.insert(files.step);
  }

  Bisection bisection(bundle, options, report);
  if (const std::optional<int64_t> step = bisection.first_bad_step(marked_by_log)) {
    report.origin = bisection.locate_and_minimize(*step);
    // The run's own numbering of the sample, where the bundle records it (as `run` names it).
    if (const auto o = report.origin->sample >= 0 ? original_of_sample(m, report.origin->sample) : std::nullopt) {
      (o->is_offset ? report.origin->original_offset : report.origin->original_sample) = o->value;
    }
    for (int64_t sample : report.samples.minimal) {
      if (const auto o = original_of_sample(m, sample)) report.samples.minimal_in_run.push_back(*o);
    }
    if (report.samples.minimal_in_run.size() != report.samples.minimal.size()) report.samples.minimal_in_run.clear();
    report.origin_tokens = origin_tokens(bundle, *report.origin, bisection.origin_embedding(),
                                         default_thresholds(m.precision.compute));
    bisection.set_stage("checks", report.origin->step);
    check_update_into_origin(bundle, bisection.placement(), bisection.hook(), report);  // bisect_verdict.h
  } else if (needs_full_probe_pass(bundle)) {
    judge_as_run(bundle, options, report);  // a spike or logged site statistics: run's own pass decides
  } else {
    const std::vector<Finding> more = bisection.clean_window_findings();
    report.findings.insert(report.findings.end(), more.begin(), more.end());
  }
  settle_bisect_root_cause(report);
  if (!options.what_ifs.empty()) {
    bisection.set_stage("what-if", report.origin ? report.origin->step : 0);
    report.what_if = evaluate_what_ifs(bundle, report.origin, options.what_ifs, bisection.hook(),
                                       options.devices, options.native_low_precision, options.stream_scratch);
  }
  report.elapsed_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  return report;
}

}  // namespace nanreplay
