// The capture helper (capture/nanreplay_capture.py) writes the parameters the
// replay reads: its list of keys and shapes must be the parameter table's
// (probes/param_table.h), config for config.
#include <catch2/catch.hpp>

#include <fstream>

#include <nlohmann/json.hpp>

#include "probes/sites.h"
#include "tests/cli_harness.h"

namespace {

nlohmann::json capture_helper_parameters(const std::string& arch, const nlohmann::json& cfg) {
  nanreplay_test::ScratchDir dir("param-table");
  const std::string script = "import json, sys\nsys.path.insert(0, " + nlohmann::json(std::string(NANREPLAY_SOURCE_DIR) + "/capture").dump() +
                             ")\nimport nanreplay_capture as c\nprint(json.dumps(c.expected_parameters(" +
                             nlohmann::json(arch).dump() + ", json.loads(" + nlohmann::json(cfg.dump()).dump() + "))))\n";
  std::ofstream(dir / "dump.py") << script;
  const std::string cmd = std::string(NANREPLAY_PYTHON) + " " + nanreplay_test::shell_quote((dir / "dump.py").string()) +
                          " > " + nanreplay_test::shell_quote((dir / "out.json").string());
  REQUIRE(std::system(cmd.c_str()) == 0);
  return nlohmann::json::parse(nanreplay_test::slurp(dir / "out.json"));
}

}  // namespace

TEST_CASE("the capture helper's parameter list is the parameter table's", "[capture][params]") {
  nanreplay::ModelConfig llama;
  llama.arch = nanreplay::Arch::kLlama;
  llama.vocab_size = 64;
  llama.hidden_size = 32;
  llama.num_layers = 2;
  llama.num_heads = 4;
  llama.num_kv_heads = 2;
  llama.intermediate_size = 48;
  llama.max_seq_len = 16;
  nanreplay::ModelConfig tied = llama;
  tied.tie_embeddings = true;
  nanreplay::ModelConfig gpt2 = llama;
  gpt2.arch = nanreplay::Arch::kGpt2;
  gpt2.num_kv_heads = gpt2.num_heads;
  gpt2.intermediate_size = 4 * gpt2.hidden_size;
  gpt2.tie_embeddings = true;
  // The llama family's options that add parameters (biases, q/k norms).
  nanreplay::ModelConfig qwen2 = llama;
  qwen2.attention_bias = true;
  nanreplay::ModelConfig qwen3 = llama;
  qwen3.qk_norm = nanreplay::QkNorm::kHead;
  nanreplay::ModelConfig olmo2 = tied;
  olmo2.qk_norm = nanreplay::QkNorm::kFull;
  olmo2.attention_bias = true;
  // Qwen3's own head width (q_proj [H*D, C], o_proj [C, H*D]); OLMo 2's post-norms after the MLP.
  nanreplay::ModelConfig wide_heads = qwen3;
  wide_heads.explicit_head_dim = 12;
  nanreplay::ModelConfig post_norm = olmo2;
  post_norm.norm_layout = nanreplay::NormLayout::kPost;
  for (const nanreplay::ModelConfig& m : {llama, tied, gpt2, qwen2, qwen3, olmo2, wide_heads, post_norm}) {
    nlohmann::json cfg = {{"hidden_size", m.hidden_size}, {"vocab_size", m.vocab_size},
                          {"num_layers", m.num_layers},   {"num_heads", m.num_heads},
                          {"num_kv_heads", m.num_kv_heads}, {"intermediate_size", m.intermediate_size},
                          {"max_seq_len", m.max_seq_len}, {"tie_embeddings", m.tie_embeddings}};
    if (m.attention_bias) cfg["attention_bias"] = true;
    if (m.qk_norm != nanreplay::QkNorm::kNone) cfg["qk_norm"] = m.qk_norm == nanreplay::QkNorm::kHead ? "head" : "full";
    if (m.explicit_head_dim > 0) cfg["head_dim"] = m.explicit_head_dim;
    if (m.norm_layout == nanreplay::NormLayout::kPost) cfg["norm_layout"] = "post";
    nlohmann::json ours = nlohmann::json::array();
    for (const nanreplay::ParamSpec& p : nanreplay::expected_parameters(m)) ours.push_back({p.name, p.shape});
    INFO(cfg.dump());
    CHECK(capture_helper_parameters(nanreplay::arch_name(m.arch), cfg) == ours);
  }
}
