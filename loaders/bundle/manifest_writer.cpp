// See manifest_writer.h. Keys appear as docs/bundle-format.md lists them.
#include "loaders/bundle/manifest_writer.h"

#include "loaders/arch/model_options.h"
#include "loaders/bundle/optimizer_manifest.h"

namespace nanreplay {

namespace {

nlohmann::json model_json(const ModelConfig& m) {
  nlohmann::json model = {{"arch", arch_name(m.arch)},      {"vocab_size", m.vocab_size},
                          {"hidden_size", m.hidden_size},   {"num_layers", m.num_layers},
                          {"num_heads", m.num_heads},       {"num_kv_heads", m.num_kv_heads},
                          {"max_seq_len", m.max_seq_len},   {"norm_eps", m.norm_eps},
                          {"rope_theta", m.rope_theta},     {"tie_embeddings", m.tie_embeddings}};
  if (m.arch == Arch::kLlama) model["intermediate_size"] = m.intermediate_size;
  write_model_options(m, model);  // each only when it is not the default
  return model;
}

nlohmann::json precision_json(const PrecisionConfig& p) {
  nlohmann::json precision = {{"compute", compute_name(p.compute)}};
  if (p.compute == Compute::kFp8) {
    const Fp8Config fp8 = p.fp8.value_or(Fp8Config{});
    precision["fp8"] = {{"fwd", fp8.fwd}, {"bwd", fp8.bwd}, {"amax_history_len", fp8.amax_history_len},
                        {"margin", fp8.margin}};
  }
  return precision;
}

nlohmann::json optimizer_json(const OptimizerConfig& o) { return optimizer_config_json(o); }

nlohmann::json data_json(const DataConfig& d) {
  nlohmann::json shards = nlohmann::json::array();
  for (const ShardSpec& s : d.shards) {
    nlohmann::json shard = {{"path", s.path}, {"dtype", s.dtype == TokenDtype::kUint16 ? "uint16" : "uint32"},
                            {"tokens", s.tokens}};
    if (s.sha256) shard["sha256"] = *s.sha256;
    shards.push_back(shard);
  }
  const SamplerSpec& s = d.sampler;
  const nlohmann::json sampler =
      s.kind == SamplerSpec::Kind::kExplicit
          ? nlohmann::json{{"kind", "explicit"}}
          : nlohmann::json{{"kind", "randperm"}, {"seed", s.seed}, {"epoch", s.epoch},
                           {"epoch_start_step", s.epoch_start_step}};
  return {{"shards", shards},
          {"seq_len", d.seq_len},
          {"micro_batch_size", d.micro_batch_size},
          {"grad_accum_steps", d.grad_accum_steps},
          {"world_size", d.world_size},
          {"sampler", sampler}};
}

nlohmann::json step_json(const StepEntry& e) {
  nlohmann::json entry = {{"step", e.step}, {"dir", e.dir}};
  if (e.samples) entry["samples"] = *e.samples;
  if (e.original_samples) entry["original_samples"] = *e.original_samples;
  if (e.original_offsets) entry["original_offsets"] = *e.original_offsets;
  return entry;
}

}  // namespace

nlohmann::json manifest_json(const Manifest& m) {
  nlohmann::json steps = nlohmann::json::array();
  for (const StepEntry& e : m.steps) steps.push_back(step_json(e));
  nlohmann::json out = {{"format", "nanreplay.bundle"}, {"version", m.version}, {"model", model_json(m.model)},
                        {"precision", precision_json(m.precision)}, {"data", data_json(m.data)},
                        {"steps", steps}};
  if (m.optimizer) out["optimizer"] = optimizer_json(*m.optimizer);
  if (m.incident) {
    nlohmann::json incident = {{"symptom", m.incident->symptom}};
    if (m.incident->step) incident["step"] = *m.incident->step;
    if (m.incident->kind) incident["kind"] = incident_kind_name(*m.incident->kind);
    if (m.incident->spike) incident["spike"] = spike_thresholds_json(*m.incident->spike);
    out["incident"] = incident;
  }
  if (m.minimized) {
    out["minimized"] = {{"from", m.minimized->bundle}, {"manifest_sha256", m.minimized->manifest_sha256}};
  }
  for (const ValueSource& v : m.provenance) {  // a cut bundle keeps what its values rest on
    nlohmann::json entry = {{"from", v.from}, {"detail", v.detail}};
    if (!v.value.empty()) entry["value"] = nlohmann::json::parse(v.value);
    out["provenance"][v.key] = entry;
  }
  return out;
}

}  // namespace nanreplay
