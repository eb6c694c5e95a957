// The site table and the parameter table: the single source of truth for
// names, layouts and execution order.
#include "probes/sites.h"

#include <cstdlib>
#include <stdexcept>

namespace nanreplay {

const std::vector<SiteDef>& site_table() {
  using L = SiteLayout;
  static const std::vector<SiteDef> table = {
      {SiteId::kEmbed, "embed", false, L::kTokens, false, true, true},
      {SiteId::kInput, "input", true, L::kTokens, false, true, true},
      {SiteId::kAttnNorm, "attn_norm", true, L::kTokens, false, true, true},
      {SiteId::kAttnQ, "attn.q", true, L::kTokens, false, true, true},
      {SiteId::kAttnK, "attn.k", true, L::kTokens, false, true, true},
      {SiteId::kAttnV, "attn.v", true, L::kTokens, false, true, true},
      {SiteId::kAttnScores, "attn.scores", true, L::kHeadsSquare, true, true, true},
      {SiteId::kAttnProbs, "attn.probs", true, L::kHeadsSquare, true, true, true},
      {SiteId::kAttnContext, "attn.context", true, L::kHeadsDim, false, true, true},
      {SiteId::kAttnOut, "attn.out", true, L::kTokens, false, true, true},
      {SiteId::kAttnResidual, "attn_residual", true, L::kTokens, false, true, true},
      {SiteId::kMlpNorm, "mlp_norm", true, L::kTokens, false, true, true},
      {SiteId::kMlpGate, "mlp.gate", true, L::kTokens, false, true, false},
      {SiteId::kMlpUp, "mlp.up", true, L::kTokens, false, true, true},
      {SiteId::kMlpAct, "mlp.act", true, L::kTokens, false, true, true},
      {SiteId::kMlpDown, "mlp.down", true, L::kTokens, false, true, true},
      {SiteId::kOutput, "output", true, L::kTokens, false, true, true},
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
  const bool llama = model.arch == Arch::kLlama;
  auto present = [&](const SiteDef& def) { return llama ? def.llama : def.gpt2; };
  std::vector<SiteRef> order;
  order.push_back({SiteId::kEmbed, -1});
  for (int layer = 0; layer < model.num_layers; ++layer) {
    for (const SiteDef& def : site_table()) {
      if (def.in_layer && present(def)) order.push_back({def.id, layer});
    }
  }
  order.push_back({SiteId::kFinalNorm, -1});
  order.push_back({SiteId::kLogits, -1});
  order.push_back({SiteId::kLoss, -1});
  return order;
}

std::vector<ParamSpec> expected_parameters(const ModelConfig& m) {
  const int64_t hidden = m.hidden_size;
  const int64_t kv_width = m.num_kv_heads * m.head_dim();
  std::vector<ParamSpec> params;
  if (m.arch == Arch::kLlama) {
    params.push_back({"model.embed_tokens.weight", {m.vocab_size, hidden}});
    for (int64_t i = 0; i < m.num_layers; ++i) {
      const std::string p = "model.layers." + std::to_string(i) + ".";
      params.push_back({p + "input_layernorm.weight", {hidden}});
      params.push_back({p + "self_attn.q_proj.weight", {hidden, hidden}});
      params.push_back({p + "self_attn.k_proj.weight", {kv_width, hidden}});
      params.push_back({p + "self_attn.v_proj.weight", {kv_width, hidden}});
      params.push_back({p + "self_attn.o_proj.weight", {hidden, hidden}});
      params.push_back({p + "post_attention_layernorm.weight", {hidden}});
      params.push_back({p + "mlp.gate_proj.weight", {m.intermediate_size, hidden}});
      params.push_back({p + "mlp.up_proj.weight", {m.intermediate_size, hidden}});
      params.push_back({p + "mlp.down_proj.weight", {hidden, m.intermediate_size}});
    }
    params.push_back({"model.norm.weight", {hidden}});
    if (!m.tie_embeddings) params.push_back({"lm_head.weight", {m.vocab_size, hidden}});
    return params;
  }
  const int64_t ffn = 4 * hidden;
  params.push_back({"transformer.wte.weight", {m.vocab_size, hidden}});
  params.push_back({"transformer.wpe.weight", {m.max_seq_len, hidden}});
  for (int64_t i = 0; i < m.num_layers; ++i) {
    const std::string p = "transformer.h." + std::to_string(i) + ".";
    params.push_back({p + "ln_1.weight", {hidden}});
    params.push_back({p + "ln_1.bias", {hidden}});
    params.push_back({p + "attn.c_attn.weight", {3 * hidden, hidden}});
    params.push_back({p + "attn.c_attn.bias", {3 * hidden}});
    params.push_back({p + "attn.c_proj.weight", {hidden, hidden}});
    params.push_back({p + "attn.c_proj.bias", {hidden}});
    params.push_back({p + "ln_2.weight", {hidden}});
    params.push_back({p + "ln_2.bias", {hidden}});
    params.push_back({p + "mlp.c_fc.weight", {ffn, hidden}});
    params.push_back({p + "mlp.c_fc.bias", {ffn}});
    params.push_back({p + "mlp.c_proj.weight", {hidden, ffn}});
    params.push_back({p + "mlp.c_proj.bias", {hidden}});
  }
  params.push_back({"transformer.ln_f.weight", {hidden}});
  params.push_back({"transformer.ln_f.bias", {hidden}});
  return params;
}

int layer_of_parameter(const std::string& key) {
  for (const std::string prefix : {"model.layers.", "transformer.h."}) {
    if (key.compare(0, prefix.size(), prefix) == 0) return std::atoi(key.c_str() + prefix.size());
  }
  return -1;
}

}  // namespace nanreplay
