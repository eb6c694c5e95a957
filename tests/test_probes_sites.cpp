// The site table: names, order, parsing, and the parameter table; model.mtp's sites.
#include <catch2/catch.hpp>

#include <optional>
#include <set>
#include <string>
#include <vector>

#include "probes/sites.h"

using namespace nanreplay;

namespace {
ModelConfig small_llama() {
  ModelConfig m;
  m.arch = Arch::kLlama;
  m.vocab_size = 32;
  m.hidden_size = 16;
  m.num_layers = 2;
  m.num_heads = 4;
  m.num_kv_heads = 2;
  m.intermediate_size = 24;
  m.max_seq_len = 8;
  return m;
}

// model.mtp's probe sites: each depth's in its block's scope layers.{L+k-1},
// after the decoder's `loss`, in execution order; none without model.mtp nor
// at a decoder layer. The replayed values are tests/py/test_family_deepseek_mtp.py's.
ModelConfig with_two_depths() {
  ModelConfig m = small_llama();
  m.mtp = MultiTokenPrediction{2, 0.3};
  return m;
}

const std::set<SiteId> kMtpSites = {SiteId::kMtpEmbed,     SiteId::kMtpEnorm,  SiteId::kMtpHnorm, SiteId::kMtpEhProj,
                                    SiteId::kMtpFinalNorm, SiteId::kMtpLogits, SiteId::kMtpLoss};

std::vector<std::string> names_of(const std::vector<SiteRef>& sites) {
  std::vector<std::string> names;
  for (const SiteRef& s : sites) names.push_back(site_name(s));
  return names;
}

// A dense decoder layer's sites in `layer`'s scope, as forward_sites lists them.
std::vector<std::string> block_sites(int layer) {
  std::vector<std::string> names;
  for (const char* site : {"input", "attn_norm", "attn.q", "attn.k", "attn.v", "attn.scores", "attn.probs",
                           "attn.context", "attn.out", "attn_residual", "mlp_norm", "mlp.gate", "mlp.up", "mlp.act",
                           "mlp.down", "output"}) {
    names.push_back("layers." + std::to_string(layer) + "." + site);
  }
  return names;
}

}  // namespace

TEST_CASE("forward_sites lists every report-v1 site in execution order", "[sites]") {
  const auto sites = forward_sites(small_llama());
  std::vector<std::string> names;
  for (const auto& s : sites) names.push_back(site_name(s));
  const std::vector<std::string> layer0 = {
      "layers.0.input",        "layers.0.attn_norm",    "layers.0.attn.q",     "layers.0.attn.k",
      "layers.0.attn.v",       "layers.0.attn.scores",  "layers.0.attn.probs", "layers.0.attn.context",
      "layers.0.attn.out",     "layers.0.attn_residual", "layers.0.mlp_norm",  "layers.0.mlp.gate",
      "layers.0.mlp.up",       "layers.0.mlp.act",      "layers.0.mlp.down",   "layers.0.output"};
  REQUIRE(names.size() == 1 + 2 * layer0.size() + 3);
  CHECK(names.front() == "embed");
  CHECK(std::vector<std::string>(names.begin() + 1, names.begin() + 17) == layer0);
  CHECK(names[17] == "layers.1.input");
  CHECK(names[names.size() - 3] == "final_norm");
  CHECK(names[names.size() - 2] == "logits");
  CHECK(names.back() == "loss");
}

TEST_CASE("gpt2 has no mlp.gate site", "[sites]") {
  ModelConfig m = small_llama();
  m.arch = Arch::kGpt2;
  for (const auto& s : forward_sites(m)) CHECK(s.id != SiteId::kMlpGate);
}

TEST_CASE("site names parse back to the same site", "[sites]") {
  for (const auto& s : forward_sites(small_llama())) {
    const auto parsed = parse_site_name(site_name(s));
    REQUIRE(parsed);
    CHECK(*parsed == s);
  }
  CHECK_FALSE(parse_site_name("layers.x.attn.q"));
  CHECK_FALSE(parse_site_name("layers.0.embed"));
  CHECK_FALSE(parse_site_name("attn.q"));
  CHECK_FALSE(parse_site_name("nonsense"));
}

TEST_CASE("per-head sites are scores, probs, the sink's share and context; only scores and probs are causal",
          "[sites]") {
  std::set<std::string> per_head, causal;
  for (const auto& def : site_table()) {
    if (is_per_head(def.id)) per_head.insert(def.name);
    if (def.causal) causal.insert(def.name);
  }
  CHECK(per_head == std::set<std::string>{"attn.scores", "attn.probs", "attn.sink", "attn.context"});
  CHECK(causal == std::set<std::string>{"attn.scores", "attn.probs"});
}

TEST_CASE("expected_parameters follows the spec's naming, order and shapes", "[sites]") {
  ModelConfig m = small_llama();
  auto params = expected_parameters(m);
  REQUIRE(params.size() == 1 + 2 * 9 + 2);
  CHECK(params.front().name == "model.embed_tokens.weight");
  CHECK(params[3].name == "model.layers.0.self_attn.k_proj.weight");
  CHECK(params[3].shape == std::vector<int64_t>{8, 16});  // 2 kv heads x head_dim 4
  CHECK(params.back().name == "lm_head.weight");
  m.tie_embeddings = true;
  CHECK(expected_parameters(m).back().name == "model.norm.weight");

  m.arch = Arch::kGpt2;
  params = expected_parameters(m);
  CHECK(params.front().name == "transformer.wte.weight");
  CHECK(params[1].shape == std::vector<int64_t>{8, 16});  // wpe: max_seq_len x hidden
  CHECK(params[4].name == "transformer.h.0.attn.c_attn.weight");
  CHECK(params[4].shape == std::vector<int64_t>{48, 16});
  CHECK(params.back().name == "transformer.ln_f.bias");
}

TEST_CASE("forward_sites lists each MTP depth's sites after loss, in its block's scope", "[sites][mtp]") {
  const std::vector<std::string> decoder = names_of(forward_sites(small_llama()));
  const std::vector<std::string> names = names_of(forward_sites(with_two_depths()));
  // The decoder's sites first, unchanged, through `loss`.
  REQUIRE(names.size() > decoder.size());
  CHECK(std::vector<std::string>(names.begin(), names.begin() + static_cast<std::ptrdiff_t>(decoder.size())) ==
        decoder);
  CHECK(decoder.back() == "loss");
  std::vector<std::string> expected;
  for (const int layer : {2, 3}) {  // depth k's block is layer num_layers + k - 1
    const std::string scope = "layers." + std::to_string(layer) + ".";
    for (const char* site : {"mtp.embed", "mtp.enorm", "mtp.hnorm", "mtp.eh_proj"}) expected.push_back(scope + site);
    for (const std::string& site : block_sites(layer)) expected.push_back(site);
    for (const char* site : {"mtp.final_norm", "mtp.logits", "mtp.loss"}) expected.push_back(scope + site);
  }
  CHECK(std::vector<std::string>(names.begin() + static_cast<std::ptrdiff_t>(decoder.size()), names.end()) == expected);
}

TEST_CASE("MTP site names parse back to the same site", "[sites][mtp]") {
  for (const SiteRef& s : forward_sites(with_two_depths())) {
    const std::optional<SiteRef> parsed = parse_site_name(site_name(s));
    REQUIRE(parsed);
    CHECK(*parsed == s);
  }
  CHECK(parse_site_name("layers.2.mtp.eh_proj") == std::optional<SiteRef>(SiteRef{SiteId::kMtpEhProj, 2}));
  CHECK_FALSE(parse_site_name("mtp.eh_proj"));  // always in a block's scope
  CHECK_FALSE(parse_site_name("layers.2.mtp"));
  CHECK_FALSE(parse_site_name("layers.2.mtp.block"));
}

TEST_CASE("MTP sites exist only in model.mtp's blocks", "[sites][mtp]") {
  const ModelConfig without = small_llama();
  const ModelConfig with = with_two_depths();
  for (const SiteRef& s : forward_sites(without)) CHECK(kMtpSites.count(s.id) == 0);
  for (const SiteId id : kMtpSites) {
    const SiteDef& def = site_def(id);
    CHECK(def.mtp_only);
    CHECK_FALSE(site_present(def, without));
    CHECK(site_present(def, with));
    for (const int decoder_layer : {-1, 0, 1}) CHECK_FALSE(site_present(def, with, decoder_layer));
    CHECK(site_present(def, with, 2));
    CHECK(site_present(def, with, 3));
    CHECK_FALSE(site_present(def, with, 4));  // past the last depth
  }
  CHECK(site_def(SiteId::kMtpLoss).layout == SiteLayout::kScalar);
  CHECK_FALSE(is_mtp_layer(with, 1));
  CHECK(is_mtp_layer(with, 2));
  CHECK(is_mtp_layer(with, 3));
  CHECK_FALSE(is_mtp_layer(with, 4));
  CHECK(layers_with_sites(with) == 4);
  CHECK(layers_with_sites(without) == 2);
}

TEST_CASE("an MTP block with experts has the expert sites where no decoder layer does", "[sites][mtp][moe]") {
  ModelConfig m = with_two_depths();
  m.moe = MoeConfig{};
  m.moe->num_experts = 4;
  m.moe->top_k = 2;
  m.moe->layers = {2};  // depth 1's block only
  CHECK(site_present(site_def(SiteId::kMlpRouter), m));
  std::set<int> router_layers;
  for (const SiteRef& s : forward_sites(m)) {
    if (s.id == SiteId::kMlpRouter) router_layers.insert(s.layer);
  }
  CHECK(router_layers == std::set<int>{2});
}
