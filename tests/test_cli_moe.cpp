// A mixture of experts (model.moe, Hugging Face Qwen3-MoE's routing) through
// the CLI: a clean MoE bundle replays its own run with the expert load in
// every output, a router overflow and an expert overflow are named by run and
// bisect alike (the expert included), a collapsed router is a warning with
// its layer, expert and share, the router what-ifs, and bad MoE input. The
// numbers are cross-checked against eager PyTorch in
// tests/py/test_crosscheck_pytorch.py (clean-moe in fp32, bf16, rolled).
#include <catch2/catch.hpp>

#include <fstream>
#include <numeric>

#include "tests/triage_harness.h"

using nanreplay_test::check_one_error_line;
using nanreplay_test::read_json;
using nanreplay_test::run_cli;
using nanreplay_test::ScratchDir;
using nanreplay_test::slurp;
using nanreplay_test::triage;
using nanreplay_test::Triaged;
using nanreplay_test::with_code;

namespace {

// Routed rows per layer and step: every token of every micro-batch and rank, top_k times.
int64_t routed_rows_per_step(const nlohmann::json& manifest) {
  const nlohmann::json& d = manifest["data"];
  return d["seq_len"].get<int64_t>() * d["micro_batch_size"].get<int64_t>() * d["grad_accum_steps"].get<int64_t>() *
         d.value("world_size", int64_t{1}) * manifest["model"]["moe"]["top_k"].get<int64_t>();
}

nlohmann::json trace_rows(const ScratchDir& dir, const std::vector<std::string>& query) {
  std::vector<std::string> args = {"trace", (dir / "out" / "trace.h5").string(), "--json", "--limit", "100000"};
  args.insert(args.end(), query.begin(), query.end());
  const auto result = run_cli(args);
  INFO(result.err);
  REQUIRE(result.status == 0);
  return nlohmann::json::parse(result.out)["rows"];
}

}  // namespace

TEST_CASE("a clean mixture of experts replays its own run, with the expert load in report.json, the trace, md and html",
          "[cli][moe]") {
  ScratchDir dir("moe-clean");
  REQUIRE(run_cli({"synth", "clean-moe", (dir / "bundle").string()}).status == 0);
  const auto run = run_cli({"run", (dir / "bundle").string(), "--out", (dir / "out").string(), "--quiet"});
  INFO(run.err);
  CHECK(run.status == 0);
  const nlohmann::json report = read_json(dir / "out" / "report.json");
  const nlohmann::json manifest = read_json(dir / "bundle" / "manifest.json");
  CHECK(report["reproduction"]["reproduces"] == true);
  CHECK(report["findings"].empty());
  CHECK(report["first_nonfinite"].is_null());
  const int64_t layers = manifest["model"]["num_layers"];
  const int64_t experts = manifest["model"]["moe"]["num_experts"];
  const nlohmann::json& last = report["steps"].back();
  REQUIRE(last.contains("expert_tokens"));
  REQUIRE(last["expert_tokens"].size() == static_cast<size_t>(layers));
  for (const auto& layer : last["expert_tokens"]) {
    REQUIRE(layer.size() == static_cast<size_t>(experts));
    CHECK(std::accumulate(layer.begin(), layer.end(), int64_t{0},
                          [](int64_t a, const nlohmann::json& v) { return a + v.get<int64_t>(); }) ==
          routed_rows_per_step(manifest));
  }
  // The trace holds the same counts: the forward per-expert records of the layer's first expert site.
  const int64_t step = last["step"];
  for (int64_t expert = 0; expert < experts; ++expert) {
    const nlohmann::json rows = trace_rows(dir, {"--step", std::to_string(step), "--phase", "forward", "--site",
                                                 "layers.1.mlp.expert.gate", "--expert", std::to_string(expert)});
    REQUIRE_FALSE(rows.empty());
    int64_t routed = 0;
    for (const auto& row : rows) {
      CHECK(row["expert"] == expert);
      routed += row["routed_tokens"].get<int64_t>();
    }
    CHECK(routed == last["expert_tokens"][1][static_cast<size_t>(expert)]);
  }
  // Backward statistics per expert too.
  CHECK_FALSE(trace_rows(dir, {"--step", std::to_string(step), "--phase", "backward", "--site", "layers.0.mlp.expert.down",
                               "--expert", "3"}).empty());
  CHECK(slurp(dir / "out" / "report.md").find("## Expert load") != std::string::npos);
  CHECK(slurp(dir / "out" / "report.html").find("<h2>Expert load</h2>") != std::string::npos);
}

TEST_CASE("a router overflow: NUMERIC_OVERFLOW at mlp.router, the planted token, run and bisect agree",
          "[cli][moe][incident]") {
  ScratchDir dir("moe-router-overflow");
  const Triaged t = triage(dir, "router-overflow");  // also checks that bisect names run's origin, expert included
  CHECK(t.status == 1);
  CHECK(t.report["reproduction"]["reproduces"] == true);
  const nlohmann::json& first = t.report["first_nonfinite"];
  CHECK(first["site"] == "layers.1.mlp.router");
  CHECK(first["phase"] == "forward");
  CHECK(first["expert"].is_null());
  CHECK(first["step"] == t.planted["fault_step"]);
  CHECK(first["sample"] == t.planted["fault_sample"]);
  CHECK(first["position"] == t.planted["fault_position"]);
  const auto overflow = with_code(t.report, "NUMERIC_OVERFLOW");
  REQUIRE(overflow.size() == 1);
  CHECK(overflow[0]["evidence"]["site"] == "layers.1.mlp.router");
  CHECK(t.report["root_cause"]["code"] == "NUMERIC_OVERFLOW");
}

TEST_CASE("an expert overflow: NUMERIC_OVERFLOW names the expert, the routed token's sample and position",
          "[cli][moe][incident]") {
  ScratchDir dir("moe-expert-overflow");
  const Triaged t = triage(dir, "expert-overflow");  // bisect names the same expert
  CHECK(t.status == 1);
  const nlohmann::json& first = t.report["first_nonfinite"];
  CHECK(first["site"] == "layers.1.mlp.expert.up");
  CHECK(first["expert"] == t.planted["fault_expert"]);
  CHECK(first["expert"] == 2);
  CHECK(first["kind"] == "inf");
  CHECK(first["step"] == t.planted["fault_step"]);
  CHECK(first["sample"] == t.planted["fault_sample"]);
  CHECK(first["position"] == t.planted["fault_position"]);
  const auto overflow = with_code(t.report, "NUMERIC_OVERFLOW");
  REQUIRE(overflow.size() == 1);
  CHECK(overflow[0]["evidence"]["expert"] == 2);
  CHECK(overflow[0]["message"].get<std::string>().find("(expert 2)") != std::string::npos);
  CHECK(t.verdict.find("| expert 2 |") != std::string::npos);
  // The propagation leaves the expert through the weighted sum.
  bool through_combine = false;
  for (const auto& p : t.report["propagation"]) through_combine |= p["site"] == "layers.1.mlp.combine";
  CHECK(through_combine);
  // bisect's text names the expert too, and the trace's first non-finite row of the expert is the origin's.
  const auto bisect = run_cli({"bisect", (dir / "bundle").string(), "--no-samples"});
  CHECK(bisect.status == 1);
  CHECK(bisect.out.find("| expert 2 |") != std::string::npos);
  const nlohmann::json rows = trace_rows(dir, {"--expert", "2", "--first-nonfinite", "--limit", "1"});
  REQUIRE(rows.size() == 1);
  CHECK(rows[0]["site"] == "layers.1.mlp.expert.up");
  CHECK(rows[0]["sample"] == first["sample"]);
  CHECK(rows[0]["position"] == first["position"]);
}

TEST_CASE("a router that sends every token to the same experts is NUMERIC_ROUTER_COLLAPSE, a warning with its evidence",
          "[cli][moe][triage]") {
  ScratchDir dir("moe-collapse");
  const Triaged t = triage(dir, "router-collapse");
  CHECK(t.status == 0);  // a warning: nothing went non-finite
  CHECK(t.report["first_nonfinite"].is_null());
  const nlohmann::json manifest = read_json(dir / "bundle" / "manifest.json");
  const nlohmann::json& first_step = t.report["steps"][0];
  // Every router logit ties at zero: top-2 of 4 goes to experts 0 and 1 for every token (ties to the lower index).
  const int64_t tokens = routed_rows_per_step(manifest) / 2;
  CHECK(first_step["expert_tokens"][0] == nlohmann::json({tokens, tokens, 0, 0}));
  const auto collapse = with_code(t.report, "NUMERIC_ROUTER_COLLAPSE");
  REQUIRE_FALSE(collapse.empty());
  const nlohmann::json& evidence = collapse[0]["evidence"];
  CHECK(collapse[0]["severity"] == "warning");
  CHECK(collapse[0]["layer"] == "numeric");
  CHECK(evidence["step"] == first_step["step"]);
  CHECK(evidence["layer"] == 0);
  CHECK(evidence["expert"] == 0);
  CHECK(evidence["share"] == 1.0);
  CHECK(evidence["tokens"] == tokens);
  for (const auto& finding : collapse) CHECK(finding["evidence"]["layer"] == 0);  // layer 1 is healthy
  // The reports show the expert load of the collapsed step.
  CHECK(slurp(dir / "out" / "report.md").find("Tokens routed to each expert at step " +
                                              std::to_string(first_step["step"].get<int64_t>())) != std::string::npos);
}

TEST_CASE("what-ifs router-fp32 and z-loss replay the failing step with the router changed", "[cli][moe][what-if]") {
  ScratchDir dir("moe-what-if");
  REQUIRE(run_cli({"synth", "router-overflow", (dir / "bundle").string()}).status == 0);
  const auto run = run_cli({"run", (dir / "bundle").string(), "--out", (dir / "out").string(), "--what-if",
                            "router-fp32", "--what-if", "z-loss=0.1"});
  INFO(run.err);
  REQUIRE(run.status == 1);
  const nlohmann::json outcomes = read_json(dir / "out" / "report.json")["what_if"];
  REQUIRE(outcomes.size() == 2);
  // In fp32 the router's logits no longer overflow, and nothing else does.
  CHECK(outcomes[0]["what_if"] == "router-fp32");
  CHECK(outcomes[0]["resolved"] == true);
  CHECK(outcomes[0]["first_nonfinite_after"].is_null());
  // The z-loss changes the loss, not the forward values: the router still overflows.
  CHECK(outcomes[1]["what_if"] == "z-loss=0.1");
  CHECK(outcomes[1]["resolved"] == false);
  CHECK(outcomes[1]["first_nonfinite_after"]["site"] == "layers.1.mlp.router");
  CHECK(outcomes[1]["change"].get<std::string>().find("0 -> 0.1") != std::string::npos);

  // Refused before anything is replayed: a value for router-fp32, a negative coefficient, a dense bundle.
  const std::string bundle = (dir / "bundle").string();
  check_one_error_line(run_cli({"run", bundle, "--out", (dir / "o2").string(), "--what-if", "router-fp32=1"}),
                       {"router-fp32", "takes no value"});
  check_one_error_line(run_cli({"run", bundle, "--out", (dir / "o2").string(), "--what-if", "z-loss=-1"}),
                       {"z-loss=-1", ">= 0"});
  REQUIRE(run_cli({"synth", "head-overflow", (dir / "dense").string()}).status == 0);
  check_one_error_line(run_cli({"run", (dir / "dense").string(), "--out", (dir / "o2").string(), "--what-if", "z-loss=1"}),
                       {"z-loss=1", "model.moe"});
  CHECK_FALSE(std::filesystem::exists(dir / "o2"));
}

TEST_CASE("a mixture of experts on gpt2, or a checkpoint without an expert, is one line naming file and key",
          "[cli][moe][bad-input]") {
  ScratchDir dir("moe-bad");
  REQUIRE(run_cli({"synth", "clean-gpt2", (dir / "gpt2").string()}).status == 0);
  nlohmann::json manifest = read_json(dir / "gpt2" / "manifest.json");
  manifest["model"]["moe"] = {{"num_experts", 4}, {"top_k", 2}};
  std::ofstream(dir / "gpt2" / "manifest.json") << manifest.dump(2);
  check_one_error_line(run_cli({"inspect", (dir / "gpt2").string()}), {"manifest.json", "model.moe", "gpt2"});

  // An MoE manifest of 5 experts over a checkpoint of 4: the first router is the wrong shape.
  REQUIRE(run_cli({"synth", "clean-moe", (dir / "moe").string()}).status == 0);
  manifest = read_json(dir / "moe" / "manifest.json");
  manifest["model"]["moe"]["num_experts"] = 5;
  std::ofstream(dir / "moe" / "manifest.json") << manifest.dump(2);
  const auto run = run_cli({"run", (dir / "moe").string(), "--out", (dir / "out").string()});
  check_one_error_line(run, {"model.safetensors", "model.layers.0.mlp.gate.weight"});
  CHECK_FALSE(std::filesystem::exists(dir / "out" / "report.json"));
}
