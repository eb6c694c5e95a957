// How frontier MoE / MuonClip runs fail (issue 40): report.json's per-step
// attn_logit_max and expert_activation_max, NUMERIC_EXPERT_OUTLIER_ACTIVATION,
// and the qk-clip=TAU what-if (Kimi K2's MuonClip as a fix), through the CLI
// and the outlier rule on records (docs/report-format.md, docs/triage.md,
// docs/bisect-and-what-if.md). MuonClip's bound on MHA, GQA and latent
// attention, through the library: tests/test_torch_qk_clip.cpp.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <limits>

#include "reports/triage/numeric/expert_outlier.h"
#include "tests/triage_harness.h"

using nanreplay_test::check_one_error_line;
using nanreplay_test::triage;
using nanreplay_test::run_cli;
using nanreplay_test::ScratchDir;
using nanreplay_test::Triaged;
using nanreplay_test::with_code;

namespace {

const nlohmann::json& frontier_step(const nlohmann::json& report, int64_t step) {
  for (const nlohmann::json& s : report["steps"]) {
    if (s["step"] == step) return s;
  }
  FAIL("no step " << step << " in report.json");
  return report;
}

// A number of report.json, "inf"/"nan" as +inf/NaN.
double frontier_number(const nlohmann::json& v) {
  if (v.is_string()) return v == "inf" ? std::numeric_limits<double>::infinity() : std::nan("");
  return v.get<double>();
}

// Step 7's mlp.expert.down forward record of layer 1's `expert`: its output max |x|, found at
// (sample, position 3), over 5 routed tokens.
nanreplay::ProbeRecord expert_output_record(int expert, double max_abs, int64_t sample) {
  nanreplay::ProbeRecord r;
  r.step = 7;
  r.phase = nanreplay::Phase::kForward;
  r.site = {nanreplay::SiteId::kMlpExpertDown, 1};
  r.layer = 1;
  r.expert = expert;
  r.routed_tokens = 5;
  r.stats.max_abs = max_abs;
  r.largest_sample = sample;
  r.largest_position = 3;
  return r;
}

// Multiplies every value of the float32 tensors whose names contain each of `parts` in a safetensors file
// by `factor`, in place: an edit between two checkpoints no optimizer made.
int scale_tensors(const std::filesystem::path& path, const std::vector<std::string>& parts, float factor) {
  std::string bytes = nanreplay_test::slurp(path);
  uint64_t header_length = 0;
  std::memcpy(&header_length, bytes.data(), sizeof header_length);  // little-endian, as on every host here
  const nlohmann::json header = nlohmann::json::parse(bytes.substr(8, header_length));
  int scaled = 0;
  for (const auto& [name, entry] : header.items()) {
    const bool named = std::all_of(parts.begin(), parts.end(),
                                   [&](const std::string& part) { return name.find(part) != std::string::npos; });
    if (name == "__metadata__" || !named) continue;
    REQUIRE(entry["dtype"] == "F32");
    const size_t begin = 8 + header_length + entry["data_offsets"][0].get<size_t>();
    const size_t end = 8 + header_length + entry["data_offsets"][1].get<size_t>();
    for (size_t at = begin; at < end; at += sizeof(float)) {
      float value = 0;
      std::memcpy(&value, bytes.data() + at, sizeof value);
      value *= factor;
      std::memcpy(bytes.data() + at, &value, sizeof value);
    }
    ++scaled;
  }
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
  return scaled;
}

}  // namespace

TEST_CASE("attn_logit_max names the planted head; qk-clip=100 resolves its overflow and qk-clip=1e6 does not",
          "[cli][frontier][what-if]") {
  ScratchDir dir("frontier-qk-clip");
  const Triaged t = triage(dir, "head-overflow", {}, {"--what-if", "qk-clip=100", "--what-if", "qk-clip=1e6"});
  CHECK(t.status == 1);
  const nlohmann::json& first = t.report["first_nonfinite"];
  REQUIRE(first["site"] == "layers.1.attn.scores");
  REQUIRE(first["head"] == 2);
  // Every replayed step has [layer][head]; at the incident the planted head is the largest (it overflowed fp16).
  for (const nlohmann::json& s : t.report["steps"]) {
    REQUIRE(s["attn_logit_max"].size() == 2);
    for (const nlohmann::json& layer : s["attn_logit_max"]) CHECK(layer.size() == 4);
  }
  const nlohmann::json& at = frontier_step(t.report, first["step"].get<int64_t>())["attn_logit_max"];
  CHECK(at[1][2] == "inf");
  for (size_t l = 0; l < 2; ++l) {
    for (size_t h = 0; h < 4; ++h) {
      if (l == 1 && h == 2) continue;
      CHECK(frontier_number(at[l][h]) < 100.0);  // the others are ordinary
    }
  }
  const nlohmann::json& outcomes = t.report["what_if"];
  REQUIRE(outcomes.size() == 2);
  // Measured again in fp32, head 2's largest logit is ~3.7e6: clipped to 100 it fits fp16 ...
  CHECK(outcomes[0]["resolved"] == true);
  CHECK(outcomes[0]["first_nonfinite_after"].is_null());
  CHECK(outcomes[0]["change"].get<std::string>().find("1 head rescaled") != std::string::npos);
  CHECK(outcomes[0]["change"].get<std::string>().find("layer 1 head 2") != std::string::npos);
  // ... clipped to 1e6 it still passes fp16's 65504.
  CHECK(outcomes[1]["resolved"] == false);
  CHECK(outcomes[1]["first_nonfinite_after"]["site"] == "layers.1.attn.scores");
  CHECK(outcomes[1]["first_nonfinite_after"]["head"] == 2);

  // Refused by name before anything is replayed: tau <= 0 or no number; a gpt2 bundle.
  const std::string bundle = (dir / "bundle").string();
  for (const char* bad : {"qk-clip=0", "qk-clip=-5"}) {
    check_one_error_line(run_cli({"run", bundle, "--out", (dir / "bad").string(), "--what-if", bad}), {bad, "> 0"});
  }
  check_one_error_line(run_cli({"run", bundle, "--out", (dir / "bad").string(), "--what-if", "qk-clip=x"}),
                       {"qk-clip=x", "not a number"});
  REQUIRE(run_cli({"synth", "clean-gpt2", (dir / "gpt2").string()}).status == 0);
  check_one_error_line(
      run_cli({"run", (dir / "gpt2").string(), "--out", (dir / "bad").string(), "--what-if", "qk-clip=100"}),
      {"qk-clip=100", "llama"});
  CHECK_FALSE(std::filesystem::exists(dir / "bad"));
}

TEST_CASE("expert_activation_max and NUMERIC_EXPERT_OUTLIER_ACTIVATION name GPT-OSS's overflowing expert",
          "[cli][frontier][moe]") {
  ScratchDir dir("frontier-expert-outlier");
  const Triaged t = triage(dir, "gpt-oss-expert-overflow");
  CHECK(t.status == 1);
  const nlohmann::json& first = t.report["first_nonfinite"];
  REQUIRE(first["site"] == "layers.1.mlp.expert.act");
  const int64_t step = first["step"].get<int64_t>();
  // Per step [layer][expert] {input, output}; at the incident expert 2 of layer 1 alone is non-finite.
  for (const nlohmann::json& s : t.report["steps"]) {
    REQUIRE(s["expert_activation_max"].size() == 2);
    for (const nlohmann::json& layer : s["expert_activation_max"]) {
      REQUIRE(layer.size() == 4);
      for (const nlohmann::json& e : layer) CHECK((e.contains("input") && e.contains("output")));
    }
  }
  const nlohmann::json& layer1 = frontier_step(t.report, step)["expert_activation_max"][1];
  CHECK(layer1[2]["output"] == "nan");  // inf * 0 in the down projection
  CHECK(frontier_number(layer1[2]["input"]) < 10.0);  // its input was ordinary: the expert made it
  for (size_t e : {0, 1, 3}) {
    if (layer1[e]["output"].is_null()) continue;  // nothing routed to it
    CHECK(frontier_number(layer1[e]["output"]) < 10.0);
  }
  const auto found = with_code(t.report, "NUMERIC_EXPERT_OUTLIER_ACTIVATION");
  REQUIRE(found.size() == 1);
  const nlohmann::json& ev = found[0]["evidence"];
  CHECK(found[0]["severity"] == "error");
  CHECK(ev["step"] == t.planted["fault_step"]);
  CHECK(ev["layer"] == 1);
  CHECK(ev["expert"] == t.planted["fault_expert"]);
  CHECK(ev["sample"] == t.planted["fault_sample"]);
  CHECK(ev["position"] == t.planted["fault_position"]);
  CHECK(ev["token"] == first["token"]);
  CHECK(ev["value"] == "inf");
  CHECK(frontier_number(ev["typical"]) < 10.0);
  // Supporting evidence: the root cause stays the overflow it details.
  CHECK(t.report["root_cause"]["code"] == "NUMERIC_OVERFLOW");
}

TEST_CASE("a dense layer's expert_activation_max is null, and healthy experts raise no outlier",
          "[cli][frontier][moe]") {
  for (const char* preset : {"clean-llama4-moe", "clean-moe"}) {
    INFO(preset);
    ScratchDir dir(std::string("frontier-clean-") + preset);
    const Triaged t = triage(dir, preset);
    CHECK(t.status == 0);
    CHECK(with_code(t.report, "NUMERIC_EXPERT_OUTLIER_ACTIVATION").empty());
    const nlohmann::json& last = t.report["steps"].back()["expert_activation_max"];
    if (std::string(preset) == "clean-llama4-moe") CHECK(last[0].is_null());  // Llama 4's dense layer 0
    CHECK(last.back().is_array());
  }
}

TEST_CASE("NUMERIC_EXPERT_OUTLIER_ACTIVATION: a finite expert output far above its layer's others", "[frontier][triage]") {
  using nanreplay::ProbeRecord;
  const auto down = expert_output_record;
  const nanreplay::TriageThresholds t = nanreplay::default_thresholds(nanreplay::Compute::kFp32);
  const auto token_at = [](int64_t sample, int64_t position) { return sample * 100 + position; };
  const std::vector<ProbeRecord> outlier = {down(0, 2.0, 1), down(1, 3.0, 2), down(2, 900.0, 46), down(3, 2.5, 4)};
  const auto found = nanreplay::expert_outlier_findings(outlier, 7, t, token_at);
  REQUIRE(found.size() == 1);
  const nanreplay::Evidence& ev = found[0].evidence;
  using K = nanreplay::EvidenceKey;
  CHECK(found[0].severity == nanreplay::Severity::kWarning);
  CHECK(ev.integer(K::kExpert) == 2);
  CHECK(ev.integer(K::kLayer) == 1);
  CHECK(ev.integer(K::kSample) == 46);
  CHECK(ev.integer(K::kPosition) == 3);
  CHECK(ev.integer(K::kToken) == 4603);
  CHECK(ev.number(K::kValue) == 900.0);
  CHECK(ev.number(K::kTypical) == 2.5);  // the median of 2, 2.5 and 3
  // Under the ratio (16x the median: 40 is 16x of 2.5) or under the floor: nothing.
  const std::vector<ProbeRecord> under_ratio = {down(0, 2.0, 1), down(1, 3.0, 2), down(2, 40.0, 46), down(3, 2.5, 4)};
  CHECK(nanreplay::expert_outlier_findings(under_ratio, 7, t, token_at).empty());
  const std::vector<ProbeRecord> under_floor = {down(0, 0.1, 1), down(1, 0.1, 2), down(2, 60.0, 46), down(3, 0.1, 4)};
  CHECK(nanreplay::expert_outlier_findings(under_floor, 7, t, token_at).empty());
  CHECK(nanreplay::expert_outlier_findings(outlier, 8, t, token_at).empty());  // another step's records
}

TEST_CASE("NUMERIC_EXPERT_OUTLIER_ACTIVATION: a layer's experts grown together, each far above its own past",
          "[frontier][triage]") {
  using nanreplay::ProbeRecord;
  const auto down = [](int expert, double max_abs) { return expert_output_record(expert, max_abs, 10 + expert); };
  // An earlier step of the window: layer 1's four experts' output maxima (layer 0 dense); rows 0 = no token.
  auto earlier = [](int64_t step, std::vector<double> outputs, int64_t rows = 4) {
    nanreplay::StepOutcome o;
    o.step = step;
    std::vector<nanreplay::ExpertActivationMax> layer;
    for (double out : outputs) layer.push_back({1.0, out, rows});
    o.expert_activation_max = {std::nullopt, layer};
    return o;
  };
  const nanreplay::TriageThresholds t = nanreplay::default_thresholds(nanreplay::Compute::kFp32);
  const auto token_at = [](int64_t sample, int64_t position) { return sample * 100 + position; };
  // Every expert near 900 this step: none is far from the others.
  const std::vector<ProbeRecord> grown = {down(0, 800.0), down(1, 850.0), down(2, 1000.0), down(3, 900.0)};
  CHECK(nanreplay::expert_outlier_findings(grown, 7, t, token_at).empty());
  const std::vector<nanreplay::StepOutcome> past = {earlier(5, {2.0, 2.0, 2.0, 2.0}), earlier(6, {3.0, 3.0, 4.0, 3.0})};
  const auto found = nanreplay::expert_outlier_findings(grown, 7, t, token_at, past);
  REQUIRE(found.size() == 1);
  const nanreplay::Evidence& ev = found[0].evidence;
  using K = nanreplay::EvidenceKey;
  CHECK(found[0].severity == nanreplay::Severity::kWarning);
  // The largest ratio: expert 3's 900 / median(2, 3) = 360 (expert 2: 1000 / median(2, 4) = 333).
  CHECK(ev.integer(K::kExpert) == 3);
  CHECK(ev.integer(K::kLayer) == 1);
  CHECK(ev.number(K::kValue) == 900.0);
  CHECK(ev.number(K::kTypical) == 2.5);
  REQUIRE(ev.integers(K::kSteps) != nullptr);
  CHECK(*ev.integers(K::kSteps) == std::vector<int64_t>{5, 6});
  CHECK(ev.integer(K::kSample) == 13);
  CHECK(found[0].message.find("its own median over steps 5..6") != std::string::npos);
  // One earlier step is too short a history; steps without tokens for the expert do not count.
  CHECK(nanreplay::expert_outlier_findings(grown, 7, t, token_at, {past[1]}).empty());
  const std::vector<nanreplay::StepOutcome> idle = {earlier(5, {2.0, 2.0, 2.0, 2.0}, 0), past[1]};
  CHECK(nanreplay::expert_outlier_findings(grown, 7, t, token_at, idle).empty());
  // A past already as large: no growth, nothing.
  const std::vector<nanreplay::StepOutcome> large = {earlier(5, {700, 700, 700, 700}), earlier(6, {700, 700, 700, 700})};
  CHECK(nanreplay::expert_outlier_findings(grown, 7, t, token_at, large).empty());
}

TEST_CASE("NUMERIC_EXPERT_OUTLIER_ACTIVATION fires on a finite incident: expert-spike's expert, token and sample",
          "[cli][frontier][moe][spike]") {
  ScratchDir dir("frontier-expert-spike");
  const Triaged t = triage(dir, "expert-spike");
  CHECK(t.status == 0);  // a warning: nothing went non-finite
  CHECK(t.report["first_nonfinite"].is_null());
  const auto found = with_code(t.report, "NUMERIC_EXPERT_OUTLIER_ACTIVATION");
  REQUIRE(found.size() == 1);
  const nlohmann::json& ev = found[0]["evidence"];
  CHECK(found[0]["severity"] == "warning");
  CHECK(ev["step"] == t.planted["fault_step"]);
  CHECK(ev["layer"] == t.planted["fault_layer"]);
  CHECK(ev["expert"] == t.planted["fault_expert"]);
  CHECK(ev["sample"] == t.planted["fault_sample"]);
  CHECK(ev["position"] == t.planted["fault_position"]);
  CHECK(ev["token"] == t.planted["fault_token"]);
  CHECK(ev["site"] == "layers.1.mlp.expert.down");
  // The expert's output against the others': far past the 16x ratio and the floor of 64.
  const double value = ev["value"].get<double>(), typical = ev["typical"].get<double>();
  CHECK(value > 1e4);
  CHECK(value > 16 * typical);
  // report.json's own per-expert maxima say the same.
  const nlohmann::json& layer1 = frontier_step(t.report, ev["step"].get<int64_t>())["expert_activation_max"][1];
  CHECK(layer1[2]["output"].get<double>() == Approx(value));
  CHECK(t.report["root_cause"]["code"] == "NUMERIC_EXPERT_OUTLIER_ACTIVATION");  // worth a look, nothing else found
}

TEST_CASE("NUMERIC_EXPERT_OUTLIER_ACTIVATION against an expert's own past: a layer's experts grown together",
          "[cli][frontier][moe]") {
  ScratchDir dir("frontier-expert-history");
  const auto synth = run_cli({"synth", "clean-moe", (dir / "bundle").string()});
  REQUIRE(synth.status == 0);
  // Between checkpoints 102 and 103 every expert of layer 1 has its down projection scaled by 1e5: no expert
  // stands out from the others at step 103, each from its own steps 100..102.
  const auto checkpoint = dir / "bundle" / "steps" / "103" / "model.safetensors";
  REQUIRE(scale_tensors(checkpoint, {"layers.1.mlp.experts.", "down_proj"}, 1e5f) == 4);
  const Triaged t = nanreplay_test::run_bundle(dir);
  const auto found = with_code(t.report, "NUMERIC_EXPERT_OUTLIER_ACTIVATION");
  REQUIRE(found.size() == 1);
  const nlohmann::json& ev = found[0]["evidence"];
  CHECK(found[0]["severity"] == "warning");
  CHECK(ev["step"] == 103);
  CHECK(ev["layer"] == 1);
  CHECK(ev["steps"] == nlohmann::json::array({100, 101, 102}));
  CHECK(ev["site"] == "layers.1.mlp.expert.down");
  const double value = ev["value"].get<double>(), typical = ev["typical"].get<double>();
  CHECK(value > 16 * typical);
  CHECK(value > 64);
  // The evidence is report.json's own per-step maxima: the step's value, the median of the expert's earlier ones.
  const int64_t expert = ev["expert"].get<int64_t>();
  CHECK(frontier_step(t.report, 103)["expert_activation_max"][1][expert]["output"].get<double>() == Approx(value));
  std::vector<double> earlier;
  for (int64_t step : {100, 101, 102}) {
    earlier.push_back(frontier_step(t.report, step)["expert_activation_max"][1][expert]["output"].get<double>());
  }
  std::sort(earlier.begin(), earlier.end());
  CHECK(typical == Approx(earlier[1]));
  // The edit itself is what the system layer names: an update AdamW did not compute.
  CHECK_FALSE(with_code(t.report, "SYSTEM_UPDATE_MISMATCH").empty());
}

TEST_CASE("loss_terms: report.json and report.md say which router losses the replayed loss adds, and from where",
          "[cli][moe]") {
  ScratchDir dir("frontier-loss-terms");
  const Triaged t = triage(dir, "clean-moe");
  REQUIRE(t.status == 0);
  const nlohmann::json& terms = t.report["loss_terms"];
  REQUIRE(terms.size() == 2);
  CHECK(terms[0]["term"] == "router_aux_loss");
  CHECK(terms[0]["coefficient"].get<double>() == Approx(0.01));  // clean-moe's manifest
  CHECK(terms[0]["in_logged_loss"] == true);
  CHECK(terms[0]["source"] == "manifest.json model.moe.router_aux_loss_coef");  // no provenance entry
  CHECK(terms[1]["term"] == "router_z_loss");
  CHECK(terms[1]["coefficient"].get<double>() == Approx(0.001));
  const std::string markdown = nanreplay_test::slurp(dir / "out" / "report.md");
  CHECK(nanreplay_test::contains(markdown, "The replayed loss adds 0.01 x `router_aux_loss`"));
  // A dense model's loss is the cross-entropy alone: no key.
  ScratchDir dense("frontier-loss-terms-dense");
  CHECK_FALSE(triage(dense, "clean-fp32").report.contains("loss_terms"));
}
