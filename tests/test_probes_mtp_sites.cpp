// model.mtp's probe sites (probes/sites.h): each depth's sites in its block's
// scope layers.{L+k-1}, after the decoder's `loss`, in execution order; names
// that parse back; nothing of them in a model without model.mtp nor at a
// decoder layer. The replayed values are tests/py/test_family_deepseek_mtp.py's.
#include <catch2/catch.hpp>

#include <set>
#include <string>
#include <vector>

#include "probes/sites.h"

using namespace nanreplay;

namespace {

ModelConfig decoder_only() {
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

ModelConfig with_two_depths() {
  ModelConfig m = decoder_only();
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

TEST_CASE("forward_sites lists each MTP depth's sites after loss, in its block's scope", "[sites][mtp]") {
  const std::vector<std::string> decoder = names_of(forward_sites(decoder_only()));
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
  const ModelConfig without = decoder_only();
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
