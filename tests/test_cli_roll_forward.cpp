// Rolling forward from one checkpoint, end to end through the CLI: each
// incident preset written twice from the same training run (a checkpoint at
// every step, and one at the first step only, `synth --checkpoint-every`)
// replays to the same origin, findings and losses; a bit flip between two
// checkpoints is still found; a roll-forward that leaves the run says so;
// bad rolled bundles are refused with the file and key.
#include <catch2/catch.hpp>

#include <cmath>
#include <fstream>
#include <functional>
#include <iterator>
#include <map>
#include <set>
#include <tuple>

#include "reports/triage/numeric/update_spike.h"
#include "tests/triage_harness.h"

using nanreplay_test::read_json;
using nanreplay_test::write_json;
using nanreplay_test::run_bundle;
using nanreplay_test::run_cli;
using nanreplay_test::ScratchDir;
using nanreplay_test::triage;
using nanreplay_test::Triaged;
using nanreplay_test::with_code;

namespace fs = std::filesystem;

namespace {

// The findings a person acts on: (code, severity, step), info left out
// (a per-step cascade folds its later non-finite checkpoints into info).
// Each one as "code severity step" (strings print the same through Catch and glog's stream operators).
std::multiset<std::string> actionable(const nlohmann::json& report) {
  std::multiset<std::string> out;
  for (const auto& f : report["findings"]) {
    if (f["severity"] == "info") continue;
    const auto& step = f["evidence"]["step"];
    out.insert(f["code"].get<std::string>() + " " + f["severity"].get<std::string>() + " " +
               std::to_string(step.is_number() ? step.get<int64_t>() : -1));
  }
  return out;
}

bool same_number(const nlohmann::json& a, const nlohmann::json& b) {
  if (a.is_null() || b.is_null() || a.is_string() || b.is_string()) return a == b;  // null or "nan"/"inf"
  const double x = a.get<double>(), y = b.get<double>();
  return std::fabs(x - y) <= 1e-6 * std::max(std::fabs(y), 1e-12);
}

// The update-spike rule over a rolled run's report.json update_stats, as if
// its last step were an incident: what calibrates it on clean windows.
std::vector<nanreplay::Finding> update_spikes_if_last_were_incident(const nlohmann::json& report) {
  std::vector<nanreplay::StepUpdateStats> updates;
  for (const auto& row : report["update_stats"]) {
    nanreplay::StepUpdateStats step{row["step"].get<int64_t>(), {}};
    for (const auto& t : row["tensors"]) {
      nanreplay::TensorUpdateStats u;
      u.param = t["param"].get<std::string>();
      u.update_rms = t["update_rms"].is_number() ? t["update_rms"].get<double>() : std::nan("");
      if (t["g2_over_v"].is_number()) u.g2_over_v = t["g2_over_v"].get<double>();
      step.tensors.push_back(u);
    }
    updates.push_back(step);
  }
  return nanreplay::update_spike_findings(updates, report["steps"].back()["step"].get<int64_t>(),
                                          nanreplay::default_thresholds(nanreplay::Compute::kFp32));
}

bool close_to(const nlohmann::json& a, const nlohmann::json& b, double relative) {
  if (!a.is_number() || !b.is_number()) return a == b;
  const double x = a.get<double>(), y = b.get<double>();
  return std::fabs(x - y) <= relative * std::max(std::fabs(y), 1e-12);
}

// Per step's update statistics (from the checkpoints) against the rolled
// window's (its own updates): the same update RMS and mean g^2 / v per tensor,
// where both were measured and the checkpoints hold no change made outside
// the optimizer (a flipped bit is in the checkpoint, not in the derived update).
void check_update_stats_agree(const nlohmann::json& per_step, const nlohmann::json& rolled) {
  std::map<std::pair<int64_t, std::string>, nlohmann::json> from_checkpoints;
  for (const auto& row : per_step["update_stats"]) {
    for (const auto& t : row["tensors"]) from_checkpoints[{row["step"].get<int64_t>(), t["param"].get<std::string>()}] = t;
  }
  // Only the updates made from the same gradients (check_rolled_matches_per_step checks those apart).
  std::set<int64_t> same_gradients;
  for (size_t i = 0; i < rolled["steps"].size() && i < per_step["steps"].size(); ++i) {
    if (same_number(rolled["steps"][i]["grad_norm"], per_step["steps"][i]["grad_norm"])) {
      same_gradients.insert(rolled["steps"][i]["step"].get<int64_t>());
    }
  }
  int compared = 0;
  for (const auto& row : rolled["update_stats"]) {
    if (same_gradients.count(row["step"].get<int64_t>()) == 0) continue;
    for (const auto& t : row["tensors"]) {
      const auto it = from_checkpoints.find({row["step"].get<int64_t>(), t["param"].get<std::string>()});
      // A non-finite checkpoint (CHECKPOINT_NONFINITE's) has no finite update to compare.
      if (it == from_checkpoints.end() || it->second.value("outside_optimizer", false) ||
          !it->second["update_rms"].is_number()) {
        continue;
      }
      INFO("step " << row["step"] << " " << t["param"] << ": per step " << it->second.dump() << ", rolled " << t.dump());
      CHECK(close_to(it->second["update_rms"], t["update_rms"], 1e-4));
      CHECK(close_to(it->second["g2_over_v"], t["g2_over_v"], 1e-4));
      // Not g2_over_v_max: its element's v_hat may be near zero, where rounding of the two states decides it.
      ++compared;
    }
  }
  CHECK(compared > 0);
}

// synth + run, without triage()'s bisect agreement: every preset's bisect is
// checked per step elsewhere, and in order on a rolled window below.
Triaged synth_and_triage(const ScratchDir& dir, const std::string& preset, const std::vector<std::string>& synth_extra = {}) {
  std::vector<std::string> args = {"synth", preset, (dir / "bundle").string()};
  args.insert(args.end(), synth_extra.begin(), synth_extra.end());
  REQUIRE(run_cli(args).status == 0);
  const auto run = run_cli({"run", (dir / "bundle").string(), "--out", (dir / "out").string(), "--quiet"});
  INFO(run.err);
  Triaged t;
  t.status = run.status;
  t.report = read_json(dir / "out" / "report.json");
  return t;
}

// `preset` per step and rolled forward from its first checkpoint name the same origin and findings.
void check_rolled_matches_per_step(const std::string& preset) {
  INFO("preset " << preset);
  ScratchDir per_step("roll-" + preset), rolled("rolled-" + preset);
  const Triaged expected = synth_and_triage(per_step, preset);
  const Triaged got = synth_and_triage(rolled, preset, {"--checkpoint-every", "1000"});
  CHECK(got.status == expected.status);
  CHECK(got.report["first_nonfinite"] == expected.report["first_nonfinite"]);
  CHECK(got.report["root_cause"]["code"] == expected.report["root_cause"]["code"]);
  CHECK(actionable(got.report) == actionable(expected.report));
  CHECK(with_code(got.report, "SYSTEM_TRAJECTORY_DIVERGED").empty());
  const auto& steps = got.report["steps"];
  REQUIRE(steps.size() == expected.report["steps"].size());
  for (size_t i = 0; i < steps.size(); ++i) {
    INFO("step " << steps[i]["step"]);
    const bool has_checkpoint = fs::exists(rolled / "bundle" / "steps" / std::to_string(steps[i]["step"].get<int>()) /
                                           "model.safetensors");
    CHECK(steps[i]["params"] == (has_checkpoint ? "checkpoint" : "derived"));
    CHECK(expected.report["steps"][i]["params"] == "checkpoint");
    CHECK(same_number(steps[i]["loss"], expected.report["steps"][i]["loss"]));
    CHECK(same_number(steps[i]["grad_norm"], expected.report["steps"][i]["grad_norm"]));
    CHECK(steps[i]["scaler_skipped"] == expected.report["steps"][i]["scaler_skipped"]);
  }
  CHECK(steps.back()["params"] == (preset == "bit-flip" || preset == "silent-bit-flip" ? "checkpoint" : "derived"));
  const auto& trajectory = got.report["reproduction"]["trajectory"];
  REQUIRE(trajectory.is_object());
  CHECK(trajectory["diverged_at"].is_null());
  CHECK(expected.report["reproduction"]["trajectory"].is_null());
  // Every update measured (the last step's too): derived rolling forward,
  // between checkpoints per step, and the two agree.
  REQUIRE(got.report.contains("update_stats"));
  REQUIRE(expected.report.contains("update_stats"));
  CHECK(got.report["update_stats"].front()["step"] == steps[0]["step"]);
  CHECK(expected.report["update_stats"].front()["step"] == steps[0]["step"]);
  check_update_stats_agree(expected.report, got.report);
  // Calibration: a window with no incident would give no update spike even if its last step were one.
  if (got.report["first_nonfinite"].is_null() && got.report["spike"].is_null()) {
    for (const Triaged* t : {&got, &expected}) {
      CHECK(with_code(t->report, "NUMERIC_UPDATE_SPIKE").empty());
      for (const auto& f : update_spikes_if_last_were_incident(t->report)) FAIL_CHECK(f.message);
    }
  }
}

}  // namespace

TEST_CASE("rolled forward from one checkpoint, the numeric incidents name the same origin and findings",
          "[cli][roll]") {
  for (const char* preset : {"head-overflow", "zero-embedding", "cascade", "fp8-scale-jump", "mlp-overflow"}) {
    check_rolled_matches_per_step(preset);
  }
}

TEST_CASE("rolled forward, the fp16 scaler's skips and loss scales follow the run", "[cli][roll]") {
  for (const char* preset : {"transient-fp16", "loss-scale-overflow", "clean-fp16"}) check_rolled_matches_per_step(preset);
}

TEST_CASE("rolled forward, bit flips between checkpoints are still found", "[cli][roll]") {
  for (const char* preset : {"bit-flip", "silent-bit-flip"}) check_rolled_matches_per_step(preset);
  ScratchDir dir("rolled-flip");
  const Triaged t = triage(dir, "silent-bit-flip", {"--checkpoint-every", "1000"});
  const auto flips = with_code(t.report, "SYSTEM_BIT_FLIP");
  REQUIRE(flips.size() == 1);
  CHECK(flips[0]["evidence"]["step"] == t.planted["fault_step"]);
  CHECK(flips[0]["evidence"]["param"] == t.planted["fault_param"]);
  CHECK(t.report["steps"][0]["params"] == "checkpoint");
  CHECK(t.report["steps"][1]["params"] == "derived");
}

TEST_CASE("rolled forward, clean runs of every layout stay clean and match their checkpoints", "[cli][roll]") {
  for (const char* preset : {"clean-fp32", "clean-bf16", "clean-dp", "clean-accum", "clean-gpt2", "rank-mismatch"}) {
    check_rolled_matches_per_step(preset);
  }
}

TEST_CASE("rolled forward, the update that jumped first before a spike is NUMERIC_UPDATE_SPIKE", "[cli][roll][spike]") {
  ScratchDir dir("rolled-update-spike");
  const Triaged t = synth_and_triage(dir, "spike-token", {"--checkpoint-every", "1000"});
  CHECK(t.status == 1);
  REQUIRE(t.report["spike"].is_object());
  const auto jumps = with_code(t.report, "NUMERIC_UPDATE_SPIKE");
  REQUIRE_FALSE(jumps.empty());
  const auto& first = jumps[0];
  CHECK(first["severity"] == "info");
  CHECK(first["evidence"]["incident_step"] == 103);
  CHECK(first["evidence"]["step"].get<int64_t>() <= 103);
  // The planted token's logit pulls the head's gradient far above Adam's second moment.
  CHECK(first["evidence"]["param"] == "lm_head.weight");
  CHECK(first["evidence"]["g2_over_v"].get<double>() >= 25.0);
  CHECK(t.report["root_cause"]["code"] != "NUMERIC_UPDATE_SPIKE");  // context, never the cause
  // The statistics it judged: every update, the spike's own (the last step's) included.
  const auto& updates = t.report["update_stats"];
  REQUIRE(updates.size() == 4);
  CHECK(updates.back()["step"] == 103);
  std::ifstream md(dir / "out" / "report.md");
  CHECK(std::string(std::istreambuf_iterator<char>(md), {}).find("NUMERIC_UPDATE_SPIKE") != std::string::npos);
}

TEST_CASE("per step, the update that jumped first before a spike is NUMERIC_UPDATE_SPIKE, as rolled forward",
          "[cli][roll][spike]") {
  ScratchDir per_step("per-step-update-spike"), rolled("rolled-update-spike-twin");
  const Triaged t = synth_and_triage(per_step, "spike-token");
  const Triaged twin = synth_and_triage(rolled, "spike-token", {"--checkpoint-every", "1000"});
  CHECK(t.status == 1);
  REQUIRE(t.report["spike"].is_object());
  const auto jumps = with_code(t.report, "NUMERIC_UPDATE_SPIKE");
  const auto twin_jumps = with_code(twin.report, "NUMERIC_UPDATE_SPIKE");
  REQUIRE_FALSE(jumps.empty());
  REQUIRE(jumps.size() == twin_jumps.size());
  for (size_t i = 0; i < jumps.size(); ++i) {
    CHECK(jumps[i]["evidence"]["param"] == twin_jumps[i]["evidence"]["param"]);
    CHECK(jumps[i]["evidence"]["step"] == twin_jumps[i]["evidence"]["step"]);
    CHECK(close_to(jumps[i]["evidence"]["g2_over_v"], twin_jumps[i]["evidence"]["g2_over_v"], 1e-4));
  }
  CHECK(jumps[0]["evidence"]["param"] == "lm_head.weight");
  CHECK(jumps[0]["evidence"]["g2_over_v"].get<double>() >= 25.0);
  CHECK(t.report["root_cause"]["code"] != "NUMERIC_UPDATE_SPIKE");
  // Steps 100-102 from their checkpoints, 103 (the last) the optimizer's own update of its checkpoint and state.
  const auto& updates = t.report["update_stats"];
  REQUIRE(updates.size() == 4);
  CHECK(updates.front()["step"] == 100);
  CHECK(updates.back()["step"] == 103);
  check_update_stats_agree(t.report, twin.report);
}

TEST_CASE("per step, a tensor rewritten outside the optimizer is marked in update_stats and not judged an update spike",
          "[cli][roll][spike]") {
  ScratchDir dir("per-step-bad-update");
  const Triaged t = synth_and_triage(dir, "spike-bad-update");
  std::set<std::pair<std::string, int64_t>> rewritten;  // (param, the checkpoint's step)
  for (const auto& f : with_code(t.report, "SYSTEM_UPDATE_MISMATCH")) {
    rewritten.insert({f["evidence"]["param"].get<std::string>(), f["evidence"]["step"].get<int64_t>()});
  }
  REQUIRE(rewritten.count({"lm_head.weight", 103}) == 1);
  for (const auto& row : t.report["update_stats"]) {
    for (const auto& u : row["tensors"]) {
      INFO(row["step"] << " " << u["param"]);
      CHECK(u.value("outside_optimizer", false) ==
            (rewritten.count({u["param"].get<std::string>(), row["step"].get<int64_t>() + 1}) == 1));
    }
  }
  for (const auto& f : with_code(t.report, "NUMERIC_UPDATE_SPIKE")) CHECK(f["evidence"]["param"] != "lm_head.weight");
}

TEST_CASE("a checkpoint every two steps: later checkpoints are replayed from and compared with the derived update",
          "[cli][roll]") {
  ScratchDir per_step("every2-ref"), dir("every2");
  const Triaged expected = triage(per_step, "clean-fp32");
  const Triaged t = triage(dir, "clean-fp32", {"--checkpoint-every", "2"});
  CHECK(t.status == 0);
  std::vector<std::string> params;
  for (const auto& s : t.report["steps"]) params.push_back(s["params"]);
  CHECK(params == std::vector<std::string>{"checkpoint", "derived", "checkpoint", "derived"});
  CHECK(actionable(t.report).empty());
  for (size_t i = 0; i < params.size(); ++i) {
    CHECK(same_number(t.report["steps"][i]["loss"], expected.report["steps"][i]["loss"]));
  }
}

TEST_CASE("a roll-forward that leaves the run is SYSTEM_TRAJECTORY_DIVERGED, said before the verdict",
          "[cli][roll][verdict]") {
  ScratchDir dir("diverged");
  REQUIRE(run_cli({"synth", "clean-fp32", (dir / "bundle").string(), "--checkpoint-every", "1000"}).status == 0);
  // The job really ran step 100 with 30x the learning rate its state.json
  // says: the replay's step 101 starts elsewhere than the run's.
  const fs::path state = dir / "bundle" / "steps" / "100" / "state.json";
  nlohmann::json s = read_json(state);
  s["lr"] = 0.1;
  write_json(state, s);
  const Triaged t = run_bundle(dir);
  CHECK(t.status == 0);  // a warning: nothing went non-finite
  const auto diverged = with_code(t.report, "SYSTEM_TRAJECTORY_DIVERGED");
  REQUIRE(diverged.size() == 1);
  CHECK(diverged[0]["severity"] == "warning");
  CHECK(diverged[0]["evidence"]["step"] == 101);
  CHECK(diverged[0]["evidence"]["expected"] == t.report["steps"][1]["logged_loss"]);
  CHECK(diverged[0]["evidence"]["after"] == t.report["steps"][1]["loss"]);
  CHECK(t.report["reproduction"]["trajectory"]["diverged_at"] == 101);
  CHECK(t.report["reproduction"]["reproduces"] == true);  // step 100 itself replays to the log
  CHECK(t.report["root_cause"]["code"] == "SYSTEM_TRAJECTORY_DIVERGED");
  CHECK(t.verdict.find("ROLL-FORWARD DIVERGED") < t.verdict.find("NOT REPRODUCED"));
}

TEST_CASE("bisect walks a rolled-forward window in order and names run's origin", "[cli][roll][bisect]") {
  ScratchDir dir("rolled-bisect");
  const Triaged t = triage(dir, "head-overflow", {"--checkpoint-every", "1000"});  // checks agreement with run
  const auto bisect =
      nlohmann::json::parse(run_cli({"bisect", (dir / "bundle").string(), "--json", "--no-samples"}).out);
  CHECK(bisect["stages"]["step"]["method"] == "in_order");
  const auto& tested = bisect["stages"]["step"]["tested"];
  REQUIRE(tested.size() == t.report["steps"].size());  // the incident is at the last step
  CHECK(bisect["stages"]["step"]["clean_predecessor"] == tested[tested.size() - 2]["step"]);
  // Cheaper than run, in passes (counts, not times): each step once, the bad one only up to the pass
  // that settles it, then one pass of full probes; run replays every pass and re-checks the deciding one.
  const auto& replays = bisect["replays"];
  const int64_t run_replays = t.report["replays"]["total"].get<int64_t>();
  CHECK(run_replays == t.report["replays"]["steps"].get<int64_t>() + 1);  // the determinism re-check
  CHECK(tested.back()["replays"].get<int64_t>() < bisect["passes_per_step"].get<int64_t>());
  CHECK(replays["origin"].get<int64_t>() < run_replays);
  // With the samples stage too: the subsets holding the origin's sample are known to fail and the
  // damage lies in its one token row, so nothing more is replayed; the same minimal set as per step.
  const auto full = nlohmann::json::parse(run_cli({"bisect", (dir / "bundle").string(), "--json"}).out);
  CHECK(full["origin"] == bisect["origin"]);
  CHECK(full["replays"]["total"].get<int64_t>() < run_replays);
  CHECK(full["stages"]["samples"]["minimal"] == nlohmann::json::array({full["origin"]["sample"]}));
  CHECK(full["stages"]["samples"]["data_dependent"] == true);
  const auto text = run_cli({"bisect", (dir / "bundle").string(), "--no-samples"});
  CHECK(text.out.find("in order") != std::string::npos);
}

TEST_CASE("bad rolled-forward bundles are refused with the file and key", "[cli][roll][bad]") {
  ScratchDir dir("rolled-bad");
  const fs::path good = dir / "good";
  REQUIRE(run_cli({"synth", "clean-fp32", good.string(), "--checkpoint-every", "1000"}).status == 0);
  const auto refused = [&](const std::string& name, const std::function<void(const fs::path&)>& edit,
                           const std::string& file, const std::string& key) {
    INFO(name);
    const fs::path bundle = dir / name;
    fs::copy(good, bundle, fs::copy_options::recursive);
    edit(bundle);
    const auto run = run_cli({"run", bundle.string(), "--out", (dir / (name + "-out")).string()});
    CHECK(run.status == 2);
    CHECK(std::count(run.err.begin(), run.err.end(), '\n') == 1);
    CHECK(run.err.find(file) != std::string::npos);
    CHECK(run.err.find(key) != std::string::npos);
    CHECK_FALSE(fs::exists(dir / (name + "-out")));
  };
  refused("no-lr", [](const fs::path& b) {
    nlohmann::json s = read_json(b / "steps" / "101" / "state.json");
    s.erase("lr");
    write_json(b / "steps" / "101" / "state.json", s);
  }, "steps/101/state.json", "lr");
  refused("gap", [](const fs::path& b) {
    nlohmann::json m = read_json(b / "manifest.json");
    m["steps"].erase(m["steps"].begin() + 2);  // steps 100, 101, 103: 103 has no checkpoint
    write_json(b / "manifest.json", m);
  }, "manifest.json", "a gap before step 103");
  refused("no-optimizer", [](const fs::path& b) { fs::remove(b / "steps" / "100" / "optimizer.safetensors"); },
          "steps/100/optimizer.safetensors", "optimizer");
  refused("no-first-model", [](const fs::path& b) { fs::remove(b / "steps" / "100" / "model.safetensors"); },
          "steps/100/model.safetensors", "model");
  refused("no-optimizer-config", [](const fs::path& b) {
    nlohmann::json m = read_json(b / "manifest.json");
    m.erase("optimizer");
    write_json(b / "manifest.json", m);
  }, "manifest.json", "optimizer");
}

TEST_CASE("run: a --steps window starting at a rolled-forward step is refused, naming the checkpoint to start at",
          "[cli][roll][bad]") {
  ScratchDir dir("rolled-window-start");
  const fs::path bundle = dir / "bundle";
  REQUIRE(run_cli({"synth", "clean-fp32", bundle.string(), "--checkpoint-every", "3"}).status == 0);  // 100 and 103
  const auto run = run_cli({"run", bundle.string(), "--steps", "101-103", "--out", (dir / "out").string()});
  CHECK(run.status == 2);  // was an internal error (exit 3): no parameters to roll step 101 forward from
  CHECK(std::count(run.err.begin(), run.err.end(), '\n') == 1);
  CHECK(run.err.find("--steps: step 101 holds no checkpoint") != std::string::npos);
  CHECK(run.err.find("start it at 100") != std::string::npos);
  CHECK_FALSE(fs::exists(dir / "out"));
  // From the checkpoint, the same window replays.
  CHECK(run_cli({"run", bundle.string(), "--steps", "100-103", "--out", (dir / "from-100").string()}).status == 0);
}
