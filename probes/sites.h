// The one table of probe sites (report-v1): every name the trace, the report,
// the terminal and the site filters use comes from here. A site is named
// "<scope>.<site>", scope "layers.{i}" inside the blocks, none outside.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "loaders/bundle/manifest.h"

namespace nanreplay {

enum class SiteId : uint8_t {
  kEmbed,
  // model.mtp: a depth's sites before its block, in its block's scope (MTP layers only).
  kMtpEmbed,         // the embedding of the depth's rolled input ids
  kMtpEnorm,         // enorm of it
  kMtpHnorm,         // hnorm of the previous depth's output (depth 1: the decoder's final norm)
  kMtpEhProj,        // eh_proj(cat(enorm, hnorm)): the block's input
  kInput,
  kAttnNorm,
  kAttnQLatent,      // model.latent_attention (DeepSeek-V3) with a q_lora_rank: q_a_layernorm's output
  kAttnKvLatent,     // model.latent_attention: kv_a_layernorm's output
  kAttnQ,
  kAttnK,
  kAttnV,
  kAttnScores,
  kAttnProbs,
  kAttnSink,         // model.attention_sinks (GPT-OSS): each head's sink probability per query
  kAttnContext,
  kAttnOut,
  kAttnPostNorm,     // norm_layout post (OLMo 2): the norm of attn.out, added to the stream
  kAttnResidual,
  kMlpNorm,
  kMlpGate,
  kMlpUp,
  kMlpAct,
  kMlpDown,
  kMlpRouter,        // a mixture of experts in place of mlp.gate ... mlp.down
  kMlpRouterProbs,
  kMlpExpertGate,
  kMlpExpertUp,
  kMlpExpertAct,
  kMlpExpertDown,
  kMlpSharedGate,    // moe with a shared expert (Llama 4, DeepSeek-V3): its gate ... down, on every token
  kMlpSharedUp,
  kMlpSharedAct,
  kMlpSharedDown,
  kMlpCombine,
  kMlpPostNorm,      // norm_layout post: the norm of the MLP's output
  kOutput,
  kMtpFinalNorm,     // model.mtp: the depth's shared_head.norm of its block's output
  kMtpLogits,        // the model's output head on it
  kMtpLoss,          // the depth's masked mean cross-entropy (scalar)
  kFinalNorm,
  kLogits,
  kLoss,
};

// How a site's tensor is laid out, which fixes how its first non-finite
// element is decoded into (sample, head, position).
enum class SiteLayout {
  kTokens,       // [batch, position, features]
  kHeadsSquare,  // [batch, head, query position, key position] (scores, probs)
  kHeadsDim,     // [batch, head, position, head_dim] (context)
  kExperts,      // [routed token, features], rows grouped by expert (per-expert sites)
  kScalar,       // the loss
};

// Which MLP a layer site belongs to: every layer has one or the other (model.moe.layers decides).
enum class MlpKind : uint8_t { kAny, kDense, kExperts };

struct SiteDef {
  SiteId id;
  const char* name;  // without the "layers.{i}." scope
  bool in_layer;
  SiteLayout layout;
  bool causal;       // only key <= query counts (scores, probs)
  bool llama;        // present in the llama forward
  bool gpt2;         // present in the gpt2 forward
  MlpKind mlp = MlpKind::kAny;  // dense: not with model.moe; experts: only with it
  std::optional<NormLayout> norms = std::nullopt;  // set: only in models whose norms sit so (pre or post; sandwich has both)
  bool (*option)(const ModelConfig&) = nullptr;  // set: only in models with this option on
  bool mtp_only = false;  // only in the multi-token prediction blocks' scopes (model.mtp), never a decoder layer's
};

const std::vector<SiteDef>& site_table();
const SiteDef& site_def(SiteId id);

struct SiteRef {
  SiteId id = SiteId::kEmbed;
  int layer = -1;  // -1 outside the layers
  bool operator==(const SiteRef& other) const { return id == other.id && layer == other.layer; }
};

std::string site_name(const SiteRef& ref);
bool is_per_head(SiteId id);
bool is_per_expert(SiteId id);
// Whether `layer` is one of model.mtp's blocks (num_layers + k - 1 for depth k), past the decoder's layers.
bool is_mtp_layer(const ModelConfig& model, int layer);
// Every layer that has sites: the decoder's, then model.mtp's blocks.
int layers_with_sites(const ModelConfig& model);
// Whether the model's forward produces this site in some layer; with `layer`, in that layer.
bool site_present(const SiteDef& def, const ModelConfig& model);
bool site_present(const SiteDef& def, const ModelConfig& model, int layer);
// Parses "layers.3.attn.q" or "logits"; nullopt when no such site.
std::optional<SiteRef> parse_site_name(const std::string& name);

// Every forward site of the model, in execution order: embed, the decoder's
// layers, final_norm, logits, loss, then each model.mtp depth's sites in its
// block's scope (mtp.embed ... mtp.eh_proj, the block's, mtp.final_norm ...
// mtp.loss). The backward order is exactly its reverse.
std::vector<SiteRef> forward_sites(const ModelConfig& model);

// Parameter keys (safetensors names) and shapes the architecture needs, in the
// spec's order: embedding, layers in order, final norm, head.
struct ParamSpec {
  std::string name;
  std::vector<int64_t> shape;
};
std::vector<ParamSpec> expected_parameters(const ModelConfig& model);
// The block a parameter key belongs to ("model.layers.3.mlp.up_proj.weight": 3), -1 outside.
int layer_of_parameter(const std::string& key);

}  // namespace nanreplay
