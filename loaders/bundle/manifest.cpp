// manifest.json (bundle format v1, docs/bundle-format.md) parsed into a
// Manifest, one section per function. Key constraint: every value is checked
// for type and range here, so later stages can trust the struct; each error
// names the full key path the user wrote ("data.shards[0].tokens").
#include "loaders/bundle/manifest.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <limits>
#include <utility>

#include "loaders/arch/manifest_values.h"
#include "loaders/arch/model_options.h"
#include "loaders/base/error.h"
#include "loaders/base/json_util.h"
#include "loaders/bundle/bundle_paths.h"
#include "loaders/bundle/optimizer_manifest.h"
#include "loaders/bundle/provenance.h"

namespace nanreplay {
namespace {

constexpr const char* kFormatName = "nanreplay.bundle";
constexpr int64_t kFormatVersion = 1;

std::string indexed(const std::string& path, size_t index) {
  return path + "[" + std::to_string(index) + "]";
}

// ---- value checks (those the model options share: loaders/arch/manifest_values.h)

int64_t require_non_negative(int64_t value, const std::string& file,
                             const std::string& key_path) {
  if (value < 0) {
    throw InputError(file, key_path,
                     "expected a non-negative integer, got " + std::to_string(value));
  }
  return value;
}

int64_t non_negative_integer(const nlohmann::json& value, const std::string& file,
                             const std::string& key_path) {
  return require_non_negative(json_integer(value, file, key_path), file, key_path);
}

int64_t non_negative_integer(const JsonReader& reader, const std::string& key) {
  return require_non_negative(reader.integer(key), reader.file(), reader.key_path(key));
}

int64_t optional_non_negative_integer(const JsonReader& reader, const std::string& key,
                                      int64_t fallback) {
  return reader.has(key) ? non_negative_integer(reader, key) : fallback;
}

int64_t checked_product(int64_t a, int64_t b, const std::string& file, const std::string& key,
                        const std::string& what) {
  int64_t product = 0;
  if (__builtin_mul_overflow(a, b, &product)) {
    throw InputError(file, key, what + " overflows a 64-bit integer");
  }
  return product;
}

// ---- header ---------------------------------------------------------------

void check_format_and_version(const JsonReader& root) {
  const std::string hint = "a bundle v1 manifest starts with \"format\": \"nanreplay.bundle\", "
                           "\"version\": 1";
  if (!root.has("format")) {
    throw InputError(root.file(), "format", "required key is missing; " + hint);
  }
  const std::string format = root.string("format");
  if (format != kFormatName) {
    throw InputError(root.file(), "format",
                     "expected \"nanreplay.bundle\", got " + json_describe(format) +
                         "; is this a nanreplay incident bundle? " + hint);
  }
  if (!root.has("version")) {
    throw InputError(root.file(), "version", "required key is missing; " + hint);
  }
  const int64_t version = root.integer("version");
  if (version != kFormatVersion) {
    const std::string fix = version > kFormatVersion
                                ? "re-export the bundle as v1 or use a newer nanreplay"
                                : "re-export the bundle with \"version\": 1";
    throw InputError(root.file(), "version",
                     "expected 1, got " + std::to_string(version) +
                         "; this nanreplay reads bundle format v1 only: " + fix);
  }
}

// ---- model ----------------------------------------------------------------

// After the options: an explicit head_dim frees hidden_size from num_heads,
// and partial_rotary_factor sets how many dimensions rotary turns.
void check_head_layout(const JsonReader& model, const ModelConfig& config) {
  // Latent attention's head widths are its own (model.latent_attention checks them).
  const bool own_widths = config.explicit_head_dim > 0 || config.latent_attention;
  if (!own_widths && config.hidden_size % config.num_heads != 0) {
    throw InputError(model.file(), model.key_path("hidden_size"),
                     "expected a multiple of model.num_heads (" +
                         std::to_string(config.num_heads) + "), got " +
                         std::to_string(config.hidden_size));
  }
  // q_proj is [num_heads * head_dim, hidden_size]: kept to a dimension, so its element count fits 64 bits.
  if (config.explicit_head_dim > 0 && config.num_heads * config.explicit_head_dim > kLargestDimension) {
    throw InputError(model.file(), model.key_path("head_dim"),
                     "expected num_heads * head_dim of at most 2^30, got " + std::to_string(config.num_heads) +
                         " * " + std::to_string(config.explicit_head_dim));
  }
  if (config.num_heads % config.num_kv_heads != 0) {
    throw InputError(model.file(), model.key_path("num_kv_heads"),
                     "expected a divisor of model.num_heads (" +
                         std::to_string(config.num_heads) + "), got " +
                         std::to_string(config.num_kv_heads));
  }
  if (config.arch == Arch::kLlama && config.partial_rotary_factor != 1.0 &&
      (config.rotary_dim() < 2 || config.rotary_dim() % 2 != 0)) {
    throw InputError(model.file(), model.key_path("partial_rotary_factor"),
                     "expected int(head_dim * partial_rotary_factor) to be even and at least 2 (rotary turns "
                     "pairs of dimensions), got int(" + std::to_string(config.head_dim()) + " * " +
                         exact_number_text(config.partial_rotary_factor) + ") = " +
                         std::to_string(config.rotary_dim()));
  }
  if (config.arch == Arch::kLlama && config.partial_rotary_factor == 1.0 && !config.latent_attention &&
      config.head_dim() % 2 != 0) {
    if (config.explicit_head_dim > 0) {
      throw InputError(model.file(), model.key_path("head_dim"),
                       "expected an even head_dim for llama's rotary embeddings, got " +
                           std::to_string(config.explicit_head_dim));
    }
    throw InputError(model.file(), model.key_path("hidden_size"),
                     "expected an even head_dim (hidden_size / num_heads) for llama's rotary "
                     "embeddings, got " + std::to_string(config.hidden_size) + " / " +
                         std::to_string(config.num_heads) + " = " +
                         std::to_string(config.head_dim()));
  }
}

// gpt2 fixes the MLP width, full-width k and v (c_attn stacks q, k, v of
// hidden_size each) and the tied head; a manifest that says otherwise
// describes some other model, so it is refused rather than overridden.
void apply_gpt2_rules(const JsonReader& model, ModelConfig& config) {
  if (config.num_kv_heads != config.num_heads) {
    throw InputError(model.file(), model.key_path("num_kv_heads"),
                     "expected num_heads = " + std::to_string(config.num_heads) +
                         " for gpt2 (c_attn holds full-width q, k and v; no grouped-query "
                         "attention), got " + std::to_string(config.num_kv_heads));
  }
  const int64_t width = checked_product(4, config.hidden_size, model.file(),
                                        model.key_path("hidden_size"), "4 * hidden_size");
  if (model.has("intermediate_size") && positive_integer(model, "intermediate_size") != width) {
    throw InputError(model.file(), model.key_path("intermediate_size"),
                     "expected 4 * hidden_size = " + std::to_string(width) + " for gpt2, got " +
                         std::to_string(model.integer("intermediate_size")));
  }
  config.intermediate_size = width;
  if (!model.optional_boolean("tie_embeddings").value_or(true)) {
    throw InputError(model.file(), model.key_path("tie_embeddings"),
                     "expected true for gpt2 (its output head is always the token embedding), "
                     "got false");
  }
  config.tie_embeddings = true;
}

// The dimensions every model has, the family's own rules, then the family's
// options row by row (loaders/arch/llama_options.cpp); another family's
// option is refused by name before anything else is read.
ModelConfig parse_model(const JsonReader& model) {
  ModelConfig config;
  config.arch = read_arch(model);
  refuse_foreign_options(model, config.arch);
  config.vocab_size = dimension(model, "vocab_size");
  config.hidden_size = dimension(model, "hidden_size");
  config.num_layers = dimension(model, "num_layers");
  config.num_heads = dimension(model, "num_heads");
  config.num_kv_heads = optional_dimension(model, "num_kv_heads", config.num_heads);
  config.max_seq_len = dimension(model, "max_seq_len");
  if (model.has("norm_eps")) config.norm_eps = finite_number_above(model, "norm_eps", 0, true);
  if (model.has("rope_theta")) {
    config.rope_theta = finite_number_above(model, "rope_theta", 0, false);
  }
  if (config.arch == Arch::kLlama) {
    config.intermediate_size = dimension(model, "intermediate_size");
    config.tie_embeddings = model.optional_boolean("tie_embeddings").value_or(false);
  } else {
    apply_gpt2_rules(model, config);
  }
  parse_model_options(model, config);
  check_head_layout(model, config);
  return config;
}

// ---- precision ------------------------------------------------------------

Compute parse_compute(const JsonReader& precision) {
  if (!precision.has("compute")) return Compute::kFp32;
  const std::string name = one_of(precision, "compute", {"fp32", "bf16", "fp16", "fp8"});
  if (name == "bf16") return Compute::kBf16;
  if (name == "fp16") return Compute::kFp16;
  if (name == "fp8") return Compute::kFp8;
  return Compute::kFp32;
}

Fp8Config parse_fp8(const std::optional<JsonReader>& fp8) {
  Fp8Config config;
  if (!fp8) return config;
  if (fp8->has("fwd")) config.fwd = one_of(*fp8, "fwd", {"e4m3", "e5m2"});
  if (fp8->has("bwd")) config.bwd = one_of(*fp8, "bwd", {"e4m3", "e5m2"});
  config.amax_history_len =
      optional_positive_integer(*fp8, "amax_history_len", config.amax_history_len);
  if (fp8->has("margin")) config.margin = finite_number_above(*fp8, "margin", 0, true);
  return config;
}

PrecisionConfig parse_precision(const std::optional<JsonReader>& precision) {
  PrecisionConfig config;
  if (!precision) return config;
  config.compute = parse_compute(*precision);
  // precision.fp8 is read only for fp8 compute; other modes ignore it.
  if (config.compute == Compute::kFp8) config.fp8 = parse_fp8(precision->optional_object("fp8"));
  return config;
}

// ---- optimizer ------------------------------------------------------------

OptimizerConfig parse_optimizer(const JsonReader& optimizer) { return parse_optimizer_config(optimizer); }

// ---- data -----------------------------------------------------------------

std::string parse_sha256(const JsonReader& shard) {
  std::string hex = shard.string("sha256");
  const bool all_hex = std::all_of(hex.begin(), hex.end(),
                                   [](unsigned char c) { return std::isxdigit(c) != 0; });
  if (hex.size() != 64 || !all_hex) {
    throw InputError(shard.file(), shard.key_path("sha256"),
                     "expected 64 hexadecimal characters, got " + json_describe(hex));
  }
  std::transform(hex.begin(), hex.end(), hex.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return hex;
}

ShardSpec parse_shard(const JsonReader& shard) {
  ShardSpec spec;
  spec.path = shard.string("path");
  check_bundle_relative_path(spec.path, shard.file(), shard.key_path("path"));
  spec.dtype = one_of(shard, "dtype", {"uint16", "uint32"}) == "uint16" ? TokenDtype::kUint16
                                                                        : TokenDtype::kUint32;
  spec.tokens = positive_integer(shard, "tokens");
  if (shard.has("sha256")) spec.sha256 = parse_sha256(shard);
  return spec;
}

std::vector<ShardSpec> parse_shards(const JsonReader& data) {
  const nlohmann::json& list = data.array("shards");
  if (list.empty()) {
    throw InputError(data.file(), data.key_path("shards"),
                     "expected at least one shard, got an empty array");
  }
  std::vector<ShardSpec> shards;
  int64_t total_tokens = 0;
  for (size_t i = 0; i < list.size(); ++i) {
    const std::string path = indexed(data.key_path("shards"), i);
    shards.push_back(parse_shard(JsonReader(list[i], data.file(), path)));
    if (__builtin_add_overflow(total_tokens, shards.back().tokens, &total_tokens)) {
      throw InputError(data.file(), path + ".tokens",
                       "expected a token count whose total fits a 64-bit integer");
    }
  }
  return shards;
}

// seed is stored as uint64 because torch.Generator.manual_seed takes one.
uint64_t parse_seed(const JsonReader& sampler) {
  if (!sampler.has("seed")) {
    throw InputError(sampler.file(), sampler.key_path("seed"),
                     "required key is missing (the randperm sampler needs its seed)");
  }
  const nlohmann::json& seed = sampler.json().at("seed");
  if (seed.is_number_unsigned()) return seed.get<uint64_t>();  // may exceed int64
  return static_cast<uint64_t>(non_negative_integer(sampler, "seed"));
}

SamplerSpec parse_sampler(const JsonReader& sampler) {
  SamplerSpec spec;
  if (one_of(sampler, "kind", {"randperm", "explicit"}) == "explicit") {
    spec.kind = SamplerSpec::Kind::kExplicit;
    return spec;
  }
  spec.kind = SamplerSpec::Kind::kRandperm;
  spec.seed = parse_seed(sampler);
  spec.epoch = optional_non_negative_integer(sampler, "epoch", 0);
  spec.epoch_start_step = optional_non_negative_integer(sampler, "epoch_start_step", 0);
  return spec;
}

DataConfig parse_data(const JsonReader& data, const ModelConfig& model) {
  DataConfig config;
  config.shards = parse_shards(data);
  config.seq_len = positive_integer(data, "seq_len");
  if (config.seq_len > model.max_seq_len) {
    throw InputError(data.file(), data.key_path("seq_len"),
                     "expected at most model.max_seq_len (" + std::to_string(model.max_seq_len) +
                         "), got " + std::to_string(config.seq_len));
  }
  config.micro_batch_size = positive_integer(data, "micro_batch_size");
  config.grad_accum_steps = optional_positive_integer(data, "grad_accum_steps", 1);
  config.world_size = optional_positive_integer(data, "world_size", 1);
  const int64_t per_rank = checked_product(
      config.micro_batch_size, config.grad_accum_steps, data.file(),
      data.key_path("grad_accum_steps"), "micro_batch_size * grad_accum_steps");
  checked_product(per_rank, config.world_size, data.file(), data.key_path("world_size"),
                  "micro_batch_size * grad_accum_steps * world_size");
  config.sampler = parse_sampler(data.object("sampler"));
  return config;
}

// ---- steps ----------------------------------------------------------------

std::vector<std::vector<int64_t>> parse_samples(const nlohmann::json& ranks,
                                                const std::string& file,
                                                const std::string& key) {
  if (!ranks.is_array()) {
    throw InputError(file, key,
                     "expected an array of per-rank arrays, got " + json_describe(ranks));
  }
  std::vector<std::vector<int64_t>> samples(ranks.size());
  for (size_t rank = 0; rank < ranks.size(); ++rank) {
    const nlohmann::json& list = ranks[rank];
    const std::string rank_key = indexed(key, rank);
    if (!list.is_array()) {
      throw InputError(file, rank_key,
                       "expected an array of sample indices, got " + json_describe(list));
    }
    samples[rank].reserve(list.size());
    for (size_t j = 0; j < list.size(); ++j) {
      samples[rank].push_back(non_negative_integer(list[j], file, indexed(rank_key, j)));
    }
  }
  return samples;
}

// original_samples / original_offsets annotate `samples` entry by entry.
void check_same_layout(const std::optional<std::vector<std::vector<int64_t>>>& samples,
                       const std::vector<std::vector<int64_t>>& originals, const JsonReader& entry,
                       const std::string& key) {
  if (!samples) {
    throw InputError(entry.file(), entry.key_path(key),
                     "annotates the step's samples, but the entry has no \"samples\"");
  }
  bool same = samples->size() == originals.size();
  for (size_t rank = 0; same && rank < originals.size(); ++rank) same = (*samples)[rank].size() == originals[rank].size();
  if (!same) {
    throw InputError(entry.file(), entry.key_path(key),
                     "expected the same layout as \"samples\" (one entry per rank and per sample)");
  }
}

StepEntry parse_step(const JsonReader& entry, size_t index) {
  StepEntry step;
  step.manifest_index = index;
  step.step = non_negative_integer(entry, "step");
  step.dir = entry.string("dir");
  check_bundle_relative_path(step.dir, entry.file(), entry.key_path("dir"));
  if (entry.has("samples")) {
    step.samples = parse_samples(entry.json().at("samples"), entry.file(),
                                 entry.key_path("samples"));
  }
  for (const char* key : {"original_samples", "original_offsets"}) {
    if (!entry.has(key)) continue;
    auto originals = parse_samples(entry.json().at(key), entry.file(), entry.key_path(key));
    check_same_layout(step.samples, originals, entry, key);
    (std::string(key) == "original_samples" ? step.original_samples : step.original_offsets) = std::move(originals);
  }
  return step;
}

void sort_and_check_unique(std::vector<StepEntry>& steps, const std::string& file) {
  std::stable_sort(steps.begin(), steps.end(),
                   [](const StepEntry& a, const StepEntry& b) { return a.step < b.step; });
  for (size_t i = 1; i < steps.size(); ++i) {
    if (steps[i].step == steps[i - 1].step) {
      const size_t later = std::max(steps[i].manifest_index, steps[i - 1].manifest_index);
      const size_t earlier = std::min(steps[i].manifest_index, steps[i - 1].manifest_index);
      throw InputError(file, indexed("steps", later) + ".step",
                       "expected each step once, got step " + std::to_string(steps[i].step) +
                           " again (also steps[" + std::to_string(earlier) + "])");
    }
  }
}

std::vector<StepEntry> parse_steps(const JsonReader& root, const DataConfig& data) {
  const nlohmann::json& list = root.array("steps");
  if (list.empty()) {
    throw InputError(root.file(), "steps", "expected at least one step, got an empty array");
  }
  std::vector<StepEntry> steps;
  for (size_t i = 0; i < list.size(); ++i) {
    steps.push_back(parse_step(JsonReader(list[i], root.file(), indexed("steps", i)), i));
    if (data.sampler.kind == SamplerSpec::Kind::kExplicit && !steps.back().samples) {
      throw InputError(root.file(), indexed("steps", i) + ".samples",
                       "required key is missing (data.sampler.kind is \"explicit\")");
    }
  }
  sort_and_check_unique(steps, root.file());
  return steps;
}

IncidentInfo parse_incident(const JsonReader& incident) {
  IncidentInfo info;
  if (incident.has("step")) info.step = non_negative_integer(incident, "step");
  info.symptom = incident.optional_string("symptom").value_or("");
  if (const std::optional<std::string> kind = incident.optional_string("kind")) {
    if (*kind != "spike" && *kind != "nonfinite") {
      throw InputError(incident.file(), incident.key_path("kind"),
                       "expected \"spike\" or \"nonfinite\", got " + json_describe(nlohmann::json(*kind)));
    }
    info.kind = *kind == "spike" ? IncidentKind::kSpike : IncidentKind::kNonfinite;
  }
  if (auto spike = incident.optional_object("spike")) info.spike = parse_spike_thresholds(*spike);
  return info;
}

}  // namespace

const char* compute_name(Compute compute) {
  switch (compute) {
    case Compute::kBf16:
      return "bf16";
    case Compute::kFp16:
      return "fp16";
    case Compute::kFp8:
      return "fp8";
    case Compute::kFp32:
      break;
  }
  return "fp32";
}

std::optional<OriginalSample> original_of_sample(const Manifest& manifest, int64_t sample) {
  for (const StepEntry& entry : manifest.steps) {
    const auto& originals = entry.original_samples ? entry.original_samples : entry.original_offsets;
    if (!entry.samples || !originals) continue;
    for (size_t rank = 0; rank < entry.samples->size(); ++rank) {
      const std::vector<int64_t>& list = (*entry.samples)[rank];
      const auto at = std::find(list.begin(), list.end(), sample);
      if (at != list.end()) {
        return OriginalSample{!entry.original_samples.has_value(), (*originals)[rank][static_cast<size_t>(at - list.begin())]};
      }
    }
  }
  return std::nullopt;
}

Manifest parse_manifest(const std::string& json_text, const std::string& file_label) {
  const nlohmann::json document = parse_json_guarded(json_text, file_label);
  const JsonReader root(document, file_label, "");
  check_format_and_version(root);

  Manifest manifest;
  manifest.version = kFormatVersion;
  manifest.model = parse_model(root.object("model"));
  manifest.precision = parse_precision(root.optional_object("precision"));
  if (auto optimizer = root.optional_object("optimizer")) {
    manifest.optimizer = parse_optimizer(*optimizer);
  }
  manifest.data = parse_data(root.object("data"), manifest.model);
  manifest.steps = parse_steps(root, manifest.data);
  if (auto incident = root.optional_object("incident")) {
    manifest.incident = parse_incident(*incident);
  }
  if (auto minimized = root.optional_object("minimized")) {
    manifest.minimized = MinimizedFrom{minimized->string("from"),
                                       minimized->optional_string("manifest_sha256").value_or("")};
  }
  if (auto provenance = root.optional_object("provenance")) manifest.provenance = parse_provenance(*provenance);
  return manifest;
}

}  // namespace nanreplay
