// The site table and the parameter table: the single source of truth for
// names, layouts and execution order.
#include "probes/sites.h"

#include <cctype>
#include <cstdlib>
#include <stdexcept>

#include "probes/param_table.h"

namespace nanreplay {

namespace {
bool with_attention_sinks(const ModelConfig& m) { return m.attention_sinks; }
bool with_q_latent(const ModelConfig& m) { return m.latent_attention && m.latent_attention->q_lora_rank > 0; }
bool with_kv_latent(const ModelConfig& m) { return m.latent_attention.has_value(); }
bool with_shared_expert_sites(const ModelConfig& m) { return m.moe && m.moe->shared_expert_intermediate_size > 0; }
constexpr bool kMtpOnly = true;
}  // namespace

const std::vector<SiteDef>& site_table() {
  using L = SiteLayout;
  using M = MlpKind;
  static const std::vector<SiteDef> table = {
      {SiteId::kEmbed, "embed", false, L::kTokens, false, true, true},
      // model.mtp (llama only): a depth's sites before its block, in the block's scope layers.{L+k-1}.
      {SiteId::kMtpEmbed, "mtp.embed", true, L::kTokens, false, true, false, M::kAny, std::nullopt, nullptr, kMtpOnly},
      {SiteId::kMtpEnorm, "mtp.enorm", true, L::kTokens, false, true, false, M::kAny, std::nullopt, nullptr, kMtpOnly},
      {SiteId::kMtpHnorm, "mtp.hnorm", true, L::kTokens, false, true, false, M::kAny, std::nullopt, nullptr, kMtpOnly},
      {SiteId::kMtpEhProj, "mtp.eh_proj", true, L::kTokens, false, true, false, M::kAny, std::nullopt, nullptr,
       kMtpOnly},
      {SiteId::kInput, "input", true, L::kTokens, false, true, true},
      {SiteId::kAttnNorm, "attn_norm", true, L::kTokens, false, true, true, M::kAny, NormLayout::kPre},
      // Latent attention (DeepSeek-V3): the compressed q and kv, each after its RMSNorm.
      {SiteId::kAttnQLatent, "attn.q_latent", true, L::kTokens, false, true, false, M::kAny, std::nullopt, with_q_latent},
      {SiteId::kAttnKvLatent, "attn.kv_latent", true, L::kTokens, false, true, false, M::kAny, std::nullopt,
       with_kv_latent},
      {SiteId::kAttnQ, "attn.q", true, L::kTokens, false, true, true},
      {SiteId::kAttnK, "attn.k", true, L::kTokens, false, true, true},
      {SiteId::kAttnV, "attn.v", true, L::kTokens, false, true, true},
      {SiteId::kAttnScores, "attn.scores", true, L::kHeadsSquare, true, true, true},
      {SiteId::kAttnProbs, "attn.probs", true, L::kHeadsSquare, true, true, true},
      // (B, H, T, 1): the share of each query's attention the head's sink takes (forward only).
      {SiteId::kAttnSink, "attn.sink", true, L::kHeadsDim, false, true, false, M::kAny, std::nullopt,
       with_attention_sinks},
      {SiteId::kAttnContext, "attn.context", true, L::kHeadsDim, false, true, true},
      {SiteId::kAttnOut, "attn.out", true, L::kTokens, false, true, true},
      {SiteId::kAttnPostNorm, "attn.post_norm", true, L::kTokens, false, true, false, M::kAny, NormLayout::kPost},
      {SiteId::kAttnResidual, "attn_residual", true, L::kTokens, false, true, true},
      {SiteId::kMlpNorm, "mlp_norm", true, L::kTokens, false, true, true, M::kAny, NormLayout::kPre},
      {SiteId::kMlpGate, "mlp.gate", true, L::kTokens, false, true, false, M::kDense},
      {SiteId::kMlpUp, "mlp.up", true, L::kTokens, false, true, true, M::kDense},
      {SiteId::kMlpAct, "mlp.act", true, L::kTokens, false, true, true, M::kDense},
      {SiteId::kMlpDown, "mlp.down", true, L::kTokens, false, true, true, M::kDense},
      {SiteId::kMlpRouter, "mlp.router", true, L::kTokens, false, true, false, M::kExperts},
      {SiteId::kMlpRouterProbs, "mlp.router_probs", true, L::kTokens, false, true, false, M::kExperts},
      {SiteId::kMlpExpertGate, "mlp.expert.gate", true, L::kExperts, false, true, false, M::kExperts},
      {SiteId::kMlpExpertUp, "mlp.expert.up", true, L::kExperts, false, true, false, M::kExperts},
      {SiteId::kMlpExpertAct, "mlp.expert.act", true, L::kExperts, false, true, false, M::kExperts},
      {SiteId::kMlpExpertDown, "mlp.expert.down", true, L::kExperts, false, true, false, M::kExperts},
      // The shared expert beside the routed ones: a dense SwiGLU MLP on every token.
      {SiteId::kMlpSharedGate, "mlp.shared.gate", true, L::kTokens, false, true, false, M::kExperts, std::nullopt,
       with_shared_expert_sites},
      {SiteId::kMlpSharedUp, "mlp.shared.up", true, L::kTokens, false, true, false, M::kExperts, std::nullopt,
       with_shared_expert_sites},
      {SiteId::kMlpSharedAct, "mlp.shared.act", true, L::kTokens, false, true, false, M::kExperts, std::nullopt,
       with_shared_expert_sites},
      {SiteId::kMlpSharedDown, "mlp.shared.down", true, L::kTokens, false, true, false, M::kExperts, std::nullopt,
       with_shared_expert_sites},
      {SiteId::kMlpCombine, "mlp.combine", true, L::kTokens, false, true, false, M::kExperts},
      {SiteId::kMlpPostNorm, "mlp.post_norm", true, L::kTokens, false, true, false, M::kAny, NormLayout::kPost},
      {SiteId::kOutput, "output", true, L::kTokens, false, true, true},
      // model.mtp: the depth's head after its block.
      {SiteId::kMtpFinalNorm, "mtp.final_norm", true, L::kTokens, false, true, false, M::kAny, std::nullopt, nullptr,
       kMtpOnly},
      {SiteId::kMtpLogits, "mtp.logits", true, L::kTokens, false, true, false, M::kAny, std::nullopt, nullptr,
       kMtpOnly},
      {SiteId::kMtpLoss, "mtp.loss", true, L::kScalar, false, true, false, M::kAny, std::nullopt, nullptr, kMtpOnly},
      {SiteId::kFinalNorm, "final_norm", false, L::kTokens, false, true, true},
      {SiteId::kLogits, "logits", false, L::kTokens, false, true, true},
      {SiteId::kLoss, "loss", false, L::kScalar, false, true, true},
  };
  return table;
}

const SiteDef& site_def(SiteId id) { return site_table().at(static_cast<size_t>(id)); }

bool is_per_head(SiteId id) {
  const SiteLayout layout = site_def(id).layout;
  return layout == SiteLayout::kHeadsSquare || layout == SiteLayout::kHeadsDim;
}

bool is_per_expert(SiteId id) { return site_def(id).layout == SiteLayout::kExperts; }

bool is_mtp_layer(const ModelConfig& model, int layer) {
  return model.mtp && layer >= model.num_layers && layer < layers_with_sites(model);
}

int layers_with_sites(const ModelConfig& model) {
  return static_cast<int>(model.num_layers + (model.mtp ? model.mtp->num_layers : 0));
}

bool site_present(const SiteDef& def, const ModelConfig& model, int layer) {
  if (!(model.arch == Arch::kLlama ? def.llama : def.gpt2)) return false;
  if (def.mtp_only && !is_mtp_layer(model, layer)) return false;
  if (def.option && !def.option(model)) return false;
  // Sandwich norms (Gemma 3) have both the pre-norm and the post-norm sites.
  if (def.norms && *def.norms != model.norm_layout && model.norm_layout != NormLayout::kSandwich) return false;
  return def.mlp == MlpKind::kAny || (def.mlp == MlpKind::kExperts) == model.moe_layer(layer);
}

bool site_present(const SiteDef& def, const ModelConfig& model) {
  if (!def.in_layer) return site_present(def, model, -1);
  for (const int layer : model.one_layer_of_each_kind()) {
    if (site_present(def, model, layer)) return true;
  }
  // model.mtp's blocks (at most 64): an MTP block may hold experts where no decoder layer does.
  for (int layer = static_cast<int>(model.num_layers); layer < layers_with_sites(model); ++layer) {
    if (site_present(def, model, layer)) return true;
  }
  return false;
}

std::string site_name(const SiteRef& ref) {
  const SiteDef& def = site_def(ref.id);
  if (!def.in_layer) return def.name;
  return "layers." + std::to_string(ref.layer) + "." + def.name;
}

std::optional<SiteRef> parse_site_name(const std::string& name) {
  std::string rest = name;
  int layer = -1;
  const std::string scope = "layers.";
  if (rest.compare(0, scope.size(), scope) == 0) {
    const size_t dot = rest.find('.', scope.size());
    if (dot == std::string::npos || dot == scope.size()) return std::nullopt;
    const std::string digits = rest.substr(scope.size(), dot - scope.size());
    if (digits.find_first_not_of("0123456789") != std::string::npos || digits.size() > 6) {
      return std::nullopt;
    }
    layer = std::stoi(digits);
    rest = rest.substr(dot + 1);
  }
  for (const SiteDef& def : site_table()) {
    if (rest == def.name && def.in_layer == (layer >= 0)) return SiteRef{def.id, layer};
  }
  return std::nullopt;
}

std::vector<SiteRef> forward_sites(const ModelConfig& model) {
  std::vector<SiteRef> order;
  auto add_layer = [&](int layer) {
    for (const SiteDef& def : site_table()) {
      if (def.in_layer && site_present(def, model, layer)) order.push_back({def.id, layer});
    }
  };
  order.push_back({SiteId::kEmbed, -1});
  for (int layer = 0; layer < model.num_layers; ++layer) add_layer(layer);
  order.push_back({SiteId::kFinalNorm, -1});
  order.push_back({SiteId::kLogits, -1});
  order.push_back({SiteId::kLoss, -1});
  // model.mtp: the depths run after the LM loss (ModelPass::head), each in its block's scope.
  for (int layer = static_cast<int>(model.num_layers); layer < layers_with_sites(model); ++layer) add_layer(layer);
  return order;
}

std::vector<ParamSpec> expected_parameters(const ModelConfig& m) {
  std::vector<ParamSpec> params;
  auto add_place = [&](ParamPlace place, int layer) {
    std::vector<const ParamDef*> per_expert;  // consecutive in the table: expert by expert
    auto add_experts = [&] {
      for (int e = 0; !per_expert.empty() && e < m.moe->num_experts; ++e) {
        for (const ParamDef* def : per_expert) params.push_back({param_key(m.arch, def->role, layer, e), def->shape(m)});
      }
      per_expert.clear();
    };
    for (const ParamDef& def : param_table(m.arch)) {
      if (def.place != place || !has_parameter(def, m, layer)) continue;
      if (is_per_expert(def)) {
        per_expert.push_back(&def);
        continue;
      }
      add_experts();
      params.push_back({param_key(m.arch, def.role, layer), def.shape(m)});
    }
    add_experts();
  };
  add_place(ParamPlace::kBefore, -1);
  for (int layer = 0; layer < m.num_layers; ++layer) add_place(ParamPlace::kLayer, layer);
  add_place(ParamPlace::kAfter, -1);
  // model.mtp: each depth's own parameters around its block, after the model's (param_table.h).
  for (int depth = 1; m.mtp && depth <= m.mtp->num_layers; ++depth) {
    for (const MtpPart part : {MtpPart::kEnorm, MtpPart::kHnorm, MtpPart::kEhProj}) {
      params.push_back({mtp_key(m, depth, part), mtp_shape(m, part)});
    }
    add_place(ParamPlace::kLayer, mtp_block_layer(m, depth));
    params.push_back({mtp_key(m, depth, MtpPart::kHeadNorm), mtp_shape(m, MtpPart::kHeadNorm)});
  }
  return params;
}

int layer_of_parameter(const std::string& key) {
  for (const Arch arch : {Arch::kLlama, Arch::kGpt2}) {
    for (const ParamDef& def : param_table(arch)) {
      if (def.place != ParamPlace::kLayer) continue;
      const std::string prefix = std::string(def.key).substr(0, std::string(def.key).find("{i}"));
      if (key.compare(0, prefix.size(), prefix) == 0 && prefix.size() < key.size() && std::isdigit(key[prefix.size()])) {
        return std::atoi(key.c_str() + prefix.size());
      }
    }
  }
  return -1;
}

}  // namespace nanreplay
