// Bundle summary for `nanreplay inspect`. Reads the manifest, each step's
// state.json and safetensors header (mapped, not loaded) and hashes the shards.
// It reports; validate_bundle_structure (replay/step/bundle_structure.h) validates.
#include "reports/outputs/bundle_summary.h"

#include <algorithm>
#include <cstdio>
#include <map>
#include <sstream>
#include <vector>

#include "loaders/arch/latent_attention_option.h"
#include "loaders/arch/moe_option.h"
#include "loaders/arch/mtp_option.h"
#include "loaders/base/error.h"
#include "loaders/bundle/provenance.h"
#include "loaders/formats/safetensors.h"
#include "replay/step/memory_estimate.h"
#include "replay/probing/probe_retention.h"
#include "reports/outputs/terminal_text.h"

namespace nanreplay {

namespace {

constexpr const char* kFaithfulnessNote =
    "not whether the bundle faithfully records the run: only a replay that reproduces the logged losses "
    "shows that";

int64_t parameter_count(const StepFiles& files) {
  const SafetensorsFile model = SafetensorsFile::open(files.model.string(), files.label("model.safetensors"));
  int64_t count = 0;
  for (const TensorInfo& tensor : model.tensors()) count += tensor.numel();
  return count;
}

nlohmann::json optional_number(const std::optional<double>& value) {
  return value ? json_number(*value) : nlohmann::json(nullptr);
}

}  // namespace

// What `run` would need, in memory and streamed layer by layer, against the
// default limit, and the mode that limit gives it.
nlohmann::json memory_summary(const Bundle& bundle) {
  const size_t held = std::min(bundle.steps().size(), ProbeRetention::kMostStepsHeld);
  const MemoryEstimate in_memory = estimate_replay_memory(bundle.manifest(), held, true, bundle.rolls_forward());
  const MemoryEstimate streamed = estimate_streamed_memory(bundle.manifest(), held, true, bundle.rolls_forward());
  const MemoryLimit limit = default_memory_limit();
  const double room = static_cast<double>(limit.bytes);
  const char* mode = in_memory.total() <= room ? "in memory" : streamed.total() <= room ? "streamed" : "neither fits";
  return {{"in_memory_bytes", in_memory.total()},
          {"streamed_bytes", streamed.total()},
          {"limit_bytes", limit.bytes},
          {"limit_source", limit.source},
          {"run_mode", mode}};
}

nlohmann::json summarize_bundle(const Bundle& bundle) {
  const Manifest& m = bundle.manifest();
  nlohmann::json steps = nlohmann::json::array();
  int64_t parameters = -1;
  for (const StepFiles& files : bundle.steps()) {
    const StepState state = bundle.load_state(files);
    const int64_t count = files.has_model ? parameter_count(files) : parameters;
    if (parameters < 0) parameters = count;
    steps.push_back({{"step", files.step},
                     {"dir", printable(files.dir_label)},
                     {"params", files.has_model ? "checkpoint" : "derived"},
                     {"optimizer_state", bundle.has_optimizer(files)},
                     {"logged_loss", optional_number(state.logged.loss)},
                     {"logged_grad_norm", optional_number(state.logged.grad_norm)},
                     {"lr", optional_number(state.lr)},
                     {"parameters", count}});
  }
  std::map<std::string, ChecksumMismatch> mismatches;
  for (const ChecksumMismatch& bad : bundle.tokens().verify_checksums()) mismatches[bad.shard] = bad;
  nlohmann::json shards = nlohmann::json::array();
  for (size_t i = 0; i < bundle.tokens().num_shards(); ++i) {
    const ShardSpec& spec = bundle.tokens().spec(i);
    const int64_t width = spec.dtype == TokenDtype::kUint16 ? 2 : 4;
    const auto mismatch = mismatches.find(spec.path);
    const std::string checksum = !spec.sha256 ? "not declared" : mismatch != mismatches.end() ? "mismatch" : "ok";
    nlohmann::json shard = {{"path", printable(spec.path)},
                            {"dtype", spec.dtype == TokenDtype::kUint16 ? "uint16" : "uint32"},
                            {"tokens", spec.tokens},
                            {"bytes", spec.tokens * width},
                            {"checksum", checksum},
                            {"sha256", spec.sha256 ? nlohmann::json(*spec.sha256) : nlohmann::json(nullptr)}};
    if (mismatch != mismatches.end()) shard["actual_sha256"] = mismatch->second.actual;
    shards.push_back(std::move(shard));
  }
  const SamplerSpec& sampler = m.data.sampler;
  const bool randperm = sampler.kind == SamplerSpec::Kind::kRandperm;
  const auto randperm_only = [&](const nlohmann::json& value) { return randperm ? value : nlohmann::json(nullptr); };
  nlohmann::json incident = nullptr;
  if (m.incident) {
    incident = {{"step", m.incident->step ? nlohmann::json(*m.incident->step) : nlohmann::json(nullptr)},
                {"symptom", printable(m.incident->symptom)}};
  }
  nlohmann::json summary = {{"bundle", bundle.root().string()},
          {"valid", mismatches.empty()},
          {"validated", "structure"},
          {"faithfulness", kFaithfulnessNote},
          {"model",
           {{"arch", arch_name(m.model.arch)},
            {"vocab_size", m.model.vocab_size},
            {"hidden_size", m.model.hidden_size},
            {"num_layers", m.model.num_layers},
            {"num_heads", m.model.num_heads},
            {"num_kv_heads", m.model.num_kv_heads},
            {"intermediate_size", m.model.intermediate_size},
            {"max_seq_len", m.model.max_seq_len},
            {"parameters", parameters}}},
          {"precision", compute_name(m.precision.compute)},
          {"steps", steps},
          {"data",
           {{"seq_len", m.data.seq_len},
            {"micro_batch_size", m.data.micro_batch_size},
            {"grad_accum_steps", m.data.grad_accum_steps},
            {"world_size", m.data.world_size},
            {"total_tokens", bundle.tokens().total_tokens()},
            {"samples", bundle.num_samples()},
            {"shards", shards}}},
          {"sampler",
           {{"kind", randperm ? "randperm" : "explicit"},
            {"seed", randperm_only(sampler.seed)},
            {"epoch", randperm_only(sampler.epoch)},
            {"epoch_start_step", randperm_only(sampler.epoch_start_step)}}},
          {"incident", incident},
          {"memory", memory_summary(bundle)}};
  if (m.model.has_layer_kinds()) {  // each layer's attention kind (Gemma 3, OLMo 3, Llama 4)
    nlohmann::json kinds = nlohmann::json::array();
    for (int layer = 0; layer < m.model.num_layers; ++layer) kinds.push_back(attention_kind_name(m.model.attention_kind(layer)));
    summary["model"]["layer_types"] = kinds;
    summary["model"]["sliding_window"] = m.model.sliding_window;
    summary["model"]["attention_chunk_size"] = m.model.attention_chunk_size;
  }
  // The options that make a frontier model what it is, as the manifest writes them back.
  if (m.model.moe) summary["model"]["moe"] = moe_json(*m.model.moe, m.model.num_layers);
  if (m.model.latent_attention) summary["model"]["latent_attention"] = latent_attention_json(*m.model.latent_attention);
  if (m.model.mtp) summary["model"]["mtp"] = mtp_json(*m.model.mtp);
  // Values the writer assumed (manifest provenance "from": "default"): the first suspects of a gap.
  const std::vector<ValueSource> defaulted = defaulted_values(m.provenance);
  if (!defaulted.empty()) summary["defaulted"] = describe_defaulted(defaulted);
  return summary;
}

namespace {

// One line each for experts, latent attention and multi-token prediction, where the model has them.
void render_frontier_options(std::ostringstream& out, const nlohmann::json& model) {
  if (model.contains("moe")) {
    const nlohmann::json& moe = model["moe"];
    out << "experts    " << moe["num_experts"] << " routed, top " << moe["top_k"] << " ("
        << moe.value("router", std::string("softmax_top_k")) << " router)";
    if (moe.value("shared_expert_intermediate_size", 0) > 0) {
      out << ", a shared expert of width " << moe["shared_expert_intermediate_size"];
    }
    if (moe.contains("layers")) out << ", on layers " << moe["layers"].dump();
    out << "\n";
  }
  if (model.contains("latent_attention")) {
    const nlohmann::json& latent = model["latent_attention"];
    out << "attention  latent: kv rank " << latent["kv_lora_rank"] << ", q rank " << latent["q_lora_rank"].dump()
        << ", rotary width " << latent["qk_rope_head_dim"] << "\n";
  }
  if (model.contains("mtp")) {
    out << "mtp        " << model["mtp"]["num_layers"] << " multi-token prediction layer(s), loss scale "
        << model["mtp"]["loss_scale"].dump() << " (in the gradients, not the logged loss)\n";
  }
}

}  // namespace

std::string render_bundle_summary(const nlohmann::json& s) {
  std::ostringstream out;
  const auto& model = s["model"];
  out << "bundle     " << s["bundle"].get<std::string>() << (s["valid"].get<bool>() ? "  (valid)" : "  (INVALID)") << "\n"
      << "model      " << model["arch"].get<std::string>() << ", " << model["num_layers"] << " layers, hidden "
      << model["hidden_size"] << ", " << model["num_heads"] << " heads (" << model["num_kv_heads"] << " kv), ffn "
      << model["intermediate_size"] << ", vocab " << model["vocab_size"] << ", " << model["parameters"]
      << " parameters\n";
  if (model.contains("layer_types")) {  // one word per layer: which attention it runs
    out << "attention ";
    for (size_t layer = 0; layer < model["layer_types"].size(); ++layer) {
      const std::string kind = model["layer_types"][layer].get<std::string>();
      out << (layer ? ", " : " ") << layer << " " << kind.substr(0, kind.find('_'));  // "sliding_attention": sliding
    }
    std::vector<std::string> sizes;
    if (model.value("sliding_window", 0) > 0) sizes.push_back("sliding window " + model["sliding_window"].dump());
    if (model.value("attention_chunk_size", 0) > 0) sizes.push_back("chunk " + model["attention_chunk_size"].dump());
    for (size_t i = 0; i < sizes.size(); ++i) out << (i ? ", " : " (") << sizes[i] << (i + 1 == sizes.size() ? ")" : "");
    out << "\n";
  }
  render_frontier_options(out, model);
  out << "precision  " << s["precision"].get<std::string>() << "\n";
  const auto& data = s["data"];
  out << "data       seq_len " << data["seq_len"] << ", micro-batch " << data["micro_batch_size"] << " x "
      << data["grad_accum_steps"] << " accumulation x " << data["world_size"] << " ranks, " << data["total_tokens"]
      << " tokens, " << data["samples"] << " samples\n";
  for (const auto& shard : data["shards"]) {
    out << "  shard    " << shard["path"].get<std::string>() << "  " << shard["dtype"].get<std::string>() << "  "
        << shard["tokens"] << " tokens  " << shard["bytes"] << " bytes  sha256 " << shard["checksum"].get<std::string>()
        << "\n";
  }
  const auto& sampler = s["sampler"];
  if (sampler["kind"] == "randperm") {
    out << "sampler    randperm, seed " << sampler["seed"] << ", epoch " << sampler["epoch"] << " (from step "
        << sampler["epoch_start_step"] << ")\n";
  } else {
    out << "sampler    explicit (each step lists its samples)\n";
  }
  if (s.contains("defaulted")) out << "defaulted  " << s["defaulted"].get<std::string>() << "\n";
  if (!s["incident"].is_null()) {
    out << "incident   step " << (s["incident"]["step"].is_null() ? "?" : s["incident"]["step"].dump()) << ": "
        << s["incident"]["symptom"].get<std::string>() << "\n";
  }
  out << "steps      " << s["steps"].size() << "\n  step      params      optimizer  logged loss   lr\n";
  for (const auto& step : s["steps"]) {
    char line[160];
    const auto number = [](const nlohmann::json& v) {
      return v.is_null() ? std::string("-") : v.is_string() ? v.get<std::string>() : format_number(v.get<double>());
    };
    std::snprintf(line, sizeof(line), "  %-9lld %-11s %-10s %-13s %s\n",
                  static_cast<long long>(step["step"].get<int64_t>()), step["params"].get<std::string>().c_str(),
                  step["optimizer_state"].get<bool>() ? "yes" : "no", number(step["logged_loss"]).c_str(),
                  number(step["lr"]).c_str());
    out << line;
  }
  const auto& memory = s["memory"];
  out << "memory     run needs ~" << format_bytes(memory["in_memory_bytes"].get<double>()) << " in memory, ~"
      << format_bytes(memory["streamed_bytes"].get<double>()) << " streamed layer by layer; limit "
      << format_bytes(memory["limit_bytes"].get<double>()) << " (" << memory["limit_source"].get<std::string>()
      << "): " << memory["run_mode"].get<std::string>() << "\n";
  out << "checked    the structure `nanreplay run` needs (every header, tensor, sample); " << kFaithfulnessNote
      << "\n";
  return out.str();
}

}  // namespace nanreplay
