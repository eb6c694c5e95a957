// The llama family's model options (docs/bundle-format.md, "Model options")
// through the CLI: each option's preset replays its own run, a checkpoint
// without an option's parameters or a bad value is one error line naming the
// file and key, an option the run did not use does not reproduce it, and a
// sliding window's statistics count only the keys each query sees.
// The numbers themselves are cross-checked against eager PyTorch in
// tests/py/test_crosscheck_pytorch.py and tests/py/test_rope_styles.py.
#include <catch2/catch.hpp>

#include <fstream>

#include "reports/outputs/trace/trace_writer.h"
#include "tests/triage_harness.h"

using nanreplay_test::check_one_error_line;
using nanreplay_test::read_json;
using nanreplay_test::write_json;
using nanreplay_test::run_cli;
using nanreplay_test::ScratchDir;
using nanreplay_test::triage;
using nanreplay_test::Triaged;
using nanreplay_test::with_code;

namespace {

// A clean fp32 bundle whose manifest `edit` changes; returns its directory.
std::filesystem::path edited_bundle(const ScratchDir& dir, const std::function<void(nlohmann::json&)>& edit,
                                    const std::string& preset = "clean-fp32") {
  const std::filesystem::path bundle = dir / "bundle";
  if (!std::filesystem::exists(bundle / "manifest.json")) {
    REQUIRE(run_cli({"synth", preset, bundle.string()}).status == 0);
    std::filesystem::copy_file(bundle / "manifest.json", dir / "manifest.orig");
  }
  nlohmann::json manifest = read_json(dir / "manifest.orig");
  edit(manifest);
  write_json(bundle / "manifest.json", manifest);
  return bundle;
}

}  // namespace

TEST_CASE("every model option's preset replays its own run: reproduced, clean, the option in the manifest",
          "[cli][options]") {
  // (bisect's agreement with run on a model with options: the incident test below.)
  const std::vector<std::pair<std::string, std::vector<std::string>>> presets = {
      {"clean-qwen2", {"attention_bias"}},
      {"clean-qwen3", {"qk_norm"}},
      {"clean-olmo2", {"qk_norm", "norm_layout"}},
      {"clean-gemma2", {"sliding_window", "attn_logit_softcap", "final_logit_softcap"}},
      {"clean-llama3", {"rope_style", "rope_scaling"}},
      {"clean-gemma3", {"layer_types", "sliding_window", "rope_local_base_freq", "rope_scaling", "norm_layout",
                        "rms_norm_offset", "scale_embeddings", "query_pre_attn_scalar", "hidden_act", "qk_norm"}}};
  // (GPT-OSS's and Llama 4's attention: their incident presets below replay three clean steps first.)
  for (const auto& [preset, keys] : presets) {
    INFO(preset);
    ScratchDir dir("options-" + preset);
    REQUIRE(run_cli({"synth", preset, (dir / "bundle").string()}).status == 0);
    const auto run = run_cli({"run", (dir / "bundle").string(), "--out", (dir / "out").string(), "--quiet"});
    CHECK(run.status == 0);
    const nlohmann::json report = read_json(dir / "out" / "report.json");
    CHECK(report["reproduction"]["reproduces"] == true);
    CHECK(report["findings"].empty());
    const nlohmann::json model = read_json(dir / "bundle" / "manifest.json")["model"];
    for (const std::string& key : keys) CHECK(model.contains(key));
  }
}

TEST_CASE("an option's parameters missing from the checkpoint, or a bad option value, is one line naming file and key",
          "[cli][options][bad-input]") {
  ScratchDir dir("options-bad");
  const std::vector<std::tuple<std::string, nlohmann::json, std::string>> cases = {
      {"qk_norm", "head", "model.layers.0.self_attn.q_norm.weight"},
      {"attention_bias", true, "model.layers.0.self_attn.q_proj.bias"},
      {"rope_style", "meta", "model.rope_style"},
      {"qk_norm", "both", "model.qk_norm"},
      {"sliding_window", 0, "model.sliding_window"},
      {"attn_logit_softcap", -30.0, "model.attn_logit_softcap"},
      {"final_logit_softcap", "inf", "model.final_logit_softcap"},
      {"rope_scaling", {{"rope_type", "longrope"}, {"factor", 4.0}}, "model.rope_scaling.rope_type"},
      {"rope_scaling", {{"rope_type", "yarn"}, {"factor", 4.0}}, "model.rope_scaling.original_max_position_embeddings"},
      {"rope_scaling", {{"rope_type", "yarn"}, {"factor", 4.0}, {"original_max_position_embeddings", 16}, {"beta_fast", 0}},
       "model.rope_scaling.beta_fast"},
      {"rope_scaling", {{"rope_type", "llama3"}, {"factor", 8.0}, {"low_freq_factor", 4.0}, {"high_freq_factor", 1.0},
                        {"original_max_position_embeddings", 16}}, "model.rope_scaling.high_freq_factor"},
      {"moe", {{"num_experts", 4}, {"top_k", 2}}, "model.layers.0.mlp.gate.weight"},
      {"moe", {{"num_experts", 4}, {"top_k", 5}}, "model.moe.top_k"},
      {"moe", {{"num_experts", 0}, {"top_k", 1}}, "model.moe.num_experts"},
      {"moe", {{"num_experts", 4}, {"top_k", 2}, {"router_z_loss_coef", -1}}, "model.moe.router_z_loss_coef"},
  };
  for (const auto& [key, value, named] : cases) {
    INFO(key << " = " << value.dump());
    const auto bundle = edited_bundle(dir, [&, &key = key, &value = value](nlohmann::json& m) { m["model"][key] = value; });
    // inspect and run share the structure check (test_cli_bad_bundles.cpp shows they refuse alike):
    // run only where the checkpoint is at fault.
    check_one_error_line(run_cli({"inspect", bundle.string()}), {named});
    if (named.find("self_attn") != std::string::npos || named.find("mlp.gate") != std::string::npos) {
      const auto out = dir / "out";
      check_one_error_line(run_cli({"run", bundle.string(), "--out", out.string()}), {"model.safetensors", named});
      CHECK_FALSE(std::filesystem::exists(out / "report.json"));
    }
  }
}

TEST_CASE("llama-family options on gpt2 are refused by name", "[cli][options][bad-input]") {
  ScratchDir dir("options-gpt2");
  const auto bundle =
      edited_bundle(dir, [](nlohmann::json& m) { m["model"]["sliding_window"] = 8; }, "clean-gpt2");
  check_one_error_line(run_cli({"inspect", bundle.string()}), {"manifest.json", "model.sliding_window", "gpt2"});
}

// (A soft cap far above the scores would change nothing: the preset's attention is near uniform.)
TEST_CASE("an option the run did not use replays another model: BUNDLE_DOES_NOT_REPRODUCE", "[cli][options][verdict]") {
  ScratchDir dir("options-wrong");
  for (const auto& [key, value] : std::vector<std::pair<std::string, nlohmann::json>>{
           {"rope_style", "interleaved"}, {"sliding_window", 2}}) {
    INFO(key);
    const auto bundle = edited_bundle(dir, [&, &key = key, &value = value](nlohmann::json& m) { m["model"][key] = value; });
    const auto run = run_cli({"run", bundle.string(), "--out", (dir / "out").string(), "--force"});
    CHECK(run.status == 1);
    const nlohmann::json report = read_json(dir / "out" / "report.json");
    CHECK(with_code(report, "BUNDLE_DOES_NOT_REPRODUCE").size() == 1);
    CHECK(report["root_cause"]["code"] == "BUNDLE_DOES_NOT_REPRODUCE");
  }
}

TEST_CASE("with a sliding window, attention statistics count only the keys each query sees", "[cli][options][probes]") {
  ScratchDir dir("options-window");
  REQUIRE(run_cli({"synth", "clean-gemma2", (dir / "bundle").string()}).status == 0);
  REQUIRE(run_cli({"run", (dir / "bundle").string(), "--out", (dir / "out").string(), "--quiet"}).status == 0);
  const nlohmann::json manifest = read_json(dir / "bundle" / "manifest.json");
  const int64_t window = manifest["model"]["sliding_window"], T = manifest["data"]["seq_len"];
  const int64_t batch = manifest["data"]["micro_batch_size"];
  int64_t visible = 0;
  for (int64_t i = 0; i < T; ++i) visible += std::min(i + 1, window);
  const nanreplay::TraceContents trace = nanreplay::read_trace((dir / "out" / "trace.h5").string());
  int checked = 0;
  for (const nanreplay::ProbeRecord& r : trace.probes) {
    if (r.phase != nanreplay::Phase::kForward || r.head < 0) continue;
    if (r.site.id != nanreplay::SiteId::kAttnScores && r.site.id != nanreplay::SiteId::kAttnProbs) continue;
    CHECK(r.stats.count == batch * visible);
    ++checked;
  }
  CHECK(checked > 0);
}

TEST_CASE("with chunked attention, a rotary layer's statistics count its chunk's keys, a NoPE layer's every earlier key",
          "[cli][options][probes][chunked]") {
  ScratchDir dir("options-chunked");
  const int64_t chunk = 8;  // data.seq_len 32: four chunks
  const auto bundle =
      edited_bundle(dir, [&](nlohmann::json& m) { m["model"]["attention_chunk_size"] = chunk; }, "clean-llama4-attn");
  const auto inspect = run_cli({"inspect", bundle.string()});
  INFO(inspect.out << inspect.err);
  CHECK_THAT(inspect.out, Catch::Matchers::Contains("attention  0 chunked, 1 full (chunk 8)"));
  run_cli({"run", bundle.string(), "--out", (dir / "out").string(), "--quiet"});  // its logged losses had one chunk
  const nlohmann::json manifest = read_json(bundle / "manifest.json");
  const int64_t T = manifest["data"]["seq_len"], batch = manifest["data"]["micro_batch_size"];
  REQUIRE(T > chunk);
  int64_t in_chunk = 0;
  for (int64_t i = 0; i < T; ++i) in_chunk += i % chunk + 1;
  const nanreplay::TraceContents trace = nanreplay::read_trace((dir / "out" / "trace.h5").string());
  int checked = 0;
  for (const nanreplay::ProbeRecord& r : trace.probes) {
    if (r.phase != nanreplay::Phase::kForward || r.head < 0) continue;
    if (r.site.id != nanreplay::SiteId::kAttnScores && r.site.id != nanreplay::SiteId::kAttnProbs) continue;
    CHECK(r.stats.count == batch * (r.layer == 0 ? in_chunk : T * (T + 1) / 2));  // layer 1 is NoPE: full
    ++checked;
  }
  CHECK(checked > 0);
}

TEST_CASE("what-ifs qk-norm and softcap: QK-norm bounds an fp16 head's scores, a cap after the overflow cannot",
          "[cli][options][what-if]") {
  ScratchDir dir("options-what-if");
  REQUIRE(run_cli({"synth", "head-overflow", (dir / "bundle").string()}).status == 0);
  const auto run = run_cli({"run", (dir / "bundle").string(), "--out", (dir / "out").string(), "--what-if", "qk-norm",
                            "--what-if", "softcap=5"});
  INFO(run.err);
  REQUIRE(run.status == 1);
  const nlohmann::json outcomes = read_json(dir / "out" / "report.json")["what_if"];
  REQUIRE(outcomes.size() == 2);
  CHECK(outcomes[0]["what_if"] == "qk-norm");
  CHECK(outcomes[0]["resolved"] == true);  // |q.k| <= head_dim with unit-weight RMS-normalised q and k
  CHECK(outcomes[1]["what_if"] == "softcap=5");
  CHECK(outcomes[1]["resolved"] == false);  // the scores overflow before any cap reads them
  CHECK(outcomes[1]["first_nonfinite_after"]["site"] == "layers.1.attn.scores");

  // Refused before anything is replayed: a bad cap, a value for qk-norm, gpt2.
  check_one_error_line(run_cli({"run", (dir / "bundle").string(), "--out", (dir / "o2").string(), "--what-if", "softcap=0"}),
                       {"softcap=0", "> 0"});
  check_one_error_line(run_cli({"run", (dir / "bundle").string(), "--out", (dir / "o2").string(), "--what-if", "qk-norm=1"}),
                       {"qk-norm", "takes no value"});
  REQUIRE(run_cli({"synth", "clean-gpt2", (dir / "gpt2").string()}).status == 0);
  check_one_error_line(run_cli({"run", (dir / "gpt2").string(), "--out", (dir / "o2").string(), "--what-if", "qk-norm"}),
                       {"qk-norm", "gpt2"});
  CHECK_FALSE(std::filesystem::exists(dir / "o2"));
}

TEST_CASE("an incident in a model with options: run and bisect name the same head", "[cli][options][incident]") {
  ScratchDir dir("options-incident");
  const Triaged t = triage(dir, "qwen2-head-overflow");  // also checks that bisect names run's origin
  CHECK(t.status == 1);
  const nlohmann::json& first = t.report["first_nonfinite"];
  CHECK(first["site"] == "layers.1.attn.scores");
  CHECK(first["head"] == 2);
  CHECK(first["step"] == t.planted["fault_step"]);
  CHECK(first["sample"] == t.planted["fault_sample"]);
  CHECK(t.report["reproduction"]["reproduces"] == true);
}

TEST_CASE("Gemma 3: run and bisect name the overflowing head of the sliding layer; a shorter window does not help",
          "[cli][options][incident][what-if]") {
  ScratchDir dir("options-gemma3");
  const Triaged t = triage(dir, "gemma3-local-overflow");  // also checks that bisect names run's origin
  CHECK(t.status == 1);
  const nlohmann::json& first = t.report["first_nonfinite"];
  CHECK(first["site"] == "layers.0.attn.scores");  // layer 0 is the sliding one (layer_types)
  CHECK(first["head"] == 1);
  CHECK(first["step"] == t.planted["fault_step"]);
  CHECK(first["sample"] == t.planted["fault_sample"]);
  CHECK(t.report["reproduction"]["reproduces"] == true);
  // The rare token's query against its own key overflows: no window leaves that key out.
  const auto run = run_cli({"run", (dir / "bundle").string(), "--out", (dir / "wi").string(), "--what-if", "window=1"});
  INFO(run.err);
  REQUIRE(run.status == 1);
  const nlohmann::json outcomes = read_json(dir / "wi" / "report.json")["what_if"];
  REQUIRE(outcomes.size() == 1);
  CHECK(outcomes[0]["resolved"] == false);
  CHECK(outcomes[0]["change"] == "sliding window 8 -> 1 keys on the sliding layers (0)");
  check_one_error_line(run_cli({"run", (dir / "bundle").string(), "--out", (dir / "o2").string(), "--what-if", "window=0"}),
                       {"window=0", ">= 1"});
}

TEST_CASE("OLMo 2: a post-norm gain's overflow is named at that norm's output; fp32 there resolves it",
          "[cli][options][incident][what-if]") {
  ScratchDir dir("options-olmo2-post");
  const Triaged t = triage(dir, "olmo2-postnorm-overflow");  // also checks that bisect names run's origin
  CHECK(t.status == 1);
  const nlohmann::json& first = t.report["first_nonfinite"];
  CHECK(first["site"] == "layers.1.attn.post_norm");  // where the gain multiplies, before the residual add
  CHECK(first["step"] == t.planted["fault_step"]);
  CHECK(t.report["reproduction"]["reproduces"] == true);
  const auto run = run_cli({"run", (dir / "bundle").string(), "--out", (dir / "wi").string(), "--what-if",
                            "fp32-layers=1", "--what-if", "fp32-layers=0"});
  INFO(run.err);
  REQUIRE(run.status == 1);
  const nlohmann::json outcomes = read_json(dir / "wi" / "report.json")["what_if"];
  REQUIRE(outcomes.size() == 2);
  CHECK(outcomes[0]["resolved"] == true);   // 1e5 times a normalised value fits fp32
  CHECK(outcomes[1]["resolved"] == false);  // the other layer computed in fp32 changes nothing there
}

TEST_CASE("Qwen3: a QK-norm gain's overflow is named at its head; fp32 there resolves it, a soft cap cannot",
          "[cli][options][incident][what-if]") {
  ScratchDir dir("options-qwen3");
  // bisect: run's origin too.
  const Triaged t = triage(dir, "qwen3-qknorm-overflow", {}, {"--what-if", "fp32-layers=1", "--what-if", "softcap=30"});
  CHECK(t.status == 1);
  const nlohmann::json& first = t.report["first_nonfinite"];
  CHECK(first["site"] == "layers.1.attn.scores");  // the gains every head shares; only head 2 reads the feature
  CHECK(first["head"] == 2);
  CHECK(first["step"] == t.planted["fault_step"]);
  CHECK(first["sample"] == t.planted["fault_sample"]);
  CHECK(t.report["reproduction"]["reproduces"] == true);
  const nlohmann::json& outcomes = t.report["what_if"];
  REQUIRE(outcomes.size() == 2);
  CHECK(outcomes[0]["resolved"] == true);   // 4x 65504 fits fp32
  CHECK(outcomes[1]["resolved"] == false);  // q k^T overflows before the cap reads it
  CHECK(outcomes[1]["first_nonfinite_after"]["site"] == "layers.1.attn.scores");
}

TEST_CASE("OLMo 3: run and bisect name the overflowing head of a sliding layer; the window does not matter",
          "[cli][options][incident][what-if]") {
  ScratchDir dir("options-olmo3");
  // The what-ifs in run's own replay (one process fewer); bisect must still name run's origin.
  const Triaged t =
      triage(dir, "olmo3-window-overflow", {}, {"--what-if", "window=1", "--what-if", "fp32-layers=1"});
  CHECK(t.status == 1);
  const nlohmann::json& first = t.report["first_nonfinite"];
  CHECK(first["site"] == "layers.1.attn.scores");  // layer 1: sliding (layer_types)
  CHECK(first["head"] == 2);
  CHECK(first["step"] == t.planted["fault_step"]);
  CHECK(first["sample"] == t.planted["fault_sample"]);
  CHECK(t.report["reproduction"]["reproduces"] == true);
  // The rare token's query overflows against its own key, which every window keeps; in fp32 it fits.
  const nlohmann::json& outcomes = t.report["what_if"];
  REQUIRE(outcomes.size() == 2);
  CHECK(outcomes[0]["resolved"] == false);
  CHECK(outcomes[0]["change"] == "sliding window 8 -> 1 keys on the sliding layers (0, 1, 2)");
  CHECK(outcomes[1]["resolved"] == true);
}

TEST_CASE("GLM-4: an overflow in the dims partial rotary leaves alone is named at its head; qk-norm resolves it",
          "[cli][options][incident][what-if]") {
  ScratchDir dir("options-glm4");
  // bisect: run's origin too.
  const Triaged t =
      triage(dir, "glm4-partial-rotary-overflow", {}, {"--what-if", "qk-norm", "--what-if", "softcap=30"});
  CHECK(t.status == 1);
  const nlohmann::json& first = t.report["first_nonfinite"];
  CHECK(first["site"] == "layers.0.attn.scores");
  CHECK(first["head"] == 2);
  CHECK(first["step"] == t.planted["fault_step"]);
  CHECK(first["sample"] == t.planted["fault_sample"]);
  CHECK(t.report["reproduction"]["reproduces"] == true);
  const nlohmann::json& outcomes = t.report["what_if"];
  REQUIRE(outcomes.size() == 2);
  CHECK(outcomes[0]["resolved"] == true);   // unit-weight RMS-normalised q and k bound |q.k| by head_dim
  CHECK(outcomes[1]["resolved"] == false);  // q k^T overflows before any cap reads it
  CHECK(outcomes[1]["first_nonfinite_after"]["site"] == "layers.0.attn.scores");
}

TEST_CASE("GPT-OSS attention: run and bisect name the overflowing head; sinks=off does not resolve it",
          "[cli][options][incident][what-if]") {
  ScratchDir dir("options-gpt-oss");
  const Triaged t = triage(dir, "gpt-oss-head-overflow");  // also checks that bisect names run's origin
  CHECK(t.status == 1);
  const nlohmann::json& first = t.report["first_nonfinite"];
  CHECK(first["site"] == "layers.1.attn.scores");
  CHECK(first["head"] == 2);
  CHECK(first["step"] == t.planted["fault_step"]);
  CHECK(first["sample"] == t.planted["fault_sample"]);
  CHECK(t.report["reproduction"]["reproduces"] == true);
  const auto run = run_cli({"run", (dir / "bundle").string(), "--out", (dir / "wi").string(), "--what-if", "sinks=off"});
  INFO(run.err);
  REQUIRE(run.status == 1);
  const nlohmann::json outcomes = read_json(dir / "wi" / "report.json")["what_if"];
  REQUIRE(outcomes.size() == 1);
  CHECK(outcomes[0]["what_if"] == "sinks=off");
  CHECK(outcomes[0]["resolved"] == false);  // q k^T overflows before the sink joins the softmax
  CHECK(outcomes[0]["first_nonfinite_after"]["site"] == "layers.1.attn.scores");
  check_one_error_line(run_cli({"run", (dir / "bundle").string(), "--out", (dir / "o2").string(), "--what-if", "sinks=on"}),
                       {"sinks=on", "off"});
  // The same bundle described without sinks: refused before any replay.
  nlohmann::json manifest = read_json(dir / "bundle" / "manifest.json");
  manifest["model"].erase("attention_sinks");
  write_json(dir / "bundle" / "manifest.json", manifest);
  check_one_error_line(run_cli({"run", (dir / "bundle").string(), "--out", (dir / "o2").string(), "--what-if", "sinks=off"}),
                       {"sinks=off", "attention_sinks"});
  CHECK_FALSE(std::filesystem::exists(dir / "o2"));
}

TEST_CASE("Llama 4 attention: an overflow in a NoPE layer is named there; its L2 QK-norm on that layer resolves it",
          "[cli][options][incident][what-if]") {
  ScratchDir dir("options-llama4");
  const Triaged t = triage(dir, "llama4-nope-overflow");  // also checks that bisect names run's origin
  CHECK(t.status == 1);
  const nlohmann::json& first = t.report["first_nonfinite"];
  CHECK(first["site"] == "layers.1.attn.scores");  // layer 1: NoPE (no rotary, no QK-norm)
  CHECK(first["head"] == 2);
  CHECK(first["step"] == t.planted["fault_step"]);
  CHECK(first["sample"] == t.planted["fault_sample"]);
  const auto run = run_cli({"run", (dir / "bundle").string(), "--out", (dir / "wi").string(), "--what-if", "qk-norm"});
  INFO(run.err);
  REQUIRE(run.status == 1);
  const nlohmann::json outcomes = read_json(dir / "wi" / "report.json")["what_if"];
  REQUIRE(outcomes.size() == 1);
  CHECK(outcomes[0]["resolved"] == true);  // the L2 norm bounds |q.k| by head_dim on the NoPE layer too
}
