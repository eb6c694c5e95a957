// The site table: names, order, parsing, and the parameter table.
#include <catch2/catch.hpp>

#include <set>

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
