// The model options of the 2026 families (docs/bundle-format.md, "Model
// options"): an explicit head_dim (Qwen3, Gemma 3), partial rotary (Phi,
// GLM) and how the causal mask reaches the softmax (llama2.c's additive
// -inf, Hugging Face's finfo.min). Each is read as given, sets the shapes
// the parameter table asks for, and is refused by file and key when it
// cannot describe a model; the math is cross-checked against eager PyTorch
// in tests/py/test_family_*.py.
#include <catch2/catch.hpp>

#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "loaders/base/error.h"
#include "loaders/bundle/manifest.h"
#include "loaders/bundle/manifest_writer.h"
#include "probes/sites.h"

namespace {

using nlohmann::json;
using Catch::Matchers::Contains;

json family_manifest(const json& model_keys) {
  json manifest = R"({
    "format": "nanreplay.bundle", "version": 1,
    "model": { "arch": "llama", "vocab_size": 32, "hidden_size": 16, "num_layers": 1,
               "num_heads": 2, "intermediate_size": 40, "max_seq_len": 8 },
    "data": { "shards": [ { "path": "data/a.bin", "dtype": "uint32", "tokens": 100 } ],
              "seq_len": 8, "micro_batch_size": 2,
              "sampler": { "kind": "randperm", "seed": 0 } },
    "steps": [ { "step": 0, "dir": "steps/0" } ]
  })"_json;
  for (auto it = model_keys.begin(); it != model_keys.end(); ++it) manifest["model"][it.key()] = it.value();
  return manifest;
}

nanreplay::ModelConfig family_model(const json& model_keys) {
  return nanreplay::parse_manifest(family_manifest(model_keys).dump(), "bundle/manifest.json").model;
}

std::vector<int64_t> shape_of(const nanreplay::ModelConfig& model, const std::string& key) {
  for (const nanreplay::ParamSpec& p : nanreplay::expected_parameters(model)) {
    if (p.name == key) return p.shape;
  }
  FAIL("no parameter " << key);
  return {};
}

void check_refused(const json& model_keys, const std::string& key, const std::string& says) {
  INFO(model_keys.dump());
  CHECK_THROWS_WITH(family_model(model_keys), Contains("bundle/manifest.json: model." + key + ": " + says));
}

}  // namespace

TEST_CASE("an explicit head_dim sets q_proj and o_proj apart from hidden_size", "[arch][families]") {
  // Qwen3's layout at toy size: 3 heads of 8 over a hidden width of 20 (no multiple of 3).
  const nanreplay::ModelConfig m = family_model({{"hidden_size", 20}, {"num_heads", 3}, {"head_dim", 8}});
  CHECK(m.head_dim() == 8);
  CHECK(shape_of(m, "model.layers.0.self_attn.q_proj.weight") == std::vector<int64_t>{24, 20});
  CHECK(shape_of(m, "model.layers.0.self_attn.k_proj.weight") == std::vector<int64_t>{24, 20});
  CHECK(shape_of(m, "model.layers.0.self_attn.o_proj.weight") == std::vector<int64_t>{20, 24});
  const nanreplay::ModelConfig qwen3 =
      family_model({{"hidden_size", 20}, {"num_heads", 4}, {"num_kv_heads", 2}, {"head_dim", 6}, {"qk_norm", "head"}});
  CHECK(shape_of(qwen3, "model.layers.0.self_attn.k_proj.weight") == std::vector<int64_t>{12, 20});
  CHECK(shape_of(qwen3, "model.layers.0.self_attn.q_norm.weight") == std::vector<int64_t>{6});
  const nanreplay::ModelConfig olmo = family_model({{"head_dim", 4}, {"qk_norm", "full"}});
  CHECK(shape_of(olmo, "model.layers.0.self_attn.q_norm.weight") == std::vector<int64_t>{8});
  CHECK(nanreplay::manifest_json(nanreplay::parse_manifest(family_manifest({{"head_dim", 4}}).dump(), "m.json"))
            ["model"]["head_dim"] == 4);
  CHECK(family_model(json::object()).head_dim() == 8);  // absent: hidden_size / num_heads, as before
}

TEST_CASE("a head layout that cannot be replayed is refused by its key", "[arch][families]") {
  check_refused({{"hidden_size", 20}, {"num_heads", 3}}, "hidden_size", "expected a multiple of model.num_heads (3)");
  check_refused({{"head_dim", 7}}, "head_dim", "expected an even head_dim for llama's rotary embeddings, got 7");
  check_refused({{"head_dim", 0}}, "head_dim", "");
  check_refused({{"head_dim", "8"}}, "head_dim", "");
  check_refused({{"head_dim", int64_t{1} << 29}, {"num_heads", 4}}, "head_dim",
                "expected num_heads * head_dim of at most 2^30, got 4 * 536870912");
}

TEST_CASE("a mixture of experts with Gemma's GeGLU is refused: its experts apply silu", "[arch][families]") {
  check_refused({{"hidden_act", "gelu_pytorch_tanh"}, {"moe", {{"num_experts", 4}, {"top_k", 2}}}}, "moe",
                "the experts apply silu; hidden_act gelu_pytorch_tanh with moe is not replayed");
}

TEST_CASE("partial_rotary_factor turns int(head_dim * factor) dimensions, an even number", "[arch][families]") {
  CHECK(family_model(json::object()).rotary_dim() == 8);
  CHECK(family_model({{"partial_rotary_factor", 0.5}}).rotary_dim() == 4);
  // Python's int() of the double product: 0.6 * 10 is 6.000000000000001, 0.4 * 80 is 32.
  CHECK(family_model({{"hidden_size", 20}, {"num_heads", 2}, {"partial_rotary_factor", 0.6}}).rotary_dim() == 6);
  CHECK(family_model({{"hidden_size", 160}, {"num_heads", 2}, {"partial_rotary_factor", 0.4}}).rotary_dim() == 32);
  // With partial rotary only the rotated part must be even (an odd head_dim is then fine).
  CHECK(family_model({{"head_dim", 9}, {"partial_rotary_factor", 0.5}}).rotary_dim() == 4);
  check_refused({{"partial_rotary_factor", 0.375}}, "partial_rotary_factor",
                "expected int(head_dim * partial_rotary_factor) to be even and at least 2 (rotary turns pairs of "
                "dimensions), got int(8 * 0.375) = 3");
  check_refused({{"partial_rotary_factor", 0.1}}, "partial_rotary_factor",
                "expected int(head_dim * partial_rotary_factor) to be even and at least 2 (rotary turns pairs of "
                "dimensions), got int(8 * 0.1) = 0");
  check_refused({{"partial_rotary_factor", 1.5}}, "partial_rotary_factor",
                "expected at most 1 (rotary on part of each head), got 1.5");
  check_refused({{"partial_rotary_factor", 0}}, "partial_rotary_factor", "");
  check_refused({{"partial_rotary_factor", "half"}}, "partial_rotary_factor", "");
}

TEST_CASE("attention_mask names how the causal mask reaches the softmax", "[arch][families]") {
  using nanreplay::AttentionMask;
  CHECK(family_model(json::object()).attention_mask == AttentionMask::kExclude);  // as before the key existed
  CHECK(family_model({{"attention_mask", "exclude"}}).attention_mask == AttentionMask::kExclude);
  CHECK(family_model({{"attention_mask", "additive_neg_inf"}}).attention_mask == AttentionMask::kAdditiveNegInf);
  CHECK(family_model({{"attention_mask", "additive_finfo_min"}}).attention_mask == AttentionMask::kAdditiveFinfoMin);
  CHECK(family_model({{"attention_mask", "fill_finfo_min"}}).attention_mask == AttentionMask::kFillFinfoMin);
  check_refused({{"attention_mask", "causal"}}, "attention_mask",
                "expected \"exclude\" or \"additive_neg_inf\" or \"additive_finfo_min\" or \"fill_finfo_min\"");
  const json written =
      nanreplay::manifest_json(nanreplay::parse_manifest(family_manifest({{"attention_mask", "exclude"}}).dump(), "m.json"));
  CHECK_FALSE(written["model"].contains("attention_mask"));  // the default is not written
}

TEST_CASE("norm_layout post is OLMo 2's block: its norms, in its module order, and their sites", "[arch][families]") {
  const nanreplay::ModelConfig olmo2 = family_model({{"norm_layout", "post"}, {"qk_norm", "full"}});
  std::vector<std::string> layer0;
  for (const nanreplay::ParamSpec& p : nanreplay::expected_parameters(olmo2)) {
    if (p.name.rfind("model.layers.0.", 0) == 0) layer0.push_back(p.name.substr(15));
  }
  // Olmo2DecoderLayer: self_attn (q, k, v, o, q_norm, k_norm), mlp, post_attention_layernorm, post_feedforward_layernorm.
  CHECK(layer0 == std::vector<std::string>{"self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                           "self_attn.v_proj.weight", "self_attn.o_proj.weight",
                                           "self_attn.q_norm.weight", "self_attn.k_norm.weight",
                                           "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
                                           "post_attention_layernorm.weight", "post_feedforward_layernorm.weight"});
  std::vector<std::string> sites;
  for (const nanreplay::SiteRef& s : nanreplay::forward_sites(olmo2)) {
    if (s.layer == 0) sites.push_back(nanreplay::site_name(s));
  }
  CHECK(sites == std::vector<std::string>{"layers.0.input", "layers.0.attn.q", "layers.0.attn.k", "layers.0.attn.v",
                                          "layers.0.attn.scores", "layers.0.attn.probs", "layers.0.attn.context",
                                          "layers.0.attn.out", "layers.0.attn.post_norm", "layers.0.attn_residual",
                                          "layers.0.mlp.gate", "layers.0.mlp.up", "layers.0.mlp.act",
                                          "layers.0.mlp.down", "layers.0.mlp.post_norm", "layers.0.output"});
  for (const char* name : {"layers.1.attn.post_norm", "layers.1.mlp.post_norm"}) {
    INFO(name);
    const auto parsed = nanreplay::parse_site_name(name);
    REQUIRE(parsed);
    CHECK(nanreplay::site_name(*parsed) == name);
  }
  // A pre-norm model (every bundle without the key) has neither site nor parameter.
  for (const nanreplay::SiteRef& s : nanreplay::forward_sites(family_model(json::object()))) {
    CHECK(s.id != nanreplay::SiteId::kAttnPostNorm);
    CHECK(s.id != nanreplay::SiteId::kMlpPostNorm);
  }
  check_refused({{"norm_layout", "both"}}, "norm_layout", "expected \"pre\" or \"post\" or \"sandwich\", got \"both\"");
}

TEST_CASE("norm_layout sandwich is Gemma 3's block: four norms in Gemma3DecoderLayer's order, both sites of each kind",
          "[arch][families]") {
  const nanreplay::ModelConfig gemma3 = family_model({{"norm_layout", "sandwich"}, {"qk_norm", "head"}});
  std::vector<std::string> norms;
  for (const nanreplay::ParamSpec& p : nanreplay::expected_parameters(gemma3)) {
    if (p.name.rfind("model.layers.0.", 0) == 0 && p.name.find("layernorm") != std::string::npos) {
      norms.push_back(p.name.substr(15));
    }
  }
  CHECK(norms == std::vector<std::string>{"input_layernorm.weight", "post_attention_layernorm.weight",
                                          "pre_feedforward_layernorm.weight", "post_feedforward_layernorm.weight"});
  std::vector<std::string> sites;
  for (const nanreplay::SiteRef& s : nanreplay::forward_sites(gemma3)) {
    if (s.layer == 0 && nanreplay::site_name(s).find("norm") != std::string::npos) sites.push_back(nanreplay::site_name(s));
  }
  CHECK(sites == std::vector<std::string>{"layers.0.attn_norm", "layers.0.attn.post_norm", "layers.0.mlp_norm",
                                          "layers.0.mlp.post_norm"});
}

TEST_CASE("layer_types gives each layer its attention kind; sliding layers take the window and the local rotary",
          "[arch][families]") {
  using nanreplay::AttentionKind;
  const json two = {{"num_layers", 2}, {"sliding_window", 4}, {"rope_local_base_freq", 10000.0},
                    {"layer_types", {"sliding_attention", "full_attention"}}};
  const nanreplay::ModelConfig m = family_model(two);
  CHECK(m.attention_kind(0) == AttentionKind::kSliding);
  CHECK(m.attention_kind(1) == AttentionKind::kFull);
  CHECK(m.window_of(0) == 4);
  CHECK(m.window_of(1) == 0);
  CHECK(m.local_rotary(0));
  CHECK_FALSE(m.local_rotary(1));
  const nanreplay::ModelConfig mistral = family_model({{"sliding_window", 4}});  // no layer_types: every layer
  CHECK(mistral.window_of(0) == 4);
  const json written = nanreplay::manifest_json(nanreplay::parse_manifest(family_manifest(two).dump(), "m.json"));
  CHECK(written["model"]["layer_types"] == json({"sliding_attention", "full_attention"}));
  check_refused({{"num_layers", 2}, {"sliding_window", 4}, {"layer_types", {"full_attention"}}}, "layer_types",
                "expected one entry per layer (2), got 1");
  check_refused({{"layer_types", {"chunked"}}}, "layer_types[0]", "expected \"full_attention\" or \"sliding_attention\"");
  check_refused({{"layer_types", {"sliding_attention"}}}, "layer_types[0]", "a sliding_attention layer needs model.sliding_window");
  check_refused({{"hidden_act", "gelu"}}, "hidden_act", "expected \"silu\" or \"gelu_pytorch_tanh\"");
  check_refused({{"rope_scaling", {{"rope_type", "linear"}}}}, "rope_scaling.factor", "");
}

TEST_CASE("attention_sinks brings one logit per head and the attn.sink site; o_proj_bias o_proj's bias",
          "[arch][families]") {
  const nanreplay::ModelConfig plain = family_model(json::object());
  const nanreplay::ModelConfig m = family_model({{"attention_sinks", true}, {"o_proj_bias", true}});
  CHECK(shape_of(m, "model.layers.0.self_attn.sinks") == std::vector<int64_t>{2});
  CHECK(shape_of(m, "model.layers.0.self_attn.o_proj.bias") == std::vector<int64_t>{16});
  CHECK(nanreplay::expected_parameters(m).size() == nanreplay::expected_parameters(plain).size() + 2);
  const auto has_sink_site = [](const nanreplay::ModelConfig& model) {
    for (const nanreplay::SiteRef& ref : nanreplay::forward_sites(model)) {
      if (ref.id == nanreplay::SiteId::kAttnSink) return true;
    }
    return false;
  };
  CHECK(has_sink_site(m));
  CHECK_FALSE(has_sink_site(plain));
  CHECK(nanreplay::forward_sites(m).size() == nanreplay::forward_sites(plain).size() + 1);
  const auto parsed = nanreplay::parse_site_name("layers.0.attn.sink");
  REQUIRE(parsed);
  CHECK(parsed->id == nanreplay::SiteId::kAttnSink);
  CHECK(nanreplay::is_per_head(nanreplay::SiteId::kAttnSink));
  check_refused({{"attention_sinks", "yes"}}, "attention_sinks", "");
}

TEST_CASE("attention_chunk_size chunks the rotary layers, or the layers layer_types names chunked_attention",
          "[arch][families]") {
  using nanreplay::AttentionKind;
  // No layer_types: as Llama4TextConfig derives it, rotary layers (no_rope_layers 1) chunked, NoPE layers full.
  const nanreplay::ModelConfig derived =
      family_model({{"num_layers", 2}, {"no_rope_layers", {1, 0}}, {"attention_chunk_size", 3}});
  CHECK(derived.attention_kind(0) == AttentionKind::kChunked);
  CHECK(derived.attention_kind(1) == AttentionKind::kFull);
  CHECK(derived.span_of(0).chunk == 3);
  CHECK(derived.span_of(0).window == 0);
  CHECK(derived.span_of(1).full());
  CHECK(derived.span_of(0).first_key(2) == 0);
  CHECK(derived.span_of(0).first_key(3) == 3);  // query 3 starts the second chunk: it sees itself only
  CHECK(derived.span_of(0).first_key(7) == 6);
  // A seq_len beyond the chunk is replayed (it was refused while only one chunk was).
  json longer = family_manifest({{"attention_chunk_size", 3}});
  CHECK(nanreplay::parse_manifest(longer.dump(), "m.json").data.seq_len == 8);
  // Explicit layer_types wins over the derivation.
  const nanreplay::ModelConfig listed = family_model(
      {{"num_layers", 2}, {"attention_chunk_size", 4}, {"layer_types", {"full_attention", "chunked_attention"}}});
  CHECK(listed.attention_kind(0) == AttentionKind::kFull);
  CHECK(listed.span_of(1).chunk == 4);
  check_refused({{"layer_types", {"chunked_attention"}}}, "layer_types[0]",
                "a chunked_attention layer needs model.attention_chunk_size");
}
