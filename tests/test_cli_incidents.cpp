// End to end through the CLI: synthetic incident bundles are written by
// `nanreplay synth`, replayed by `nanreplay run`, and the named origin
// (step, phase, site, head, sample, position) is checked against the fault
// that was planted. Clean bundles must replay with nothing flagged.
#include <catch2/catch.hpp>

#include <fstream>

#include "tests/bisect_agreement.h"
#include "tests/cli_harness.h"

using nanreplay_test::read_json;
using nanreplay_test::run_cli;
using nanreplay_test::ScratchDir;

namespace {

struct Replayed {
  nlohmann::json planted;
  nlohmann::json report;
  int status = -1;
  std::string verdict;
};

Replayed synth_and_run(const ScratchDir& dir, const std::string& preset) {
  const auto synth = run_cli({"synth", preset, (dir / "bundle").string()});
  REQUIRE(synth.status == 0);
  Replayed r;
  r.planted = nlohmann::json::parse(synth.out);
  const auto run = run_cli({"run", (dir / "bundle").string(), "--out", (dir / "out").string()});
  INFO(run.err);
  r.status = run.status;
  r.verdict = run.out;
  r.report = read_json(dir / "out" / "report.json");
  return r;
}

}  // namespace

TEST_CASE("run names a single attention head's fp16 score overflow", "[cli][incident]") {
  ScratchDir dir("head-overflow");
  const Replayed r = synth_and_run(dir, "head-overflow");
  CHECK(r.status == 1);
  const auto& first = r.report["first_nonfinite"];
  REQUIRE(r.report["reproduced"] == true);
  CHECK(first["step"] == r.planted["fault_step"]);
  CHECK(first["phase"] == "forward");
  CHECK(first["site"] == "layers.1.attn.scores");
  CHECK(first["layer"] == 1);
  CHECK(first["head"] == r.planted["fault_head"]);
  CHECK(first["kind"] == "inf");
  CHECK(first["rank"] == 0);
  CHECK(first["micro_batch"] == 0);
  CHECK(first["sample"] == r.planted["first_sample"]);
  CHECK(first["position"] == 0);
  CHECK(r.verdict.find("REPRODUCED") != std::string::npos);
  CHECK(r.verdict.find("layers.1.attn.scores") != std::string::npos);
  // The shape of the damage: at the first step only the token's own query-key pair overflows, in head 2.
  const auto& damage = first["damage"];
  REQUIRE(damage.is_object());
  CHECK(damage["pattern"] == "single_element");
  CHECK(damage["head"] == r.planted["fault_head"]);
  CHECK(damage["sample"] == r.planted["first_sample"]);
  CHECK(damage["map"]["cells"].size() <= 16);
  CHECK(r.verdict.find("Damage at layers.1.attn.scores") != std::string::npos);
  // Steps before the fault are clean.
  for (const auto& step : r.report["steps"]) {
    if (step["step"] != r.planted["fault_step"]) CHECK(step["finite"] == true);
  }
}

TEST_CASE("run names a weight with one flipped exponent bit", "[cli][incident]") {
  ScratchDir dir("bit-flip");
  const Replayed r = synth_and_run(dir, "bit-flip");
  CHECK(r.status == 1);
  const auto& first = r.report["first_nonfinite"];
  REQUIRE(r.report["reproduced"] == true);
  CHECK(first["step"] == r.planted["fault_step"]);
  CHECK(first["phase"] == "forward");
  // The flipped element is a post-attention norm weight of layer 1: its
  // output feature goes non-finite at every position, first at position 0.
  CHECK(first["site"] == "layers.1.mlp_norm");
  CHECK(first["layer"] == 1);
  CHECK(first["head"].is_null());
  CHECK(first["sample"] == r.planted["first_sample"]);
  CHECK(first["position"] == 0);
  CHECK(first["index"][2] == r.planted["fault_element"]);
  // The flipped gain's feature, at every token: a weight, not a token.
  CHECK(first["damage"]["pattern"] == "feature");
  CHECK(first["damage"]["column"] == r.planted["fault_element"]);
  CHECK(first["damage"]["rows_hit"] == first["shape"][0].get<int64_t>() * first["shape"][1].get<int64_t>());
}

TEST_CASE("run names a zero embedding row under norm_eps = 0", "[cli][incident]") {
  ScratchDir dir("zero-embedding");
  const Replayed r = synth_and_run(dir, "zero-embedding");
  CHECK(r.status == 1);
  const auto& first = r.report["first_nonfinite"];
  REQUIRE(r.report["reproduced"] == true);
  CHECK(first["step"] == r.planted["fault_step"]);
  CHECK(first["phase"] == "forward");
  CHECK(first["site"] == "layers.0.attn_norm");
  CHECK(first["kind"] == "nan");
  CHECK(first["head"].is_null());
  CHECK(first["sample"] == r.planted["first_sample"]);
  CHECK(first["position"] == r.planted["zero_position"]);
  // One token's row of the norm's output: the data.
  CHECK(first["damage"]["pattern"] == "token_row");
  CHECK(first["damage"]["position"] == r.planted["zero_position"]);
  CHECK(first["damage"]["sample"] == r.planted["first_sample"]);
}

TEST_CASE("clean bundles replay with nothing non-finite and exit 0", "[cli][clean]") {
  for (const std::string preset :
       {"clean-fp32", "clean-bf16", "clean-fp16", "clean-dp", "clean-accum", "clean-gqa", "clean-gpt2"}) {
    DYNAMIC_SECTION(preset) {
      ScratchDir dir(preset);
      const Replayed r = synth_and_run(dir, preset);
      CHECK(r.status == 0);
      CHECK(r.report["reproduced"] == false);
      CHECK(r.report["first_nonfinite"].is_null());
      REQUIRE(r.report["steps"].size() == 4);
      for (const auto& step : r.report["steps"]) {
        CHECK(step["finite"] == true);
        // The synthetic job logged what its own training computed; the replay agrees.
        CHECK(step["loss"].get<double>() == Approx(step["logged_loss"].get<double>()).epsilon(1e-6));
        CHECK(step["grad_norm"].get<double>() == Approx(step["logged_grad_norm"].get<double>()).epsilon(1e-6));
      }
      CHECK(r.report["findings"].empty());
    }
  }
}

TEST_CASE("run writes a trace h5dump can read, with the bundle, version and precision", "[cli][trace]") {
  ScratchDir dir("trace");
  const Replayed r = synth_and_run(dir, "head-overflow");
  const std::string cmd = "h5dump -A " + nanreplay_test::shell_quote((dir / "out" / "trace.h5").string()) +
                          " > " + nanreplay_test::shell_quote((dir / "attrs.txt").string()) + " 2>&1";
  REQUIRE(std::system(cmd.c_str()) == 0);
  const std::string attrs = nanreplay_test::slurp(dir / "attrs.txt");
  CHECK(attrs.find("tool_version") != std::string::npos);
  CHECK(attrs.find("fp16") != std::string::npos);
  CHECK(attrs.find("bundle") != std::string::npos);
}

TEST_CASE("demo writes its bundle, replays it and names the planted head", "[cli][demo]") {
  ScratchDir dir("demo");
  const auto demo = run_cli({"demo", (dir / "demo").string()});
  INFO(demo.err);
  CHECK(demo.status == 0);
  CHECK(demo.out.find("nanreplay named it") != std::string::npos);
  const auto report = read_json(dir / "demo" / "report" / "report.json");
  CHECK(report["first_nonfinite"]["site"] == "layers.2.attn.scores");
  CHECK(report["first_nonfinite"]["head"] == 3);
  CHECK(report["first_nonfinite"]["step"] == 105);
  // A consistent trajectory (every checkpoint AdamW's update of the one before): the
  // report says nothing about the demo's own bundle, and its healthy steps match the log.
  for (const auto& f : report["findings"]) {
    INFO(f["code"] << ": " << f["message"]);
    CHECK(f["severity"] != "warning");
    CHECK(f["layer"] != "system");
  }
  CHECK(report["reproduction"]["reproduces"] == true);
  CHECK(report["reproduction"]["checked_steps"] == 5);
  // 6 steps, 1 rank x 2 micro-batches: 105 bad after 1 pass, 102 and 104 clean (2 + 2), 1 to locate.
  const auto bisect = nanreplay_test::check_bisect_agrees_with_run(dir / "demo" / "bundle", report);
  CHECK(bisect["replays"]["step"] == 5);
  CHECK(bisect["replays"]["full_probe_pass"] == 12);
}

TEST_CASE("run refuses bad usage with exit 2 and one line", "[cli][usage]") {
  ScratchDir dir("usage");
  const auto missing = run_cli({"run", (dir / "nope").string(), "--out", (dir / "out").string()});
  CHECK(missing.status == 2);
  CHECK(missing.err.find("nope") != std::string::npos);
  CHECK(std::count(missing.err.begin(), missing.err.end(), '\n') == 1);
  CHECK_FALSE(std::filesystem::exists(dir / "out"));

  const auto unknown = run_cli({"rnu"});
  CHECK(unknown.status == 2);
  CHECK(unknown.err.find("did you mean 'run'") != std::string::npos);
}

TEST_CASE("run never writes into the bundle and replaces earlier results unless --no-clobber", "[cli][output]") {
  ScratchDir dir("outputs");
  REQUIRE(run_cli({"synth", "clean-fp32", (dir / "bundle").string()}).status == 0);
  const auto inside = run_cli({"run", (dir / "bundle").string(), "--out", (dir / "bundle" / "out").string()});
  CHECK(inside.status == 2);
  CHECK_FALSE(std::filesystem::exists(dir / "bundle" / "out"));

  // report-v1: `run --out DIR` writes DIR/report.json, DIR existing or not.
  REQUIRE(run_cli({"run", (dir / "bundle").string(), "--out", (dir / "out").string()}).status == 0);
  { std::ofstream(dir / "out" / "report.json") << "left by an earlier run"; }
  const auto again = run_cli({"run", (dir / "bundle").string(), "--out", (dir / "out").string()});
  CHECK(again.status == 0);
  CHECK(nlohmann::json::parse(nanreplay_test::slurp(dir / "out" / "report.json"))["version"] == 1);

  { std::ofstream(dir / "out" / "report.json") << "kept"; }
  const auto kept = run_cli({"run", (dir / "bundle").string(), "--out", (dir / "out").string(), "--no-clobber"});
  CHECK(kept.status == 2);
  CHECK(kept.err.find("--no-clobber") != std::string::npos);
  CHECK(nanreplay_test::slurp(dir / "out" / "report.json") == "kept");
  // --force, once needed to replace, still runs (older scripts pass it).
  CHECK(run_cli({"run", (dir / "bundle").string(), "--out", (dir / "out").string(), "--force"}).status == 0);
  // Only the results are left: no staging directory.
  size_t entries = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir / "out")) {
    (void)e;
    ++entries;
  }
  CHECK(entries == 4);  // report.json, report.md, report.html, trace.h5
}

TEST_CASE("progress shows on a terminal and stays off when piped", "[cli][progress]") {
  ScratchDir dir("progress");
  REQUIRE(run_cli({"synth", "clean-fp32", (dir / "bundle").string()}).status == 0);
  const auto piped = run_cli({"run", (dir / "bundle").string(), "--out", (dir / "piped").string()});
  CHECK(piped.status == 0);
  CHECK(piped.err.empty());
  // `script` gives the command a pseudo-terminal, as a person's shell would.
  const std::string inner = nanreplay_test::shell_quote(NANREPLAY_CLI_PATH) + " run " +
                            nanreplay_test::shell_quote((dir / "bundle").string()) + " --out " +
                            nanreplay_test::shell_quote((dir / "tty").string());
  const std::string cmd = "script -qec " + nanreplay_test::shell_quote(inner) + " /dev/null > " +
                          nanreplay_test::shell_quote((dir / "tty.txt").string()) + " 2>&1";
  REQUIRE(std::system(cmd.c_str()) == 0);
  const std::string shown = nanreplay_test::slurp(dir / "tty.txt");
  CHECK(shown.find("replaying step 100 (1/4)") != std::string::npos);
  CHECK(shown.find("backward") != std::string::npos);
  const auto quiet = run_cli({"run", (dir / "bundle").string(), "--out", (dir / "quiet").string(), "--quiet"});
  CHECK(quiet.out.empty());
  CHECK(quiet.err.empty());
}
