// The replay loop: for each step, load its checkpoint, check its batch, run
// every pass with probes, probe the parameter gradients, then decide which
// non-finite value (if any) came first. Steps are independent: each starts
// from its own checkpoint, so one step's failure never leaks into the next.
#include "replay/replay_engine.h"

#include <algorithm>
#include <chrono>
#include <climits>
#include <thread>
#include <tuple>

#include <torch/torch.h>

#include "loaders/error.h"
#include "replay/checkpoint.h"
#include "replay/gradients.h"
#include "replay/probe_session.h"

namespace nanreplay {

namespace {

constexpr size_t kMaxTokenFindingsPerStep = 20;

int layer_of_param(const std::string& name) {
  for (const std::string prefix : {"model.layers.", "transformer.h."}) {
    if (name.compare(0, prefix.size(), prefix) == 0) {
      return std::atoi(name.c_str() + prefix.size());
    }
  }
  return -1;
}

// Execution order key: (micro-batch, phase, site order, rank); parameter
// gradients come after every micro-batch.
std::tuple<int, int, int, int> execution_key(const ProbeRecord& r) {
  if (r.phase == Phase::kGrad) return {INT_MAX, 2, r.order, 0};
  return {r.micro_batch, static_cast<int>(r.phase), r.order, r.rank};
}

const ProbeRecord* earliest_nonfinite(const std::vector<ProbeRecord>& records,
                                      bool include_backward) {
  const ProbeRecord* best = nullptr;
  for (const ProbeRecord& record : records) {
    if (record.head != -1 || record.stats.all_finite()) continue;
    if (!include_backward && record.phase != Phase::kForward) continue;
    if (best == nullptr || execution_key(record) < execution_key(*best)) best = &record;
  }
  return best;
}

FirstNonfinite to_first(const ProbeRecord& record) {
  FirstNonfinite first;
  first.step = record.step;
  first.phase = record.phase;
  first.site = record.site;
  first.layer = record.layer;
  first.head = record.first_head;
  first.kind = record.stats.first_kind;
  first.rank = record.rank;
  first.micro_batch = record.micro_batch;
  first.sample = record.sample;
  first.position = record.position;
  first.index = record.first_index;
  first.shape = record.shape;
  return first;
}

// Out-of-range token ids in the step's batch: the step cannot be replayed.
std::vector<Finding> out_of_range_tokens(const Bundle& bundle, int64_t step,
                                         const StepBatch& batch) {
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
        Finding f;
        f.layer = TriageLayer::kData;
        f.code = "DATA_TOKEN_OUT_OF_RANGE";
        f.severity = Severity::kError;
        f.message = "token id " + std::to_string(token) + " >= vocab_size " +
                    std::to_string(m.model.vocab_size) + " in " +
                    bundle.tokens().spec(where.shard).path + " at offset " +
                    std::to_string(where.offset) + "; step " + std::to_string(step) +
                    " cannot be replayed";
        f.evidence = {{"shard", bundle.tokens().spec(where.shard).path},
                      {"offset", where.offset},
                      {"step", step},
                      {"rank", rank},
                      {"sample", sample},
                      {"position", pos},
                      {"token", token},
                      {"expected", m.model.vocab_size}};
        findings.push_back(std::move(f));
      }
    }
  }
  return findings;
}

void check_sampler_agreement(const Bundle& bundle, const StepEntry& entry,
                             std::vector<Finding>& findings) {
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
    Finding f;
    f.layer = TriageLayer::kData;
    f.code = "DATA_SAMPLER_MISMATCH";
    f.severity = Severity::kError;
    f.message = "step " + std::to_string(entry.step) + " rank " + std::to_string(rank) +
                ": the recorded samples disagree with randperm at batch position " +
                std::to_string(at) + " (recorded " + std::to_string(*diff.second) + ", randperm " +
                std::to_string(*diff.first) + "); replaying the recorded samples";
    f.evidence = {{"step", entry.step}, {"rank", rank}, {"index", {at}},
                  {"expected", *diff.first}, {"sample", *diff.second}};
    findings.push_back(std::move(f));
    return;
  }
}

const StepEntry& entry_for(const Manifest& m, int64_t step) {
  for (const StepEntry& entry : m.steps) {
    if (entry.step == step) return entry;
  }
  throw std::logic_error("no manifest entry for step " + std::to_string(step));
}

}  // namespace

ReplayReport replay_bundle(const Bundle& bundle, const ReplayOptions& options) {
  const auto started = std::chrono::steady_clock::now();
  const Manifest& m = bundle.manifest();
  if (m.precision.compute == Compute::kFp8) {
    throw InputError("manifest.json", "precision.compute",
                     "fp8 replay is not supported by this version of nanreplay");
  }
  ReplayReport report;
  report.bundle = bundle.root().string();
  report.tool_version = options.tool_version;
  report.arch = m.model.arch;
  report.precision = m.precision.compute;
  report.incident = m.incident;

  for (const ChecksumMismatch& bad : bundle.tokens().verify_checksums()) {
    Finding f;
    f.layer = TriageLayer::kSystem;
    f.code = "BUNDLE_CHECKSUM_MISMATCH";
    f.severity = Severity::kError;
    f.message = bad.shard + ": sha256 is " + bad.actual + ", the manifest says " + bad.expected;
    f.evidence = {{"shard", bad.shard}, {"expected", bad.expected}, {"after", bad.actual}};
    report.findings.push_back(std::move(f));
  }

  std::vector<const StepFiles*> todo;
  for (const StepFiles& files : bundle.steps()) {
    if (!options.only_steps || options.only_steps->count(files.step)) todo.push_back(&files);
  }

  std::optional<FirstNonfinite> first;
  for (size_t index = 0; index < todo.size(); ++index) {
    const StepFiles& files = *todo[index];
    const StepEntry& entry = entry_for(m, files.step);
    const StepState state = bundle.load_state(files);
    StepOutcome outcome;
    outcome.step = files.step;
    outcome.logged_loss = state.logged.loss;
    outcome.logged_grad_norm = state.logged.grad_norm;
    outcome.loss_scale = m.precision.compute == Compute::kFp16 ? state.loss_scale : 1.0;

    check_sampler_agreement(bundle, entry, report.findings);
    StepBatch batch{bundle.sampler().samples_for(entry)};
    std::vector<Finding> bad_tokens = out_of_range_tokens(bundle, files.step, batch);
    if (!bad_tokens.empty()) {
      outcome.replayed = false;
      outcome.finite = false;
      outcome.not_replayed_reason = "token id out of range in the batch";
      report.findings.insert(report.findings.end(), bad_tokens.begin(), bad_tokens.end());
      report.steps.push_back(outcome);
      continue;
    }

    ModelCheckpoint checkpoint(files, m.model);
    StepComputeOptions compute;
    compute.probes = options.probes;
    compute.loss_scale = outcome.loss_scale;
    compute.before_pass = [&](int rank, int micro) {
      if (options.should_stop && options.should_stop()) throw ReplayInterrupted{index};
      if (options.on_progress) {
        options.on_progress({index, todo.size(), files.step, rank, micro, "forward"});
      }
    };
    StepGradients step = compute_step_gradients(m, bundle.tokens(), files.step, batch,
                                                checkpoint.params(), checkpoint.order(), compute);
    if (options.probes) {
      for (size_t i = 0; i < step.grads.size(); ++i) {
        for (ProbeRecord& record : describe_tensor(step.grads[i], nullptr, {})) {
          record.step = files.step;
          record.phase = Phase::kGrad;
          record.order = static_cast<int>(i);
          record.site = checkpoint.order()[i];
          record.layer = layer_of_param(record.site);
          step.probes.push_back(std::move(record));
        }
      }
    }
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
    const bool grads_finite = std::isfinite(step.grad_norm);
    outcome.scaler_skipped = m.precision.compute == Compute::kFp16 && !grads_finite;
    const bool handled = outcome.scaler_skipped && forward_bad == nullptr && std::isfinite(step.loss);
    const ProbeRecord* bad = earliest_nonfinite(step.probes, true);
    if (handled && bad != nullptr) {
      Finding f;
      f.layer = TriageLayer::kNumeric;
      f.code = "NUMERIC_LOSS_SCALE_OVERFLOW";
      f.severity = Severity::kInfo;
      f.message = "step " + std::to_string(files.step) + ": the backward overflowed at " + bad->site +
                  " with loss scale " + std::to_string(outcome.loss_scale) +
                  "; the loss scaler skips this step and lowers the scale (handled, not the incident)";
      f.evidence = {{"step", files.step}, {"site", bad->site}, {"rank", bad->rank},
                    {"micro_batch", bad->micro_batch}, {"before", outcome.loss_scale},
                    {"after", outcome.loss_scale / 2}};
      report.findings.push_back(std::move(f));
    } else if (bad != nullptr && !first) {
      first = to_first(*bad);
    }
    if (state.skipped && m.precision.compute == Compute::kFp16 &&
        *state.skipped != outcome.scaler_skipped) {
      Finding f;
      f.layer = TriageLayer::kSystem;
      f.code = "SYSTEM_NOT_REPRODUCIBLE";
      f.severity = Severity::kWarning;
      f.message = "step " + std::to_string(files.step) + ": the job logged skipped=" +
                  (*state.skipped ? "true" : "false") + " but the replay's gradients say the scaler " +
                  (outcome.scaler_skipped ? "skips" : "does not skip") + " it";
      f.evidence = {{"step", files.step}, {"expected", *state.skipped},
                    {"after", outcome.scaler_skipped}};
      report.findings.push_back(std::move(f));
    }
    report.steps.push_back(outcome);
    report.probes.insert(report.probes.end(), std::make_move_iterator(step.probes.begin()),
                         std::make_move_iterator(step.probes.end()));
  }
  report.first_nonfinite = first;
  report.reproduced = first.has_value();
  report.elapsed_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  return report;
}

}  // namespace nanreplay

namespace nanreplay {
void set_compute_threads(int threads) {
  const int count = threads > 0 ? threads : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  torch::set_num_threads(count);
}
}  // namespace nanreplay
