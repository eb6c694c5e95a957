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

// AdamW as PyTorch's torch.optim.AdamW; absent keys take PyTorch's defaults.
struct OptimizerConfig {
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.01;
  std::optional<double> grad_clip;      // none: no clipping
  std::vector<std::string> no_decay;    // fnmatch-style globs over keys
};

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
