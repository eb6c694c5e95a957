// `nanreplay minimize` through the real binary, on two small bundles: what
// needs C++ (exit statuses, nothing written, the rank and micro-batch
// reduction, the layer cut, report.md of a run on MIN), and the renderings
// of a flipped bit in process. The sweep over every incident preset
// (same origin or flipped bit, original sample index, size ratio, rolled-forward
// windows) is tests/py/test_minimize_presets.py, against the Release CLI:
// under the sanitizers it would take minutes.
#include <string>
#include <vector>

#include "reports/results/minimize_report.h"
#include "reports/outputs/minimize_output.h"
#include "tests/cli_harness.h"

using namespace nanreplay_test;

// glitch-token: 2 ranks of 2 micro-batches, the origin in rank 1's embedding output.
TEST_CASE("minimize reduces ranks and micro-batches to the failing sample and cuts the layers", "[minimize][cli]") {
  ScratchDir dir("minimize-dp");
  REQUIRE(run_cli({"synth", "glitch-token", (dir / "bundle").string()}).status == 0);
  const CliResult run = run_cli({"minimize", (dir / "bundle").string(), "--out", (dir / "min").string(), "--json"});
  INFO(run.err);
  REQUIRE(run.status == 0);  // MIN written: the command did what was asked
  const nlohmann::json report = nlohmann::json::parse(run.out);
  CHECK(report["finding"] == "origin");
  CHECK(report["before"]["world_size"] == 2);
  CHECK(report["after"]["world_size"] == 1);
  CHECK(report["after"]["grad_accum_steps"] == 1);
  CHECK(report["after"]["samples"] == 1);
  CHECK(report["ratio"].get<double>() < 0.1);
  // An origin in the embedding keeps layer 0 only (a model has at least one layer).
  const nlohmann::json manifest = read_json(dir / "min" / "manifest.json");
  CHECK(manifest["model"]["num_layers"] == 1);
  CHECK(report["after"]["layers"] == 1);
  CHECK(manifest["minimized"]["num_layers"] == 2);

  const CliResult triage = run_cli({"run", (dir / "min").string(), "--out", (dir / "triage").string(), "--json"});
  REQUIRE(triage.status == 1);
  const nlohmann::json origin = nlohmann::json::parse(triage.out)["first_nonfinite"];
  for (const char* key : {"step", "phase", "site", "layer", "kind", "position"}) {
    CHECK(origin[key] == report["origin"][key]);
  }
  CHECK(slurp(dir / "triage" / "report.md").find("minimized bundle") != std::string::npos);
}

TEST_CASE("minimize writes nothing when nothing fails, and never into the bundle", "[minimize][cli]") {
  ScratchDir dir("minimize-none");
  REQUIRE(run_cli({"synth", "clean-fp32", (dir / "bundle").string()}).status == 0);
  const std::string manifest = slurp(dir / "bundle" / "manifest.json");
  const CliResult clean = run_cli({"minimize", (dir / "bundle").string(), "--out", (dir / "min" / "x").string()});
  CHECK(clean.status == 1);  // the other answer: nothing written
  CHECK(clean.out.find("NOTHING TO MINIMIZE") != std::string::npos);
  CHECK(clean.out.find("no flipped bit") != std::string::npos);  // says why
  CHECK_FALSE(std::filesystem::exists(dir / "min"));             // not even the parent of MIN

  const CliResult inside =
      run_cli({"minimize", (dir / "bundle").string(), "--out", (dir / "bundle" / "min").string()});
  CHECK(inside.status == 2);
  CHECK(line_count(inside.err) == 1);
  CHECK_FALSE(std::filesystem::exists(dir / "bundle" / "min"));
  CHECK(slurp(dir / "bundle" / "manifest.json") == manifest);

  std::filesystem::create_directories(dir / "taken");
  std::ofstream(dir / "taken" / "file") << "x";
  const CliResult taken = run_cli({"minimize", (dir / "bundle").string(), "--out", (dir / "taken").string()});
  CHECK(taken.status == 2);
  CHECK(run_cli({"minimize", (dir / "bundle").string()}).status == 2);  // no --out
  CHECK(run_cli({"minimize", (dir / "bundle").string(), "--out", (dir / "m").string(), "--what-if",
                 "stable-softmax"})
            .status == 2);
}

TEST_CASE("a minimized flipped bit names the one tensor that shows it", "[minimize]") {
  nanreplay::MinimizeReport r;
  r.bundle = "b";
  r.out = "m";
  r.finding = "bit_flip";
  r.flip = nanreplay::FlippedBit{103, "model.layers.0.mlp.up_proj.weight", {0, 0}, 29, 0.03, 1e-21, 0.03, "msg"};
  r.flip_after = r.flip;
  r.reproduce_command = "nanreplay run m --out triage/";
  const std::string text = nanreplay::render_minimize(r, {false});
  CHECK(text.find("BIT FLIP  step 103, model.layers.0.mlp.up_proj.weight element [0, 0], bit 29") != std::string::npos);
  CHECK(text.find("shown by  model.layers.0.mlp.up_proj.weight in steps/103/model.safetensors against AdamW from "
                  "step 102") != std::string::npos);
  CHECK(text.find("same flipped bit") != std::string::npos);
  const nlohmann::json j = nanreplay::minimize_to_json(r);
  CHECK(j["finding"] == "bit_flip");
  CHECK(j["origin"].is_null());
  CHECK(j["bit_flip"]["tensor"] == "steps/103/model.safetensors");
  CHECK(j["bit_flip"]["update_from"] == 102);
  CHECK(j["bit_flip"]["index"] == nlohmann::json::array({0, 0}));
  CHECK(j["bit_flip_after"]["bit"] == 29);
  CHECK(j["reason"].is_null());
}

// spike-token: a finite loss spike at step 103 carried by one sample; its
// origin (embed) rests on the healthy steps before it.
TEST_CASE("minimize cuts a spike to its healthy baseline and the sample that carries it", "[minimize][cli][spike]") {
  ScratchDir dir("minimize-spike");
  REQUIRE(run_cli({"synth", "spike-token", (dir / "bundle").string()}).status == 0);
  const CliResult run = run_cli({"minimize", (dir / "bundle").string(), "--out", (dir / "min").string(), "--json"});
  INFO(run.err);
  REQUIRE(run.status == 0);
  const nlohmann::json report = nlohmann::json::parse(run.out);
  REQUIRE(report["finding"] == "spike");
  const nlohmann::json& spike = report["spike"];
  CHECK(spike["reproduced"] == true);
  CHECK(spike["site"] == "embed");
  // Two healthy steps before the spike (min_history 1), one sample each, layer 0 only.
  CHECK(report["before"]["steps"] == 4);
  CHECK(report["after"]["steps"] == 3);
  CHECK(report["after"]["samples"] == 3);
  CHECK(report["after"]["layers"] == 1);
  CHECK(report["after"]["world_size"] == 1);
  CHECK(report["after"]["grad_accum_steps"] == 1);
  CHECK(report["ratio"].get<double>() < 0.3);
  CHECK(report["kept_samples_original"] == nlohmann::json::array({spike["sample"]}));
  const nlohmann::json manifest = read_json(dir / "min" / "manifest.json");
  CHECK(manifest["incident"]["kind"] == "spike");
  CHECK(manifest["incident"]["step"] == spike["step"]);
  CHECK(manifest["steps"].back()["original_samples"] == nlohmann::json::array({nlohmann::json::array({spike["sample"]})}));

  // The verdict of run on MIN is the original's: the same spike origin, reproduced, and exit 1.
  const CliResult triage = run_cli({"run", (dir / "min").string(), "--out", (dir / "triage").string(), "--json"});
  REQUIRE(triage.status == 1);
  const nlohmann::json after = nlohmann::json::parse(triage.out)["spike"];
  for (const char* key : {"reproduced", "step", "phase", "site", "layer", "head", "expert", "position"}) {
    CHECK(after[key] == spike[key]);
  }
  CHECK(after["sample"] == report["spike_after"]["sample"]);
}
