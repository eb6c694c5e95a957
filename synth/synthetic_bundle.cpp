// Trains a tiny model for a few steps and writes every step as a v1 bundle.
// The same gradient code as the replay is used, so a clean synthetic bundle
// replays to exactly the losses it logged.
#include "synth/synthetic_bundle.h"

#include <cmath>
#include <fstream>
#include <iterator>
#include <map>
#include <numeric>
#include <random>
#include <stdexcept>

#include <unistd.h>

#include <torch/torch.h>

#include "loaders/bundle/manifest_writer.h"
#include "probes/param_table.h"
#include "probes/site_stats_summary.h"
#include "loaders/formats/safetensors.h"
#include "loaders/bundle/sampler.h"
#include "loaders/bundle/token_shards.h"
#include "replay/optim/optimizer.h"
#include "replay/step/step.h"
#include "reports/results/report.h"

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

// ---- the token stream -------------------------------------------------------

std::vector<uint32_t> initial_tokens(const SyntheticSpec& spec) {
  if (!spec.corpus.empty()) return std::vector<uint32_t>(spec.corpus.begin(), spec.corpus.end());
  std::mt19937_64 rng(spec.data_seed);
  std::uniform_int_distribution<int64_t> token(0, spec.model.vocab_size - 1);
  std::vector<uint32_t> tokens(static_cast<size_t>(spec.num_tokens));
  for (uint32_t& t : tokens) t = static_cast<uint32_t>(token(rng));
  return tokens;
}

// Faults that plant one rare token: it occurs nowhere in the stream but where
// the fault puts it, so no step before the fault reads it.
bool plants_token(const FaultSpec& f) {
  return f.kind == FaultKind::kHeadOverflow || f.kind == FaultKind::kGlitchToken ||
         f.kind == FaultKind::kZeroEmbedding || f.kind == FaultKind::kRepeatRun ||
         f.kind == FaultKind::kRouterOverflow || f.kind == FaultKind::kExpertOverflow ||
         f.kind == FaultKind::kSpikeToken;
}

// Where the planted token goes at the fault step: (sample, position) pairs.
struct TokenSite {
  int64_t sample;
  int64_t position;
};

std::vector<TokenSite> planted_sites(const SyntheticSpec& spec, const std::vector<std::vector<int64_t>>& batch) {
  const FaultSpec& f = spec.fault;
  const std::vector<int64_t>& list = batch.at(static_cast<size_t>(f.rank));
  std::vector<TokenSite> sites;
  if (f.kind == FaultKind::kSpikeToken) {  // every other position from 1: each one's next token is another
    for (int64_t i = 1; i < spec.seq_len; i += 2) sites.push_back({list.at(0), i});
    return sites;
  }
  if (f.kind == FaultKind::kRepeatRun) {  // half the window, from position 4
    for (int64_t i = 4; i < 4 + spec.seq_len / 2; ++i) sites.push_back({list.at(0), i});
    return sites;
  }
  if (f.position < 0 || f.position >= spec.seq_len) throw std::invalid_argument("planted token position out of range");
  const int occurrences = f.kind == FaultKind::kGlitchToken ? f.occurrences : 1;
  for (int k = 0; k < occurrences; ++k) sites.push_back({list.at(static_cast<size_t>(f.slot + k)), f.position});
  return sites;
}

// Removes `token` from the stream (it becomes its neighbour id), then writes
// it at each site.
void plant_token(std::vector<uint32_t>& tokens, const SyntheticSpec& spec, uint32_t token,
                 const std::vector<TokenSite>& sites) {
  const uint32_t stand_in = token > 0 ? token - 1 : token + 1;
  for (uint32_t& t : tokens) t = t == token ? stand_in : t;
  for (const TokenSite& site : sites) tokens[static_cast<size_t>(site.sample * spec.seq_len + site.position)] = token;
}

void poison_low_entropy(std::vector<uint32_t>& tokens, const SyntheticSpec& spec, int64_t sample) {
  const int64_t begin = sample * spec.seq_len;
  for (int64_t i = 0; i <= spec.seq_len; ++i) tokens[static_cast<size_t>(begin + i)] = i % 2 ? 3 : 5;
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

// ---- the model and the faults planted in it -----------------------------------

ParamMap init_params(const SyntheticSpec& spec, std::vector<std::string>& order) {
  torch::manual_seed(spec.init_seed);
  ParamMap params;
  for (const ParamSpec& p : expected_parameters(spec.model)) {
    const bool norm = p.name.find("norm") != std::string::npos || p.name.find("ln_") != std::string::npos;
    const bool bias = p.name.size() > 5 && p.name.compare(p.name.size() - 5, 5, ".bias") == 0;
    // Latent attention's q_b_proj and kv_a_proj_with_mqa make its q and k.
    const bool qk = p.name.find("q_proj") != std::string::npos || p.name.find("k_proj") != std::string::npos ||
                    p.name.find("q_b_proj") != std::string::npos || p.name.find("kv_a_proj") != std::string::npos;
    // The options' extra parameters start away from their neutral values, so
    // a replay that ignored or misplaced one would not match the run.
    // GPT-OSS's router and expert biases too (none of Qwen3-MoE's parameters is a bias).
    const bool moe_bias = bias && p.name.find(".mlp.") != std::string::npos && spec.model.moe.has_value();
    const bool attention_extra = (p.name.find("self_attn.") != std::string::npos && (bias || norm)) || moe_bias;
    // Gemma's norms scale by 1 + weight: theirs start near 0 (a replay without the offset would double them).
    const double unit = spec.model.rms_norm_offset ? 0.0 : 1.0;
    torch::Tensor t = attention_extra ? (bias ? torch::randn(p.shape) * 0.1 : unit + torch::randn(p.shape) * 0.1)
                      : bias          ? torch::zeros(p.shape)
                      : norm          ? (spec.model.rms_norm_offset ? torch::randn(p.shape) * 0.1 : torch::ones(p.shape))
                                      : torch::randn(p.shape) * (qk ? spec.attention_init_std : spec.init_std);
    t.requires_grad_(true);
    params.emplace(p.name, t);
    order.push_back(p.name);
  }
  return params;
}

std::string embedding_key(const ModelConfig& m) { return expected_parameters(m).front().name; }

// Head `f.head` of layer `f.layer` reads one feature of the residual stream
// that only `token`'s embedding holds: no other embedding row, no block
// writes it and no other weight reads it. For every other token the feature
// and every gradient through it are exactly zero, so AdamW never moves it
// (zero moments, zero update, decay of zero) and the head's scores stay 0.
// For the token, q k^T exceeds fp16's range many times over wherever the token
// meets itself (the diagonal first: rotary leaves q_i . k_i as is).
// With a per-head QK-norm (Qwen3, Gemma 3) q and k are normalised per head,
// so a gain on the projections alone cancels: the head's dimension 0 reads
// the token's feature (so the token's normalised q and k lie along it, at
// sqrt(D)) and the layer's q_norm and k_norm weights are large there, while
// every other head's dimension 0 is zero (the norms' weights are shared by
// the heads). The token's q k^T at itself is then 4x fp16's maximum.
void amplify_through_head_norm(const SyntheticSpec& spec, ParamMap& params, int64_t feature) {
  const ModelConfig& m = spec.model;
  const FaultSpec& f = spec.fault;
  const int64_t D = m.head_dim();
  using R = ParamRole;
  auto weight = [&](R role) -> torch::Tensor& { return params.at(param_key(m.arch, role, f.layer)); };
  const int64_t kv_head = f.head / (m.num_heads / m.num_kv_heads);
  for (const auto& [proj, heads, planted] : {std::tuple{R::kQProj, m.num_heads, static_cast<int64_t>(f.head)}, std::tuple{R::kKProj, m.num_kv_heads, kv_head}}) {
    for (int64_t h = 0; h < heads; ++h) weight(proj)[h * D].zero_();
    weight(proj)[planted * D][feature] = 1000.0;  // the token's q and k: along dimension 0 only
  }
  const double scaling = m.query_pre_attn_scalar ? std::pow(*m.query_pre_attn_scalar, -0.5) : 1.0 / std::sqrt(static_cast<double>(D));
  const double gain = std::sqrt(4.0 * 65504.0 / (static_cast<double>(D) * scaling));  // (D * gain^2) * scaling
  for (R norm : {R::kQNorm, R::kKNorm}) weight(norm)[0] = m.rms_norm_offset ? gain - 1.0 : gain;
}

// With the QK-norm over the whole projection (OLMo 2, 3) the token's q is
// normalised across every head: its planted head, the only one reading the
// feature, holds about sqrt(num_heads) per dimension (k: sqrt(num_kv_heads)).
// The norms' weights are per dimension of every head, so gains on the planted
// head's dimensions take the token's q k^T at itself to 4x fp16's maximum;
// every other token is zero there, and so is every gradient through the gains.
void amplify_through_full_norm(const SyntheticSpec& spec, ParamMap& params, int64_t kv_head) {
  const ModelConfig& m = spec.model;
  const FaultSpec& f = spec.fault;
  const int64_t D = m.head_dim();
  const double heads = std::sqrt(static_cast<double>(m.num_heads * m.num_kv_heads));
  const double gain = std::sqrt(4.0 * 65504.0 / (static_cast<double>(D) * heads));
  params.at(param_key(m.arch, ParamRole::kQNorm, f.layer)).narrow(0, f.head * D, D).fill_(gain);
  params.at(param_key(m.arch, ParamRole::kKNorm, f.layer)).narrow(0, kv_head * D, D).fill_(gain);
}

// Latent attention (DeepSeek-V3's MLA) has no q_proj / k_proj rows per head:
// head f.head's q and k come out of two latents. One dimension of each
// (latent dimension 0) reads only the token's feature, and of their readers
// only the head's nope rows of q_b_proj (q_proj itself without a q latent)
// and of kv_b_proj read it, reading nothing else; the q rotary rows, the
// other heads and v read it nowhere, and the rotary key k_pe every head
// shares (kv_a_proj_with_mqa's last rows) does not read the feature. For
// every other token the head's q_nope and k_nope are exactly zero, so (as in
// amplify_token_in_head) no gradient reaches the planted weights; the token's
// own q_nope . k_nope (about 8 x 800 x 570) overflows fp16, q and k finite.
constexpr double kLatentOverflowLatentGain = 10.0;  // the token's latent dimension: far above the others
constexpr double kLatentOverflowHeadGain = 200.0;   // each nope dim of q and k reading it

void amplify_token_in_latent_head(const SyntheticSpec& spec, ParamMap& params, int64_t token) {
  const ModelConfig& m = spec.model;
  const FaultSpec& f = spec.fault;
  const LatentAttention& a = *m.latent_attention;
  const int64_t N = a.qk_nope_head_dim, R = a.qk_rope_head_dim, Dv = a.v_head_dim;
  constexpr int64_t kFeature = 0;
  torch::Tensor embedding = params.at(embedding_key(m));
  embedding.select(1, kFeature).zero_();
  embedding[token][kFeature] = 0.5;
  using Role = ParamRole;
  auto weight = [&](Role role, int layer) -> torch::Tensor& { return params.at(param_key(m.arch, role, layer)); };
  const Role q_reader = a.q_lora_rank > 0 ? Role::kQAProj : Role::kQProj;
  for (int layer = 0; layer < m.num_layers; ++layer) {
    for (Role reader : {q_reader, Role::kKvAProj, Role::kGateProj, Role::kUpProj}) {
      weight(reader, layer).select(1, kFeature).zero_();
    }
    for (Role writer : {Role::kOProj, Role::kDownProj}) weight(writer, layer)[kFeature].zero_();
  }
  if (!m.tie_embeddings) weight(Role::kLmHead, -1).select(1, kFeature).zero_();
  // Rows `first, count` of `w` read column `column` alone, at `gain`; no other row reads that column.
  const auto read_only = [](torch::Tensor& w, int64_t first, int64_t count, int64_t column, double gain) {
    w.select(1, column).zero_();
    w.narrow(0, first, count).zero_();
    w.narrow(0, first, count).select(1, column).fill_(gain);
  };
  if (a.q_lora_rank > 0) {
    read_only(weight(Role::kQAProj, f.layer), 0, 1, kFeature, kLatentOverflowLatentGain);
    read_only(weight(Role::kQBProj, f.layer), f.head * (N + R), N, 0, kLatentOverflowHeadGain);
  } else {
    read_only(weight(Role::kQProj, f.layer), f.head * (N + R), N, kFeature, kLatentOverflowHeadGain);
  }
  read_only(weight(Role::kKvAProj, f.layer), 0, 1, kFeature, kLatentOverflowLatentGain);
  read_only(weight(Role::kKvBProj, f.layer), f.head * (N + Dv), N, 0, kLatentOverflowHeadGain);
}

void amplify_token_in_head(const SyntheticSpec& spec, ParamMap& params, int64_t token) {
  const ModelConfig& m = spec.model;
  const FaultSpec& f = spec.fault;
  if (m.latent_attention) {
    amplify_token_in_latent_head(spec, params, token);
    return;
  }
  const int64_t D = m.head_dim(), C = m.hidden_size;
  constexpr int64_t kFeature = 0;
  torch::Tensor embedding = params.at(embedding_key(m));
  embedding.select(1, kFeature).zero_();
  embedding[token][kFeature] = 0.5;  // a few times the row's other entries: not an outlier row
  using R = ParamRole;
  auto weight = [&](R role, int layer) -> torch::Tensor& { return params.at(param_key(m.arch, role, layer)); };
  for (int layer = 0; layer < m.num_layers; ++layer) {
    for (R reader : {R::kQProj, R::kKProj, R::kVProj, R::kGateProj, R::kUpProj}) {
      weight(reader, layer).select(1, kFeature).zero_();
    }
    for (R writer : {R::kOProj, R::kDownProj}) weight(writer, layer)[kFeature].zero_();
    if (m.o_proj_bias) weight(R::kOProjBias, layer)[kFeature].zero_();  // GPT-OSS: a bias writes every token
  }
  if (!m.tie_embeddings) weight(R::kLmHead, -1).select(1, kFeature).zero_();
  // Partial rotary (Phi, GLM): the head reads the feature only in the dims
  // rotary leaves as they are, so its score is the same at every distance.
  const int64_t rotated = m.partial_rotary_factor < 1.0 ? m.rotary_dim() : 0;
  // At a normalized value of 1 (the token's is larger) q k^T is 4x fp16's maximum.
  const double c = std::sqrt(4.0 * 65504.0 / static_cast<double>(D - rotated));
  const torch::Tensor reads_feature = torch::zeros({D, C});
  reads_feature.narrow(0, rotated, D - rotated).select(1, kFeature).fill_(c);
  const int64_t kv_head = f.head / (m.num_heads / m.num_kv_heads);
  if (m.qk_norm == QkNorm::kHead) {
    amplify_through_head_norm(spec, params, kFeature);
    return;
  }
  weight(R::kQProj, f.layer).narrow(0, f.head * D, D).copy_(reads_feature);
  weight(R::kKProj, f.layer).narrow(0, kv_head * D, D).copy_(reads_feature);
  if (m.attention_bias) {  // the head's own biases would meet the amplified feature in every sample
    weight(R::kQBias, f.layer).narrow(0, f.head * D, D).zero_();
    weight(R::kKBias, f.layer).narrow(0, kv_head * D, D).zero_();
  }
  if (m.qk_norm == QkNorm::kFull) amplify_through_full_norm(spec, params, kv_head);
}

// A mixture of experts' faults, through a feature only `token`'s embedding
// holds (as amplify_token_in_head): every reader of the feature but the
// planted ones is zeroed, every writer too. Router overflow: every expert's
// router row reads it at a gain that takes the token's logits past fp16's
// range; the same gain for all experts shifts no other token's routing
// (softmax is shift-invariant) and the router's gradient summed over
// experts is zero. Expert overflow: the router prefers expert f.expert for
// the token, whose gate and up rows both read the feature (their product
// has no gradient at zero), so its up projection overflows on the token
// alone. The router's preference does pass a gradient to other tokens'
// feature: these presets train at a small learning rate, so the feature
// stays near zero for them across the window.
void amplify_token_in_experts(const SyntheticSpec& spec, ParamMap& params, int64_t token) {
  const ModelConfig& m = spec.model;
  const FaultSpec& f = spec.fault;
  constexpr int64_t kFeature = 0;
  torch::Tensor embedding = params.at(embedding_key(m));
  embedding.select(1, kFeature).zero_();
  embedding[token][kFeature] = 0.5;
  using R = ParamRole;
  auto weight = [&](R role, int layer, int expert = -1) -> torch::Tensor& {
    return params.at(param_key(m.arch, role, layer, expert));
  };
  // Attention's readers of the feature: q/k/v, or latent attention's q and kv down-projections.
  std::vector<R> attention_readers = {R::kQProj, R::kKProj, R::kVProj};
  if (m.latent_attention) {
    attention_readers = {m.latent_attention->q_lora_rank > 0 ? R::kQAProj : R::kQProj, R::kKvAProj};
  }
  for (int layer = 0; layer < m.num_layers; ++layer) {
    for (R reader : attention_readers) weight(reader, layer).select(1, kFeature).zero_();
    weight(R::kOProj, layer)[kFeature].zero_();
    if (!m.moe_layer(layer)) {  // a dense layer among the expert ones (Llama 4's moe.layers)
      for (R reader : {R::kGateProj, R::kUpProj}) weight(reader, layer).select(1, kFeature).zero_();
      weight(R::kDownProj, layer)[kFeature].zero_();
      continue;
    }
    weight(R::kRouter, layer).select(1, kFeature).zero_();
    if (m.moe->shared_expert_intermediate_size > 0) {  // Llama 4's shared expert reads every token
      for (R reader : {R::kSharedGateProj, R::kSharedUpProj}) weight(reader, layer).select(1, kFeature).zero_();
      weight(R::kSharedDownProj, layer)[kFeature].zero_();
    }
    for (int e = 0; e < m.moe->num_experts; ++e) {
      for (R reader : {R::kExpertGateProj, R::kExpertUpProj}) weight(reader, layer, e).select(1, kFeature).zero_();
      weight(R::kExpertDownProj, layer, e)[kFeature].zero_();
    }
  }
  if (!m.tie_embeddings) weight(R::kLmHead, -1).select(1, kFeature).zero_();
  // GPT-OSS's biases write every token's feature: zeroed there, as the projections.
  for (int layer = 0; layer < m.num_layers; ++layer) {
    if (m.o_proj_bias) weight(R::kOProjBias, layer)[kFeature].zero_();
    for (int e = 0; e < m.moe->num_experts && m.moe->expert_bias; ++e) weight(R::kExpertDownBias, layer, e)[kFeature].zero_();
  }
  // The token's normalized feature is several times 1, so a gain just inside
  // fp16's range (the weight itself must round to a finite value) overflows.
  const double overflowing = 60000.0;
  if (f.kind == FaultKind::kRouterOverflow) {
    weight(R::kRouter, f.layer).select(1, kFeature).fill_(overflowing);
    return;
  }
  weight(R::kRouter, f.layer)[f.expert][kFeature] = 30.0;  // probability ~1 for the token
  if (m.moe->expert_activation == ExpertActivation::kGptOss) {
    // GPT-OSS's experts: gate and up each a few hundred, finite, their product
    // (the activation, unclamped) past fp16's range; a swiglu_limit catches it.
    weight(R::kExpertGateProj, f.layer, f.expert)[0][kFeature] = 200.0;
    weight(R::kExpertUpProj, f.layer, f.expert)[0][kFeature] = 200.0;
    return;
  }
  weight(R::kExpertGateProj, f.layer, f.expert)[0][kFeature] = 1.0;
  weight(R::kExpertUpProj, f.layer, f.expert)[0][kFeature] = overflowing;
}

// A token the model has never read, whose embedding row points along hidden
// feature 0 with norm `embedding_value` (typical rows: 0.16), and whose own
// lm_head row points the same way with norm kSpikeHeadGain: where it is
// read, the final norm hands the head ~sqrt(hidden) along feature 0, so the
// model predicts the token itself with a logit near 8 * 5 = 40 and the loss
// there is ~40 nats, finite; everywhere else its logit is ~N(0, 25), too
// small to move a loss of ln(vocab). Needs an untied head.
constexpr double kSpikeHeadGain = 5.0;

void plant_spike_token(const SyntheticSpec& spec, ParamMap& params, int64_t token) {
  if (spec.model.tie_embeddings) throw std::invalid_argument("the spike token needs an untied lm_head");
  torch::Tensor row = params.at(embedding_key(spec.model))[token];
  row.zero_();
  row[0].fill_(spec.fault.embedding_value);
  torch::Tensor head = params.at(param_key(spec.model.arch, ParamRole::kLmHead))[token];
  head.zero_();
  head[0].fill_(kSpikeHeadGain);
}

// Attention-logit growth (spike-logit-growth): head f.head of layer f.layer
// writes one feature of the residual stream that nothing else writes or
// reads but the (untied) lm_head, so the head's output reaches the logits
// directly. While the head's query-key logits are small its softmax averages
// many keys, whose values along that feature have random signs and mostly
// cancel; as the logits grow it picks one key per query and hands the
// logits that key's whole value: the loss rises with the head's largest
// logit. The q and k rows grow by kLogitGrowthPerStep into every
// checkpoint of the window, then by kLogitGrowthAtSpike into the fault
// step's (the logits by the square of each): the spike step's logits leave
// their trend 4x while q and k leave theirs 2x, below the site ratio, so
// the origin is the scores, not the projections before them.
constexpr double kLogitGrowthPerStep = 2.0;
constexpr double kLogitGrowthAtSpike = 4.0;
constexpr double kLogitGrowthOutGain = 0.1;   // o_proj: head -> the feature
constexpr double kLogitGrowthHeadGain = 3.0;  // lm_head: the feature -> every token's logit

void scale_head_qk(const SyntheticSpec& spec, ParamMap& params, double factor) {
  const ModelConfig& m = spec.model;
  const FaultSpec& f = spec.fault;
  const int64_t D = m.head_dim();
  const int64_t kv_head = f.head / (m.num_heads / m.num_kv_heads);
  params.at(param_key(m.arch, ParamRole::kQProj, f.layer)).narrow(0, f.head * D, D).mul_(factor);
  params.at(param_key(m.arch, ParamRole::kKProj, f.layer)).narrow(0, kv_head * D, D).mul_(factor);
}

void plant_logit_growth(const SyntheticSpec& spec, ParamMap& params) {
  const ModelConfig& m = spec.model;
  const FaultSpec& f = spec.fault;
  if (m.tie_embeddings) throw std::invalid_argument("logit growth needs an untied lm_head");
  const int64_t D = m.head_dim();
  constexpr int64_t kFeature = 0;
  using R = ParamRole;
  auto weight = [&](R role, int layer) -> torch::Tensor& { return params.at(param_key(m.arch, role, layer)); };
  params.at(embedding_key(m)).select(1, kFeature).zero_();
  for (int layer = 0; layer < m.num_layers; ++layer) {
    for (R reader : {R::kQProj, R::kKProj, R::kVProj, R::kGateProj, R::kUpProj}) {
      weight(reader, layer).select(1, kFeature).zero_();
    }
    for (R writer : {R::kOProj, R::kDownProj}) weight(writer, layer)[kFeature].zero_();
  }
  weight(R::kOProj, f.layer)[kFeature].narrow(0, f.head * D, D).copy_(torch::randn({D}) * kLogitGrowthOutGain);
  weight(R::kLmHead, -1).select(1, kFeature).copy_(torch::randn({m.vocab_size}) * kLogitGrowthHeadGain);
}

// Faults of the model that predate the captured window (in memory, before the
// first checkpoint): AdamW carries them from checkpoint to checkpoint.
void plant_in_model(const SyntheticSpec& spec, ParamMap& params, int64_t token) {
  torch::NoGradGuard no_grad;
  const FaultSpec& f = spec.fault;
  if (f.kind == FaultKind::kHeadOverflow || (f.kind == FaultKind::kRepeatRun && f.trigger_head)) {
    amplify_token_in_head(spec, params, token);
  }
  if (f.kind == FaultKind::kRouterOverflow || f.kind == FaultKind::kExpertOverflow) {
    amplify_token_in_experts(spec, params, token);
  }
  if (f.kind == FaultKind::kRouterCollapse) params.at(param_key(spec.model.arch, ParamRole::kRouter, f.layer)).zero_();
  if (f.kind == FaultKind::kGlitchToken) params.at(embedding_key(spec.model))[token].fill_(f.embedding_value);
  if (f.kind == FaultKind::kSpikeToken) plant_spike_token(spec, params, token);
  if (f.kind == FaultKind::kLogitGrowth) plant_logit_growth(spec, params);
  if (f.kind == FaultKind::kZeroEmbedding) params.at(embedding_key(spec.model))[token].zero_();
}

// Makes output feature 0 of layer `f.layer`'s up projection about 1e5 in
// magnitude (normed inputs have |h|^2 ~ hidden_size), so fp16 overflows there
// while fp32 would not: the row a runaway update left behind.
void inject_mlp_overflow(const SyntheticSpec& spec, ParamMap& params, const FaultSpec& f) {
  const int64_t C = spec.model.hidden_size;
  const double sigma = 1e5 / std::sqrt(static_cast<double>(C));
  params.at(param_key(spec.model.arch, ParamRole::kUpProj, f.layer))[0].copy_(torch::randn({C}) * sigma);
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
    if (((bits >> 23) & 0xff) == static_cast<uint32_t>(f.flip_exponent)) {
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

// Faults that are a change between two checkpoints, made to the parameters
// of the fault step before its checkpoint is written.
void edit_checkpoint(const SyntheticSpec& spec, ParamMap& params, SyntheticOutcome& outcome) {
  torch::NoGradGuard no_grad;
  const FaultSpec& f = spec.fault;
  if (f.kind == FaultKind::kMlpOverflow) inject_mlp_overflow(spec, params, f);
  if (f.kind == FaultKind::kBitFlip) {
    outcome.fault_param = f.param;
    outcome.fault_element = inject_bit_flip(params, f);
  }
  if (f.kind == FaultKind::kLogitGrowth) scale_head_qk(spec, params, kLogitGrowthAtSpike);
  if (f.kind == FaultKind::kNormGainOverflow) {
    params.at(f.param)[0].fill_(f.weight_scale);
    outcome.fault_param = f.param;
    outcome.fault_element = 0;
  }
  if (f.kind == FaultKind::kRewrittenWeights) {
    for (ParamRole role : {ParamRole::kQProj, ParamRole::kKProj}) {
      params.at(param_key(spec.model.arch, role, f.layer)).mul_(f.weight_scale);
    }
    outcome.fault_param = param_key(spec.model.arch, ParamRole::kQProj, f.layer);
  }
}

// Meta's interleaved-rotary layout of a q or k projection stored as Hugging
// Face's rotate-half one: the inverse of convert_llama_weights_to_hf.py's
// permute. Rows of one head go from (half, pair) order to (pair, half).
torch::Tensor to_interleaved_layout(const torch::Tensor& w, int64_t heads) {
  const int64_t D = w.size(0) / heads;
  return w.reshape({heads, 2, D / 2, -1}).transpose(1, 2).reshape(w.sizes());
}

// The tensors of a checkpoint as the bundle stores them.
std::vector<torch::Tensor> as_stored(const SyntheticSpec& spec, const std::vector<std::string>& names,
                                     std::vector<torch::Tensor> values) {
  if (!spec.mislabel_rope) return values;
  const ModelConfig& m = spec.model;
  for (int layer = 0; layer < m.num_layers; ++layer) {
    for (const auto& [role, heads] : {std::pair{ParamRole::kQProj, m.num_heads}, std::pair{ParamRole::kKProj, m.num_kv_heads}}) {
      const auto i = std::find(names.begin(), names.end(), param_key(m.arch, role, layer)) - names.begin();
      values[static_cast<size_t>(i)] = to_interleaved_layout(values[static_cast<size_t>(i)], heads);
    }
  }
  return values;
}

// DeepSeek-V3's correction bias (model.moe.router_score_bias) after `updates` steps of the
// synthetic run: a spread start, then each step torchtitan's aux-loss-free update, coeff 1e-3 times
// sign(mean load - load) made mean-zero, on a made-up per-expert load that changes every step (the
// synthetic trainer does not count its tokens per expert).
std::map<std::string, std::vector<double>> synthetic_router_score_bias(const ModelConfig& m, int64_t updates) {
  std::map<std::string, std::vector<double>> by_name;
  const int64_t E = m.moe->num_experts;
  for (int layer = 0; layer < m.num_layers; ++layer) {
    if (!m.moe_layer(layer)) continue;
    std::vector<double> bias;
    for (int64_t e = 0; e < E; ++e) bias.push_back(0.01 * static_cast<double>((e * 5 + layer * 3) % 7 - 3) / 3.0);
    for (int64_t t = 0; t < updates; ++t) {
      std::vector<double> load, delta;
      for (int64_t e = 0; e < E; ++e) load.push_back(static_cast<double>((e * 7 + t * 3 + layer) % 5));
      const double mean_load = std::accumulate(load.begin(), load.end(), 0.0) / static_cast<double>(E);
      for (int64_t e = 0; e < E; ++e) delta.push_back(1e-3 * static_cast<double>((mean_load > load[e]) - (mean_load < load[e])));
      const double mean_delta = std::accumulate(delta.begin(), delta.end(), 0.0) / static_cast<double>(E);
      for (int64_t e = 0; e < E; ++e) bias[e] += delta[e] - mean_delta;
    }
    by_name[router_score_bias_key(layer)] = bias;
  }
  return by_name;
}

// ---- training ---------------------------------------------------------------

struct Trainer {
  const SyntheticSpec& spec;
  Manifest& m;
  const StepSampler& sampler;
  int64_t num_samples;
  const TokenStream& tokens;
  const fs::path& root;
  SyntheticOutcome& outcome;
  std::vector<std::string> order;
  ParamMap params;
  OptimizerMoments moments;
  std::map<std::string, Fp8ModuleScales> fp8_scales;
  double loss_scale;

  void write_checkpoint(const fs::path& step_dir) {
    std::vector<torch::Tensor> values;
    for (const std::string& name : order) values.push_back(params.at(name));
    write_tensors(step_dir / "model.safetensors", order, as_stored(spec, order, values), std::nullopt);
    if (!spec.write_optimizer) return;
    std::vector<ParamState> states = moments.params;
    if (states.empty()) {  // before the first update: the state PyTorch would create
      for (size_t i = 0; i < order.size(); ++i) states.push_back(zero_state(*rule_of_param(*m.optimizer, order[i]).rule, values[i]));
    }
    stored_layout_of_state(states);
    std::vector<std::string> names;
    std::vector<torch::Tensor> state;
    for (size_t i = 0; i < order.size(); ++i) {
      for (const auto& [key, tensor] : states[i].tensors) {
        names.push_back(order[i] + "." + key);
        state.push_back(tensor);
      }
    }
    write_tensors(step_dir / "optimizer.safetensors", names, state, states.front().step);
  }

  // A state kept per element (Adam's moments, Muon's buffer) in the layout
  // the checkpoint stores its parameters in (mislabel_rope).
  void stored_layout_of_state(std::vector<ParamState>& states) const {
    if (!spec.mislabel_rope) return;
    for (const std::string key : {"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer"}) {
      std::vector<torch::Tensor> values;
      for (size_t i = 0; i < order.size(); ++i) {
        const auto found = states[i].tensors.find(key);
        if (found == states[i].tensors.end()) break;
        values.push_back(found->second);
      }
      if (values.size() != order.size()) continue;
      values = as_stored(spec, order, values);
      for (size_t i = 0; i < order.size(); ++i) states[i].tensors[key] = values[i];
    }
  }

  bool has_checkpoint(int64_t s) const {
    const FaultKind kind = spec.fault.kind;
    const bool edited = s == spec.fault.step && (kind == FaultKind::kBitFlip || kind == FaultKind::kMlpOverflow ||
                                                 kind == FaultKind::kRewrittenWeights || kind == FaultKind::kBadUpdate ||
                                                 kind == FaultKind::kNormGainOverflow);
    return edited || (s - spec.first_step) % std::max<int64_t>(1, spec.checkpoint_every) == 0;
  }

  // What a run with light per-step site records logs; the mismatch fault
  // logs one site as another machine computed it (its max |x| 1.5x).
  nlohmann::json logged_site_stats(int64_t s, const StepResult& grads) const {
    auto pair = [](const LoggedSiteStat& p) { return nlohmann::json{{"max_abs", p.max_abs}, {"rms", p.rms}}; };
    nlohmann::json sites = nlohmann::json::object();
    for (auto& [name, stats] : summarize_forward_sites(grads.probes)) {
      if (s == spec.fault.step && spec.fault.kind == FaultKind::kSiteStatsMismatch && name == spec.fault.site) {
        stats.whole.max_abs *= 1.5;
      }
      nlohmann::json site = pair(stats.whole);
      for (const LoggedSiteStat& h : stats.per_head) site["per_head"].push_back(pair(h));
      for (const LoggedSiteStat& e : stats.per_expert) site["per_expert"].push_back(pair(e));
      sites[name] = site;
    }
    return sites;
  }

  nlohmann::json logged_values(int64_t s, const StepResult& grads) const {
    const FaultSpec& fault = spec.fault;
    nlohmann::json logged = {{"loss", json_number(grads.loss)},
                             {"grad_norm", json_number(grads.grad_norm)},
                             {"rank_losses", nlohmann::json::array()},
                             {"rank_grad_norms", nlohmann::json::array()}};
    for (double v : grads.rank_losses) logged["rank_losses"].push_back(json_number(v));
    if (s == fault.step && fault.kind == FaultKind::kRankMismatch && grads.rank_losses.size() > 1) {
      logged["rank_losses"][1] = grads.rank_losses[1] * 1.5;
    }
    if (s == fault.step && fault.kind == FaultKind::kNotReproducible) logged["loss"] = "nan";
    if (spec.log_site_stats) logged["site_stats"] = logged_site_stats(s, grads);
    for (double v : grads.rank_grad_norms) logged["rank_grad_norms"].push_back(json_number(v));
    return logged;
  }

  void train_step(StepEntry& entry) {
    const int64_t s = entry.step;
    const FaultSpec& fault = spec.fault;
    StepBatch batch{sampler.randperm_samples(s)};
    if (s == fault.step && fault.kind == FaultKind::kSamplerMismatch) {
      // The run read a different sample than randperm says (a resumed loader, say).
      const auto& list = batch.samples[0];
      int64_t other = list[0];
      while (std::find(list.begin(), list.end(), other) != list.end()) other = (other + 1) % num_samples;
      batch.samples[0][0] = other;
    }
    if (spec.record_samples || fault.kind == FaultKind::kSamplerMismatch) entry.samples = batch.samples;
    if (s == fault.step && fault.kind == FaultKind::kFp8ScaleJump) fp8_scales.begin()->second.input = 1000.0;
    if (s == fault.step && fault.kind == FaultKind::kFp8ScaleCollapse) {
      // Transformer Engine's scale is fp8_max / amax: an amax gone inf gives 0.
      fp8_scales.at(module_key(m.model.arch, ParamRole::kQProj, 0)).input = 0.0;
    }
    double step_scale = loss_scale;
    if (s == fault.step && fault.kind == FaultKind::kLossScaleOverflow) step_scale = std::ldexp(1.0, 40);
    if (fault.kind == FaultKind::kLogitGrowth && s > spec.first_step && s < fault.step) {
      torch::NoGradGuard no_grad;
      scale_head_qk(spec, params, kLogitGrowthPerStep);
    }
    if (s == fault.step) {
      outcome.fault_step = s;
      outcome.first_sample = batch.samples[0][0];
      edit_checkpoint(spec, params, outcome);
    }
    const fs::path step_dir = root / entry.dir;
    fs::create_directories(step_dir);
    if (has_checkpoint(s)) write_checkpoint(step_dir);

    StepState replayed_state;  // what the step computes with: its loss scale and fp8 scales
    replayed_state.step = s;
    replayed_state.loss_scale = step_scale;
    replayed_state.fp8_scales = fp8_scales;
    if (m.model.moe && m.model.moe->score_bias) {
      replayed_state.router_score_bias = synthetic_router_score_bias(m.model, s - spec.first_step);
    }
    StepRequest request;
    request.probes = spec.log_site_stats ? ProbeLevel::kFull : ProbeLevel::kOff;
    const StepResult grads = replay_step({m, tokens, s, replayed_state, batch}, params, order, request);
    outcome.losses.push_back(grads.loss);
    const bool skipped = spec.compute == Compute::kFp16 && !std::isfinite(grads.grad_norm);
    nlohmann::json state = {{"step", s}, {"lr", spec.lr}, {"logged", logged_values(s, grads)}};
    if (!spec.lr_by_group.empty()) state["lr"] = spec.lr_by_group;
    if (spec.compute == Compute::kFp16) {
      state["loss_scale"] = step_scale;
      state["skipped"] = skipped;
    }
    for (const auto& [module, sc] : fp8_scales) {
      state["fp8_scales"][module] = {{"input", *sc.input}, {"weight", *sc.weight}, {"grad_output", *sc.grad_output}};
    }
    for (const auto& [name, bias] : replayed_state.router_score_bias) state["router_score_bias"][name] = bias;
    write_text(step_dir / "state.json", state.dump(2) + "\n");

    if (skipped) {
      loss_scale = step_scale / 2;
      return;
    }
    std::vector<torch::Tensor> plain;
    for (const std::string& name : order) plain.push_back(params.at(name).detach());
    const GroupLr lr_of = [this](const std::string& group) {
      const auto found = spec.lr_by_group.find(group);
      return found != spec.lr_by_group.end() ? found->second : spec.lr;
    };
    const bool bad_update = fault.kind == FaultKind::kBadUpdate && s + 1 == fault.step;
    const torch::Tensor before = bad_update ? params.at(fault.param).detach().clone() : torch::Tensor();
    optimizer_update(plain, grads.grads.all(), grads.grad_norm, moments, lr_of, spec.optimizer, order, m.model,
                     grads.attn_logit_max);
    if (bad_update) {  // the update into the fault step's checkpoint, applied weight_scale times over
      torch::NoGradGuard no_grad;
      torch::Tensor p = params.at(fault.param);
      p.copy_(before + (p - before) * fault.weight_scale);
    }
  }
};

SyntheticSpec with_corpus_size(SyntheticSpec spec) {
  if (spec.corpus.empty()) return spec;
  if (spec.model.vocab_size != 256) throw std::invalid_argument("a byte corpus needs vocab_size 256");
  spec.num_tokens = static_cast<int64_t>(spec.corpus.size());
  return spec;
}

// The manifest of the run the spec describes, before any step is trained.
Manifest training_manifest(const SyntheticSpec& spec) {
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
    StepEntry entry;
    entry.step = s;
    entry.dir = "steps/" + std::to_string(s);
    m.steps.push_back(std::move(entry));
  }
  return m;
}

// A fault that lives in the data the job trained on: a planted token, a low-entropy sample.
void plant_data_fault(std::vector<uint32_t>& stream, const SyntheticSpec& spec,
                      const std::vector<std::vector<int64_t>>& fault_batch, int64_t token, SyntheticOutcome& outcome) {
  const FaultSpec& fault = spec.fault;
  if (plants_token(fault)) {
    const std::vector<TokenSite> sites = planted_sites(spec, fault_batch);
    plant_token(stream, spec, static_cast<uint32_t>(token), sites);
    outcome.fault_token = token;
    outcome.fault_sample = sites.front().sample;
    outcome.fault_position = sites.front().position;
    if (fault.kind == FaultKind::kZeroEmbedding) {
      outcome.zero_token = token;
      outcome.zero_position = sites.front().position;
    }
  }
  if (fault.kind == FaultKind::kLowEntropy) poison_low_entropy(stream, spec, fault_batch[0][0]);
}

// Damage after the capture: the replay reads what the job did not.
void damage_after_capture(const fs::path& tmp, Manifest& m, const SyntheticSpec& spec, int64_t first_sample) {
  if (spec.fault.kind == FaultKind::kTokenOutOfRange) {
    rewrite_token(tmp, m, first_sample * spec.seq_len + 3, static_cast<uint32_t>(spec.model.vocab_size + 7), true);
  }
  if (spec.fault.kind == FaultKind::kChecksumMismatch) rewrite_token(tmp, m, first_sample * spec.seq_len + 3, 1, false);
}

// What the manifest claims: the run's, or the wrong seed a mislabeled bundle names; the incident.
void claim_in_manifest(Manifest& m, const SyntheticSpec& spec) {
  const FaultSpec& fault = spec.fault;
  if (spec.manifest_sampler_seed) m.data.sampler.seed = *spec.manifest_sampler_seed;
  if (fault.kind != FaultKind::kNone) {
    m.incident.emplace();
    m.incident->step = fault.step;
    m.incident->symptom = fault.kind == FaultKind::kRouterCollapse ? "loss plateau, one expert busy" : "loss=nan";
  }
  if (spec.incident_kind) {
    if (!m.incident) m.incident.emplace();
    m.incident->kind = spec.incident_kind;
    if (*spec.incident_kind == IncidentKind::kSpike) m.incident->symptom = "loss spike";
  }
  if (fault.kind == FaultKind::kSiteStatsMismatch) m.incident->symptom = "logged site statistics";
  if (spec.compute == Compute::kFp8) m.precision.fp8 = Fp8Config{};
}

}  // namespace

SyntheticOutcome write_synthetic_bundle(const fs::path& dir, const SyntheticSpec& requested) {
  const SyntheticSpec spec = with_corpus_size(requested);
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
    Manifest m = training_manifest(spec);
    const int64_t num_samples = (spec.num_tokens - 1) / spec.seq_len;
    const StepSampler sampler(m, num_samples, "manifest.json");
    const FaultSpec& fault = spec.fault;
    const std::vector<std::vector<int64_t>> fault_batch =
        fault.kind == FaultKind::kNone ? std::vector<std::vector<int64_t>>{} : sampler.randperm_samples(fault.step);
    std::vector<uint32_t> stream = initial_tokens(spec);
    SyntheticOutcome outcome;
    const int64_t token = spec.model.vocab_size - 1;  // the planted token, when the fault has one
    plant_data_fault(stream, spec, fault_batch, token, outcome);
    m.data.shards = write_shards(tmp, spec, stream);
    const TokenStream tokens(tmp, m.data.shards, "manifest.json");

    Trainer trainer{spec, m, sampler, num_samples, tokens, tmp, outcome, {}, {}, {}, {}, spec.loss_scale};
    trainer.params = init_params(spec, trainer.order);
    plant_in_model(spec, trainer.params, token);
    if (spec.compute == Compute::kFp8) {
      using R = ParamRole;  // every linear of layer 0 computes in fp8
      for (R role : {R::kQProj, R::kKProj, R::kVProj, R::kOProj, R::kGateProj, R::kUpProj, R::kDownProj}) {
        trainer.fp8_scales[module_key(spec.model.arch, role, 0)] = {1.0, 1.0, 1.0};
      }
    }
    for (StepEntry& entry : m.steps) trainer.train_step(entry);
    if (spec.manifest_sampler_seed) {
      for (StepEntry& entry : m.steps) entry.samples.reset();  // nothing to contradict the claimed seed
    }

    damage_after_capture(tmp, m, spec, fault_batch.empty() ? 0 : fault_batch[0][0]);
    claim_in_manifest(m, spec);
    write_text(tmp / "manifest.json", manifest_json(m).dump(2) + "\n");
    fs::remove(dir, ec);  // an empty directory the caller made
    fs::rename(tmp, dir);
    return outcome;
  } catch (...) {
    fs::remove_all(tmp, ec);
    throw;
  }
}

// ---- presets -------------------------------------------------------------------

namespace {

struct PresetDef {
  SyntheticPreset info;
  void (*configure)(SyntheticSpec&);
};

int64_t last_step(const SyntheticSpec& spec) { return spec.first_step + spec.num_steps - 1; }

void fault_at_last(SyntheticSpec& spec, FaultKind kind) {
  spec.fault.kind = kind;
  spec.fault.step = last_step(spec);
}

// fp16: a token whose embedding row has diverged to 1e5, read at three
// isolated places (three samples of the step, one position each): no run, no
// odd entropy, only the token.
void poisoned_token(SyntheticSpec& spec) {
  spec.compute = Compute::kFp16;
  fault_at_last(spec, FaultKind::kGlitchToken);
  spec.fault.occurrences = 3;
  spec.fault.position = 9;
  spec.micro_batch_size = 4;
}

// fp32 and norm_eps 0: a token whose embedding row is zero gives 0/0 in the
// first norm.
void zero_embedding(SyntheticSpec& spec) {
  spec.model.norm_eps = 0.0;
  fault_at_last(spec, FaultKind::kZeroEmbedding);
}

void head_overflow(SyntheticSpec& spec) {
  spec.compute = Compute::kFp16;
  fault_at_last(spec, FaultKind::kHeadOverflow);
  spec.fault.layer = 1;
  spec.fault.head = 2;
  spec.fault.position = 0;
}

// Qwen3-MoE's mixture of experts: 4 experts of width 48, 2 per token,
// renormalized, with both router losses.
void qwen3_moe(SyntheticSpec& spec) {
  spec.model.moe = MoeConfig{4, 2, 48, true, 0.01, 0.001};
}

// GPT-OSS's mixture of experts: 4 experts of width 48, 2 per token, the
// softmax over the top 2 logits, router and expert biases, gate and up fused,
// the clamped activation (alpha 1.702, limit 7, GptOssExperts' constants),
// the aux loss.
void gpt_oss_moe(SyntheticSpec& spec) {
  MoeConfig moe{4, 2, 48, false, 0.01, 0.0};
  moe.router = RouterKind::kTopKSoftmax;
  moe.router_bias = true;
  moe.expert_bias = true;
  moe.fused_gate_up = true;
  moe.expert_activation = ExpertActivation::kGptOss;
  moe.swiglu_alpha = 1.702;
  moe.swiglu_limit = 7.0;
  spec.model.moe = moe;
}

// fp16 MoE faults in layer 1 at the last step, trained at a small learning
// rate (amplify_token_in_experts says why). The loss scale has backed off to
// 1: the planted gains pass every token's gradient through the amplified
// feature, which a larger scale would overflow in every step's backward.
void moe_fault(SyntheticSpec& spec, FaultKind kind) {
  qwen3_moe(spec);
  spec.compute = Compute::kFp16;
  spec.loss_scale = 1.0;
  spec.lr = 3e-5;
  fault_at_last(spec, kind);
  spec.fault.layer = 1;
  spec.fault.expert = 2;
  spec.fault.position = 6;
}

// Gemma 2's caps and a sliding window, over attention that depends on positions.
void gemma2_attention(SyntheticSpec& spec) {
  spec.model.attn_logit_softcap = 2.0;  // small enough that the cap bends the scores
  spec.model.final_logit_softcap = 5.0;
  spec.model.sliding_window = 8;
  spec.attention_init_std = 0.3;
}

// Gemma 3's text model: sandwich norms scaling by 1 + weight, embeddings
// times sqrt(hidden), a per-head QK-norm, query_pre_attn_scalar, a GeGLU MLP,
// a tied head, and layer 0 sliding (window 8, the local rotary base) before a
// full-attention layer 1 (the global base, linearly scaled).
void gemma3_text(SyntheticSpec& spec) {
  ModelConfig& m = spec.model;
  m.norm_layout = NormLayout::kSandwich;
  m.rms_norm_offset = true;
  m.scale_embeddings = true;
  m.qk_norm = QkNorm::kHead;
  m.num_kv_heads = 2;
  m.explicit_head_dim = 24;
  m.query_pre_attn_scalar = 32.0;
  m.hidden_act = HiddenAct::kGeluTanh;
  m.tie_embeddings = true;
  m.norm_eps = 1e-6;
  m.sliding_window = 8;
  m.layer_types = {AttentionKind::kSliding, AttentionKind::kFull};
  m.rope_theta = 1e6;
  m.rope_local_base_freq = 10000.0;
  RopeScaling linear;
  linear.type = RopeScalingType::kLinear;
  linear.factor = 4.0;
  m.rope_scaling = linear;
  spec.attention_init_std = 0.3;
}

// OLMo 2's block: post-norm (each sublayer reads the residual itself and its
// output is normalised before the add) and the QK-norm over the whole projection.
// Weights at 1/sqrt(hidden_size): at 0.02 this toy width's sublayer outputs
// have a mean square below norm_eps, which the zero-norm check flags once a
// norm reads them directly.
void olmo2_block(SyntheticSpec& spec) {
  spec.model.norm_layout = NormLayout::kPost;
  spec.model.qk_norm = QkNorm::kFull;
  spec.init_std = 0.125;
}

// OLMo 3's text model: OLMo 2's block in 4 layers, three sliding (a window of
// 8, a quarter of the sequence) to one full, Olmo3Config's default
// layer_types; one rotary for every layer, unscaled.
void olmo3_text(SyntheticSpec& spec) {
  olmo2_block(spec);
  ModelConfig& m = spec.model;
  m.num_layers = 4;
  m.sliding_window = 8;
  m.layer_types = {AttentionKind::kSliding, AttentionKind::kSliding, AttentionKind::kSliding, AttentionKind::kFull};
  spec.attention_init_std = 0.3;
}

// Phi-4-mini's shape of Phi-3: rotary on the first 3/4 of each head
// (partial_rotary_factor 0.75), a tied head, grouped-query attention, and
// Phi-3-mini's sliding window on every layer (8 keys here).
void phi3_model(SyntheticSpec& spec) {
  ModelConfig& m = spec.model;
  m.partial_rotary_factor = 0.75;
  m.tie_embeddings = true;
  m.num_kv_heads = 2;
  m.sliding_window = 8;
  spec.attention_init_std = 0.3;
}

// GLM-4-0414: GLM's rotary (adjacent pairs, the first half of each head),
// q/k/v biases, grouped-query attention and sandwich norms (a norm after
// attention and after the MLP too).
void glm4_model(SyntheticSpec& spec) {
  ModelConfig& m = spec.model;
  m.partial_rotary_factor = 0.5;
  m.rope_style = RopeStyle::kInterleaved;
  m.attention_bias = true;
  m.num_kv_heads = 2;
  m.norm_layout = NormLayout::kSandwich;
  spec.attention_init_std = 0.3;
  spec.init_std = 0.125;  // as OLMo's (olmo2_block): a norm reads each sublayer's output
}

// GPT-OSS's attention on a dense llama block: sink logits, q/k/v and o_proj
// biases, a head_dim of its own, grouped-query attention, YaRN over an
// original context of 256 (its ramp spans the first 5 of 12 frequencies), and
// layer_types alternating a sliding window of 8 with full attention, layer 0
// sliding, as GptOssConfig's default layer_types.
void gpt_oss_attention(SyntheticSpec& spec) {
  ModelConfig& m = spec.model;
  m.attention_sinks = true;
  m.attention_bias = true;
  m.o_proj_bias = true;
  m.explicit_head_dim = 24;
  m.num_kv_heads = 2;
  RopeScaling yarn;
  yarn.type = RopeScalingType::kYarn;
  yarn.factor = 8.0;
  yarn.original_max_position_embeddings = 256;
  m.rope_scaling = yarn;
  m.sliding_window = 8;
  m.layer_types = {AttentionKind::kSliding, AttentionKind::kFull};
  spec.attention_init_std = 0.3;
}

// Llama 4's text attention on a dense llama block: its complex (interleaved)
// rotary with llama3 scaling of equal low and high frequency factors, the L2
// QK-norm after rotary on the rotary layer 0, layer 1 NoPE with attention
// temperature tuning (floor_scale 4, so the scale changes within 32
// positions), and a chunk size no sequence exceeds (chunking changes nothing).
void llama4_attention(SyntheticSpec& spec) {
  ModelConfig& m = spec.model;
  m.rope_style = RopeStyle::kInterleaved;
  RopeScaling equal_factors;  // llama3 with low_freq_factor == high_freq_factor, as Llama 4's
  equal_factors.factor = 16.0;
  equal_factors.low_freq_factor = 1.0;
  equal_factors.high_freq_factor = 1.0;
  equal_factors.original_max_position_embeddings = 32;
  m.rope_scaling = equal_factors;
  m.qk_norm = QkNorm::kL2;
  m.no_rope_layers = {1, 0};
  m.attn_temperature_tuning = ModelConfig::TemperatureTuning{4.0, 0.1};
  m.attention_chunk_size = 64;
  spec.attention_init_std = 0.3;
}

// Llama 4's mixture of experts on its attention, at a toy width: layer 0
// dense (the model's intermediate_size, Llama 4's intermediate_size_mlp),
// layer 1 routed (moe.layers, as interleave_moe_layer_step 2 gives),
// Llama4Router's top-1 sigmoid, each expert's input scaled by its score, gate
// and up one matmul (gate_up_proj), and the shared expert.
void llama4_moe(SyntheticSpec& spec) {
  llama4_attention(spec);
  spec.seq_len = 16;
  spec.model.hidden_size = 32;
  spec.model.intermediate_size = 48;
  MoeConfig moe{4, 1, 24, false, 0.0, 0.0};
  moe.router = RouterKind::kSigmoidTopK;
  moe.scale_expert_input = true;
  moe.fused_gate_up = true;
  moe.shared_expert_intermediate_size = 24;
  moe.layers = {1};
  spec.model.moe = moe;
}

// DeepSeek-V3's multi-head latent attention on a dense llama block, at a
// tiny size: q through a rank-16 latent, a rank-8 kv latent, heads of 8
// nope + 4 rotary dims for q and k and 8 for v, interleaved rotary (its
// rope_interleave), YaRN over an original context of 16 with mscale and
// mscale_all_dim unequal, so both cos/sin and the softmax scale carry a factor.
void deepseek_latent_attention(SyntheticSpec& spec) {
  ModelConfig& m = spec.model;
  m.hidden_size = 32;
  m.intermediate_size = 64;
  LatentAttention latent;
  latent.q_lora_rank = 16;
  latent.kv_lora_rank = 8;
  latent.qk_nope_head_dim = 8;
  latent.qk_rope_head_dim = 4;
  latent.v_head_dim = 8;
  m.latent_attention = latent;
  m.rope_style = RopeStyle::kInterleaved;
  RopeScaling yarn;
  yarn.type = RopeScalingType::kYarn;
  yarn.factor = 4.0;
  yarn.original_max_position_embeddings = 16;
  yarn.mscale = 1.0;
  yarn.mscale_all_dim = 0.8;
  m.rope_scaling = yarn;
  spec.attention_init_std = 0.3;
}

// DeepSeek-V3's mixture of experts on its latent attention, three layers: layer 0 dense
// (first_k_dense_replace 1), layers 1 and 2 routed by the grouped sigmoid router (8 experts in 4
// groups, the best 2 groups kept, top 2, renormalized, times 2.5) with a per-step correction bias,
// and one shared expert of the experts' width (n_shared_experts 1).
void deepseek_moe(SyntheticSpec& spec) {
  deepseek_latent_attention(spec);
  spec.model.num_layers = 3;
  MoeConfig moe{8, 2, 16, true, 0.0, 0.0};
  moe.router = RouterKind::kSigmoidGrouped;
  moe.n_group = 4;
  moe.topk_group = 2;
  moe.routed_scaling_factor = 2.5;
  moe.score_bias = true;
  moe.shared_expert_intermediate_size = 16;
  moe.layers = {1, 2};
  spec.model.moe = moe;
}

// Meta's interleaved rotary and Llama 3.1's scaling with a short original
// context, so the 32-position window spans all three frequency bands.
void llama3_rotary(SyntheticSpec& spec) {
  spec.model.rope_style = RopeStyle::kInterleaved;
  RopeScaling llama3;
  llama3.factor = 8.0;
  llama3.low_freq_factor = 1.0;
  llama3.high_freq_factor = 4.0;
  llama3.original_max_position_embeddings = 32;
  spec.model.rope_scaling = llama3;
  spec.attention_init_std = 0.3;  // attention that depends on positions, so the rotary matters
}

const std::vector<PresetDef>& preset_table() {
  static const std::vector<PresetDef> table = {
      {{"clean-fp32", "nothing: 4 healthy fp32 steps"}, [](SyntheticSpec&) {}},
      {{"clean-bf16", "nothing, in bf16"}, [](SyntheticSpec& s) { s.compute = Compute::kBf16; }},
      {{"clean-fp16", "nothing, in fp16 with a loss scale"}, [](SyntheticSpec& s) { s.compute = Compute::kFp16; }},
      {{"clean-dp", "nothing, 2 data-parallel ranks"}, [](SyntheticSpec& s) { s.world_size = 2; }},
      {{"clean-accum", "nothing, 4 micro-batches of 1 sample"},
       [](SyntheticSpec& s) {
         s.micro_batch_size = 1;
         s.grad_accum_steps = 4;
       }},
      {{"clean-gqa", "nothing, grouped-query attention and a tied head"},
       [](SyntheticSpec& s) {
         s.model.num_kv_heads = 2;
         s.model.tie_embeddings = true;
       }},
      // The llama family's options, each preset as the model it comes from.
      {{"clean-qwen2", "nothing, Qwen2's q/k/v biases (attention_bias)"},
       [](SyntheticSpec& s) { s.model.attention_bias = true; }},
      {{"clean-qwen3", "nothing, Qwen3's per-head QK-norm (qk_norm head), grouped-query attention"},
       [](SyntheticSpec& s) {
         s.model.qk_norm = QkNorm::kHead;
         s.model.num_kv_heads = 2;
       }},
      {{"qwen3-qknorm-overflow", "fp16 Qwen3: the per-head QK-norm's gain on one dimension grown until head 2 of "
                                 "layer 1 overflows q k^T on a rare token, at the last step"},
       [](SyntheticSpec& s) {
         s.model.qk_norm = QkNorm::kHead;
         s.model.num_kv_heads = 2;
         head_overflow(s);  // through the shared q_norm / k_norm gains (amplify_through_head_norm)
       }},
      {{"clean-olmo2", "nothing, OLMo 2's block: post-norm and the QK-norm over the whole projection (qk_norm full)"},
       olmo2_block},
      {{"olmo2-postnorm-overflow", "fp16 OLMo 2 (post-norm, QK-norm over the projection): one gain of layer 1's "
                                   "post-attention norm rewritten to 1e5 at the last step overflows that norm's output"},
       [](SyntheticSpec& s) {
         olmo2_block(s);
         s.compute = Compute::kFp16;
         fault_at_last(s, FaultKind::kNormGainOverflow);
         s.fault.layer = 1;
         s.fault.param = "model.layers.1.post_attention_layernorm.weight";
         s.fault.weight_scale = 1e5;  // fp16's largest is 65504: every token whose normalised value there exceeds 0.66
       }},
      {{"clean-olmo3", "nothing, OLMo 3's text model: OLMo 2's block, 4 layers, three sliding (window 8) to one full"},
       olmo3_text},
      {{"olmo3-window-overflow", "fp16 OLMo 3: head 2 of the sliding layer 1 overflows q k^T on a rare token through "
                                 "its QK-norm gains, at the last step"},
       [](SyntheticSpec& s) {
         olmo3_text(s);
         head_overflow(s);  // layer 1 (sliding), head 2
       }},
      {{"clean-phi3", "nothing, Phi-3 as Phi-4-mini: rotary on 3/4 of each head, a tied head, a sliding window of 8"},
       phi3_model},
      {{"clean-glm4", "nothing, GLM-4-0414: rotary on adjacent pairs of half of each head, q/k/v biases, sandwich norms"},
       glm4_model},
      {{"glm4-partial-rotary-overflow", "fp16 GLM-4-0414: head 2 of layer 0 overflows q k^T on a rare token in the "
                                        "half of the head rotary leaves alone, at the last step"},
       [](SyntheticSpec& s) {
         glm4_model(s);
         head_overflow(s);
         // Layer 0 reads the embeddings: deeper, each normalised sublayer output added to the stream
         // dilutes the token's feature below the overflow.
         s.fault.layer = 0;
         s.model.num_kv_heads = s.model.num_heads;  // a shared kv head: gpt-oss-head-overflow says why not
       }},
      {{"clean-gemma2", "nothing, Gemma 2's attention and final soft caps, and a sliding window of 8"}, gemma2_attention},
      {{"clean-llama3", "nothing, Meta's interleaved rotary with Llama 3.1's frequency scaling"}, llama3_rotary},
      {{"clean-gemma3", "nothing, Gemma 3's text model: sandwich norms (1 + weight), scaled embeddings, GeGLU, "
                        "a sliding layer (window 8, local rotary base) then a full one (linearly scaled rotary)"},
       gemma3_text},
      {{"gemma3-local-overflow", "fp16 Gemma 3: head 1 of the sliding layer 0 overflows q k^T on a rare token "
                                      "through its QK-norm weights, at the last step"},
       [](SyntheticSpec& s) {
         gemma3_text(s);
         head_overflow(s);
         s.fault.layer = 0;
         s.fault.head = 1;
         // The planted norm gains pass every token's gradient through the head's dimension 0: the backward
         // overflows fp16 at the preset's loss scale, so the scaler skips the steps before the fault
         // (NUMERIC_LOSS_SCALE_OVERFLOW, handled) and nothing trains the other heads' dimension 0 away
         // from zero; a run whose updates went through reaches the overflow earlier, on other tokens.
       }},
      {{"clean-combined", "nothing, every llama-family option at once (the full QK-norm), grouped-query attention"},
       [](SyntheticSpec& s) {
         llama3_rotary(s);
         gemma2_attention(s);
         s.model.attention_bias = true;
         s.model.qk_norm = QkNorm::kFull;
         s.model.num_kv_heads = 2;
       }},
      {{"clean-moe", "nothing, Qwen3-MoE's mixture of experts (4 experts, top 2, renormalized, aux and z losses)"},
       qwen3_moe},
      {{"clean-moe-bf16", "nothing, the mixture of experts in bf16"},
       [](SyntheticSpec& s) {
         qwen3_moe(s);
         s.compute = Compute::kBf16;
       }},
      {{"router-overflow", "fp16 MoE: layer 1's router amplifies a rare token until its logits overflow, at the last step"},
       [](SyntheticSpec& s) {
         moe_fault(s, FaultKind::kRouterOverflow);
         // Without a z-loss: its gradient through the amplified feature would reach every token and
         // train the run off course before the fault (softmax's own gradient sums to zero over experts).
         s.model.moe->router_z_loss_coef = 0.0;
       }},
      {{"expert-overflow", "fp16 MoE: layer 1 routes a rare token to expert 2, whose up projection overflows on it"},
       [](SyntheticSpec& s) { moe_fault(s, FaultKind::kExpertOverflow); }},
      {{"router-collapse", "fp32 MoE: layer 0's router is zero at the first step, so every token ties and goes to "
                           "experts 0 and 1 (NUMERIC_ROUTER_COLLAPSE, nothing non-finite)"},
       [](SyntheticSpec& s) {
         qwen3_moe(s);
         s.fault.kind = FaultKind::kRouterCollapse;
         s.fault.step = s.first_step;
         s.fault.layer = 0;
       }},
      // GPT-OSS's mixture of experts (issue 40), on GPT-OSS's attention.
      {{"clean-gpt-oss-moe", "nothing, GPT-OSS: its attention and mixture of experts (4 experts, top 2 logits "
                             "softmaxed, router and expert biases, the activation clamped at 7, aux loss)"},
       [](SyntheticSpec& s) {
         gpt_oss_attention(s);
         gpt_oss_moe(s);
       }},
      {{"gpt-oss-expert-overflow", "fp16 GPT-OSS run without the SwiGLU clamp: layer 1 routes a rare token to "
                                   "expert 2, whose activation overflows on it (swiglu-clamp=7 resolves it)"},
       [](SyntheticSpec& s) {
         gpt_oss_attention(s);
         moe_fault(s, FaultKind::kExpertOverflow);
         gpt_oss_moe(s);
         s.model.moe->swiglu_limit.reset();
       }},
      {{"expert-spike", "fp32 MoE: layer 1 routes a rare token to expert 2, whose up projection is about 1e5 on it "
                        "at the last step: finite, one expert's output far above the others' "
                        "(NUMERIC_EXPERT_OUTLIER_ACTIVATION); declared a spike"},
       [](SyntheticSpec& s) {
         moe_fault(s, FaultKind::kExpertOverflow);
         s.compute = Compute::kFp32;
         s.incident_kind = IncidentKind::kSpike;
       }},
      // Llama 4's mixture of experts (issue 40) on its attention (llama4_moe).
      {{"clean-llama4-moe", "nothing, Llama 4: its attention, a dense layer 0 and experts on layer 1 (4 experts, "
                            "top 1 by sigmoid, the expert's input scaled by its score, a shared expert)"},
       llama4_moe},
      {{"llama4-moe-overflow", "fp16 Llama 4 MoE: layer 1's sigmoid router sends a rare token to expert 2, whose up "
                               "projection overflows on it at the last step (beside the shared expert)"},
       [](SyntheticSpec& s) {
         moe_fault(s, FaultKind::kExpertOverflow);
         llama4_moe(s);  // in place of moe_fault's Qwen3-MoE
       }},
      // Spikes that never go non-finite (docs/spikes.md).
      {{"clean-site-stats", "nothing, every step logging its forward sites' max |x| and rms (logged.site_stats)"},
       [](SyntheticSpec& s) { s.log_site_stats = true; }},
      {{"site-mismatch", "logged site statistics where the last step's layers.1.attn.out was computed differently "
                         "(SYSTEM_SITE_MISMATCH, nothing non-finite)"},
       [](SyntheticSpec& s) {
         s.log_site_stats = true;
         fault_at_last(s, FaultKind::kSiteStatsMismatch);
         s.fault.site = "layers.1.attn.out";
       }},
      {{"spike-token", "fp32: a rare token with a large but finite embedding row, which the model predicts after "
                       "itself with a logit near 40, at every other position of one sample at the last step: the "
                       "loss spikes, nothing goes non-finite"},
       [](SyntheticSpec& s) {
         fault_at_last(s, FaultKind::kSpikeToken);
         s.fault.embedding_value = 1.0;
       }},
      {{"spike-bit-flip", "fp32: a flipped exponent bit makes one weight of the last checkpoint large but finite; "
                          "the incident is declared a spike"},
       [](SyntheticSpec& s) {
         fault_at_last(s, FaultKind::kBitFlip);
         s.fault.param = "model.layers.1.self_attn.q_proj.weight";
         s.fault.flip_exponent = 119;
         s.fault.bit = 26;
         s.incident_kind = IncidentKind::kSpike;
       }},
      {{"rewritten-weights", "fp32: layer 1's q_proj and k_proj multiplied by 1e20 outside the optimizer before "
                             "the last step, whose attention scores overflow (SYSTEM_UPDATE_MISMATCH, then NaN)"},
       [](SyntheticSpec& s) {
         fault_at_last(s, FaultKind::kRewrittenWeights);
         s.fault.layer = 1;
       }},
      {{"spike-bad-update", "fp32: the update of lm_head into the last checkpoint applied 100 times over, outside "
                            "the optimizer; the loss spikes, nothing goes non-finite; declared a spike"},
       [](SyntheticSpec& s) {
         fault_at_last(s, FaultKind::kBadUpdate);
         s.fault.param = "lm_head.weight";
         s.fault.weight_scale = 100.0;
         s.incident_kind = IncidentKind::kSpike;
       }},
      {{"spike-logit-growth", "fp32: head 2 of layer 1's q and k weights grow in every checkpoint of the window, "
                              "faster into the last; its largest query-key logit grows step by step until its "
                              "softmax picks one key per query and the loss spikes, nothing goes non-finite; "
                              "weights only (no optimizer state)"},
       [](SyntheticSpec& s) {
         fault_at_last(s, FaultKind::kLogitGrowth);
         s.fault.layer = 1;
         s.fault.head = 2;
         s.write_optimizer = false;
         // A small learning rate: the planted gains would send AdamW's first
         // updates through the feature and move the loss more than the head does.
         s.lr = 3e-5;
         // The feature's share of the loss varies from sample to sample; eight
         // samples a micro-batch, drawn by this seed, give healthy steps whose
         // losses lie within 2% with no sample far above its step's median
         // (no DATA_LOSS_OUTLIER to stand beside the spike).
         s.micro_batch_size = 8;
         s.sampler_seed = 12;
       }},
      {{"clean-gpt2", "nothing, nanoGPT's gpt2 (LayerNorm, biases, learned positions, tied head)"},
       [](SyntheticSpec& s) {
         s.model.arch = Arch::kGpt2;
         s.model.intermediate_size = 4 * s.model.hidden_size;
         s.model.tie_embeddings = true;
         s.optimizer.no_decay = {"*.bias", "*ln_*.weight"};  // nanoGPT decays only 2-D weights
       }},
      {{"head-overflow", "fp16: head 2 of layer 1 amplifies a rare token, read first at the last step"},
       head_overflow},
      {{"qwen2-head-overflow", "fp16 Qwen2 (q/k/v biases): head 2 of layer 1 amplifies a rare token at the last step"},
       [](SyntheticSpec& s) {
         head_overflow(s);
         s.model.attention_bias = true;
       }},
      {{"clean-gpt-oss-attn", "nothing, GPT-OSS's attention (sinks, q/k/v/o biases, head_dim 24, YaRN, sliding and "
                              "full layers) on a dense MLP"},
       gpt_oss_attention},
      {{"clean-llama4-attn", "nothing, Llama 4's text attention (interleaved rotary, llama3 scaling with equal factors, "
                             "L2 QK-norm on the rotary layer, a NoPE layer with temperature tuning) on a dense MLP"},
       llama4_attention},
      {{"clean-deepseek-mla", "nothing, DeepSeek-V3's multi-head latent attention (q and kv latents, a rotary key head "
                              "shared by every head, v narrower than q and k, YaRN's mscale) on a dense MLP"},
       deepseek_latent_attention},
      {{"clean-deepseek-mla-bf16", "nothing, DeepSeek-V3's multi-head latent attention in bf16"},
       [](SyntheticSpec& s) {
         deepseek_latent_attention(s);
         s.compute = Compute::kBf16;
       }},
      {{"clean-deepseek-moe", "nothing, DeepSeek-V3: latent attention, a dense layer 0 and experts on layers 1-2 "
                              "(8 experts in 4 groups, 2 groups kept, top 2 by sigmoid + a per-step correction "
                              "bias, times 2.5, a shared expert)"},
       deepseek_moe},
      {{"deepseek-moe-overflow", "fp16 DeepSeek-V3 MoE: layer 1's grouped sigmoid router sends a rare token to "
                                 "expert 2, whose up projection overflows on it at the last step (beside the shared "
                                 "expert; the correction bias changes every step but plays no part)"},
       [](SyntheticSpec& s) {
         moe_fault(s, FaultKind::kExpertOverflow);
         deepseek_moe(s);  // in place of moe_fault's Qwen3-MoE
       }},
      {{"deepseek-mla-overflow", "fp16 DeepSeek-V3 latent attention: head 2 of layer 1 reads a rare token through "
                                 "its q and kv latents (q_b_proj's and kv_b_proj's nope rows; the shared rotary key "
                                 "untouched) and its scores overflow at the last step"},
       [](SyntheticSpec& s) {
         deepseek_latent_attention(s);
         head_overflow(s);
       }},
      {{"llama4-nope-overflow", "fp16 Llama 4 attention: head 2 of layer 1, a NoPE layer (no rotary, no QK-norm), "
                                "amplifies a rare token at the last step"},
       [](SyntheticSpec& s) {
         llama4_attention(s);
         head_overflow(s);
       }},
      {{"gpt-oss-head-overflow", "fp16 GPT-OSS attention: head 2 of layer 1 (full attention) amplifies a rare token "
                                 "at the last step; its scores overflow before the sink joins the softmax"},
       [](SyntheticSpec& s) {
         gpt_oss_attention(s);
         head_overflow(s);
         // One kv head per query head: a kv head shared with another query head would pass that
         // head's gradient into the planted rows, and the feature would reach other tokens.
         s.model.num_kv_heads = s.model.num_heads;
       }},
      {{"bit-flip", "a flipped exponent bit in a norm weight of the last checkpoint (NaN)"},
       [](SyntheticSpec& s) {
         fault_at_last(s, FaultKind::kBitFlip);
         s.fault.param = "model.layers.1.post_attention_layernorm.weight";
       }},
      {{"silent-bit-flip", "a flipped exponent bit that never shows up as NaN"},
       [](SyntheticSpec& s) {
         fault_at_last(s, FaultKind::kBitFlip);
         s.fault.param = "model.layers.0.mlp.up_proj.weight";
         s.fault.bit = 29;
       }},
      {{"zero-embedding", "norm_eps 0 and a rare token whose embedding row is zero"}, zero_embedding},
      {{"token-out-of-range", "a token id >= vocab_size in the last step's batch"},
       [](SyntheticSpec& s) { fault_at_last(s, FaultKind::kTokenOutOfRange); }},
      {{"repeat-run", "fp16: a run of one token a head amplifies, in the last step's first sample"},
       [](SyntheticSpec& s) {
         head_overflow(s);
         s.fault.kind = FaultKind::kRepeatRun;
         s.fault.trigger_head = true;
       }},
      {{"low-entropy", "a sample alternating two tokens, which nothing else implicates"},
       [](SyntheticSpec& s) { fault_at_last(s, FaultKind::kLowEntropy); }},
      {{"sampler-mismatch", "recorded samples that disagree with randperm"},
       [](SyntheticSpec& s) { fault_at_last(s, FaultKind::kSamplerMismatch); }},
      {{"fp8-scale-jump", "fp8: an input scale that jumps 1000x"},
       [](SyntheticSpec& s) {
         s.compute = Compute::kFp8;
         fault_at_last(s, FaultKind::kFp8ScaleJump);
       }},
      {{"loss-scale-overflow", "fp16: a loss scale so large the backward overflows (handled by the scaler)"},
       [](SyntheticSpec& s) {
         s.compute = Compute::kFp16;
         s.fault.kind = FaultKind::kLossScaleOverflow;
         s.fault.step = s.first_step + 1;
       }},
      {{"rank-mismatch", "2 ranks: rank 1's logged loss disagrees with its replay"},
       [](SyntheticSpec& s) {
         s.world_size = 2;
         fault_at_last(s, FaultKind::kRankMismatch);
       }},
      {{"not-reproducible", "a logged NaN at a step that replays finite"},
       [](SyntheticSpec& s) { fault_at_last(s, FaultKind::kNotReproducible); }},
      {{"checksum-mismatch", "a shard byte changed after its sha256 was recorded"},
       [](SyntheticSpec& s) { fault_at_last(s, FaultKind::kChecksumMismatch); }},
      {{"glitch-token", "fp16, 2 ranks: a rare token whose embedding row is 1e5, in rank 1's last sample"},
       [](SyntheticSpec& s) {
         s.compute = Compute::kFp16;
         s.world_size = 2;
         s.micro_batch_size = 4;
         fault_at_last(s, FaultKind::kGlitchToken);
         s.fault.position = 9;
         s.fault.rank = 1;
         s.fault.slot = 7;
       }},
      {{"poisoned-token", "fp16: a token whose embedding row is 1e5, at three isolated places"}, poisoned_token},
      {{"cascade", "fp32: the zero embedding at step 101 of 5; training goes on and AdamW spreads the NaN"},
       [](SyntheticSpec& s) {
         s.num_steps = 5;
         zero_embedding(s);
         s.fault.step = s.first_step + 1;
       }},
      {{"transient-fp16", "fp16: a glitch token at step 101 of 5; the scaler skips it and later steps are clean"},
       [](SyntheticSpec& s) {
         s.compute = Compute::kFp16;
         s.num_steps = 5;
         s.fault.kind = FaultKind::kGlitchToken;
         s.fault.step = s.first_step + 1;
         s.fault.position = 9;
       }},
      {{"mlp-overflow", "fp16, 6 steps: an up_proj row edited at step 102 overflows every step from there"},
       [](SyntheticSpec& s) {
         s.compute = Compute::kFp16;
         s.num_steps = 6;
         s.fault.kind = FaultKind::kMlpOverflow;
         s.fault.step = s.first_step + 2;
         s.fault.layer = 1;
       }},
      {{"fp8-scale-collapse", "fp8: an input scale that drops to 0"},
       [](SyntheticSpec& s) {
         s.compute = Compute::kFp8;
         fault_at_last(s, FaultKind::kFp8ScaleCollapse);
       }},
      {{"mislabeled-rope", "fp32: q/k stored in Meta's interleaved layout under rotate-half names, "
                           "and the zero embedding at the last step"},
       [](SyntheticSpec& s) {
         zero_embedding(s);
         s.mislabel_rope = true;
         s.attention_init_std = 0.3;  // attention that depends on positions, so the layout matters
       }},
      {{"wrong-seed", "fp32: the manifest names another sampler seed than the run used"},
       [](SyntheticSpec& s) { s.manifest_sampler_seed = s.sampler_seed + 1; }},
      {{"demo", "fp16, 4 layers, 6 steps: head 3 of layer 2 amplifies a rare token first read at step 105"},
       [](SyntheticSpec& s) {
         s.model.hidden_size = 128;
         s.model.num_layers = 4;
         s.model.intermediate_size = 344;
         s.model.max_seq_len = 128;
         s.seq_len = 64;
         s.num_tokens = 32768;
         s.num_steps = 6;
         head_overflow(s);
         s.fault.layer = 2;
         s.fault.head = 3;
       }},
  };
  return table;
}

SyntheticSpec base_spec() {
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
  return spec;
}

}  // namespace

const std::vector<SyntheticPreset>& synthetic_presets() {
  static const std::vector<SyntheticPreset> presets = [] {
    std::vector<SyntheticPreset> out;
    for (const PresetDef& def : preset_table()) out.push_back(def.info);
    return out;
  }();
  return presets;
}

std::vector<std::string> synthetic_preset_names() {
  std::vector<std::string> names;
  for (const SyntheticPreset& p : synthetic_presets()) names.push_back(p.name);
  return names;
}

SyntheticSpec synthetic_preset(const std::string& name) {
  for (const PresetDef& def : preset_table()) {
    if (name != def.info.name) continue;
    SyntheticSpec spec = base_spec();
    def.configure(spec);
    return spec;
  }
  throw std::invalid_argument("unknown preset '" + name + "'");
}

}  // namespace nanreplay
