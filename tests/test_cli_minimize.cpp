// `nanreplay minimize` through the real binary: on every incident preset the
// minimized bundle names the same origin (step, phase, site, layer, head,
// expert, kind, position, and the sample mapped back to its original index)
// and is a fraction of the original's size; rolled-forward, data-parallel and
// accumulation bundles included; nothing written where nothing is to be kept,
// and never into the input.
#include <string>
#include <vector>

#include "tests/cli_harness.h"

using namespace nanreplay_test;

namespace {

struct Minimized {
  nlohmann::json report;  // minimize --json
  nlohmann::json origin;  // bisect --json of MIN: its origin
  nlohmann::json manifest;  // MIN's manifest.json
};

Minimized minimize(const ScratchDir& dir, const std::string& preset, const std::vector<std::string>& synth_extra = {}) {
  std::vector<std::string> synth = {"synth", preset, (dir / "bundle").string()};
  synth.insert(synth.end(), synth_extra.begin(), synth_extra.end());
  const CliResult written = run_cli(synth);
  INFO(written.err);
  REQUIRE(written.status == 0);
  const CliResult run = run_cli({"minimize", (dir / "bundle").string(), "--out", (dir / "min").string(), "--json"});
  INFO(preset << ": " << run.err);
  REQUIRE(run.status == 1);
  Minimized m;
  m.report = nlohmann::json::parse(run.out);
  const CliResult bisect = run_cli({"bisect", (dir / "min").string(), "--json", "--no-samples"});
  REQUIRE(bisect.status == 1);
  m.origin = nlohmann::json::parse(bisect.out)["origin"];
  m.manifest = read_json(dir / "min" / "manifest.json");
  return m;
}

// The original index MIN records for its own sample `sample`.
int64_t original_of(const nlohmann::json& manifest, int64_t sample) {
  for (const auto& step : manifest["steps"]) {
    for (size_t r = 0; r < step["samples"].size(); ++r) {
      for (size_t i = 0; i < step["samples"][r].size(); ++i) {
        if (step["samples"][r][i] == sample) return step["original_samples"][r][i].get<int64_t>();
      }
    }
  }
  return -1;
}

void check_same_origin(const Minimized& m, double max_ratio) {
  const nlohmann::json& before = m.report["origin"];
  const nlohmann::json& after = m.origin;
  INFO(before.dump() << "\n" << after.dump());
  REQUIRE(after.is_object());
  for (const char* key : {"step", "phase", "site", "layer", "head", "expert", "kind", "position"}) {
    CHECK(before[key] == after[key]);
  }
  if (before["sample"].get<int64_t>() >= 0) {
    CHECK(original_of(m.manifest, after["sample"].get<int64_t>()) == m.report["original_sample"].get<int64_t>());
  }
  CHECK(m.report["after"]["bytes"].get<double>() < max_ratio * m.report["before"]["bytes"].get<double>());
  CHECK(m.report["ratio"].get<double>() < max_ratio);
  CHECK(m.manifest["minimized"]["from"].get<std::string>().find("bundle") != std::string::npos);
}

void check_presets(const std::vector<std::string>& presets, double max_ratio) {
  for (const std::string& preset : presets) {
    DYNAMIC_SECTION(preset) {
      ScratchDir dir("minimize");
      check_same_origin(minimize(dir, preset), max_ratio);
    }
  }
}

}  // namespace

// One step of four (or six), one sample, and the layers a forward origin needs: under a tenth.
TEST_CASE("minimize keeps the origin of the attention and MLP overflows", "[minimize][cli]") {
  check_presets({"head-overflow", "qwen2-head-overflow", "repeat-run", "mlp-overflow"}, 0.1);
}

TEST_CASE("minimize keeps the origin of the data and scale faults", "[minimize][cli]") {
  check_presets({"zero-embedding", "poisoned-token", "fp8-scale-collapse", "mislabeled-rope"}, 0.1);
}

TEST_CASE("minimize keeps the origin of transient and cascading failures", "[minimize][cli]") {
  check_presets({"cascade", "transient-fp16"}, 0.1);
}

TEST_CASE("minimize keeps the origin of a mixture of experts' overflows", "[minimize][cli]") {
  check_presets({"router-overflow", "expert-overflow"}, 0.1);
}

TEST_CASE("minimize reduces two data-parallel ranks and their micro-batches to the one that fails", "[minimize][cli]") {
  ScratchDir dir("minimize-dp");
  const Minimized m = minimize(dir, "glitch-token");
  check_same_origin(m, 0.1);
  CHECK(m.report["before"]["world_size"] == 2);
  CHECK(m.report["after"]["world_size"] == 1);
  CHECK(m.report["after"]["grad_accum_steps"] == 1);
  CHECK(m.report["after"]["samples"] == 1);
}

TEST_CASE("minimize cuts the model after a forward origin's layer", "[minimize][cli]") {
  ScratchDir dir("minimize-cut");
  const Minimized m = minimize(dir, "demo");  // layers.2.attn.scores of 4 layers
  check_same_origin(m, 0.1);
  CHECK(m.manifest["model"]["num_layers"] == 3);
  CHECK(m.report["after"]["layers"] == 3);
  // run on MIN: report.md names the original.
  const CliResult run = run_cli({"run", (dir / "min").string(), "--out", (dir / "triage").string()});
  REQUIRE(run.status == 1);
  CHECK(slurp(dir / "triage" / "report.md").find("minimized bundle") != std::string::npos);
}

TEST_CASE("minimize keeps the update that brought a flipped bit in", "[minimize][cli]") {
  ScratchDir dir("minimize-flip");
  const Minimized m = minimize(dir, "bit-flip");
  check_same_origin(m, 0.5);
  CHECK(m.manifest["steps"].size() == 2);  // 102 and 103, with 102's optimizer state
  CHECK(std::filesystem::exists(dir / "min" / "steps" / "102" / "optimizer.safetensors"));
}

TEST_CASE("minimize writes a rolled-forward step's derived parameters as its checkpoint", "[minimize][cli]") {
  ScratchDir dir("minimize-rolled");
  const Minimized m = minimize(dir, "zero-embedding", {"--checkpoint-every", "10"});
  check_same_origin(m, 0.35);
  CHECK(m.report["before"]["checkpoints"] == 1);
  CHECK(m.manifest["steps"].size() == 1);
  CHECK(std::filesystem::exists(dir / "min" / "steps" / "103" / "model.safetensors"));
}

TEST_CASE("minimize writes nothing when nothing is non-finite, and never into the bundle", "[minimize][cli]") {
  ScratchDir dir("minimize-none");
  REQUIRE(run_cli({"synth", "clean-fp32", (dir / "bundle").string()}).status == 0);
  const std::string manifest = slurp(dir / "bundle" / "manifest.json");
  const CliResult clean = run_cli({"minimize", (dir / "bundle").string(), "--out", (dir / "min").string(), "--json"});
  CHECK(clean.status == 0);
  CHECK(nlohmann::json::parse(clean.out)["out"].is_null());
  CHECK_FALSE(std::filesystem::exists(dir / "min"));

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
}
