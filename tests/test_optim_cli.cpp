// Optimizers beyond AdamW through the CLI (docs/optimizers.md): a Muon run
// with an AdamW group and MuonClip, rolled forward from its first
// checkpoint, replays clean and matches its per-step twin and its own last
// checkpoint; a bit flipped between two Muon checkpoints is still found; bad
// optimizer bundles are refused with the file and key. The numbers of every
// rule are cross-checked against PyTorch in tests/py/test_optim_crosscheck.py.
#include <catch2/catch.hpp>

#include <cmath>
#include <fstream>
#include <functional>

#include "tests/triage_harness.h"

using nanreplay_test::read_json;
using nanreplay_test::run_cli;
using nanreplay_test::ScratchDir;
using nanreplay_test::with_code;

namespace fs = std::filesystem;

namespace {

const char* const kMuonRun = R"({
  "kind": "adamw", "betas": [0.9, 0.95], "weight_decay": 0.1, "grad_clip": 1.0, "no_decay": ["*norm.weight"],
  "groups": [ { "name": "muon", "params": ["model.layers.*_proj.weight"], "kind": "muon",
                "adjust_lr_fn": "match_rms_adamw", "qk_clip": { "tau": 0.02 } } ]
})";
const char* const kMuonLr = R"({"default": 0.003, "muon": 0.02})";

void write_text(const fs::path& path, const std::string& text) { std::ofstream(path) << text; }

nlohmann::json run_report(const ScratchDir& dir, const fs::path& bundle, const std::string& name, int& status) {
  const auto run = run_cli({"run", bundle.string(), "--out", (dir / name).string(), "--quiet"});
  INFO(run.err);
  status = run.status;
  return read_json(dir / name / "report.json");
}

fs::path synth_muon(const ScratchDir& dir, const std::string& name, const std::string& preset,
                    const std::vector<std::string>& extra = {}) {
  write_text(dir / "muon.json", kMuonRun);
  std::vector<std::string> args = {"synth", preset, (dir / name).string(), "--optimizer", (dir / "muon.json").string(),
                                   "--lr", kMuonLr, "--steps", "5"};
  args.insert(args.end(), extra.begin(), extra.end());
  const auto synth = run_cli(args);
  INFO(synth.err);
  REQUIRE(synth.status == 0);
  return dir / name;
}

}  // namespace

TEST_CASE("a Muon run with MuonClip rolled forward matches its per-step twin and its last checkpoint",
          "[cli][roll][optim]") {
  ScratchDir dir("optim-muon");
  const fs::path per_step = synth_muon(dir, "per-step", "clean-fp32");
  const fs::path rolled = synth_muon(dir, "rolled", "clean-fp32", {"--checkpoint-every", "4"});
  const nlohmann::json manifest = read_json(rolled / "manifest.json");
  CHECK(manifest["optimizer"]["groups"][0]["kind"] == "muon");
  CHECK(read_json(rolled / "steps" / "101" / "state.json")["lr"]["muon"] == 0.02);
  CHECK_FALSE(fs::exists(rolled / "steps" / "101" / "model.safetensors"));
  CHECK(fs::exists(rolled / "steps" / "104" / "model.safetensors"));

  int expected_status = -1, status = -1;
  const nlohmann::json expected = run_report(dir, per_step, "per-step-out", expected_status);
  const nlohmann::json got = run_report(dir, rolled, "rolled-out", status);
  CHECK(expected_status == 0);
  CHECK(status == 0);
  for (const char* code : {"SYSTEM_UPDATE_MISMATCH", "SYSTEM_BIT_FLIP", "SYSTEM_TRAJECTORY_DIVERGED"}) {
    CHECK(with_code(expected, code).empty());
    CHECK(with_code(got, code).empty());
  }
  // Update statistics of every derived update: g^2 / v for the AdamW group only; no update spike.
  CHECK(with_code(got, "NUMERIC_UPDATE_SPIKE").empty());
  REQUIRE(got.contains("update_stats"));
  for (const auto& row : got["update_stats"]) {
    for (const auto& t : row["tensors"]) {
      const bool muon = t["param"].get<std::string>().find("_proj.weight") != std::string::npos;
      CHECK(t["update_rms"].get<double>() > 0.0);
      CHECK(t["g2_over_v"].is_null() == (muon || row["step"] == 100));  // AdamW's from its second update on
    }
  }
  const auto& steps = got["steps"];
  REQUIRE(steps.size() == 5);
  for (size_t i = 0; i < steps.size(); ++i) {
    INFO("step " << steps[i]["step"]);
    CHECK(steps[i]["params"] == (i == 0 || i == 4 ? "checkpoint" : "derived"));
    const double want = expected["steps"][i]["loss"].get<double>();
    CHECK(std::fabs(steps[i]["loss"].get<double>() - want) <= 1e-6 * std::fabs(want));
  }
}

// Adam's rule is elementwise like AdamW's, whose incidents tests/test_cli_roll_forward.cpp rolls forward.
TEST_CASE("an incident under each optimizer rolled forward names the same origin as its per-step twin",
          "[cli][roll][optim]") {
  ScratchDir dir("optim-incidents");
  const std::vector<std::pair<std::string, std::string>> runs = {
      {"adafactor", R"({"kind": "adafactor", "weight_decay": 0.01})"},
      {"adafactor_hf", R"({"kind": "adafactor_hf", "beta1": 0.9})"},
      {"muon", kMuonRun}};
  for (const auto& [name, optimizer] : runs) {
    INFO(name);
    write_text(dir / (name + ".json"), optimizer);
    int statuses[2] = {-1, -1};
    nlohmann::json reports[2];
    for (int rolled = 0; rolled < 2; ++rolled) {
      const fs::path bundle = dir / (name + (rolled ? "-rolled" : "-per-step"));
      std::vector<std::string> args = {"synth", "zero-embedding", bundle.string(), "--optimizer",
                                       (dir / (name + ".json")).string(), "--lr",
                                       name == "muon" ? kMuonLr : "0.003"};
      if (rolled) args.insert(args.end(), {"--checkpoint-every", "1000"});
      REQUIRE(run_cli(args).status == 0);
      reports[rolled] = run_report(dir, bundle, name + (rolled ? "-rolled-out" : "-out"), statuses[rolled]);
    }
    CHECK(statuses[1] == statuses[0]);
    CHECK(reports[0]["first_nonfinite"].is_object());
    CHECK(reports[1]["first_nonfinite"] == reports[0]["first_nonfinite"]);
    CHECK(reports[1]["root_cause"]["code"] == reports[0]["root_cause"]["code"]);
    CHECK(with_code(reports[1], "SYSTEM_TRAJECTORY_DIVERGED").empty());
    CHECK(reports[1]["steps"].back()["params"] == "derived");
  }
}

TEST_CASE("a bit flipped between two Muon checkpoints is still found", "[cli][optim]") {
  ScratchDir dir("optim-muon-flip");
  const fs::path bundle = synth_muon(dir, "flip", "silent-bit-flip");  // in mlp.up_proj.weight, a Muon parameter
  int status = -1;
  const nlohmann::json report = run_report(dir, bundle, "out", status);
  CHECK_FALSE(with_code(report, "SYSTEM_BIT_FLIP").empty());
  CHECK(with_code(report, "SYSTEM_UPDATE_MISMATCH").empty());
}

TEST_CASE("bad optimizer bundles are refused with the file and key", "[cli][optim][bad]") {
  ScratchDir dir("optim-bad");
  const fs::path good = synth_muon(dir, "good", "clean-fp32", {"--checkpoint-every", "1000"});
  const auto refused = [&](const std::string& name, const std::function<void(const fs::path&)>& edit,
                           const std::string& file, const std::string& key) {
    INFO(name);
    const fs::path bundle = dir / name;
    fs::copy(good, bundle, fs::copy_options::recursive);
    edit(bundle);
    const auto run = run_cli({"run", bundle.string(), "--out", (dir / (name + "-out")).string()});
    CHECK(run.status == 2);
    CHECK(run.err.find(file) != std::string::npos);
    CHECK(run.err.find(key) != std::string::npos);
  };
  const auto edit_manifest = [](const std::function<void(nlohmann::json&)>& change) {
    return [change](const fs::path& b) {
      nlohmann::json m = read_json(b / "manifest.json");
      change(m["optimizer"]);
      std::ofstream(b / "manifest.json") << m.dump(2);
    };
  };
  refused("unknown-kind", edit_manifest([](nlohmann::json& o) { o["kind"] = "lion"; }), "manifest.json",
          "optimizer.kind");
  refused("foreign-key", edit_manifest([](nlohmann::json& o) { o["groups"][0]["betas"] = {0.9, 0.95}; }),
          "manifest.json", "optimizer.groups[0].betas");
  refused("muon-on-vectors", edit_manifest([](nlohmann::json& o) { o["groups"][0]["params"] = {"*"}; }),
          "manifest.json", "optimizer.groups");
  refused("lr-without-group", [](const fs::path& b) {
    nlohmann::json s = read_json(b / "steps" / "101" / "state.json");
    s["lr"] = {{"default", 0.003}};
    std::ofstream(b / "steps" / "101" / "state.json") << s.dump(2);
  }, "steps/101/state.json", "lr.muon");
  refused("state-missing", edit_manifest([](nlohmann::json& o) {
    o["groups"][0] = {{"name", "muon"}, {"params", {"model.layers.*_proj.weight"}}, {"kind", "adamw"}};
  }), "optimizer.safetensors", "exp_avg");
}
