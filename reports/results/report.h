// The outcome of a replay as plain data (report-v1), and its JSON rendering.
// The library computes a ReplayReport; the edges render it as JSON, the HDF5
// trace, or terminal text. Non-finite numbers render as "nan"/"inf"/"-inf".
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "kernels/tensor_stats.h"
#include "loaders/bundle/manifest.h"
#include "probes/probe_record.h"
#include "reports/results/counterfactual.h"
#include "reports/results/finding.h"
#include "reports/results/spike.h"
#include "reports/results/timings.h"
#include "reports/results/update_stats.h"

namespace nanreplay {


struct FirstNonfinite {
  int64_t step = 0;
  Phase phase = Phase::kForward;
  SiteRef site;        // forward / backward
  std::string param;   // phase grad: the parameter's key
  int layer = -1;
  int head = -1;
  int expert = -1;     // per-expert sites (a mixture of experts)
  NonfiniteKind kind = NonfiniteKind::kNan;
  int rank = -1;
  int micro_batch = -1;
  int64_t sample = -1;
  int64_t position = -1;
  std::vector<int64_t> index;  // coordinates of the element in the site's layout
  std::vector<int64_t> shape;
  // Parameters already non-finite in this step's checkpoint: the site only
  // propagates them, the checkpoint is where the values came from.
  std::vector<std::string> contaminated_params;
  int64_t token = -1;  // the input token id at (sample, position), -1: none
  // What a compact capture recorded for `sample`: the run's own dataset
  // index, or its token offset (docs/bundle-format.md, original_samples).
  std::optional<int64_t> original_sample;
  std::optional<int64_t> original_offset;
  // Where the site's non-finite elements lie (probes/damage_shape.h); null: not taken.
  std::shared_ptr<const DamageShape> damage;
  // What the mask did to the origin's row of attention scores (probes/masked_score.h); null: none.
  std::shared_ptr<const MaskedScore> masked_score;

  std::string name() const { return probe_name(phase, site, param); }  // "layers.2.attn.scores"
};

// " (run's sample 46)" or " (run's token offset 1024)" where the bundle
// records the run's own numbering of the origin's sample, else `otherwise`.
std::string run_numbering_note(const FirstNonfinite& f, const std::string& otherwise = "");

// How many sites of the propagation a report lists before "first N of M".
constexpr size_t kPropagationShown = 10;

// A token of the origin's sample, and how its embedding row compares with
// the embedding matrix's own rows (the origin step's checkpoint).
struct OriginToken {
  int64_t token = -1;
  int64_t position = -1;   // in the sample
  double norm = 0.0;       // 2-norm of its embedding row
  double typical_norm = 0.0;  // median row norm of the matrix
  double norm_spread = 0.0;   // median absolute deviation of the row norms
  bool outlier = false;
};

// Whether the healthy steps replay to what the job logged (losses, gradient
// norms) within the precision's tolerance: a replay proves it replays the
// run before its verdict means anything.
struct ReproductionCheck {
  int64_t checked_steps = 0;   // replayed and logged finite
  int64_t matching_steps = 0;
  double tolerance = 0.0;      // relative
  double max_gap = 0.0;        // largest relative gap seen
  std::optional<bool> reproduces;  // none: nothing to compare
  // Rolling forward: the derived steps against the logged losses, with the
  // looser trajectory tolerance (docs/triage.md). Empty without derived steps.
  struct Trajectory {
    int64_t checked_steps = 0;
    double tolerance = 0.0;
    double max_gap = 0.0;
    std::optional<int64_t> diverged_at;  // the first derived step beyond the tolerance
  };
  std::optional<Trajectory> trajectory;
};

// The first non-finite value a probe record holds, as the report names it.
FirstNonfinite first_nonfinite_of(const ProbeRecord& record);

// One what-if replay (docs/bisect-and-what-if.md): the step where the
// unmodified replay first went non-finite, replayed with one modification.
struct WhatIfOutcome {
  std::string what_if;           // as the user wrote it, e.g. "fp32-layers=2,3"
  std::string change;            // what the replay changed, for people
  std::optional<int64_t> step;   // the step replayed; none when nothing was non-finite
  std::optional<FirstNonfinite> before;
  std::optional<FirstNonfinite> after;  // none: the step is finite with the change
  std::optional<bool> resolved;  // none when there was nothing to resolve
  std::optional<double> loss_after;
  bool scaler_skipped = false;   // fp16: the loss scaler would still skip the step
  int64_t replays = 0;           // passes this what-if took
};

// A non-finite site after the origin, in execution order: how it spread.
struct PropagationEntry {
  Phase phase = Phase::kForward;
  SiteRef site;
  std::string param;  // phase grad
  int layer = -1;
  int head = -1;
  NonfiniteKind kind = NonfiniteKind::kNan;
  int64_t nan_count = 0;
  int64_t inf_count = 0;
  int expert = -1;  // per-expert sites: the expert of the first non-finite element

  std::string name() const { return probe_name(phase, site, param); }
};

struct RootCause {
  TriageLayer layer = TriageLayer::kNumeric;
  std::optional<FindingCode> code;  // the finding it rests on; none: "NONFINITE" with an origin, else "NONE"
  std::string summary;              // one sentence for a person
};
// The root cause's code as report.json writes it.
std::string root_cause_code(const RootCause& cause, bool reproduced);

// The first probe on which two replays of one step disagree.
struct ProbeDifference {
  std::string phase;  // "forward", "backward", "grad"; empty when the probe counts differed
  std::string site;   // a site name as everywhere else ("layers.1.attn.scores")
  int rank = -1, micro_batch = -1, head = -1, expert = -1;
};

// One step replayed a second time, every probe compared bit for bit with the first replay.
struct ReplayComparison {
  int64_t step = 0;
  bool identical = true;
  int64_t probes_compared = 0;
  std::string first_difference;  // "<phase> <site>" of the first probe that differed, if any
  ProbeDifference where;
};

// The same step replayed twice on this machine must give bitwise identical probes.
// It replays what decides the verdict: the micro-batch (rank, micro_batch)
// that holds the origin, or the last step's first one when there is none;
// the whole step only when the origin is a parameter gradient (which every
// micro-batch feeds).
struct DeterminismCheck : ReplayComparison {
  bool checked = false;
  bool whole_step = false;
  int rank = -1, micro_batch = -1;  // with !whole_step
};

// "step 101, rank 0 micro-batch 1" or "step 101 (every micro-batch)": what
// the determinism check replayed, for every rendering.
std::string determinism_scope(const DeterminismCheck& check);

// --cross-check: the step replayed on a second device.
struct CrossDeviceCheck : ReplayComparison {
  std::string device_a, device_b;
  double max_abs_a = 0.0, max_abs_b = 0.0, sum_a = 0.0, sum_b = 0.0;
};

// One step's probes in three numbers, for the compact strip of report.html
// and for scripts: the largest finite |x| forward and backward over every
// whole-tensor site, and how many site records hold a non-finite value.
struct ProbeSummary {
  bool probed = false;
  double forward_max_abs = 0.0;
  double backward_max_abs = 0.0;
  int64_t nonfinite_records = 0;
};
ProbeSummary summarize_probes(const std::vector<ProbeRecord>& step_records);


// One expert's largest activations over a step's rows routed to it
// (replay/arch/expert_activation_max.h); rows 0: nothing routed to it.
struct ExpertActivationMax {
  double input = 0.0;   // max |x| of the rows entering the expert (Llama 4: after the routing weight scales them)
  double output = 0.0;  // max |x| of its down projection's output, before the routing weight
  int64_t rows = 0;
};

// The correction bias a step's router added to its scores to choose experts (DeepSeek-V3's
// e_score_correction_bias; steps[].router_score_bias), by layer with experts.
struct RouterScoreBias {
  std::map<int, std::vector<double>> by_layer;
  bool derived = false;  // by model.moe.score_bias_update from the step before; else state.json's
  // A rolled-forward step that logs its bias too: max |derived - logged| over every layer and expert
  // (the logged one is replayed); none otherwise.
  std::optional<double> derived_gap;
};

struct StepOutcome {
  int64_t step = 0;
  bool replayed = false;
  std::string not_replayed_reason;
  double loss = 0.0;
  std::optional<double> logged_loss;
  double grad_norm = 0.0;
  std::optional<double> logged_grad_norm;
  bool finite = true;
  bool derived = false;  // parameters from the tool's own update of the step before, not a checkpoint
  bool scaler_skipped = false;  // fp16: the loss scaler would skip this step
  // fp16: only the backward overflowed and the scaler skips the step: handled, not the incident.
  bool handled_overflow = false;
  double loss_scale = 1.0;
  std::vector<double> rank_losses;
  std::vector<std::vector<double>> micro_batch_losses;  // [rank][micro-batch], replayed; not in report.json
  std::vector<double> rank_grad_norms;
  // The job logged the global norm (what clip_grad_norm_ returns on every
  // rank) as each rank's: its rank_grad_norms say nothing about the ranks.
  bool rank_norms_logged_global = false;
  ProbeSummary probe_summary;
  // A mixture of experts: [layer][expert] tokens routed over every rank and
  // micro-batch (reports/triage/numeric/expert_load.h); empty for a dense model.
  std::vector<std::vector<int64_t>> expert_tokens;
  // [layer][query head]: the largest scaled pre-softmax logit over every
  // pass (steps[].attn_logit_max); empty when not recorded.
  std::vector<std::vector<double>> attn_logit_max;
  // [layer]: per expert, max |x| of its input and of its down projection's
  // output (steps[].expert_activation_max); none for a layer without experts;
  // empty for a dense model.
  std::vector<std::optional<std::vector<ExpertActivationMax>>> expert_activation_max;
  // [layer][expert]: the largest raw router logit (before the softmax or sigmoid) over every pass
  // (steps[].router_logit_max); -inf for a layer without experts; empty when not recorded.
  std::vector<std::vector<double>> router_logit_max;
  // A router that adds a correction bias (steps[].router_score_bias); none otherwise.
  std::optional<RouterScoreBias> router_score_bias;
  // model.mtp: each depth's mean cross-entropy over the step's passes, unscaled (steps[].mtp_loss); empty without.
  std::vector<double> mtp_losses;
};

// One term the replayed loss adds to the cross-entropy (report.json's
// loss_terms, reports/triage/loss_terms_note.h).
struct LossTerm {
  std::string term;          // router_aux_loss, router_z_loss, mtp_loss
  double coefficient = 0.0;  // 0: the run added no such term, as the bundle says
  bool in_logged_loss = true;  // mtp_loss: in the gradients only, as Megatron-LM logs its loss
  std::string source;        // where the bundle's writer found the coefficient
};

// Multi-token prediction (report.json's multi_token_prediction): replayed in
// the gradients (manifest model.mtp), or left out by the bundle's writer
// (provenance "model.mtp" without model.mtp): then a likely cause beside a
// verdict that the replay does not reproduce the run.
struct MtpSummary {
  bool replayed = false;
  int64_t num_layers = 0;   // replayed only
  double loss_scale = 0.0;  // replayed only
  std::string detail;       // the provenance entry's words, when the writer gave them
};

struct ReplayReport {
  std::string bundle;
  std::string tool_version;
  Arch arch = Arch::kLlama;
  int64_t moe_top_k = 0;  // a mixture of experts' top_k (0: dense): what steps[].expert_tokens' shares divide by
  Compute precision = Compute::kFp32;
  std::optional<IncidentInfo> incident;
  std::optional<MinimizedFrom> minimized;  // the bundle was written by `nanreplay minimize` from this one
  std::vector<ValueSource> defaulted;      // manifest provenance entries "from": "default"
  std::optional<MtpSummary> mtp;           // none: no multi-token prediction layers, as far as the bundle says
  std::vector<LossTerm> loss_terms;        // empty: the cross-entropy alone
  bool reproduced = false;
  std::optional<FirstNonfinite> first_nonfinite;
  std::vector<StepOutcome> steps;
  std::vector<Finding> findings;
  std::vector<PropagationEntry> propagation;  // after first_nonfinite, same step/micro-batch/rank
  std::optional<RootCause> root_cause;
  DeterminismCheck determinism;
  // Where the replay ran ("cpu", "cuda:0", or two devices for a split model)
  // and how bf16/fp16 were computed: "emulated" (rounding fp32, the CPU way)
  // or "native" (the low type on the device); "fp32"/"fp8" otherwise.
  std::vector<std::string> devices{"cpu"};
  std::string low_precision = "emulated";
  std::optional<CrossDeviceCheck> cross_check;
  // Every probe, or with ReplayOptions::on_step_probes those of the steps that matter.
  std::vector<ProbeRecord> probes;
  // The token ids of first_nonfinite's sample (seq_len + 1 of them, the first
  // at global token index offending_tokens_start), for the HTML token window.
  // Empty when the origin names no sample.
  std::vector<int64_t> offending_tokens;
  int64_t offending_tokens_start = -1;
  // The token at the origin's position, then every token of its sample up to
  // there whose embedding row is an outlier. Empty when the origin names no sample.
  std::vector<OriginToken> origin_tokens;
  ReproductionCheck reproduction;
  double elapsed_seconds = 0.0;
  PhaseTimings timings;
  // A spike incident (docs/spikes.md); none for any other bundle.
  std::optional<SpikeReport> spike;
  // A spike incident: the spike step's and the previous step's batches crossed with their weights.
  std::optional<Counterfactuals> counterfactuals;
  // A spike incident: per head the largest query-key logit, per expert the
  // largest activation, step by step up to the spike (window_outliers.h).
  std::optional<WindowOutliers> window_outliers;
  // `run --what-if`: one outcome per what-if, in the order given.
  std::optional<std::vector<WhatIfOutcome>> what_if;
  // Each update's statistics per tensor (derived, or between checkpoints), in step order (update_stats.h).
  std::vector<StepUpdateStats> update_stats;
  // Passes replayed (one forward and backward of one micro-batch, as bisect counts them):
  // the steps', and the self-checks' (determinism, cross-check) again.
  int64_t step_replays = 0;
  int64_t check_replays = 0;
};

// Steps tables of long windows: every step up to kListedSteps, else the
// first and last kListedEdge steps and those within kListedEdge / 2 of the
// first non-finite value (indices into report.steps, increasing). The
// terminal, report.md and report.html list these; report.json has them all.
constexpr size_t kListedSteps = 200;
constexpr size_t kListedEdge = 20;
std::vector<size_t> steps_worth_listing(const ReplayReport& report);

// A JSON number, or "nan"/"inf"/"-inf" for non-finite values.
nlohmann::json json_number(double value);
// An index (layer, head, rank, sample...), or null for -1: "does not apply".
nlohmann::json optional_index(int64_t value);
// 1 when a non-finite origin or an error finding was named, else 0.
int exit_status_for(const ReplayReport& report);

}  // namespace nanreplay
