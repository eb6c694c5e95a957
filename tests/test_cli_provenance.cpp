// The manifest's provenance block: a value the writer defaulted is named
// beside every verdict of non-reproduction (the finding, the root cause,
// report.json's defaulted_values) and by inspect, and a malformed block is one
// bad-input line.
#include <catch2/catch.hpp>

#include <fstream>

#include "tests/triage_harness.h"

using nanreplay_test::read_json;
using nanreplay_test::write_json;
using nanreplay_test::run_bundle;
using nanreplay_test::run_cli;
using nanreplay_test::ScratchDir;
using nanreplay_test::with_code;

namespace {

// clean-fp32 with one step's logged loss 1% off (SYSTEM_NOT_REPRODUCIBLE) and `provenance` in its manifest.
std::filesystem::path odd_bundle(const ScratchDir& dir, const nlohmann::json& provenance) {
  REQUIRE(run_cli({"synth", "clean-fp32", (dir / "bundle").string()}).status == 0);
  const auto state_path = dir / "bundle" / "steps" / "102" / "state.json";
  nlohmann::json state = read_json(state_path);
  state["logged"]["loss"] = state["logged"]["loss"].get<double>() * 1.01;
  write_json(state_path, state);
  nlohmann::json manifest = read_json(dir / "bundle" / "manifest.json");
  manifest["provenance"] = provenance;
  write_json(dir / "bundle" / "manifest.json", manifest);
  return dir / "bundle";
}

}  // namespace

TEST_CASE("a defaulted norm_eps is named beside SYSTEM_NOT_REPRODUCIBLE and in report.json", "[cli][provenance]") {
  ScratchDir dir("provenance-default");
  odd_bundle(dir, {{"model.norm_eps", {{"from", "default"}, {"detail", "no config gives it"}, {"value", 1e-5}}},
                   {"model.num_heads", {{"from", "flag"}, {"detail", "--num-heads"}, {"value", 4}}}});
  const auto t = run_bundle(dir);
  const auto odd = with_code(t.report, "SYSTEM_NOT_REPRODUCIBLE");
  REQUIRE(odd.size() == 1);
  const std::string message = odd[0]["message"].get<std::string>();
  CHECK(message.find("defaulted") != std::string::npos);
  CHECK(message.find("model.norm_eps = 1e-05 (no config gives it)") != std::string::npos);
  CHECK(message.find("num_heads") == std::string::npos);  // given by a flag: not a suspect
  const auto summary = run_cli({"inspect", (dir / "bundle").string()});
  CHECK(summary.out.find("defaulted  model.norm_eps = 1e-05 (no config gives it)") != std::string::npos);
  REQUIRE(t.report["defaulted_values"].size() == 1);
  CHECK(t.report["defaulted_values"][0]["key"] == "model.norm_eps");
  CHECK(t.report["defaulted_values"][0]["value"] == 1e-5);
}

TEST_CASE("nothing defaulted adds nothing to the verdict", "[cli][provenance]") {
  ScratchDir dir("provenance-none");
  odd_bundle(dir, {{"model.norm_eps", {{"from", "checkpoint"}, {"detail", "config.json: rms_norm_eps"}}}});
  const auto t = run_bundle(dir);
  const auto odd = with_code(t.report, "SYSTEM_NOT_REPRODUCIBLE");
  REQUIRE(odd.size() == 1);
  CHECK(odd[0]["message"].get<std::string>().find("defaulted") == std::string::npos);
  CHECK_FALSE(t.report.contains("defaulted_values"));
}

TEST_CASE("a malformed provenance block is bad input naming the key", "[cli][provenance]") {
  ScratchDir dir("provenance-bad");
  odd_bundle(dir, {{"model.norm_eps", {{"detail", "no from"}}}});
  const auto result = run_cli({"inspect", (dir / "bundle").string()});
  CHECK(result.status == 2);
  CHECK(result.err.find("provenance.model.norm_eps.from") != std::string::npos);
}
