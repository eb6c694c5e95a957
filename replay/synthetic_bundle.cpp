// Trains a tiny model for a few steps and writes every step as a v1 bundle.
// The same gradient code as the replay is used, so a clean synthetic bundle
// replays to exactly the losses it logged.
#include "replay/synthetic_bundle.h"

#include <cmath>
#include <fstream>
#include <iterator>
#include <map>
#include <random>
#include <stdexcept>

#include <unistd.h>

#include <torch/torch.h>

#include "loaders/safetensors.h"
#include "loaders/sampler.h"
#include "loaders/token_shards.h"
#include "replay/adamw.h"
#include "replay/gradients.h"
#include "reports/report.h"

namespace nanreplay {

namespace fs = std::filesystem;

namespace {

void write_text(const fs::path& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << text;
  if (!out) throw std::runtime_error("cannot write " + path.string());
}

void write_tensors(const fs::path& path, const std::vector<std::string>& names,
                   const std::vector<torch::Tensor>& tensors, std::optional<int64_t> step) {
  SafetensorsWriter writer;
  for (size_t i = 0; i < names.size(); ++i) {
    const torch::Tensor t = tensors[i].detach().to(torch::kFloat32).contiguous();
    writer.add(names[i], DType::kF32, t.sizes().vec(), t.data_ptr(),
               static_cast<size_t>(t.numel()) * sizeof(float));
  }
  if (step) writer.add("step", DType::kI64, {}, &*step, sizeof(int64_t));
  writer.write(path.string());
}

std::vector<uint32_t> random_tokens(const SyntheticSpec& spec) {
  std::mt19937_64 rng(spec.data_seed);
  std::uniform_int_distribution<int64_t> token(0, spec.model.vocab_size - 1);
  std::vector<uint32_t> tokens(static_cast<size_t>(spec.num_tokens));
  for (uint32_t& t : tokens) t = static_cast<uint32_t>(token(rng));
  return tokens;
}

std::vector<uint8_t> shard_bytes(const std::vector<uint32_t>& tokens, int64_t begin, int64_t count,
                                 TokenDtype dtype) {
  const size_t width = dtype == TokenDtype::kUint16 ? 2 : 4;
  std::vector<uint8_t> bytes(static_cast<size_t>(count) * width);
  for (int64_t i = 0; i < count; ++i) {
    std::memcpy(bytes.data() + i * static_cast<int64_t>(width), &tokens[static_cast<size_t>(begin + i)],
                width);  // little-endian host
  }
  return bytes;
}

std::vector<ShardSpec> write_shards(const fs::path& root, const SyntheticSpec& spec,
                                    const std::vector<uint32_t>& tokens) {
  std::vector<ShardSpec> shards;
  const int64_t per_shard = spec.num_tokens / spec.shards;
  for (int s = 0; s < spec.shards; ++s) {
    const int64_t count = s + 1 == spec.shards ? spec.num_tokens - per_shard * s : per_shard;
    const std::vector<uint8_t> bytes = shard_bytes(tokens, per_shard * s, count, spec.token_dtype);
    char name[32];
    std::snprintf(name, sizeof(name), "data/shard_%03d.bin", s);
    std::ofstream out(root / name, std::ios::binary);
    out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
    if (!out) throw std::runtime_error("cannot write shard " + std::string(name));
    ShardSpec shard;
    shard.path = name;
    shard.dtype = spec.token_dtype;
    shard.tokens = count;
    if (spec.checksums) shard.sha256 = sha256_hex(bytes.data(), bytes.size());
    shards.push_back(shard);
  }
  return shards;
}

// Data poisons that the job itself read: written into the stream before training.
void poison_tokens(std::vector<uint32_t>& tokens, const SyntheticSpec& spec, int64_t sample) {
  const int64_t begin = sample * spec.seq_len;
  const FaultKind kind = spec.fault.kind;
  if (kind == FaultKind::kRepeatRun) {
    for (int64_t i = 4; i < 4 + spec.seq_len / 2; ++i) tokens[static_cast<size_t>(begin + i)] = 17;
  }
  if (kind == FaultKind::kLowEntropy) {
    for (int64_t i = 0; i <= spec.seq_len; ++i) tokens[static_cast<size_t>(begin + i)] = i % 2 ? 3 : 5;
  }
}

// Rewrites one token of a written shard in place (damage after capture).
void rewrite_token(const fs::path& root, Manifest& m, int64_t global, uint32_t value, bool update_sha) {
  int64_t start = 0;
  for (ShardSpec& shard : m.data.shards) {
    if (global < start + shard.tokens) {
      const size_t width = shard.dtype == TokenDtype::kUint16 ? 2 : 4;
      std::fstream io(root / shard.path, std::ios::in | std::ios::out | std::ios::binary);
      io.seekp(static_cast<std::streamoff>((global - start) * static_cast<int64_t>(width)));
      io.write(reinterpret_cast<const char*>(&value), static_cast<std::streamsize>(width));
      io.close();
      if (update_sha && shard.sha256) {
        std::ifstream in(root / shard.path, std::ios::binary);
        std::vector<uint8_t> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
        shard.sha256 = sha256_hex(bytes.data(), bytes.size());
      }
      return;
    }
    start += shard.tokens;
  }
}

ParamMap init_params(const SyntheticSpec& spec, std::vector<std::string>& order) {
  torch::manual_seed(spec.init_seed);
  ParamMap params;
  for (const ParamSpec& p : expected_parameters(spec.model)) {
    const bool norm = p.name.find("norm") != std::string::npos || p.name.find("ln_") != std::string::npos;
    const bool bias = p.name.size() > 5 && p.name.compare(p.name.size() - 5, 5, ".bias") == 0;
    torch::Tensor t = bias   ? torch::zeros(p.shape)
                      : norm ? torch::ones(p.shape)
                             : torch::randn(p.shape) * 0.02;
    t.requires_grad_(true);
    params.emplace(p.name, t);
    order.push_back(p.name);
  }
  return params;
}

nlohmann::json manifest_json(const SyntheticSpec& spec, const Manifest& m) {
  const ModelConfig& mc = m.model;
  nlohmann::json model = {{"arch", arch_name(mc.arch)},      {"vocab_size", mc.vocab_size},
                          {"hidden_size", mc.hidden_size},   {"num_layers", mc.num_layers},
                          {"num_heads", mc.num_heads},       {"num_kv_heads", mc.num_kv_heads},
                          {"max_seq_len", mc.max_seq_len},   {"norm_eps", mc.norm_eps},
                          {"rope_theta", mc.rope_theta},     {"tie_embeddings", mc.tie_embeddings}};
  if (mc.arch == Arch::kLlama) model["intermediate_size"] = mc.intermediate_size;
  nlohmann::json shards = nlohmann::json::array();
  for (const ShardSpec& s : m.data.shards) {
    nlohmann::json shard = {{"path", s.path},
                            {"dtype", s.dtype == TokenDtype::kUint16 ? "uint16" : "uint32"},
                            {"tokens", s.tokens}};
    if (s.sha256) shard["sha256"] = *s.sha256;
    shards.push_back(shard);
  }
  nlohmann::json steps = nlohmann::json::array();
  for (const StepEntry& e : m.steps) {
    nlohmann::json entry = {{"step", e.step}, {"dir", e.dir}};
    if (e.samples) entry["samples"] = *e.samples;
    steps.push_back(entry);
  }
  const OptimizerConfig& o = spec.optimizer;
  nlohmann::json optimizer = {{"kind", "adamw"},        {"betas", {o.beta1, o.beta2}},
                              {"eps", o.eps},           {"weight_decay", o.weight_decay},
                              {"no_decay", o.no_decay}};
  if (o.grad_clip) optimizer["grad_clip"] = *o.grad_clip;
  nlohmann::json out = {
      {"format", "nanreplay.bundle"},
      {"version", 1},
      {"model", model},
      {"precision", spec.compute == Compute::kFp8
                        ? nlohmann::json{{"compute", "fp8"},
                                         {"fp8", {{"fwd", "e4m3"}, {"bwd", "e5m2"}, {"amax_history_len", 16}, {"margin", 0}}}}
                        : nlohmann::json{{"compute", compute_name(spec.compute)}}},
      {"optimizer", optimizer},
      {"data",
       {{"shards", shards},
        {"seq_len", m.data.seq_len},
        {"micro_batch_size", m.data.micro_batch_size},
        {"grad_accum_steps", m.data.grad_accum_steps},
        {"world_size", m.data.world_size},
        {"sampler",
         {{"kind", "randperm"}, {"seed", m.data.sampler.seed}, {"epoch", 0}, {"epoch_start_step", spec.first_step}}}}},
      {"steps", steps},
  };
  if (spec.fault.kind != FaultKind::kNone) {
    out["incident"] = {{"step", spec.fault.step}, {"symptom", "loss=nan"}};
  }
  return out;
}

// Makes head `f.head` of layer `f.layer` produce q.k products beyond fp16's
// range at position 0 (rotary leaves position 0 unrotated, so q0.k0 = |q0|^2).
void inject_head_overflow(const SyntheticSpec& spec, ParamMap& params, const FaultSpec& f) {
  const ModelConfig& m = spec.model;
  const int64_t D = m.head_dim(), C = m.hidden_size;
  const double sigma = std::sqrt(32.0 * 65520.0 / static_cast<double>(D * C));
  const torch::Tensor rows = torch::randn({D, C}) * sigma;
  const std::string pre = "model.layers." + std::to_string(f.layer) + ".self_attn.";
  const int64_t kv_head = f.head / (m.num_heads / m.num_kv_heads);
  params.at(pre + "q_proj.weight").narrow(0, f.head * D, D).copy_(rows);
  params.at(pre + "k_proj.weight").narrow(0, kv_head * D, D).copy_(rows);
}

// Makes output feature 0 of layer `f.layer`'s up projection about 1e5 in
// magnitude (normed inputs have |h|^2 ~ hidden_size), so fp16 overflows there
// while fp32 would not: the row a runaway update left behind.
void inject_mlp_overflow(const SyntheticSpec& spec, ParamMap& params, const FaultSpec& f) {
  const int64_t C = spec.model.hidden_size;
  const double sigma = 1e5 / std::sqrt(static_cast<double>(C));
  params.at("model.layers." + std::to_string(f.layer) + ".mlp.up_proj.weight")[0].copy_(torch::randn({C}) * sigma);
}

// Writes into `sample` (at `position`, which only its own window holds) the
// smallest token id that no sample of the step reads: a rare "glitch" token.
int64_t plant_glitch_token(std::vector<uint32_t>& tokens, const SyntheticSpec& spec,
                           const std::vector<std::vector<int64_t>>& step_samples, int64_t sample, int64_t position) {
  if (position < 1 || position >= spec.seq_len) throw std::invalid_argument("glitch token position out of range");
  std::vector<bool> seen(static_cast<size_t>(spec.model.vocab_size), false);
  for (const std::vector<int64_t>& rank_samples : step_samples) {
    for (int64_t s : rank_samples) {
      for (int64_t i = 0; i <= spec.seq_len; ++i) seen[tokens[static_cast<size_t>(s * spec.seq_len + i)]] = true;
    }
  }
  const auto unused = std::find(seen.begin(), seen.end(), false);
  if (unused == seen.end()) throw std::runtime_error("glitch token: every token id occurs in the step");
  const auto token = static_cast<int64_t>(unused - seen.begin());
  tokens[static_cast<size_t>(sample * spec.seq_len + position)] = static_cast<uint32_t>(token);
  return token;
}

// Flips bit `f.bit` of the first element whose exponent field is 127
// (|x| in [1, 2)), so that an exponent-MSB flip yields inf or NaN.
int64_t inject_bit_flip(ParamMap& params, const FaultSpec& f) {
  torch::Tensor t = params.at(f.param);
  float* data = t.data_ptr<float>();
  int64_t chosen = 0;
  for (int64_t i = 0; i < t.numel(); ++i) {
    uint32_t bits;
    std::memcpy(&bits, data + i, 4);
    if (((bits >> 23) & 0xff) == 127) {
      chosen = i;
      break;
    }
  }
  uint32_t bits;
  std::memcpy(&bits, data + chosen, 4);
  bits ^= (1u << f.bit);
  std::memcpy(data + chosen, &bits, 4);
  return chosen;
}

}  // namespace

SyntheticOutcome write_synthetic_bundle(const fs::path& dir, const SyntheticSpec& spec) {
  std::error_code ec;
  if (fs::exists(dir, ec) && !fs::is_empty(dir, ec)) {
    throw std::runtime_error(dir.string() + " exists and is not empty");
  }
  const fs::path parent = dir.has_parent_path() ? dir.parent_path() : fs::path(".");
  fs::create_directories(parent);
  const fs::path tmp = parent / ("." + dir.filename().string() + ".tmp-" + std::to_string(getpid()));
  fs::remove_all(tmp, ec);
  fs::create_directories(tmp / "data");
  try {
    Manifest m;
    m.model = spec.model;
    m.precision.compute = spec.compute;
    m.optimizer = spec.optimizer;
    m.data.seq_len = spec.seq_len;
    m.data.micro_batch_size = spec.micro_batch_size;
    m.data.grad_accum_steps = spec.grad_accum_steps;
    m.data.world_size = spec.world_size;
    m.data.sampler.seed = spec.sampler_seed;
    m.data.sampler.epoch_start_step = spec.first_step;
    for (int64_t s = spec.first_step; s < spec.first_step + spec.num_steps; ++s) {
      m.steps.push_back({s, "steps/" + std::to_string(s), std::nullopt});
    }
    const int64_t num_samples = (spec.num_tokens - 1) / spec.seq_len;
    const StepSampler sampler(m, num_samples, "manifest.json");
    const FaultSpec& fault = spec.fault;
    const int64_t fault_sample =
        fault.kind == FaultKind::kNone ? -1 : sampler.randperm_samples(fault.step)[0][0];
    std::vector<uint32_t> stream = random_tokens(spec);
    if (fault_sample >= 0) poison_tokens(stream, spec, fault_sample);
    SyntheticOutcome outcome;
    if (fault.kind == FaultKind::kGlitchToken) {
      const std::vector<std::vector<int64_t>> step_samples = sampler.randperm_samples(fault.step);
      outcome.fault_sample = step_samples.at(static_cast<size_t>(fault.rank)).at(static_cast<size_t>(fault.slot));
      outcome.fault_token = plant_glitch_token(stream, spec, step_samples, outcome.fault_sample, fault.position);
    }
    m.data.shards = write_shards(tmp, spec, stream);
    const TokenStream tokens(tmp, m.data.shards, "manifest.json");
    std::map<std::string, Fp8ModuleScales> fp8_scales;
    if (spec.compute == Compute::kFp8) {
      for (const char* module : {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                                 "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"}) {
        fp8_scales["model.layers.0." + std::string(module)] = {1.0, 1.0, 1.0};
      }
    }

    std::vector<std::string> order;
    ParamMap params = init_params(spec, order);
    AdamWMoments moments;
    double loss_scale = spec.loss_scale;
    for (StepEntry& entry : m.steps) {
      const int64_t s = entry.step;
      StepBatch batch{sampler.randperm_samples(s)};
      if (s == fault.step && fault.kind == FaultKind::kSamplerMismatch) {
        // The run read a different sample than randperm says (a resumed loader, say).
        const auto& list = batch.samples[0];
        int64_t other = list[0];
        while (std::find(list.begin(), list.end(), other) != list.end()) other = (other + 1) % num_samples;
        batch.samples[0][0] = other;
      }
      if (spec.record_samples || fault.kind == FaultKind::kSamplerMismatch) entry.samples = batch.samples;
      if (s == fault.step && fault.kind == FaultKind::kFp8ScaleJump) {
        fp8_scales.begin()->second.input = 1000.0;
      }
      if (s == fault.step && fault.kind == FaultKind::kFp8ScaleCollapse) {
        // Transformer Engine's scale is fp8_max / amax: an amax gone inf gives 0.
        fp8_scales.at("model.layers.0.self_attn.q_proj").input = 0.0;
      }
      double step_scale = loss_scale;
      if (s == fault.step && fault.kind == FaultKind::kLossScaleOverflow) step_scale = std::ldexp(1.0, 40);
      if (s == spec.fault.step) {
        torch::NoGradGuard no_grad;
        outcome.fault_step = s;
        outcome.first_sample = batch.samples[0][0];
        const FaultSpec& f = spec.fault;
        if (f.kind == FaultKind::kHeadOverflow) inject_head_overflow(spec, params, f);
        if (f.kind == FaultKind::kMlpOverflow) inject_mlp_overflow(spec, params, f);
        if (f.kind == FaultKind::kGlitchToken) {
          params.at(expected_parameters(spec.model).front().name)[outcome.fault_token].fill_(1e5);
        }
        if (f.kind == FaultKind::kBitFlip) {
          outcome.fault_param = f.param;
          outcome.fault_element = inject_bit_flip(params, f);
        }
        if (f.kind == FaultKind::kZeroEmbedding) {
          const std::vector<int64_t> first = tokens.sample_tokens(batch.samples[0][0], spec.seq_len);
          int64_t pos = f.position;
          while (pos + 1 < spec.seq_len &&
                 std::find(first.begin(), first.begin() + pos, first[static_cast<size_t>(pos)]) !=
                     first.begin() + pos) {
            ++pos;
          }
          outcome.zero_token = first[static_cast<size_t>(pos)];
          outcome.zero_position = pos;
          params.at("model.embed_tokens.weight")[outcome.zero_token].zero_();
        }
      }
      const fs::path step_dir = tmp / entry.dir;
      fs::create_directories(step_dir);
      std::vector<torch::Tensor> values;
      for (const std::string& name : order) values.push_back(params.at(name));
      write_tensors(step_dir / "model.safetensors", order, values, std::nullopt);
      if (spec.write_optimizer) {
        std::vector<std::string> names;
        std::vector<torch::Tensor> state;
        for (size_t i = 0; i < order.size(); ++i) {
          names.push_back(order[i] + ".exp_avg");
          state.push_back(moments.exp_avg.empty() ? torch::zeros_like(values[i]) : moments.exp_avg[i]);
          names.push_back(order[i] + ".exp_avg_sq");
          state.push_back(moments.exp_avg_sq.empty() ? torch::zeros_like(values[i])
                                                     : moments.exp_avg_sq[i]);
        }
        write_tensors(step_dir / "optimizer.safetensors", names, state, moments.step);
      }

      StepComputeOptions options;
      options.loss_scale = spec.compute == Compute::kFp16 ? step_scale : 1.0;
      options.fp8_scales = &fp8_scales;
      const StepGradients grads = compute_step_gradients(m, tokens, s, batch, params, order, options);
      outcome.losses.push_back(grads.loss);
      const bool skipped = spec.compute == Compute::kFp16 && !std::isfinite(grads.grad_norm);
      nlohmann::json logged = {{"loss", json_number(grads.loss)},
                               {"grad_norm", json_number(grads.grad_norm)},
                               {"rank_losses", nlohmann::json::array()},
                               {"rank_grad_norms", nlohmann::json::array()}};
      for (double v : grads.rank_losses) logged["rank_losses"].push_back(json_number(v));
      if (s == fault.step && fault.kind == FaultKind::kRankMismatch && grads.rank_losses.size() > 1) {
        logged["rank_losses"][1] = grads.rank_losses[1] * 1.5;
      }
      if (s == fault.step && fault.kind == FaultKind::kNotReproducible) logged["loss"] = "nan";
      for (double v : grads.rank_grad_norms) logged["rank_grad_norms"].push_back(json_number(v));
      nlohmann::json state = {{"step", s}, {"lr", spec.lr}, {"logged", logged}};
      if (spec.compute == Compute::kFp16) {
        state["loss_scale"] = step_scale;
        state["skipped"] = skipped;
      }
      if (!fp8_scales.empty()) {
        for (const auto& [module, sc] : fp8_scales) {
          state["fp8_scales"][module] = {{"input", *sc.input}, {"weight", *sc.weight}, {"grad_output", *sc.grad_output}};
        }
      }
      write_text(step_dir / "state.json", state.dump(2) + "\n");

      if (skipped) {
        loss_scale = step_scale / 2;
      } else {
        std::vector<torch::Tensor> plain;
        for (const std::string& name : order) plain.push_back(params.at(name).detach());
        adamw_update(plain, grads.grads, grads.grad_norm, moments, spec.lr, spec.optimizer, order);
      }
    }
    // Damage after the capture: the replay reads what the job did not.
    if (fault.kind == FaultKind::kTokenOutOfRange) {
      rewrite_token(tmp, m, fault_sample * spec.seq_len + 3, static_cast<uint32_t>(spec.model.vocab_size + 7), true);
    }
    if (fault.kind == FaultKind::kChecksumMismatch) {
      rewrite_token(tmp, m, fault_sample * spec.seq_len + 3, 1, false);
    }
    write_text(tmp / "manifest.json", manifest_json(spec, m).dump(2) + "\n");
    fs::remove(dir, ec);  // an empty directory the caller made
    fs::rename(tmp, dir);
    return outcome;
  } catch (...) {
    fs::remove_all(tmp, ec);
    throw;
  }
}

std::vector<std::string> synthetic_preset_names() {
  return {"clean-fp32",        "clean-bf16",       "clean-fp16",          "clean-dp",
          "clean-accum",       "clean-gqa",        "clean-gpt2",          "head-overflow",
          "bit-flip",          "silent-bit-flip",  "zero-embedding",      "token-out-of-range",
          "repeat-run",        "low-entropy",      "sampler-mismatch",    "fp8-scale-jump",
          "loss-scale-overflow", "rank-mismatch",  "not-reproducible",    "checksum-mismatch",
          "glitch-token",      "mlp-overflow",     "fp8-scale-collapse",  "demo"};
}

SyntheticSpec synthetic_preset(const std::string& name) {
  SyntheticSpec spec;
  ModelConfig& m = spec.model;
  m.arch = Arch::kLlama;
  m.vocab_size = 256;
  m.hidden_size = 64;
  m.num_layers = 2;
  m.num_heads = 4;
  m.num_kv_heads = 4;
  m.intermediate_size = 172;
  m.max_seq_len = 64;
  spec.optimizer.beta1 = 0.9;
  spec.optimizer.beta2 = 0.95;
  spec.optimizer.weight_decay = 0.1;
  spec.optimizer.grad_clip = 1.0;
  spec.optimizer.no_decay = {"*norm.weight"};
  const int64_t last = spec.first_step + spec.num_steps - 1;
  if (name == "clean-fp32") return spec;
  if (name == "clean-bf16") {
    spec.compute = Compute::kBf16;
    return spec;
  }
  if (name == "clean-fp16") {
    spec.compute = Compute::kFp16;
    return spec;
  }
  if (name == "clean-dp") {
    spec.world_size = 2;
    return spec;
  }
  if (name == "clean-gqa") {
    m.num_kv_heads = 2;
    m.tie_embeddings = true;
    return spec;
  }
  if (name == "clean-gpt2") {  // nanoGPT: LayerNorm + biases, learned positions, tied head
    m.arch = Arch::kGpt2;
    m.intermediate_size = 4 * m.hidden_size;
    m.tie_embeddings = true;
    // nanoGPT's configure_optimizers decays only the 2-D weights.
    spec.optimizer.no_decay = {"*.bias", "*ln_*.weight"};
    return spec;
  }
  if (name == "clean-accum") {
    spec.micro_batch_size = 1;
    spec.grad_accum_steps = 4;
    return spec;
  }
  // One fault each, at the last step unless the fault needs steps after it.
  const std::map<std::string, FaultKind> simple_faults = {
      {"token-out-of-range", FaultKind::kTokenOutOfRange}, {"repeat-run", FaultKind::kRepeatRun},
      {"low-entropy", FaultKind::kLowEntropy},             {"sampler-mismatch", FaultKind::kSamplerMismatch},
      {"not-reproducible", FaultKind::kNotReproducible},   {"checksum-mismatch", FaultKind::kChecksumMismatch}};
  if (const auto it = simple_faults.find(name); it != simple_faults.end()) {
    spec.fault.kind = it->second;
    spec.fault.step = last;
    return spec;
  }
  if (name == "rank-mismatch") {
    spec.world_size = 2;
    spec.fault = {FaultKind::kRankMismatch, last, 0, 0, "", 30, 5};
    return spec;
  }
  if (name == "fp8-scale-jump") {
    spec.compute = Compute::kFp8;
    spec.fault = {FaultKind::kFp8ScaleJump, last, 0, 0, "", 30, 5};
    return spec;
  }
  if (name == "loss-scale-overflow") {
    spec.compute = Compute::kFp16;
    spec.fault = {FaultKind::kLossScaleOverflow, spec.first_step + 1, 0, 0, "", 30, 5};
    return spec;
  }
  if (name == "silent-bit-flip") {  // a flipped exponent bit that never shows up as NaN
    spec.fault = {FaultKind::kBitFlip, last, 0, 0, "model.layers.0.mlp.up_proj.weight", 29, 5};
    return spec;
  }
  if (name == "head-overflow") {
    spec.compute = Compute::kFp16;
    spec.fault = {FaultKind::kHeadOverflow, last, 1, 2, "", 30, 5};
    return spec;
  }
  if (name == "bit-flip") {
    spec.fault = {FaultKind::kBitFlip, last, 0, 0, "model.layers.1.post_attention_layernorm.weight", 30, 5};
    return spec;
  }
  if (name == "zero-embedding") {
    m.norm_eps = 0.0;
    spec.fault = {FaultKind::kZeroEmbedding, last, 0, 0, "", 30, 5};
    return spec;
  }
  if (name == "glitch-token") {  // data-parallel: the bad sample is rank 1's last (micro-batch 1, row 3)
    spec.compute = Compute::kFp16;
    spec.world_size = 2;
    spec.micro_batch_size = 4;
    spec.fault = {FaultKind::kGlitchToken, last, 0, 0, "", 30, 9, 1, 7};
    return spec;
  }
  if (name == "mlp-overflow") {  // mid-window: every step from the fault on overflows (the scaler skips them)
    spec.compute = Compute::kFp16;
    spec.num_steps = 6;
    spec.fault = {FaultKind::kMlpOverflow, spec.first_step + 2, 1, 0, "", 30, 5};
    return spec;
  }
  if (name == "fp8-scale-collapse") {
    spec.compute = Compute::kFp8;
    spec.fault = {FaultKind::kFp8ScaleCollapse, last, 0, 0, "", 30, 5};
    return spec;
  }
  if (name == "demo") {
    m.hidden_size = 128;
    m.num_layers = 4;
    m.intermediate_size = 344;
    m.max_seq_len = 128;
    spec.seq_len = 64;
    spec.num_tokens = 32768;
    spec.num_steps = 6;
    spec.compute = Compute::kFp16;
    spec.fault = {FaultKind::kHeadOverflow, spec.first_step + spec.num_steps - 1, 2, 3, "", 30, 5};
    return spec;
  }
  throw std::invalid_argument("unknown preset '" + name + "'");
}

}  // namespace nanreplay
