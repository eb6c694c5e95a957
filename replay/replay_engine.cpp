// The replay loop and its triage: for each step, load its checkpoint, check
// its batch (data layer), run every pass with probes, probe the parameter
// gradients, decide which non-finite value came first (numeric layer), then
// compare with what the job logged and with the next checkpoint (system
// layer). Steps are independent: each starts from its own checkpoint.
#include "replay/replay_engine.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <set>
#include <thread>

#include <dlfcn.h>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include <torch/torch.h>
#include <torch/cuda.h>

#include "loaders/error.h"
#include "replay/checkpoint.h"
#include "replay/gradients.h"
#include "replay/origin_tokens.h"
#include "replay/probe_comparison.h"
#include "replay/probe_session.h"
#include "replay/step_replay.h"
#include "replay/system_checks.h"
#include "reports/number_text.h"
#include "reports/verdict.h"

namespace nanreplay {

using K = EvidenceKey;

namespace {

constexpr size_t kMaxTokenFindingsPerStep = 20;

const ProbeRecord* earliest_nonfinite(const std::vector<ProbeRecord>& records, bool include_backward) {
  const ProbeRecord* best = nullptr;
  for (const ProbeRecord& record : records) {
    if (record.head != -1 || record.stats.all_finite()) continue;
    if (!include_backward && record.phase != Phase::kForward) continue;
    if (best == nullptr || execution_key(record) < execution_key(*best)) best = &record;
  }
  return best;
}

// Out-of-range token ids in the step's batch: the step cannot be replayed.
std::vector<Finding> out_of_range_tokens(const Bundle& bundle, int64_t step, const StepBatch& batch) {
  const Manifest& m = bundle.manifest();
  const int64_t seq = m.data.seq_len;
  std::vector<Finding> findings;
  std::vector<int64_t> window(static_cast<size_t>(seq + 1));
  for (size_t rank = 0; rank < batch.samples.size(); ++rank) {
    for (int64_t sample : batch.samples[rank]) {
      bundle.tokens().read(sample * seq, seq + 1, window.data());
      for (int64_t pos = 0; pos <= seq; ++pos) {
        const int64_t token = window[static_cast<size_t>(pos)];
        if (token < m.model.vocab_size) continue;
        if (findings.size() == kMaxTokenFindingsPerStep) return findings;
        const ShardLocation where = bundle.tokens().locate(sample * seq + pos);
        const std::string& shard = bundle.tokens().spec(where.shard).path;
        findings.push_back(make_finding(FindingCode::kDataTokenOutOfRange, Severity::kError,
            "token id " + std::to_string(token) + " >= vocab_size " + std::to_string(m.model.vocab_size) +
                " in " + shard + " at offset " + std::to_string(where.offset) + " (sample " +
                std::to_string(sample) + ", position " + std::to_string(pos) + "); step " +
                std::to_string(step) + " cannot be replayed",
            {{K::kShard, shard}, {K::kOffset, where.offset}, {K::kStep, step}, {K::kRank, rank},
             {K::kSample, sample}, {K::kPosition, pos}, {K::kToken, token}, {K::kExpected, m.model.vocab_size}}));
      }
    }
  }
  return findings;
}

// Out-of-range ids that no replayed batch reads (those are reported per step,
// above). report-v1 makes every out-of-range id a finding, wherever it lies:
// a shard holding one is poisoned even where this window does not read it.
std::vector<Finding> stray_out_of_range_tokens(const Bundle& bundle, const std::set<int64_t>& batch_samples) {
  const Manifest& m = bundle.manifest();
  const int64_t seq = m.data.seq_len;
  // Listed beyond the cap, so that ids inside batches (already reported) do
  // not crowd out the stray ones.
  const OutOfRangeTokens found =
      find_out_of_range_tokens(bundle.tokens(), m.model.vocab_size, 4 * kMaxTokenFindingsPerStep);
  std::vector<Finding> findings;
  for (const OutOfRangeToken& t : found.listed) {
    if (findings.size() == kMaxTokenFindingsPerStep) break;
    const int64_t global = bundle.tokens().global_index({t.shard, t.offset});
    // Sample i holds tokens [i*seq, i*seq + seq]: the one starting at or
    // before the token, and the previous one when the token is its last target.
    const int64_t sample = global / seq;
    const bool read = batch_samples.count(sample) || (global % seq == 0 && batch_samples.count(sample - 1));
    if (read) continue;
    const std::string& shard = bundle.tokens().spec(t.shard).path;
    Evidence evidence = {{K::kShard, shard}, {K::kOffset, t.offset}, {K::kToken, t.token},
                         {K::kExpected, m.model.vocab_size}};
    if (sample < bundle.num_samples()) {
      evidence.set(K::kSample, sample);
      evidence.set(K::kPosition, global % seq);
    }
    findings.push_back(make_finding(FindingCode::kDataTokenOutOfRange, Severity::kError,
        "token id " + std::to_string(t.token) + " >= vocab_size " + std::to_string(m.model.vocab_size) + " in " +
            shard + " at offset " + std::to_string(t.offset) +
            (sample < bundle.num_samples() ? " (sample " + std::to_string(sample) + ")" : std::string()) +
            ", which no replayed step reads (" + std::to_string(found.count) +
            " out-of-range ids in the shards in all)",
        std::move(evidence)));
  }
  return findings;
}

void check_sampler_agreement(const Bundle& bundle, const StepEntry& entry, std::vector<Finding>& findings) {
  const Manifest& m = bundle.manifest();
  if (m.data.sampler.kind != SamplerSpec::Kind::kRandperm || !entry.samples) return;
  const auto computed = bundle.sampler().randperm_samples(entry.step);
  const auto recorded = bundle.sampler().explicit_samples(entry);
  if (!recorded || *recorded == computed) return;
  for (size_t rank = 0; rank < computed.size(); ++rank) {
    const auto& a = computed[rank];
    const auto& b = (*recorded)[rank];
    auto diff = std::mismatch(a.begin(), a.end(), b.begin(), b.end());
    if (diff.first == a.end()) continue;
    const auto at = static_cast<int64_t>(diff.first - a.begin());
    findings.push_back(make_finding(FindingCode::kDataSamplerMismatch, Severity::kError,
        "step " + std::to_string(entry.step) + " rank " + std::to_string(rank) +
            ": the recorded samples disagree with randperm at batch position " + std::to_string(at) +
            " (recorded " + std::to_string(*diff.second) + ", randperm " + std::to_string(*diff.first) +
            "); replaying the recorded samples",
        {{K::kStep, entry.step}, {K::kRank, rank}, {K::kIndex, {at}}, {K::kExpected, *diff.first},
         {K::kSample, *diff.second}}));
    return;
  }
}

const StepEntry& entry_for(const Manifest& m, int64_t step) {
  for (const StepEntry& entry : m.steps) {
    if (entry.step == step) return entry;
  }
  throw std::logic_error("no manifest entry for step " + std::to_string(step));
}

const StepFiles* files_for(const Bundle& bundle, int64_t step) {
  for (const StepFiles& files : bundle.steps()) {
    if (files.step == step) return &files;
  }
  return nullptr;
}

double loss_scale_for(const Manifest& m, const StepState& state) {
  return m.precision.compute == Compute::kFp16 ? state.loss_scale : 1.0;
}

// Where a compact capture recorded the run's own sample indices (or token
// offsets), the report names them beside the bundle's.
void annotate_original_samples(ReplayReport& report, const Manifest& m) {
  auto original = [&](int64_t sample) { return sample >= 0 ? original_of_sample(m, sample) : std::nullopt; };
  if (report.first_nonfinite) {
    if (const auto o = original(report.first_nonfinite->sample)) {
      (o->is_offset ? report.first_nonfinite->original_offset : report.first_nonfinite->original_sample) = o->value;
    }
  }
  for (Finding& f : report.findings) {
    const std::optional<int64_t> sample = f.evidence.integer(K::kSample);
    if (!sample) continue;
    if (const auto o = original(*sample)) f.evidence.set(o->is_offset ? K::kOriginalOffset : K::kOriginalSample, o->value);
  }
}

// glibc keeps freed heap memory for reuse, and the activations and gradients
// of one step, freed in a different order than allocated, fragment its heap:
// without handing the free pages back, the resident set creeps up step after
// step. Called between steps, so a 10-step replay peaks where one step does.
void return_freed_memory() {
#if defined(__GLIBC__)
  malloc_trim(0);
#endif
}

// Replays `files.step` with every probe on `placement` (probes of all phases).
StepGradients replay_step_again(const Bundle& bundle, const StepFiles& files, const ComputePlacement& placement) {
  const StepState state = bundle.load_state(files);
  const StepBatch batch{bundle.sampler().samples_for(entry_for(bundle.manifest(), files.step))};
  ModelCheckpoint checkpoint(files, bundle.manifest().model);
  return replay_step(bundle, files, state, batch, checkpoint, true, {}, placement);
}

std::vector<const ProbeRecord*> probes_of_step(const std::vector<ProbeRecord>& all, int64_t step) {
  std::vector<const ProbeRecord*> out;
  for (const ProbeRecord& r : all) {
    if (r.step == step) out.push_back(&r);
  }
  return out;
}

// Replays `step` again and compares every probe with the first replay, bit for bit.
DeterminismCheck check_determinism(const Bundle& bundle, const StepFiles& files,
                                   const std::vector<ProbeRecord>& first_run, const ComputePlacement& placement) {
  DeterminismCheck check;
  check.checked = true;
  check.step = files.step;
  const StepGradients again = replay_step_again(bundle, files, placement);
  const ProbeComparison cmp = compare_probes(probes_of_step(first_run, files.step), again.probes);
  check.probes_compared = cmp.compared;
  check.identical = cmp.difference.empty();
  check.first_difference = cmp.difference;
  check.where = cmp.where();
  return check;
}

// The step on the second device, compared with the first device's replay.
CrossDeviceCheck check_across_devices(const Bundle& bundle, const StepFiles& files,
                                      const std::vector<ProbeRecord>& first_run, const ComputePlacement& second,
                                      const std::string& name_a, const std::string& name_b) {
  CrossDeviceCheck check;
  check.device_a = name_a;
  check.device_b = name_b;
  check.step = files.step;
  const StepGradients again = replay_step_again(bundle, files, second);
  const ProbeComparison cmp = compare_probes(probes_of_step(first_run, files.step), again.probes);
  check.probes_compared = cmp.compared;
  check.identical = cmp.difference.empty();
  check.first_difference = cmp.difference;
  check.where = cmp.where();
  if (cmp.a != nullptr) {
    check.max_abs_a = cmp.a->stats.max_abs;
    check.max_abs_b = cmp.b->stats.max_abs;
    check.sum_a = cmp.a->stats.sum;
    check.sum_b = cmp.b->stats.sum;
  }
  return check;
}

}  // namespace

ReplayReport replay_bundle(const Bundle& bundle, const ReplayOptions& options) {
  const auto started = std::chrono::steady_clock::now();
  const Manifest& m = bundle.manifest();
  const TriageThresholds thresholds = options.thresholds.value_or(default_thresholds(m.precision.compute));
  ReplayReport report;
  report.bundle = bundle.root().string();
  report.tool_version = options.tool_version;
  report.arch = m.model.arch;
  report.precision = m.precision.compute;
  report.incident = m.incident;
  validate_devices(options.devices, options.cross_check);
  // With --cross-check the replay runs on the first device; the second
  // replays the step of interest again for the comparison.
  const ComputePlacement placement =
      placement_for(options.cross_check ? std::vector<std::string>{options.devices.front()} : options.devices,
                    options.native_low_precision, m.precision.compute);
  report.devices = options.devices;
  report.low_precision = m.precision.compute == Compute::kFp32  ? "fp32"
                         : m.precision.compute == Compute::kFp8 ? "fp8"
                         : placement.native_low_precision       ? "native"
                                                                : "emulated";

  for (const ChecksumMismatch& bad : bundle.tokens().verify_checksums()) {
    report.findings.push_back(make_finding(FindingCode::kBundleChecksumMismatch, Severity::kError,
        bad.shard + ": sha256 is " + bad.actual + ", the manifest says " + bad.expected,
        {{K::kShard, bad.shard}, {K::kExpected, bad.expected}, {K::kAfter, bad.actual}}));
  }
  const std::vector<Finding> contaminated = checkpoint_nonfinite_findings(bundle);
  report.findings.insert(report.findings.end(), contaminated.begin(), contaminated.end());
  const DataBaseline baseline = data_baseline(bundle.tokens(), m.data.seq_len, thresholds.data.baseline_samples);

  std::vector<const StepFiles*> todo;
  for (const StepFiles& files : bundle.steps()) {
    if (!options.only_steps || options.only_steps->count(files.step)) todo.push_back(&files);
  }

  std::optional<FirstNonfinite> first;
  std::vector<StepState> states;
  std::set<int64_t> batch_samples;  // every sample a replayed step's batch holds
  for (size_t index = 0; index < todo.size(); ++index) {
    const StepFiles& files = *todo[index];
    const StepEntry& entry = entry_for(m, files.step);
    const StepState state = bundle.load_state(files);
    states.push_back(state);
    StepOutcome outcome;
    outcome.step = files.step;
    outcome.logged_loss = state.logged.loss;
    outcome.logged_grad_norm = state.logged.grad_norm;
    outcome.loss_scale = loss_scale_for(m, state);

    check_sampler_agreement(bundle, entry, report.findings);
    const StepBatch batch{bundle.sampler().samples_for(entry)};
    for (const auto& rank_samples : batch.samples) batch_samples.insert(rank_samples.begin(), rank_samples.end());
    std::vector<Finding> bad_tokens = out_of_range_tokens(bundle, files.step, batch);
    if (!bad_tokens.empty()) {
      outcome.replayed = false;
      outcome.finite = false;
      outcome.not_replayed_reason = "token id out of range in the batch";
      report.findings.insert(report.findings.end(), bad_tokens.begin(), bad_tokens.end());
      report.steps.push_back(outcome);
      continue;
    }
    std::vector<SampleProfile> profiles;
    for (const auto& rank_samples : batch.samples) {
      for (int64_t sample : rank_samples) profiles.push_back(profile_sample(bundle.tokens(), sample, m.data.seq_len));
    }
    const auto data_findings =
        sample_profile_findings(profiles, baseline, files.step, m.data.seq_len, thresholds.data);
    report.findings.insert(report.findings.end(), data_findings.begin(), data_findings.end());

    ModelCheckpoint checkpoint(files, m.model);
    StepGradients step = replay_step(bundle, files, state, batch, checkpoint, options.probes, [&](int rank, int micro, const char* phase) {
      if (options.should_stop && options.should_stop()) throw ReplayInterrupted{index};
      if (options.on_progress) options.on_progress({index, todo.size(), files.step, rank, micro, phase});
    }, placement);
    outcome.replayed = true;
    outcome.loss = step.loss;
    outcome.grad_norm = step.grad_norm;
    outcome.rank_losses = step.rank_losses;
    outcome.rank_grad_norms = step.rank_grad_norms;
    const bool probes_finite = std::all_of(step.probes.begin(), step.probes.end(),
                                           [](const ProbeRecord& r) { return r.stats.all_finite(); });
    outcome.finite = std::isfinite(step.loss) && std::isfinite(step.grad_norm) && probes_finite;

    // fp16: GradScaler skips a step whose gradients hold a non-finite value.
    // Overflow confined to the backward of such a step is handled, not the incident.
    const ProbeRecord* forward_bad = earliest_nonfinite(step.probes, false);
    outcome.scaler_skipped = m.precision.compute == Compute::kFp16 && !std::isfinite(step.grad_norm);
    const bool handled = outcome.scaler_skipped && forward_bad == nullptr && std::isfinite(step.loss);
    outcome.handled_overflow = handled;
    const ProbeRecord* bad = earliest_nonfinite(step.probes, true);
    if (handled && bad != nullptr) {
      report.findings.push_back(make_finding(FindingCode::kNumericLossScaleOverflow, Severity::kInfo,
          "step " + std::to_string(files.step) + ": the backward overflowed at " + bad->site +
              " with loss scale " + format_number(outcome.loss_scale) +
              "; the loss scaler skips this step and halves the scale (handled, not the incident)",
          {{K::kStep, files.step}, {K::kSite, bad->site}, {K::kHead, optional_index_value(bad->first_head)},
           {K::kRank, bad->rank}, {K::kMicroBatch, bad->micro_batch},
           {K::kBefore, outcome.loss_scale}, {K::kAfter, outcome.loss_scale / 2}}));
    } else if (bad != nullptr && !first) {
      first = first_nonfinite_of(*bad);
      for (const Finding& f : contaminated) {
        const std::vector<int64_t>* steps = f.evidence.integers(K::kSteps);
        const bool holds = steps != nullptr && std::find(steps->begin(), steps->end(), files.step) != steps->end();
        if (holds && f.evidence.text(K::kTensor) == "parameter") {
          first->contaminated_params.push_back(f.evidence.text(K::kParam).value_or(""));
        }
      }
      report.propagation = propagation_after(step.probes, *bad);
    }
    auto add = [&](std::vector<Finding> more) {
      report.findings.insert(report.findings.end(), more.begin(), more.end());
    };
    add(overflow_findings(step.probes, files.step, handled, m.precision.compute, thresholds));
    add(zero_norm_findings(step.norm_checks));
    add(sample_loss_findings(step.sample_losses, files.step, thresholds));
    add(rank_mismatch_findings(outcome, state, thresholds));
    if (state.skipped && m.precision.compute == Compute::kFp16 && *state.skipped != outcome.scaler_skipped) {
      report.findings.push_back(make_finding(FindingCode::kSystemNotReproducible, Severity::kWarning,
          "step " + std::to_string(files.step) + ": the job logged skipped=" + (*state.skipped ? "true" : "false") +
              " but the replay's gradients say the scaler " + (outcome.scaler_skipped ? "skips" : "does not skip") + " it",
          {{K::kStep, files.step}, {K::kExpected, outcome.scaler_skipped}, {K::kAfter, *state.skipped}}));
    }

    // System layer: does the next checkpoint follow from this one by AdamW?
    const StepFiles* next = files_for(bundle, files.step + 1);
    const bool predictable = std::isfinite(step.grad_norm) || outcome.scaler_skipped;
    if (options.check_updates && next != nullptr && m.optimizer && state.lr && predictable &&
        bundle.has_optimizer(files)) {
      add(update_findings(bundle, {&files, next, &checkpoint, &step, *state.lr, outcome.scaler_skipped}));
    }
    report.steps.push_back(outcome);
    report.probes.insert(report.probes.end(), std::make_move_iterator(step.probes.begin()),
                         std::make_move_iterator(step.probes.end()));
    step = StepGradients{};
    return_freed_memory();
  }

  const std::vector<Finding> stray_tokens = stray_out_of_range_tokens(bundle, batch_samples);
  report.findings.insert(report.findings.end(), stray_tokens.begin(), stray_tokens.end());
  const std::vector<Finding> fp8_jumps = fp8_scale_jump_findings(states, thresholds);
  report.findings.insert(report.findings.end(), fp8_jumps.begin(), fp8_jumps.end());
  if (first) {
    report.origin_tokens = origin_tokens(bundle, *first, thresholds);
    if (first->sample >= 0 && first->sample < bundle.num_samples()) {
      report.offending_tokens = bundle.tokens().sample_tokens(first->sample, m.data.seq_len);
      report.offending_tokens_start = first->sample * m.data.seq_len;
    }
  }
  report.first_nonfinite = first;
  report.reproduced = first.has_value();

  if (options.check_determinism && options.probes && !report.steps.empty()) {
    const int64_t step = first ? first->step : report.steps.back().step;
    const StepFiles* files = files_for(bundle, step);
    const bool replayed = std::any_of(report.steps.begin(), report.steps.end(),
                                      [&](const StepOutcome& s) { return s.step == step && s.replayed; });
    if (files != nullptr && replayed) {
      report.determinism = check_determinism(bundle, *files, report.probes, placement);
      if (!report.determinism.identical) {
        report.findings.push_back(make_finding(FindingCode::kSystemNondeterministic, Severity::kWarning,
            "replaying step " + std::to_string(step) + " twice on this machine gave different values at " +
                report.determinism.first_difference,
            difference_evidence(step, report.determinism.where)));
      }
    }
  }
  if (options.cross_check && options.probes && !report.steps.empty()) {
    const int64_t step = first ? first->step : report.steps.back().step;
    const StepFiles* files = files_for(bundle, step);
    const bool replayed = std::any_of(report.steps.begin(), report.steps.end(),
                                      [&](const StepOutcome& s) { return s.step == step && s.replayed; });
    if (files != nullptr && replayed) {
      const ComputePlacement second =
          placement_for({options.devices.back()}, options.native_low_precision, m.precision.compute);
      report.cross_check = check_across_devices(bundle, *files, report.probes, second,
                                                options.devices.front(), options.devices.back());
      const CrossDeviceCheck& c = *report.cross_check;
      if (!c.identical) {
        report.findings.push_back(make_finding(FindingCode::kSystemDeviceMismatch, Severity::kError,
            "step " + std::to_string(step) + " replayed on " + c.device_a + " and " + c.device_b +
                " from the same inputs differs first at " + c.first_difference + " (rank " +
                std::to_string(c.where.rank) + ", micro-batch " + std::to_string(c.where.micro_batch) +
                "): one of the two devices computes wrongly",
            difference_evidence(step, c.where).set(K::kBefore, c.max_abs_a).set(K::kAfter, c.max_abs_b)));
      }
    }
  }
  settle_verdict(report, thresholds);
  annotate_original_samples(report, m);
  report.elapsed_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  return report;
}

void validate_devices(const std::vector<std::string>& names, bool cross_check) {
  if (names.empty() || names.size() > 2) {
    throw UsageError("--device takes one device or two separated by a comma (cpu, cuda:0, cuda:0,cuda:1)");
  }
  const std::vector<torch::Device> devices = placement_for(names, false, Compute::kFp32).devices;
  if (cross_check && (devices.size() != 2 || devices[0].type() != devices[1].type())) {
    throw UsageError("--cross-check needs two devices of the same kind (--device cuda:0,cuda:1): "
                     "different kinds of device compute with different kernels by design");
  }
  for (size_t i = 0; i < devices.size(); ++i) {
    if (!devices[i].is_cuda()) continue;
    if (!torch::cuda::is_available()) {
#ifdef NANREPLAY_TORCH_CUDA
      throw UsageError("--device " + names[i] + ": no CUDA device is available on this machine");
#else
      throw UsageError("--device " + names[i] + ": this nanreplay was built against a LibTorch without "
                       "CUDA; rebuild against a CUDA LibTorch (docs/gpu.md) or use --device cpu");
#endif
    }
    if (devices[i].index() >= static_cast<int>(torch::cuda::device_count())) {
      throw UsageError("--device " + names[i] + ": only " + std::to_string(torch::cuda::device_count()) +
                       " CUDA device(s) visible");
    }
  }
}

void tune_heap_for_replay() {
#if defined(__GLIBC__)
  // glibc's own ceiling for its adaptive mmap threshold (DEFAULT_MMAP_THRESHOLD_MAX
  // on 64-bit), and the trim threshold it pairs with it (twice as much).
  constexpr int kMmapThreshold = 32 << 20;
  mallopt(M_MMAP_THRESHOLD, kMmapThreshold);
  mallopt(M_TRIM_THRESHOLD, 2 * kMmapThreshold);
#endif
}

void set_compute_threads(int threads) {
  const int count = threads > 0 ? threads : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  torch::set_num_threads(count);
  // LibTorch's count does not reach a BLAS with its own thread pool, which
  // would still use every core: cap it as well.
  using SetBlasThreads = void (*)(int);
  if (const auto set_blas_threads =
          reinterpret_cast<SetBlasThreads>(dlsym(RTLD_DEFAULT, "openblas_set_num_threads"))) {
    set_blas_threads(count);
  }
}

bool blas_has_own_thread_pool() {
  // Looked up at run time, so a LibTorch on another BLAS links as before.
  // OpenBLAS reports its threading model: 0 sequential, 1 pthreads, 2 OpenMP.
  using GetParallel = int (*)();
  const auto get_parallel = reinterpret_cast<GetParallel>(dlsym(RTLD_DEFAULT, "openblas_get_parallel"));
  return get_parallel != nullptr && get_parallel() == 1;
}

}  // namespace nanreplay
