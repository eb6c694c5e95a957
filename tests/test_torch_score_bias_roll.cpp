// DeepSeek-V3's correction bias derived along a rolled-forward window
// (model.moe.score_bias_update, replay/step/trajectory.h): roll_to, which
// bisect's what-ifs and minimize start a derived step from, gives each step the
// same derived bias as `run` replays it with (report.json's
// steps[].router_score_bias, which tests/py/test_router_score_bias.py checks
// against torchtitan's rule), and without the key the step is refused by name.
#include <catch2/catch.hpp>

#include <fstream>

#include <nlohmann/json.hpp>

#include "loaders/base/error.h"
#include "loaders/bundle/bundle.h"
#include "replay/step/trajectory.h"
#include "synth/synthetic_bundle.h"
#include "tests/cli_harness.h"

using namespace nanreplay;
using nanreplay_test::read_json;
using nanreplay_test::write_json;
using nanreplay_test::run_cli;
using nanreplay_test::ScratchDir;

namespace {

// clean-deepseek-moe with one checkpoint, its later steps' logged biases removed; `update`: the manifest key.
std::filesystem::path stripped_window(const ScratchDir& dir, const char* name, const nlohmann::json& update) {
  const std::filesystem::path root = dir / name;
  SyntheticSpec spec = synthetic_preset("clean-deepseek-moe");
  spec.num_steps = 3;
  spec.checkpoint_every = 1000;
  write_synthetic_bundle(root, spec);
  nlohmann::json manifest = read_json(root / "manifest.json");
  if (!update.is_null()) manifest["model"]["moe"]["score_bias_update"] = update;
  write_json(root / "manifest.json", manifest);
  for (const auto& entry : manifest["steps"]) {
    const std::filesystem::path step = root / entry["dir"].get<std::string>();
    if (std::filesystem::exists(step / "model.safetensors")) continue;
    nlohmann::json state = read_json(step / "state.json");
    state.erase("router_score_bias");
    write_json(step / "state.json", state);
  }
  return root;
}

}  // namespace

TEST_CASE("roll_to derives the correction bias run replays each rolled-forward step with", "[torch][roll]") {
  const ScratchDir dir("score-bias-roll");
  const std::filesystem::path root =
      stripped_window(dir, "derived", {{"rule", "sign_centred"}, {"rate", 0.001}});
  const auto ran = run_cli({"run", root.string(), "--out", (dir / "out").string(), "--json"});
  REQUIRE(ran.status == 0);
  const nlohmann::json report = nlohmann::json::parse(ran.out);
  const Bundle bundle(root);
  REQUIRE(report["steps"].size() == bundle.steps().size());
  for (const nlohmann::json& row : report["steps"]) {
    const int64_t step = row["step"].get<int64_t>();
    INFO("step " << step);
    const StepState state = roll_to(bundle, step).state;
    if (row["params"] == "checkpoint") {
      CHECK(row["router_score_bias_source"] == "logged");
      CHECK(state.derived_router_score_bias.empty());
      continue;
    }
    CHECK(row["router_score_bias_source"] == "derived");
    REQUIRE_FALSE(state.derived_router_score_bias.empty());
    for (const auto& [layer, bias] : state.derived_router_score_bias) {
      CHECK(row["router_score_bias"][std::to_string(layer)].get<std::vector<double>>() == bias);
    }
  }
}

TEST_CASE("without score_bias_update a rolled-forward step without its bias is refused by name", "[torch][roll]") {
  const ScratchDir dir("score-bias-roll-refused");
  const std::filesystem::path root = stripped_window(dir, "no-key", nullptr);
  const Bundle bundle(root);
  try {
    roll_to(bundle, bundle.steps().back().step);
    FAIL("rolled forward without a bias");
  } catch (const InputError& e) {
    const std::string what = e.what();
    CHECK(what.find("state.json") != std::string::npos);
    CHECK(what.find("router_score_bias[\"model.layers.1.mlp.gate.e_score_correction_bias\"]") != std::string::npos);
    CHECK(what.find("model.moe.score_bias_update") != std::string::npos);
  }
}
