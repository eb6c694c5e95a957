// The incident bundle's manifest.json (bundle format v1), parsed and validated
// key by key. Unknown keys are ignored; missing, mistyped or out-of-range keys
// throw InputError naming the file and the full key path ("data.seq_len").
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "loaders/arch/model_config.h"
#include "loaders/bundle/spike_settings.h"

namespace nanreplay {

enum class Compute { kFp32, kBf16, kFp16, kFp8 };
enum class TokenDtype { kUint16, kUint32 };

const char* compute_name(Compute compute);

struct Fp8Config {
  std::string fwd = "e4m3";
  std::string bwd = "e5m2";
  int64_t amax_history_len = 16;
  double margin = 0.0;
};

struct PrecisionConfig {
  Compute compute = Compute::kFp32;
  std::optional<Fp8Config> fp8;  // present when compute == kFp8
};

// The update rule of optimizer.kind (docs/optimizers.md), each its class's.
enum class OptimizerKind { kAdamW, kAdam, kAdafactor, kAdafactorHf, kMuon };

// One parameter group's rule and hyper-parameters, under the class's own
// keyword names; absent keys take that class's defaults (set by the parser
// per kind: the defaults below are AdamW's).
struct OptimizerRule {
  OptimizerKind kind = OptimizerKind::kAdamW;
  // Adam, AdamW: betas, eps, weight_decay, amsgrad, maximize; Adam's
  // decoupled_weight_decay (torch >= 2.7) makes it AdamW.
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;  // Adam/AdamW/Muon eps; Adafactor's pair below
  double weight_decay = 0.01;
  bool amsgrad = false;
  bool maximize = false;
  bool decoupled_weight_decay = false;
  // torch.optim.Adafactor: eps = (eps1, eps2), eps1 None = finfo(fp32).eps.
  double beta2_decay = -0.8;
  double d = 1.0;
  std::optional<double> eps1;
  double eps2 = 1e-3;
  // transformers Adafactor: eps = (eps1, eps2) (1e-30, 1e-3), beta1 None = no first moment.
  double clip_threshold = 1.0;
  double decay_rate = -0.8;
  std::optional<double> hf_beta1;
  bool relative_step = true;
  bool scale_parameter = true;
  bool warmup_init = false;
  // torch.optim.Muon (its eps is `eps` above, 1e-7 by default).
  double momentum = 0.95;
  bool nesterov = true;
  double ns_a = 3.4445, ns_b = -4.7750, ns_c = 2.0315;
  int64_t ns_steps = 5;
  std::string adjust_lr_fn = "original";  // or "match_rms_adamw"
  bool use_addmm = false;
  // MuonClip: a muon group's qk_clip.tau.
  std::optional<double> qk_clip_tau;
};

// optimizer.groups[i]: parameters matching one of `params` (first group wins).
struct OptimizerGroup {
  std::string name;
  std::vector<std::string> params;  // fnmatch-style globs over keys
  OptimizerRule rule;
};

// The run's optimizer: the top-level rule (parameters in no group), then groups.
struct OptimizerConfig : OptimizerRule {
  std::optional<double> grad_clip;      // none: no clipping
  std::vector<std::string> no_decay;    // fnmatch-style globs over keys
  std::vector<OptimizerGroup> groups;   // in the manifest's order
};

const char* optimizer_kind_name(OptimizerKind kind);

struct ShardSpec {
  std::string path;  // as the manifest lists it (relative to the bundle)
  TokenDtype dtype = TokenDtype::kUint16;
  int64_t tokens = 0;
  std::optional<std::string> sha256;  // lower-case hex, 64 chars
};

struct SamplerSpec {
  enum class Kind { kRandperm, kExplicit } kind = Kind::kRandperm;
  uint64_t seed = 0;
  int64_t epoch = 0;
  int64_t epoch_start_step = 0;
};

struct DataConfig {
  std::vector<ShardSpec> shards;
  int64_t seq_len = 0;
  int64_t micro_batch_size = 0;
  int64_t grad_accum_steps = 1;
  int64_t world_size = 1;
  SamplerSpec sampler;

  int64_t samples_per_rank_step() const { return micro_batch_size * grad_accum_steps; }
};

struct StepEntry {
  int64_t step = 0;
  std::string dir;  // relative to the bundle
  // Explicit sample indices per rank, in the order the run read them.
  std::optional<std::vector<std::vector<int64_t>>> samples;
  // What a compact capture recorded beside re-indexed samples, in the same
  // layout: the run's own dataset indices, or its token offsets.
  std::optional<std::vector<std::vector<int64_t>>> original_samples;
  std::optional<std::vector<std::vector<int64_t>>> original_offsets;
  // Position in the manifest's "steps" array before sorting, so later errors
  // can name the key the user wrote ("steps[2].samples").
  size_t manifest_index = 0;
};

struct IncidentInfo {
  std::optional<int64_t> step;
  std::string symptom;
  // "kind": "spike" | "nonfinite"; absent: a window whose log spikes with
  // nothing non-finite logged is taken as a spike (docs/spikes.md).
  std::optional<IncidentKind> kind;
  std::optional<SpikeThresholds> spike;  // "spike": the thresholds, where given
};

// A bundle `nanreplay minimize` wrote (docs/minimize.md): the bundle it was
// cut from. Not used by the replay; report.md names it.
struct MinimizedFrom {
  std::string bundle;           // the original bundle's path, absolute
  std::string manifest_sha256;  // of the original manifest.json
};

// Where a value the bundle's writer settled came from: one entry of the
// optional "provenance" block (docs/bundle-format.md, "Provenance"). The replay
// does not use it; the report names the defaulted values beside a verdict that
// the bundle does not reproduce the run.
struct ValueSource {
  std::string key;     // the manifest key it describes: "model.norm_eps"
  std::string from;    // tensors, checkpoint, config, flag, naming, default
  std::string detail;  // where exactly, in words
  std::string value;   // the value as compact JSON text; empty when not recorded
};

struct Manifest {
  int64_t version = 1;
  ModelConfig model;
  PrecisionConfig precision;
  std::optional<OptimizerConfig> optimizer;
  DataConfig data;
  std::vector<StepEntry> steps;  // sorted by step, no duplicates
  std::optional<IncidentInfo> incident;
  std::optional<MinimizedFrom> minimized;
  std::vector<ValueSource> provenance;  // sorted by key
};

// fp16 compute, where the loss scaler, its skipped steps and its scales apply.
inline bool is_fp16(const Manifest& m) { return m.precision.compute == Compute::kFp16; }

// The run's own index of bundle sample `sample` (or the token offset it
// started at), where a step entry records original_samples / original_offsets.
struct OriginalSample {
  bool is_offset = false;
  int64_t value = 0;
};
std::optional<OriginalSample> original_of_sample(const Manifest& manifest, int64_t sample);

// `file_label` names the file in errors (e.g. "bundle/manifest.json").
// Shard paths and step dirs are checked as text only (relative, no ".."); they
// are resolved against the bundle by resolve_in_bundle when opened.
Manifest parse_manifest(const std::string& json_text, const std::string& file_label);

}  // namespace nanreplay
