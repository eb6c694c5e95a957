// Verdicts that hold up, end to end through the CLI: consequences of the
// origin are one info entry each, a bundle that does not replay the run it
// claims says so first, real text raises no data error, a poisoned token is
// named, and the capture's own sample indices appear in the report.
#include <catch2/catch.hpp>

#include <fstream>

#include "tests/triage_harness.h"

using nanreplay_test::read_json;
using nanreplay_test::write_json;
using nanreplay_test::run_bundle;
using nanreplay_test::run_cli;
using nanreplay_test::ScratchDir;
using nanreplay_test::slurp;
using nanreplay_test::triage;
using nanreplay_test::Triaged;
using nanreplay_test::with_code;
using nanreplay_test::with_severity;

namespace {

std::string second_line(const std::string& text) {
  const size_t first = text.find('\n');
  return text.substr(first + 1, text.find('\n', first + 1) - first - 1);
}

}  // namespace

TEST_CASE("a cascade after the origin is one info entry per kind, naming the checkpoint to resume from",
          "[cli][verdict]") {
  ScratchDir dir("cascade");
  const Triaged t = triage(dir, "cascade");  // origin at step 101 of 100-104; AdamW carries the NaN on
  CHECK(t.status == 1);
  CHECK(t.report["first_nonfinite"]["step"] == 101);
  CHECK(t.report["root_cause"]["code"] == "NUMERIC_ZERO_NORM");
  const auto checkpoints = with_code(t.report, "CHECKPOINT_NONFINITE");
  REQUIRE(checkpoints.size() == 1);  // not one per tensor of steps 102-104
  const auto& c = checkpoints[0];
  CHECK(c["severity"] == "info");
  CHECK(c["layer"] == "system");
  CHECK(c["evidence"]["consequence"] == true);
  CHECK(c["evidence"]["step"] == 102);
  CHECK(c["evidence"]["last_step"] == 104);
  CHECK(c["evidence"]["steps"] == nlohmann::json::array({102, 103, 104}));
  CHECK(c["evidence"]["last_clean_step"] == 101);
  CHECK(c["evidence"]["length"].get<int>() > 20);  // every parameter and moment
  const auto losses = with_code(t.report, "DATA_LOSS_OUTLIER");
  REQUIRE(losses.size() == 1);  // not one per later step
  CHECK(losses[0]["severity"] == "info");
  CHECK(losses[0]["evidence"]["steps"] == nlohmann::json::array({101, 102, 103, 104}));
  CHECK(with_severity(t.report, "warning").empty());
  CHECK(with_severity(t.report, "error").size() == 1);  // the zero norm itself
  CHECK(t.verdict.find("the last clean checkpoint is step 101") != std::string::npos);
}

TEST_CASE("a bundle whose q/k are stored interleaved under rotate-half names does not reproduce the run",
          "[cli][verdict]") {
  ScratchDir dir("mislabeled");
  const Triaged t = triage(dir, "mislabeled-rope");
  CHECK(t.status == 1);
  CHECK(t.report["reproduction"]["reproduces"] == false);
  CHECK(t.report["reproduction"]["checked_steps"] == 3);
  CHECK(t.report["reproduction"]["matching_steps"] == 0);
  const auto found = with_code(t.report, "BUNDLE_DOES_NOT_REPRODUCE");
  REQUIRE(found.size() == 1);
  CHECK(found[0]["severity"] == "error");
  CHECK(found[0]["layer"] == "system");
  CHECK(found[0]["evidence"]["tolerance"] == 1e-4);
  CHECK(found[0]["evidence"]["max_relative_gap"].get<double>() > 1e-3);
  CHECK_FALSE(found[0]["evidence"]["gaps"].empty());
  CHECK(found[0]["message"].get<std::string>().find("rope_style") != std::string::npos);
  CHECK(t.report["root_cause"]["code"] == "BUNDLE_DOES_NOT_REPRODUCE");
  // It leads the verdict, before the origin it would otherwise present with confidence.
  CHECK(second_line(t.verdict).rfind("DOES NOT REPRODUCE THE RUN", 0) == 0);
  CHECK(t.verdict.find("DOES NOT REPRODUCE THE RUN") < t.verdict.find("REPRODUCED  first non-finite"));
  CHECK(slurp(dir / "out" / "report.md").rfind("# nanreplay: DOES NOT REPRODUCE THE RUN", 0) == 0);
  // The odd-step warning is folded into it, not repeated per step.
  CHECK(with_code(t.report, "SYSTEM_NOT_REPRODUCIBLE").empty());
}

TEST_CASE("a manifest naming the wrong sampler seed does not reproduce the run", "[cli][verdict]") {
  ScratchDir dir("wrong-seed");
  const Triaged t = triage(dir, "wrong-seed");
  CHECK(t.status == 1);
  CHECK(t.report["reproduced"] == false);
  CHECK(t.report["reproduction"]["reproduces"] == false);
  CHECK(t.report["reproduction"]["checked_steps"] == 4);
  CHECK(t.report["root_cause"]["code"] == "BUNDLE_DOES_NOT_REPRODUCE");
  CHECK(with_code(t.report, "BUNDLE_DOES_NOT_REPRODUCE")[0]["message"].get<std::string>().find("sampler seed") !=
        std::string::npos);
  CHECK(second_line(t.verdict).rfind("DOES NOT REPRODUCE THE RUN", 0) == 0);
}

TEST_CASE("one odd step among matching ones is SYSTEM_NOT_REPRODUCIBLE, not a bundle that does not reproduce",
          "[cli][verdict]") {
  ScratchDir dir("odd-step");
  REQUIRE(run_cli({"synth", "clean-fp32", (dir / "bundle").string()}).status == 0);
  const auto state_path = dir / "bundle" / "steps" / "102" / "state.json";
  nlohmann::json state = read_json(state_path);
  state["logged"]["loss"] = state["logged"]["loss"].get<double>() * 1.01;
  write_json(state_path, state);
  const Triaged t = run_bundle(dir);
  CHECK(t.status == 0);
  CHECK(t.report["reproduction"]["reproduces"] == true);
  CHECK(t.report["reproduction"]["matching_steps"] == 3);
  CHECK(with_code(t.report, "BUNDLE_DOES_NOT_REPRODUCE").empty());
  const auto odd = with_code(t.report, "SYSTEM_NOT_REPRODUCIBLE");
  REQUIRE(odd.size() == 1);
  CHECK(odd[0]["severity"] == "warning");
  CHECK(odd[0]["evidence"]["step"] == 102);
}

TEST_CASE("a clean replay over real text and code reports nothing above info, no spike, and exits 0", "[cli][verdict]") {
  ScratchDir dir("real-text");
  const std::string corpus = std::string(NANREPLAY_SOURCE_DIR) + "/tests/fixtures/real_text.txt";
  // 12 steps logging their site statistics: enough history for the spike rules to judge every step.
  const Triaged t = triage(dir, "clean-site-stats", {"--corpus", corpus, "--steps", "12"});
  CHECK(t.status == 0);
  CHECK(t.report["spike"].is_null());
  CHECK(t.report["spike_check"].is_null());
  CHECK(with_code(t.report, "SYSTEM_SITE_MISMATCH").empty());
  CHECK(with_code(t.report, "SYSTEM_TRAJECTORY_DIVERGED").empty());
  CHECK(t.report["reproduction"]["reproduces"] == true);
  CHECK(with_severity(t.report, "error").empty());
  CHECK(with_severity(t.report, "warning").empty());
  // The corpus holds runs (indentation, rules) the batches read: seen, and left as context.
  const auto runs = with_code(t.report, "DATA_REPEAT_RUN");
  REQUIRE_FALSE(runs.empty());
  for (const auto& f : runs) CHECK(f["evidence"]["implicated"].is_null());
  CHECK(t.report["root_cause"]["code"] == "NONE");
}

TEST_CASE("a token with an extreme embedding row at three isolated places is named as the root cause",
          "[cli][verdict]") {
  ScratchDir dir("poisoned-token");
  const Triaged t = triage(dir, "poisoned-token");
  CHECK(t.status == 1);
  const auto& first = t.report["first_nonfinite"];
  CHECK(first["sample"] == t.planted["fault_sample"]);
  CHECK(first["position"] == t.planted["fault_position"]);
  CHECK(first["token"] == t.planted["fault_token"]);
  const auto found = with_code(t.report, "DATA_TOKEN_EMBEDDING_OUTLIER");
  REQUIRE(found.size() == 1);
  const auto& e = found[0]["evidence"];
  CHECK(found[0]["layer"] == "data");
  CHECK(found[0]["severity"] == "error");
  CHECK(e["token"] == t.planted["fault_token"]);
  CHECK(e["sample"] == t.planted["fault_sample"]);
  CHECK(e["position"] == t.planted["fault_position"]);
  CHECK(e["norm"].get<double>() > 1e4 * e["typical_norm"].get<double>());
  CHECK(t.report["root_cause"]["code"] == "DATA_TOKEN_EMBEDDING_OUTLIER");
  REQUIRE(t.report["origin_tokens"].size() == 1);
  CHECK(t.report["origin_tokens"][0]["outlier"] == true);
  // The same token at a head that amplifies it, with an ordinary row: named, not blamed.
  ScratchDir head("head-token");
  const Triaged h = triage(head, "head-overflow");
  CHECK(h.report["first_nonfinite"]["token"] == h.planted["fault_token"]);
  REQUIRE(h.report["origin_tokens"].size() == 1);
  CHECK(h.report["origin_tokens"][0]["outlier"] == false);
  CHECK(with_code(h.report, "DATA_TOKEN_EMBEDDING_OUTLIER").empty());
  CHECK(h.report["root_cause"]["code"] == "NUMERIC_OVERFLOW");
}

TEST_CASE("bisect finds an fp16 step the scaler skipped even when the window ends clean", "[cli][verdict][bisect]") {
  ScratchDir dir("transient");
  const Triaged t = triage(dir, "transient-fp16");  // triage() also checks bisect against run
  CHECK(t.status == 1);
  CHECK(t.report["first_nonfinite"]["step"] == 101);
  for (const auto& step : t.report["steps"]) {
    if (step["step"] != 101) CHECK(step["finite"] == true);
  }
  const auto bisect = run_cli({"bisect", (dir / "bundle").string(), "--json"});
  REQUIRE(bisect.status == 1);
  const auto b = nlohmann::json::parse(bisect.out);
  CHECK(b["origin"]["step"] == 101);
  CHECK(b["origin"]["sample"] == t.planted["fault_sample"]);
  std::vector<std::pair<int64_t, bool>> tested;
  for (const auto& s : b["stages"]["step"]["tested"]) tested.emplace_back(s["step"], s["bad"]);
  CHECK(tested == std::vector<std::pair<int64_t, bool>>{{104, false}, {101, true}, {100, false}});
  CHECK(b["stages"]["samples"]["data_dependent"] == true);
  CHECK(b["stages"]["samples"]["minimal"] == nlohmann::json::array({t.planted["fault_sample"]}));
}

TEST_CASE("the capture's own sample indices appear beside the bundle's", "[cli][verdict]") {
  ScratchDir dir("original");
  REQUIRE(run_cli({"synth", "head-overflow", (dir / "bundle").string()}).status == 0);
  const auto manifest_path = dir / "bundle" / "manifest.json";
  nlohmann::json manifest = read_json(manifest_path);
  for (auto& entry : manifest["steps"]) {
    nlohmann::json originals = entry["samples"];
    for (auto& rank : originals) {
      for (auto& s : rank) s = s.get<int64_t>() + 100000;
    }
    entry["original_samples"] = originals;
  }
  write_json(manifest_path, manifest);
  const Triaged t = run_bundle(dir);
  const int64_t sample = t.report["first_nonfinite"]["sample"];
  CHECK(t.report["first_nonfinite"]["original_sample"] == sample + 100000);
  CHECK(t.verdict.find("(run's sample " + std::to_string(sample + 100000) + ")") != std::string::npos);
  CHECK(slurp(dir / "out" / "report.md").find("the run's sample " + std::to_string(sample + 100000)) !=
        std::string::npos);
  for (const auto& f : with_code(t.report, "NUMERIC_OVERFLOW")) {
    CHECK(f["evidence"]["original_sample"] == sample + 100000);
  }

  // An annotation that does not match the samples' layout is bad input.
  manifest["steps"][0]["original_samples"][0].erase(0);
  write_json(manifest_path, manifest);
  const auto bad = run_cli({"run", (dir / "bundle").string(), "--out", (dir / "out2").string()});
  CHECK(bad.status == 2);
  CHECK(bad.err.find("manifest.json: steps[0].original_samples") != std::string::npos);
  CHECK(std::count(bad.err.begin(), bad.err.end(), '\n') == 1);
}

