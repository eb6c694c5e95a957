// Spike incidents end to end through the CLI (docs/spikes.md): a clean window
// is no spike; a data sample's spike and a silent bit flip are reproduced and
// located; a logged spike the replay does not make is said first; logged
// site statistics that another machine computed are SYSTEM_SITE_MISMATCH; a
// checkpoint step off the log is SYSTEM_TRAJECTORY_DIVERGED; one head's
// growing query-key logits are named as attention-logit growth; bad spike
// input is refused with the file and key.
#include <catch2/catch.hpp>

#include <cmath>
#include <fstream>

#include "loaders/base/error.h"
#include "loaders/bundle/manifest.h"
#include "loaders/bundle/step_state.h"
#include "reports/triage/spike_origin.h"
#include "reports/triage/window_outliers.h"
#include "tests/triage_harness.h"

using nanreplay_test::check_one_error_line;
using nanreplay_test::contains;
using nanreplay_test::lines_of;
using nanreplay_test::read_json;
using nanreplay_test::run_cli;
using nanreplay_test::ScratchDir;
using nanreplay_test::with_code;

namespace fs = std::filesystem;

namespace {

struct SpikeRun {
  int status = -1;
  nlohmann::json report;
  std::string out, err;
};

void write_spike_json(const fs::path& path, const nlohmann::json& value) { std::ofstream(path) << value.dump(2) << "\n"; }

void synth_spike_bundle(const ScratchDir& dir, const std::string& preset) {
  const auto synth = run_cli({"synth", preset, (dir / "bundle").string()});
  INFO(synth.err);
  REQUIRE(synth.status == 0);
}

SpikeRun run_spike_bundle(const ScratchDir& dir, const std::vector<std::string>& extra = {}) {
  std::vector<std::string> args = {"run", (dir / "bundle").string(), "--out", (dir / "out").string()};
  args.insert(args.end(), extra.begin(), extra.end());
  const auto run = run_cli(args);
  SpikeRun r{run.status, nlohmann::json(), run.out, run.err};
  if (fs::exists(dir / "out" / "report.json")) r.report = read_json(dir / "out" / "report.json");
  return r;
}

fs::path state_of(const ScratchDir& dir, int step) {
  return dir / "bundle" / "steps" / std::to_string(step) / "state.json";
}

nlohmann::json read_manifest(const ScratchDir& dir) { return read_json(dir / "bundle" / "manifest.json"); }

}  // namespace

TEST_CASE("clean windows are no spike: spike null, no site mismatch, exit 0", "[cli][spike]") {
  for (const char* preset : {"clean-site-stats"}) {  // clean-fp32 with every site's statistics logged
    INFO(preset);
    ScratchDir dir(std::string("spike-") + preset);
    synth_spike_bundle(dir, preset);
    const SpikeRun r = run_spike_bundle(dir);
    INFO(r.err);
    CHECK(r.status == 0);
    REQUIRE(r.report.contains("spike"));
    CHECK(r.report["spike"].is_null());
    CHECK(r.report["spike_check"].is_null());
    CHECK(with_code(r.report, "SYSTEM_SITE_MISMATCH").empty());
    CHECK(with_code(r.report, "SYSTEM_TRAJECTORY_DIVERGED").empty());
    CHECK(r.report["head_logit_growth"].is_null());  // no spike incident: no "what changed"
    CHECK(r.report["expert_outliers"].is_null());
  }
}

TEST_CASE("a data sample's loss spike is reproduced and located at its token", "[cli][spike]") {
  ScratchDir dir("spike-token");
  synth_spike_bundle(dir, "spike-token");
  const nlohmann::json manifest = read_manifest(dir);
  const SpikeRun r = run_spike_bundle(dir);
  INFO(r.err);
  CHECK(r.status == 1);
  CHECK_FALSE(r.report["reproduced"].get<bool>());  // nothing non-finite
  const nlohmann::json& spike = r.report["spike"];
  REQUIRE(spike.is_object());
  CHECK(spike["reproduced"] == true);
  CHECK(spike["step"] == 103);
  CHECK(spike["phase"] == "forward");
  CHECK(spike["site"] == "embed");
  CHECK(spike["layer"].is_null());
  CHECK(spike["head"].is_null());
  CHECK(spike["expert"].is_null());
  CHECK(spike["rank"] == 0);
  CHECK(spike["micro_batch"] == 0);
  // The planted token is at positions 1, 3, 5... of rank 0's first sample of the step.
  CHECK(spike["sample"] == manifest["steps"][3]["samples"][0][0]);
  CHECK(spike["position"] == 1);
  CHECK(spike["statistic"] == "max_abs");
  CHECK(spike["score"].get<double>() > 8.0);
  CHECK(r.report["spike_check"]["declared"] == false);  // found in the log
  CHECK(r.report["spike_check"]["quantity"] == "loss");
  CHECK(r.report["spike_check"]["mechanism"].is_null());  // the origin is no head's scores
  CHECK(r.report["head_logit_growth"]["steps"] == nlohmann::json({100, 101, 102, 103}));
  CHECK(r.report["expert_outliers"].is_null());  // a dense model
  CHECK(contains(r.out, "SPIKE"));
  CHECK(contains(r.report["root_cause"]["summary"].get<std::string>(), "starts at step 103, embed"));
  // The shape of the damage: one feature of the planted token's rows.
  REQUIRE(spike["damage"].is_object());
  CHECK(spike["damage"]["pattern"] == "token_feature");
  CHECK(spike["damage"]["rows_hit"] == 16);
  // The counterfactuals: step 103's batch spikes on step 102's weights, the reverse does not: data.
  const nlohmann::json& cf = r.report["counterfactuals"];
  REQUIRE(cf.is_object());
  CHECK(cf["step"] == 103);
  CHECK(cf["previous_step"] == 102);
  CHECK(cf["conclusion"] == "data");
  CHECK(cf["decided_by"] == "loss");
  CHECK(cf["loss"]["spike_batch_previous_weights"].get<double>() > 1.5 * cf["loss"]["previous"].get<double>());
  CHECK(cf["loss"]["previous_batch_spike_weights"].get<double>() < 1.1 * cf["loss"]["previous"].get<double>());
  CHECK(cf["loss"]["logged"] == r.report["steps"][3]["logged_loss"]);
  CHECK(cf["update"]["outcome"] == "computed");
  CHECK(contains(r.out, "Counterfactuals: data"));
  CHECK(contains(nanreplay_test::slurp(dir / "out" / "report.md"), "Counterfactuals: data"));
  CHECK(contains(nanreplay_test::slurp(dir / "out" / "report.html"), "Shape of the damage"));
  CHECK(r.report["next_step"]["kind"] == "spike");
  CHECK(r.report["runbook"]["layer"] == "job");
  CHECK(r.report["runbook"]["resume_from"]["step"] == 103);
  CHECK(r.report["runbook"]["confirm"].get<std::string>().rfind("nanreplay bisect ", 0) == 0);
  // --incident-kind nonfinite turns the spike off; bad spike flags are usage errors.
  CHECK(run_spike_bundle(dir, {"--incident-kind", "nonfinite"}).report["spike"].is_null());
  const SpikeRun bad = run_spike_bundle(dir, {"--incident-kind", "maybe"});
  CHECK(bad.status == 2);
  CHECK(contains(bad.err, "--incident-kind"));
  const SpikeRun ratio = run_spike_bundle(dir, {"--spike-loss-ratio", "0.5"});
  CHECK(ratio.status == 2);
  CHECK(contains(ratio.err, "--spike-loss-ratio"));
}

TEST_CASE("a finite bit flip declared a spike: its site leaves its trajectory though the loss does not spike",
          "[cli][spike]") {
  ScratchDir dir("spike-bit-flip");
  synth_spike_bundle(dir, "spike-bit-flip");
  const SpikeRun r = run_spike_bundle(dir);
  INFO(r.err);
  CHECK(r.status == 1);  // SYSTEM_BIT_FLIP
  CHECK(r.report["first_nonfinite"].is_null());
  CHECK(r.report["root_cause"]["code"] == "SYSTEM_BIT_FLIP");
  const nlohmann::json& spike = r.report["spike"];
  REQUIRE(spike.is_object());
  // A weight of 1.5 among weights of 0.02 moves this small model's loss by 1e-4: nothing to reproduce.
  CHECK(spike["reproduced"] == false);
  CHECK(spike["site"].is_null());
  const nlohmann::json& check = r.report["spike_check"];
  CHECK(check["declared"] == true);
  CHECK(check["spike_step"] == 103);
  CHECK(contains(check["not_reproduced_reason"].get<std::string>(), "declared spike"));
  // Where the flipped weight first shows: its own projection, at the step whose checkpoint holds it.
  REQUIRE(check["first_departure"].is_object());
  CHECK(check["first_departure"]["step"] == 103);
  CHECK(check["first_departure"]["site"] == "layers.1.attn.q");
  CHECK(check["first_departure"]["ratio"].get<double>() > 3.0);
  // Its outlying elements lie in one head of q; the loss does not move, the site decides: model state.
  CHECK(check["first_departure"]["damage"]["pattern"] == "head");
  const nlohmann::json& cf = r.report["counterfactuals"];
  REQUIRE(cf.is_object());
  CHECK(cf["conclusion"] == "model_state");
  CHECK(cf["decided_by"] == "site");
  CHECK(cf["site"]["site"] == "layers.1.attn.q");
  CHECK(cf["site"]["previous_batch_spike_weights"].get<double>() > 2.0 * cf["site"]["previous"].get<double>());
  CHECK(cf["update"]["outcome"] == "corrupted");
  CHECK(cf["update"]["code"] == "SYSTEM_BIT_FLIP");
}

TEST_CASE("one head's growing query-key logits: the spike starts at its scores, named attention-logit growth",
          "[cli][spike]") {
  ScratchDir dir("spike-logit-growth");
  synth_spike_bundle(dir, "spike-logit-growth");
  const SpikeRun r = run_spike_bundle(dir);
  INFO(r.err);
  CHECK(r.status == 1);
  CHECK(r.report["first_nonfinite"].is_null());
  CHECK(r.report["root_cause"]["code"] == "NONE");  // no finding: the spike's origin is the cause
  const nlohmann::json& spike = r.report["spike"];
  REQUIRE(spike.is_object());
  CHECK(spike["reproduced"] == true);
  CHECK(spike["step"] == 103);
  CHECK(spike["site"] == "layers.1.attn.scores");
  CHECK(spike["layer"] == 1);
  CHECK(spike["head"] == 2);
  CHECK(spike["statistic"] == "rms");  // the head's logits as a whole, 3.8x their trend
  CHECK(r.report["spike_check"]["quantity"] == "loss");
  // The evidence: head 2's largest logit grows every step, then jumps into the spike.
  const nlohmann::json& growth = r.report["head_logit_growth"];
  REQUIRE(growth.is_object());
  CHECK(growth["steps"] == nlohmann::json({100, 101, 102, 103}));
  const nlohmann::json& top = growth["heads"][0];
  CHECK(top["layer"] == 1);
  CHECK(top["head"] == 2);
  REQUIRE(top["max_logit"].size() == 4);
  for (size_t i = 1; i < 4; ++i) CHECK(top["max_logit"][i].get<double>() > 1.5 * top["max_logit"][i - 1].get<double>());
  CHECK(top["healthy_growth"].get<double>() >= nanreplay::kLogitGrowthHealthyFactor);
  CHECK(top["spike_jump"].get<double>() > 3.0);
  const nlohmann::json& mechanism = r.report["spike_check"]["mechanism"];
  REQUIRE(mechanism.is_object());
  CHECK(mechanism["name"] == "attention_logit_growth");
  CHECK(mechanism["layer"] == 1);
  CHECK(mechanism["head"] == 2);
  CHECK(mechanism["healthy_growth"] == top["healthy_growth"]);
  CHECK(contains(r.report["root_cause"]["summary"].get<std::string>(), "attention-logit growth"));
  CHECK(contains(r.out, "Largest query-key logit (steps 100-103): layers.1 head 2"));
  CHECK(contains(nanreplay_test::slurp(dir / "out" / "report.md"), "Largest query-key logit"));
  CHECK(contains(nanreplay_test::slurp(dir / "out" / "report.html"), "id=\"what-changed\""));
  CHECK(r.report["expert_outliers"].is_null());
}

TEST_CASE("a mixture of experts declared a spike lists its experts' largest activations", "[cli][spike]") {
  ScratchDir dir("spike-moe-outliers");
  synth_spike_bundle(dir, "clean-moe");
  const SpikeRun r = run_spike_bundle(dir, {"--incident-kind", "spike"});
  INFO(r.err);
  CHECK(r.status == 0);  // nothing spikes: no origin
  CHECK(r.report["spike"]["reproduced"] == false);
  CHECK(r.report["spike_check"]["first_departure"].is_null());
  CHECK(r.report["spike_check"]["mechanism"].is_null());
  const nlohmann::json& experts = r.report["expert_outliers"];
  REQUIRE(experts.is_object());
  CHECK(experts["steps"] == nlohmann::json({100, 101, 102, 103}));
  REQUIRE(experts["experts"].size() == nanreplay::kOutlierExpertsListed);
  double previous = INFINITY;
  for (const nlohmann::json& e : experts["experts"]) {
    REQUIRE(e["act_max"].size() == 4);
    REQUIRE(e["down_max"].size() == 4);
    REQUIRE(e["router_logit_max"].size() == 4);
    for (const nlohmann::json& v : e["router_logit_max"]) CHECK(v.is_number());
    for (const nlohmann::json& v : e["act_max"]) CHECK(v.get<double>() > 0.0);
    CHECK(e["act_max"][3].get<double>() <= previous);  // the largest at the last step first
    previous = e["act_max"][3].get<double>();
  }
  CHECK(contains(r.out, "Largest expert activation (steps 100-103)"));
}

// docs/spikes.md's calibration on the presets whose sites the dense presets
// lack: sandwich norms and local layers, sinks (a probability near 0 that
// follows the data), NoPE layers and the L2 QK-norm.
TEST_CASE("the model families' clean windows declared spikes leave no site's trajectory", "[cli][spike][families]") {
  for (const std::string preset : {"clean-gemma3", "clean-gpt-oss-attn", "clean-llama4-attn"}) {
    DYNAMIC_SECTION(preset) {
      ScratchDir dir("spike-clean-family");
      synth_spike_bundle(dir, preset);
      const SpikeRun r = run_spike_bundle(dir, {"--incident-kind", "spike"});
      INFO(r.err);
      CHECK(r.status == 0);
      CHECK(r.report["spike"]["reproduced"] == false);
      CHECK(r.report["spike_check"]["first_departure"].is_null());
      CHECK(r.report["findings"].empty());
    }
  }
}

TEST_CASE("a logged spike the replay does not make is said first, every origin field null", "[cli][spike]") {
  ScratchDir dir("spike-not-reproduced");
  synth_spike_bundle(dir, "clean-fp32");
  nlohmann::json state = read_json(state_of(dir, 103));
  state["logged"]["loss"] = state["logged"]["loss"].get<double>() * 3.0;
  write_spike_json(state_of(dir, 103), state);
  const SpikeRun r = run_spike_bundle(dir);
  INFO(r.err);
  const nlohmann::json& spike = r.report["spike"];
  REQUIRE(spike.is_object());
  CHECK(spike["reproduced"] == false);
  for (const auto& [key, value] : spike.items()) {
    if (key != "reproduced") CHECK(value.is_null());
  }
  CHECK(r.report["spike_check"]["spike_step"] == 103);
  REQUIRE_FALSE(lines_of(r.out).empty());
  CHECK(lines_of(r.out).front().rfind("SPIKE NOT REPRODUCED", 0) == 0);
  CHECK(nanreplay_test::slurp(dir / "out" / "report.md").rfind("**SPIKE NOT REPRODUCED", 0) == 0);
  CHECK(contains(nanreplay_test::slurp(dir / "out" / "report.html"), "SPIKE NOT REPRODUCED"));
  // The step left the replay although it starts from the run's own checkpoint.
  const auto diverged = with_code(r.report, "SYSTEM_TRAJECTORY_DIVERGED");
  REQUIRE(diverged.size() == 1);
  CHECK(diverged[0]["evidence"]["step"] == 103);
  CHECK(diverged[0]["evidence"]["replayed_from"] == "checkpoint");
  CHECK(diverged[0]["evidence"]["tensor"] == "loss");
  CHECK(r.status == 0);  // warnings only: no origin named
}

TEST_CASE("logged site statistics computed differently are SYSTEM_SITE_MISMATCH at that site", "[cli][spike]") {
  ScratchDir dir("spike-site-mismatch");
  synth_spike_bundle(dir, "site-mismatch");
  const SpikeRun r = run_spike_bundle(dir);
  INFO(r.err);
  CHECK(r.status == 1);
  CHECK(r.report["spike"].is_null());
  const auto found = with_code(r.report, "SYSTEM_SITE_MISMATCH");
  REQUIRE(found.size() == 1);
  const nlohmann::json& e = found[0]["evidence"];
  CHECK(found[0]["severity"] == "error");
  CHECK(e["step"] == 103);
  CHECK(e["site"] == "layers.1.attn.out");
  CHECK(e["head"].is_null());
  CHECK(e["statistic"] == "max_abs");
  CHECK(e["expected"].get<double>() == Approx(1.5 * e["after"].get<double>()).epsilon(1e-9));
}

TEST_CASE("bad spike input is refused naming the file and key", "[cli][spike]") {
  ScratchDir dir("spike-bad");
  synth_spike_bundle(dir, "clean-site-stats");
  const fs::path manifest_path = dir / "bundle" / "manifest.json";
  const nlohmann::json manifest = read_json(manifest_path);
  nlohmann::json bad = manifest;
  bad["incident"] = {{"kind", "blip"}};
  write_spike_json(manifest_path, bad);
  check_one_error_line(run_cli({"run", (dir / "bundle").string(), "--out", (dir / "out").string()}),
                       {"manifest.json", "incident.kind"});
  bad["incident"] = {{"kind", "spike"}, {"spike", {{"loss_ratio", 0.5}}}};
  write_spike_json(manifest_path, bad);
  check_one_error_line(run_cli({"run", (dir / "bundle").string(), "--out", (dir / "out").string()}),
                       {"manifest.json", "incident.spike.loss_ratio"});
  write_spike_json(manifest_path, manifest);
  nlohmann::json state = read_json(state_of(dir, 101));
  state["logged"]["site_stats"]["layers.0.attn.out"]["rms"] = -1.0;
  write_spike_json(state_of(dir, 101), state);
  check_one_error_line(run_cli({"run", (dir / "bundle").string(), "--out", (dir / "out").string()}),
                       {"101", "state.json", "logged.site_stats[\"layers.0.attn.out\"].rms"});
  CHECK_FALSE(fs::exists(dir / "out" / "report.json"));
}

TEST_CASE("the trajectory rule: a steady trend is no spike, a jump beyond it is", "[spike][unit]") {
  using nanreplay::deviation_from_trajectory;
  const nanreplay::SpikeThresholds t;
  // Growing 10 % a step: on its trend.
  const auto steady = deviation_from_trajectory({1.0, 1.1, 1.21}, 1.331, t);
  REQUIRE(steady);
  CHECK(steady->ratio == Approx(1.0));
  CHECK(std::fabs(steady->score) < 1e-9);
  // Three times what the trend predicts: log(3) / min_log_scale.
  const auto jump = deviation_from_trajectory({1.0, 1.1, 1.21}, 3 * 1.331, t);
  REQUIRE(jump);
  CHECK(jump->ratio == Approx(3.0));
  CHECK(jump->score == Approx(std::log(3.0) / t.min_log_scale));
  // Too short a history, or a value that is not positive and finite: not judged.
  CHECK_FALSE(deviation_from_trajectory({1.0}, 5.0, t));
  CHECK_FALSE(deviation_from_trajectory({1.0, 1.1}, 0.0, t));
  CHECK_FALSE(deviation_from_trajectory({1.0, 1.1}, NAN, t));
}

TEST_CASE("attention-logit growth: a head's scores as origin, grown over the healthy steps", "[spike][unit]") {
  using nanreplay::ProbeRecord;
  auto scores = [](int64_t step, int layer, int head, double max_abs) {
    ProbeRecord r;
    r.step = step;
    r.micro_batch = 0;
    r.rank = 0;
    r.site = {nanreplay::SiteId::kAttnScores, layer};
    r.layer = layer;
    r.head = head;
    r.stats.max_abs = max_abs;
    r.stats.finite_count = 1;
    return r;
  };
  auto tracker_of = [&](const std::vector<double>& head_two) {
    nanreplay::OutlierTracker t;
    for (size_t i = 0; i < head_two.size(); ++i) {
      const int64_t step = 100 + static_cast<int64_t>(i);
      // Two micro-batches: the step's value is the larger.
      t.step_done(step, {scores(step, 1, 2, head_two[i]), scores(step, 1, 2, head_two[i] / 2), scores(step, 0, 0, 5.0)},
                  {}, std::nullopt);
    }
    return t;
  };
  nanreplay::SpikeOrigin origin;
  origin.step = 103;
  origin.site = {nanreplay::SiteId::kAttnScores, 1};
  origin.layer = 1;
  origin.head = 2;
  const auto grown = tracker_of({1.0, 2.0, 4.0, 32.0}).logit_growth(origin);
  REQUIRE(grown);
  CHECK(grown->healthy_growth == Approx(4.0));
  CHECK(grown->spike_jump == Approx(8.0));
  // Grown less than the factor over the healthy steps: a jump with no growth before it.
  CHECK_FALSE(tracker_of({1.0, 1.2, 1.5, 32.0}).logit_growth(origin));
  // An origin elsewhere is no attention-logit growth.
  nanreplay::SpikeOrigin q = origin;
  q.site = {nanreplay::SiteId::kAttnQ, 1};
  q.head = -1;
  CHECK_FALSE(tracker_of({1.0, 2.0, 4.0, 32.0}).logit_growth(q));
  // The summary: heads by their value at the spike's step, steps after it left out.
  nanreplay::OutlierTracker t = tracker_of({1.0, 2.0, 4.0, 32.0, 64.0});
  const nanreplay::WindowOutliers w = t.summary(103);
  CHECK(w.steps == std::vector<int64_t>{100, 101, 102, 103});
  REQUIRE(w.heads.size() == 2);
  CHECK(w.heads[0].layer == 1);
  CHECK(w.heads[0].head == 2);
  CHECK(w.heads[0].max_logit == std::vector<double>{1.0, 2.0, 4.0, 32.0});
  CHECK(*w.heads[0].healthy_growth == Approx(4.0));
  CHECK(*w.heads[1].healthy_growth == Approx(1.0));
  CHECK(w.experts.empty());
}

TEST_CASE("a spike incident is planned from the manifest's kind and the logged series", "[spike][unit]") {
  using nanreplay::IncidentInfo;
  using nanreplay::IncidentKind;
  auto states = [](const std::vector<double>& losses) {
    std::vector<nanreplay::StepState> out;
    for (size_t i = 0; i < losses.size(); ++i) {
      nanreplay::StepState s;
      s.step = 100 + static_cast<int64_t>(i);
      s.logged.loss = losses[i];
      s.logged.grad_norm = 1.0;
      out.push_back(s);
    }
    return out;
  };
  const nanreplay::SpikeOverrides none;
  // Found in the log without a flag.
  const auto found = nanreplay::plan_spike(std::nullopt, states({5.5, 5.4, 5.3, 11.0}), none);
  CHECK(found.active);
  CHECK_FALSE(found.declared);
  CHECK(found.step == 103);
  CHECK(found.quantity == "loss");
  // A clean, falling log is none; "nonfinite" turns detection off; a logged NaN is the incident.
  CHECK_FALSE(nanreplay::plan_spike(std::nullopt, states({5.5, 5.4, 5.3, 5.2}), none).active);
  IncidentInfo nonfinite;
  nonfinite.kind = IncidentKind::kNonfinite;
  CHECK_FALSE(nanreplay::plan_spike(nonfinite, states({5.5, 5.4, 5.3, 11.0}), none).active);
  CHECK_FALSE(nanreplay::plan_spike(std::nullopt, states({5.5, 5.4, 11.0, NAN}), none).active);
  // Declared, its step wins; a flag overrides the manifest.
  IncidentInfo declared;
  declared.kind = IncidentKind::kSpike;
  declared.step = 102;
  const auto planned = nanreplay::plan_spike(declared, states({5.5, 5.4, 5.3, 5.2}), none);
  CHECK(planned.active);
  CHECK(planned.declared);
  CHECK(planned.step == 102);
  nanreplay::SpikeOverrides off;
  off.spike = false;
  CHECK_FALSE(nanreplay::plan_spike(declared, states({5.5, 5.4, 5.3, 11.0}), off).active);
  nanreplay::SpikeOverrides loose;
  loose.loss_ratio = 1.01;
  loose.zscore = 0.1;
  CHECK(nanreplay::plan_spike(std::nullopt, states({5.5, 5.4, 5.3, 5.4}), loose).active);
}

TEST_CASE("logged.site_stats is read, and a bad statistic names the file and key", "[spike][unit]") {
  const nanreplay::StepState s = nanreplay::parse_step_state(
      R"({"step": 3, "logged": {"site_stats": {"layers.0.attn.scores": {"max_abs": 3.5, "rms": 0.25,
          "per_head": [{"max_abs": 3.5, "rms": 0.3}, {"max_abs": 1, "rms": 0.2}]}}}})",
      "steps/3/state.json");
  const auto& site = s.logged.site_stats.at("layers.0.attn.scores");
  CHECK(site.whole.max_abs == 3.5);
  CHECK(site.whole.rms == 0.25);
  REQUIRE(site.per_head.size() == 2);
  CHECK(site.per_head[1].max_abs == 1.0);
  for (const char* bad : {R"({"step": 3, "logged": {"site_stats": {"embed": {"max_abs": -1, "rms": 0}}}})",
                          R"({"step": 3, "logged": {"site_stats": {"embed": {"max_abs": "nan", "rms": 0}}}})",
                          R"({"step": 3, "logged": {"site_stats": {"embed": {"rms": 0}}}})"}) {
    INFO(bad);
    try {
      nanreplay::parse_step_state(bad, "steps/3/state.json");
      FAIL("accepted");
    } catch (const nanreplay::InputError& e) {
      CHECK(nanreplay_test::contains(e.what(), "steps/3/state.json"));
      CHECK(nanreplay_test::contains(e.what(), "logged.site_stats[\"embed\"].max_abs"));
    }
  }
}

TEST_CASE("incident.kind and incident.spike are read, and bad values name the key", "[spike][unit]") {
  auto manifest_with = [](const nlohmann::json& incident) {
    nlohmann::json m = {{"format", "nanreplay.bundle"}, {"version", 1},
                        {"model", {{"arch", "llama"}, {"vocab_size", 256}, {"hidden_size", 64}, {"num_layers", 2},
                                   {"num_heads", 4}, {"num_kv_heads", 4}, {"intermediate_size", 172},
                                   {"max_seq_len", 64}, {"norm_eps", 1e-5}, {"rope_theta", 10000.0},
                                   {"tie_embeddings", false}}},
                        {"data", {{"shards", {{{"path", "data/a.bin"}, {"dtype", "uint16"}, {"tokens", 1024}}}},
                                  {"seq_len", 32}, {"micro_batch_size", 2},
                                  {"sampler", {{"kind", "randperm"}, {"seed", 1}}}}},
                        {"steps", {{{"step", 1}, {"dir", "steps/1"}}}},
                        {"incident", incident}};
    return nanreplay::parse_manifest(m.dump(), "bundle/manifest.json");
  };
  const nanreplay::Manifest m = manifest_with({{"kind", "spike"}, {"spike", {{"loss_ratio", 2.0}, {"min_history", 3}}}});
  REQUIRE(m.incident->kind);
  CHECK(*m.incident->kind == nanreplay::IncidentKind::kSpike);
  CHECK(m.incident->spike->loss_ratio == 2.0);
  CHECK(m.incident->spike->min_history == 3);
  CHECK(m.incident->spike->zscore == nanreplay::SpikeThresholds{}.zscore);
  CHECK_FALSE(manifest_with({{"step", 4}}).incident->kind.has_value());
  for (const auto& [incident, key] : std::vector<std::pair<nlohmann::json, std::string>>{
           {{{"kind", "blip"}}, "incident.kind"},
           {{{"spike", {{"zscore", -1}}}}, "incident.spike.zscore"},
           {{{"spike", {{"grad_norm_ratio", "inf"}}}}, "incident.spike.grad_norm_ratio"},
           {{{"spike", {{"min_history", 0}}}}, "incident.spike.min_history"}}) {
    INFO(incident.dump());
    try {
      manifest_with(incident);
      FAIL("accepted");
    } catch (const nanreplay::InputError& e) {
      CHECK(nanreplay_test::contains(e.what(), key));
    }
  }
}
