// The verdict stages and triage rules on hand-built reports: which findings
// stand, which fold into one consequence, when a bundle does not reproduce
// its run, and the counts and words findings carry.
#include <catch2/catch.hpp>

#include <cmath>
#include <set>

#include "reports/results/logged_value.h"
#include "reports/triage/numeric/update_spike.h"
#include "reports/triage/triage_rules.h"
#include "reports/triage/verdict.h"

using namespace nanreplay;
using K = EvidenceKey;

namespace {

StepOutcome step(int64_t number, double loss, double logged, double grad_norm = 1.0) {
  StepOutcome s;
  s.step = number;
  s.replayed = true;
  s.loss = loss;
  s.logged_loss = logged;
  s.grad_norm = grad_norm;
  s.logged_grad_norm = grad_norm;
  s.finite = std::isfinite(loss) && std::isfinite(grad_norm);
  return s;
}

Finding checkpoint_nonfinite(const std::string& param, int64_t first, std::vector<int64_t> steps) {
  return make_finding(FindingCode::kCheckpointNonfinite, Severity::kError, "held NaN",
                      {{K::kParam, param}, {K::kStep, first}, {K::kSteps, steps}, {K::kTensor, "parameter"}});
}

std::vector<const Finding*> with_code(const ReplayReport& r, const std::string& code) {
  std::vector<const Finding*> out;
  for (const Finding& f : r.findings) {
    if (f.name() == code) out.push_back(&f);
  }
  return out;
}

FirstNonfinite origin_at(int64_t step, int64_t sample = 7) {
  FirstNonfinite f;
  f.step = step;
  f.site = {SiteId::kAttnNorm, 0};
  f.sample = sample;
  f.position = 3;
  return f;
}

}  // namespace

TEST_CASE("verdict: every healthy step off is a bundle that does not reproduce, one odd step is not", "[verdict]") {
  const TriageThresholds t = default_thresholds(Compute::kFp32);
  ReplayReport all_off;
  all_off.steps = {step(1, 3.00, 3.10), step(2, 2.90, 3.00)};
  judge_reproduction(all_off, t);
  REQUIRE(with_code(all_off, "BUNDLE_DOES_NOT_REPRODUCE").size() == 1);
  CHECK(with_code(all_off, "SYSTEM_NOT_REPRODUCIBLE").empty());
  CHECK(all_off.reproduction.reproduces == false);
  CHECK(all_off.reproduction.max_gap == Approx(0.1 / 3.0));

  ReplayReport one_odd;
  one_odd.steps = {step(1, 3.0, 3.0), step(2, 2.9, 3.0), step(3, 2.8, 2.8)};
  judge_reproduction(one_odd, t);
  CHECK(with_code(one_odd, "BUNDLE_DOES_NOT_REPRODUCE").empty());
  REQUIRE(with_code(one_odd, "SYSTEM_NOT_REPRODUCIBLE").size() == 1);
  CHECK(with_code(one_odd, "SYSTEM_NOT_REPRODUCIBLE")[0]->severity == Severity::kWarning);
  CHECK(one_odd.reproduction.reproduces == true);
  CHECK(one_odd.reproduction.matching_steps == 2);

  ReplayReport within;  // bf16's tolerance is looser than fp32's
  within.steps = {step(1, 3.0, 3.0 * (1 + 5e-3)), step(2, 2.9, 2.9)};
  judge_reproduction(within, default_thresholds(Compute::kBf16));
  CHECK(within.findings.empty());
  CHECK(within.reproduction.reproduces == true);

  ReplayReport nothing_logged;
  nothing_logged.steps = {step(1, 3.0, 3.0)};
  nothing_logged.steps[0].logged_loss.reset();
  judge_reproduction(nothing_logged, t);
  CHECK_FALSE(nothing_logged.reproduction.reproduces.has_value());
}

TEST_CASE("verdict: a logged NaN the replay does not reproduce is an error, the reverse a warning", "[verdict]") {
  ReplayReport r;
  r.steps = {step(1, 3.0, NAN), step(2, NAN, 3.0, NAN)};
  judge_reproduction(r, default_thresholds(Compute::kFp32));
  const auto found = with_code(r, "SYSTEM_NOT_REPRODUCIBLE");
  REQUIRE(found.size() == 2);
  CHECK(found[0]->severity == Severity::kError);
  CHECK(found[1]->severity == Severity::kWarning);
}

TEST_CASE("verdict: later non-finite checkpoints fold into one consequence naming the clean checkpoint", "[verdict]") {
  ReplayReport r;
  r.first_nonfinite = origin_at(5);
  r.steps = {step(4, 3.0, 3.0), step(5, NAN, NAN, NAN), step(6, NAN, NAN, NAN), step(7, NAN, NAN, NAN)};
  r.findings = {checkpoint_nonfinite("a", 6, {6, 7}), checkpoint_nonfinite("b", 6, {6, 7}),
                checkpoint_nonfinite("c", 7, {7})};
  fold_consequences(r);
  REQUIRE(r.findings.size() == 1);
  const Finding& f = r.findings[0];
  CHECK(f.severity == Severity::kInfo);
  CHECK(evidence_json(f.evidence)["steps"] == nlohmann::json::array({6, 7}));
  CHECK(evidence_json(f.evidence)["length"] == 3);
  CHECK(evidence_json(f.evidence)["last_clean_step"] == 5);
  CHECK(f.message.find("the update of step 5") != std::string::npos);
}

TEST_CASE("verdict: a non-finite checkpoint at or before the origin, or no update to explain it, stays an error",
          "[verdict]") {
  ReplayReport r;
  r.first_nonfinite = origin_at(5);
  r.steps = {step(5, NAN, NAN, NAN), step(6, 3.0, 3.0)};
  r.steps[0].scaler_skipped = true;  // fp16: the scaler skipped step 5, nothing was applied
  r.findings = {checkpoint_nonfinite("cause", 5, {5}), checkpoint_nonfinite("unexplained", 6, {6})};
  fold_consequences(r);
  REQUIRE(r.findings.size() == 2);
  CHECK(r.findings[0].severity == Severity::kError);
  CHECK(r.findings[1].severity == Severity::kError);
}

TEST_CASE("verdict: non-finite per-sample losses and later overflows are context, finite outliers stay",
          "[verdict]") {
  ReplayReport r;
  r.first_nonfinite = origin_at(5);
  r.steps = {step(4, 3.0, 3.0), step(5, NAN, NAN, NAN), step(6, NAN, NAN, NAN)};
  auto nonfinite_losses = [](int64_t s, int64_t n) {
    return make_finding(FindingCode::kDataLossOutlier, Severity::kWarning, "",
                        {{K::kStep, s}, {K::kSample, 1}, {K::kSamples, std::vector<int64_t>{1, 2}}, {K::kLength, n}});
  };
  r.findings = {make_finding(FindingCode::kDataLossOutlier, Severity::kWarning, "finite outlier",
                             {{K::kStep, 4}, {K::kSample, 9}, {K::kAfter, 9.0}}),
                nonfinite_losses(5, 2), nonfinite_losses(6, 8),
                make_finding(FindingCode::kNumericOverflow, Severity::kError, "origin", {{K::kStep, 5}}),
                make_finding(FindingCode::kNumericOverflow, Severity::kError, "again", {{K::kStep, 6}})};
  fold_consequences(r);
  REQUIRE(r.findings.size() == 4);
  CHECK(r.findings[0].severity == Severity::kWarning);  // step 4's finite outlier is evidence
  CHECK(r.findings[1].severity == Severity::kInfo);
  CHECK(evidence_json(r.findings[1].evidence)["length"] == 10);
  CHECK(r.findings[2].severity == Severity::kError);  // the origin's own overflow
  CHECK(r.findings[3].severity == Severity::kInfo);
  CHECK(evidence_json(r.findings[3].evidence)["steps"] == nlohmann::json::array({6}));
}

TEST_CASE("verdict: repeat runs and low entropy are errors only when the sample is implicated", "[verdict]") {
  ReplayReport r;
  r.first_nonfinite = origin_at(5, 7);
  auto run = [](int64_t s, int64_t sample) {
    return make_finding(FindingCode::kDataRepeatRun, Severity::kInfo, "run",
                        {{K::kStep, s}, {K::kSample, sample}});
  };
  r.findings = {run(5, 7), run(5, 8), run(4, 9), run(4, 7),
                make_finding(FindingCode::kDataLossOutlier, Severity::kWarning, "",
                             {{K::kStep, 4}, {K::kSample, 9}, {K::kAfter, 12.0}})};
  calibrate_data_findings(r);
  CHECK(r.findings[0].severity == Severity::kError);  // holds the origin
  CHECK(evidence_json(r.findings[0].evidence)["implicated"] == "origin");
  CHECK(r.findings[1].severity == Severity::kInfo);
  CHECK(r.findings[2].severity == Severity::kError);  // its own loss is the outlier
  CHECK(evidence_json(r.findings[2].evidence)["implicated"] == "loss");
  CHECK(r.findings[3].severity == Severity::kInfo);   // the origin's sample, but another step
}

TEST_CASE("verdict: an embedding row is an outlier against the matrix's own rows", "[verdict]") {
  const TriageThresholds t = default_thresholds(Compute::kFp32);
  CHECK(is_embedding_outlier(1e5, 0.2, 0.02, t));
  CHECK(is_embedding_outlier(INFINITY, 0.2, 0.02, t));
  CHECK_FALSE(is_embedding_outlier(0.6, 0.2, 0.02, t));  // 3x the median: an ordinary spread
  CHECK_FALSE(is_embedding_outlier(0.0, 0.2, 0.02, t));
  ReplayReport r;
  r.first_nonfinite = origin_at(5, 7);
  r.origin_tokens = {{12, 3, 0.3, 0.2, 0.02, false}, {99, 1, 5e4, 0.2, 0.02, true}};
  token_findings(r);
  REQUIRE(r.findings.size() == 1);
  CHECK(r.findings[0].code == FindingCode::kDataTokenEmbeddingOutlier);
  CHECK(evidence_json(r.findings[0].evidence)["token"] == 99);
  CHECK(evidence_json(r.findings[0].evidence)["position"] == 1);
  CHECK(evidence_json(r.findings[0].evidence)["sample"] == 7);
  CHECK(evidence_json(r.findings[0].evidence)["typical_norm"] == 0.2);
}

TEST_CASE("triage: a per-head overflow counts the head it names, a LayerNorm says variance", "[verdict]") {
  ProbeRecord whole;
  whole.step = 3;
  whole.site = {SiteId::kAttnScores, 1};
  whole.micro_batch = 0;
  whole.rank = 0;
  whole.order = 9;
  whole.first_head = 1;
  whole.stats.inf_count = 29576;
  ProbeRecord head0 = whole, head1 = whole;
  head0.head = 0;
  head0.stats.inf_count = 23108;
  head1.head = 1;
  head1.stats.inf_count = 6468;
  const auto found = overflow_findings({whole, head0, head1}, 3, false, Compute::kFp16,
                                       default_thresholds(Compute::kFp16));
  REQUIRE(found.size() == 1);
  CHECK(evidence_json(found[0].evidence)["length"] == 6468);
  CHECK(evidence_json(found[0].evidence)["site_length"] == 29576);
  CHECK(found[0].message.find("(head 1)") != std::string::npos);
  CHECK(found[0].message.find("6468 element(s) overflowed to inf (29576 over all heads)") != std::string::npos);

  // Toward -inf: the wording follows the first element's kind.
  ProbeRecord negative = whole;
  negative.stats.inf_count = 1;
  negative.stats.first_kind = NonfiniteKind::kNegInf;
  const auto below = overflow_findings({negative}, 3, false, Compute::kFp16, default_thresholds(Compute::kFp16));
  REQUIRE(below.size() == 1);
  CHECK(below[0].message.find("1 element(s) overflowed to -inf") != std::string::npos);
  CHECK(evidence_json(below[0].evidence)["after"] == "-inf");
  negative.stats.inf_count = 3;
  CHECK(overflow_findings({negative}, 3, false, Compute::kFp16, default_thresholds(Compute::kFp16))[0]
            .message.find("3 element(s) overflowed to +inf or -inf (the first to -inf)") != std::string::npos);

  NormCheck ln;
  ln.site = {SiteId::kAttnNorm, 0};
  ln.moment = "variance";
  ln.rows_below_eps = 2;
  ln.eps = 1e-5;
  const auto zero = zero_norm_findings({ln});
  REQUIRE(zero.size() == 1);
  CHECK(zero[0].message.find("whose variance is below eps") != std::string::npos);
  CHECK(evidence_json(zero[0].evidence)["tensor"] == "variance");
}

TEST_CASE("finding codes and evidence keys: one table each, in enum order, names unique", "[verdict]") {
  std::set<std::string> codes;
  for (size_t i = 0; i < finding_code_table().size(); ++i) {
    const FindingCodeDef& def = finding_code_table()[i];
    CHECK(static_cast<size_t>(def.code) == i);
    CHECK(codes.insert(def.name).second);
    CHECK(std::string(def.name).find_first_not_of("ABCDEFGHIJKLMNOPQRSTUVWXYZ_0123456789") == std::string::npos);
    CHECK(code_name(def.code) == std::string(def.name));
  }
  std::set<std::string> keys;
  for (size_t i = 0; i < evidence_key_table().size(); ++i) {
    CHECK(static_cast<size_t>(evidence_key_table()[i].key) == i);
    CHECK(keys.insert(evidence_key_table()[i].name).second);
  }
  // Non-finite numbers render as report v1 writes them; null indices as null.
  const Evidence e = {{K::kAfter, INFINITY}, {K::kHead, optional_index_value(-1)}, {K::kSteps, std::vector<int64_t>{3}}};
  CHECK(evidence_json(e) == nlohmann::json{{"after", "inf"}, {"head", nullptr}, {"steps", {3}}});
}

TEST_CASE("verdict: a log of one rank's own loss is said once and compared with that rank's loss", "[verdict]") {
  const TriageThresholds t = default_thresholds(Compute::kFp32);
  auto two_ranks = [](int64_t number, double rank0, double rank1, double logged) {
    StepOutcome s = step(number, (rank0 + rank1) / 2, logged);
    s.rank_losses = {rank0, rank1};
    return s;
  };
  ReplayReport rank0_logged;
  rank0_logged.steps = {two_ranks(1, 3.0, 3.4, 3.0), two_ranks(2, 2.9, 3.3, 2.9), two_ranks(3, 2.8, 2.8, 2.8)};
  judge_reproduction(rank0_logged, t);
  const auto said = with_code(rank0_logged, "SYSTEM_LOG_CONVENTION");
  REQUIRE(said.size() == 1);
  CHECK(said[0]->severity == Severity::kInfo);
  CHECK(said[0]->evidence.integer(K::kRank) == 0);
  CHECK(said[0]->evidence.text(K::kTensor) == "loss");
  CHECK(with_code(rank0_logged, "SYSTEM_NOT_REPRODUCIBLE").empty());
  CHECK(with_code(rank0_logged, "BUNDLE_DOES_NOT_REPRODUCE").empty());
  CHECK(rank0_logged.reproduction.reproduces == true);
  CHECK(rank0_logged.reproduction.matching_steps == 3);

  ReplayReport rank1_logged;  // the lowest rank that explains every miss
  rank1_logged.steps = {two_ranks(1, 3.0, 3.4, 3.4), two_ranks(2, 2.9, 3.3, 3.3)};
  judge_reproduction(rank1_logged, t);
  REQUIRE(with_code(rank1_logged, "SYSTEM_LOG_CONVENTION").size() == 1);
  CHECK(with_code(rank1_logged, "SYSTEM_LOG_CONVENTION")[0]->evidence.integer(K::kRank) == 1);

  ReplayReport neither;  // one step fits no rank: no convention, the bundle is judged as before
  neither.steps = {two_ranks(1, 3.0, 3.4, 3.0), two_ranks(2, 2.9, 3.3, 3.6)};
  judge_reproduction(neither, t);
  CHECK(with_code(neither, "SYSTEM_LOG_CONVENTION").empty());
  CHECK(with_code(neither, "BUNDLE_DOES_NOT_REPRODUCE").size() == 1);
}

TEST_CASE("verdict: per-rank norms logged as the global norm are said once, not rank mismatches", "[verdict]") {
  const TriageThresholds t = default_thresholds(Compute::kFp32);
  StepOutcome s = step(5, 3.0, 3.0, /*grad_norm=*/2.0);
  s.rank_losses = {2.9, 3.1};
  s.rank_grad_norms = {2.5, 2.7};  // each rank's own norm, before the all-reduce
  StepState state;
  state.logged.rank_losses = {2.9, 3.1};
  state.logged.rank_grad_norms = {2.0, 2.0};  // clip_grad_norm_'s result on every rank
  CHECK(rank_norms_logged_global(s, state, t));
  s.rank_norms_logged_global = true;
  CHECK(rank_mismatch_findings(s, state, t).empty());
  ReplayReport report;
  report.steps = {s};
  judge_reproduction(report, t);
  const auto said = with_code(report, "SYSTEM_LOG_CONVENTION");
  REQUIRE(said.size() == 1);
  CHECK(said[0]->evidence.text(K::kTensor) == "rank_grad_norms");
  CHECK(*said[0]->evidence.integers(K::kSteps) == std::vector<int64_t>{5});

  // One rank really off: not the convention, and the mismatch stands.
  state.logged.rank_grad_norms = {2.0, 9.0};
  s.rank_norms_logged_global = false;
  CHECK_FALSE(rank_norms_logged_global(s, state, t));
  CHECK(rank_mismatch_findings(s, state, t).size() == 2);
  // Each rank's own norm, as the format asks: nothing to say.
  state.logged.rank_grad_norms = {2.5, 2.7};
  CHECK_FALSE(rank_norms_logged_global(s, state, t));
  CHECK(rank_mismatch_findings(s, state, t).empty());
}

TEST_CASE("triage: a near miss in a per-expert site names the expert holding the largest value", "[verdict][moe]") {
  ProbeRecord whole;
  whole.step = 4;
  whole.site = {SiteId::kMlpExpertUp, 1};
  whole.micro_batch = 0;
  whole.rank = 0;
  whole.order = 12;
  whole.stats.max_abs = 60000.0;  // within a tenth of a bit of fp16's 65504
  whole.headroom_bits = std::log2(65504.0 / 60000.0);
  ProbeRecord expert0 = whole, expert2 = whole;
  expert0.expert = 0;
  expert0.stats.max_abs = 3.0;
  expert2.expert = 2;
  const auto found = overflow_findings({whole, expert0, expert2}, 4, false, Compute::kFp16,
                                       default_thresholds(Compute::kFp16));
  REQUIRE(found.size() == 1);
  CHECK(std::string(found[0].name()) == "NUMERIC_HEADROOM_LOW");
  CHECK(evidence_json(found[0].evidence)["expert"] == 2);
  CHECK(evidence_json(found[0].evidence)["head"].is_null());
  CHECK(found[0].message.find("(expert 2) came within") != std::string::npos);
}

TEST_CASE("logged values: finite ones agree within the tolerance, non-finite ones by kind", "[verdict][logged_value]") {
  CHECK(logged_agrees(3.0, 3.0 * (1 + 5e-5), 1e-4));
  CHECK_FALSE(logged_agrees(3.0, 3.0 * (1 + 5e-4), 1e-4));
  CHECK(logged_agrees(NAN, NAN, 1e-4));
  CHECK(logged_agrees(INFINITY, INFINITY, 1e-4));
  CHECK(logged_agrees(-INFINITY, -INFINITY, 1e-4));
  CHECK_FALSE(logged_agrees(INFINITY, -INFINITY, 1e-4));
  CHECK_FALSE(logged_agrees(NAN, INFINITY, 1e-4));
  CHECK_FALSE(logged_agrees(NAN, 0.988857, 1e-4));
  CHECK_FALSE(logged_agrees(0.988857, NAN, 1e-4));
  CHECK(logged_gap(NAN, NAN) == 0.0);
  CHECK(std::isinf(logged_gap(2.0, NAN)));
  CHECK(logged_gap(2.0, 2.5) == Approx(0.25));
  CHECK(value_kind(-INFINITY) == ValueKind::kNegativeInf);
  CHECK(value_kind(0.0) == ValueKind::kFinite);
}

namespace {

// A DDP step of two ranks with two micro-batches each, rank 1's second
// micro-batch `poisoned` (NaN) or not; norms as every rank's own before the
// all-reduce and the global one after it.
struct DdpStep {
  StepOutcome outcome;
  StepState state;
};

DdpStep ddp_step(int64_t number, bool poisoned) {
  DdpStep d;
  StepOutcome& s = d.outcome;
  const double shift = 0.01 * static_cast<double>(number);
  s.step = number;
  s.replayed = true;
  s.micro_batch_losses = {{3.0 - shift, 3.2 - shift}, {3.4 - shift, poisoned ? NAN : 3.6 - shift}};
  s.rank_losses = {(s.micro_batch_losses[0][0] + s.micro_batch_losses[0][1]) / 2,
                   (s.micro_batch_losses[1][0] + s.micro_batch_losses[1][1]) / 2};
  s.loss = (s.rank_losses[0] + s.rank_losses[1]) / 2;
  s.rank_grad_norms = {0.988857, poisoned ? NAN : 1.2};
  s.grad_norm = poisoned ? NAN : 1.05;
  s.finite = !poisoned;
  s.logged_grad_norm = s.grad_norm;  // clip_grad_norm_'s, the same on every rank
  d.state.step = number;
  d.state.logged.rank_losses = s.rank_losses;
  return d;
}

// The window of the issue: steps 5-14, NaN on rank 1 at step 14, the loss and
// the per-rank norms logged by the conventions named; triaged as run does.
ReplayReport ddp_window(const std::string& loss_logged, bool norms_from_clip) {
  const TriageThresholds t = default_thresholds(Compute::kFp32);
  ReplayReport report;
  for (int64_t n = 5; n <= 14; ++n) {
    DdpStep d = ddp_step(n, n == 14);
    StepOutcome& s = d.outcome;
    s.logged_loss = loss_logged == "global" ? s.loss : loss_logged == "rank 0" ? s.rank_losses[0]
                                                                               : s.micro_batch_losses[0][1];
    d.state.logged.rank_grad_norms =
        norms_from_clip ? std::vector<double>{s.grad_norm, s.grad_norm} : s.rank_grad_norms;
    s.rank_norms_logged_global = rank_norms_logged_global(s, d.state, t);
    const std::vector<Finding> mismatches = rank_mismatch_findings(s, d.state, t);
    report.findings.insert(report.findings.end(), mismatches.begin(), mismatches.end());
    report.steps.push_back(s);
  }
  report.first_nonfinite = origin_at(14);
  settle_verdict(report, t);
  return report;
}

}  // namespace

TEST_CASE("verdict: a DDP job's logging conventions hold at the step that went NaN", "[verdict]") {
  for (const std::string loss : {"global", "rank 0", "last micro-batch"}) {
    for (const bool norms_from_clip : {false, true}) {
      INFO("loss logged: " << loss << ", per-rank norms from " << (norms_from_clip ? "clip_grad_norm_" : "a comm hook"));
      const ReplayReport report = ddp_window(loss, norms_from_clip);
      for (const Finding& f : report.findings) {
        INFO(f.name() << ": " << f.message);
        CHECK(f.code == FindingCode::kSystemLogConvention);
        CHECK(f.severity == Severity::kInfo);
      }
      std::vector<std::string> said;
      for (const Finding* f : with_code(report, "SYSTEM_LOG_CONVENTION")) {
        said.push_back(*f->evidence.text(K::kTensor));
        // Named on every step of the window, the NaN step included.
        CHECK(f->evidence.integers(K::kSteps)->back() == 14);
        CHECK(f->evidence.integers(K::kSteps)->size() == 10);
      }
      std::vector<std::string> expected;
      if (norms_from_clip) expected.push_back("rank_grad_norms");
      if (loss != "global") expected.push_back("loss");
      CHECK(said == expected);
      if (loss == "last micro-batch") {
        const auto named = with_code(report, "SYSTEM_LOG_CONVENTION").back();
        CHECK(named->evidence.integer(K::kRank) == 0);
        CHECK(named->evidence.integer(K::kMicroBatch) == 1);
        CHECK(named->message.find("nanoGPT") != std::string::npos);
      }
      CHECK(report.reproduction.reproduces == true);
      CHECK(report.reproduction.matching_steps == 9);
      REQUIRE(report.root_cause);  // the origin's, named by no system finding
      CHECK_FALSE(report.root_cause->code.has_value());
      CHECK(report.root_cause->summary.find("first produced at") != std::string::npos);
    }
  }
}

TEST_CASE("verdict: the global norm logged on every rank is recognised at a NaN step, by kind", "[verdict]") {
  const TriageThresholds t = default_thresholds(Compute::kFp32);
  DdpStep d = ddp_step(14, /*poisoned=*/true);
  d.state.logged.rank_grad_norms = {NAN, NAN};  // the all-reduce spread rank 1's NaN
  CHECK(rank_norms_logged_global(d.outcome, d.state, t));
  d.outcome.rank_norms_logged_global = true;
  CHECK(rank_mismatch_findings(d.outcome, d.state, t).empty());

  // Another kind than the replayed global norm is no convention: rank 0's mismatch stands.
  d.state.logged.rank_grad_norms = {INFINITY, INFINITY};
  d.outcome.rank_norms_logged_global = rank_norms_logged_global(d.outcome, d.state, t);
  CHECK_FALSE(d.outcome.rank_norms_logged_global);
  const std::vector<Finding> found = rank_mismatch_findings(d.outcome, d.state, t);
  REQUIRE(found.size() == 2);
  CHECK(found[0].evidence.integer(K::kRank) == 0);
  CHECK(found[0].severity == Severity::kError);
}

TEST_CASE("verdict: one micro-batch's loss logged as the step's is said once; other kinds contradict", "[verdict]") {
  const TriageThresholds t = default_thresholds(Compute::kFp32);
  ReplayReport one_rank;  // llama2.c: one process, the last micro-batch's loss printed
  for (int64_t n = 1; n <= 3; ++n) {
    StepOutcome s = step(n, 0, 0);
    s.micro_batch_losses = {{3.0, 2.0 + 0.1 * static_cast<double>(n)}};
    s.rank_losses = {(s.micro_batch_losses[0][0] + s.micro_batch_losses[0][1]) / 2};
    s.loss = s.rank_losses[0];
    s.logged_loss = s.micro_batch_losses[0][1];
    one_rank.steps.push_back(s);
  }
  judge_reproduction(one_rank, t);
  const auto said = with_code(one_rank, "SYSTEM_LOG_CONVENTION");
  REQUIRE(said.size() == 1);
  CHECK(said[0]->evidence.integer(K::kMicroBatch) == 1);
  CHECK(said[0]->message.find("micro-batch 1)") != std::string::npos);  // one rank: no rank named
  CHECK(with_code(one_rank, "BUNDLE_DOES_NOT_REPRODUCE").empty());
  CHECK(one_rank.reproduction.matching_steps == 3);

  ReplayReport first_micro = one_rank;  // only the last micro-batch is a convention
  first_micro.findings.clear();
  for (StepOutcome& s : first_micro.steps) s.logged_loss = s.micro_batch_losses[0][0];
  judge_reproduction(first_micro, t);
  CHECK(with_code(first_micro, "SYSTEM_LOG_CONVENTION").empty());
  CHECK(with_code(first_micro, "BUNDLE_DOES_NOT_REPRODUCE").size() == 1);

  ReplayReport kinds;  // both non-finite but of different kinds: a warning, never agreement
  kinds.steps = {step(1, 3.0, 3.0), step(2, NAN, INFINITY, NAN)};
  judge_reproduction(kinds, t);
  const auto contradicted = with_code(kinds, "SYSTEM_NOT_REPRODUCIBLE");
  REQUIRE(contradicted.size() == 1);
  CHECK(contradicted[0]->severity == Severity::kWarning);
  CHECK(contradicted[0]->message.find("different kinds") != std::string::npos);

  ReplayReport norm;  // a NaN norm logged where the whole replay is finite: suspect the machine
  norm.steps = {step(1, 3.0, 3.0), step(2, 2.9, 2.9)};
  norm.steps[1].logged_grad_norm = NAN;
  judge_reproduction(norm, t);
  REQUIRE(with_code(norm, "SYSTEM_NOT_REPRODUCIBLE").size() == 1);
  CHECK(with_code(norm, "SYSTEM_NOT_REPRODUCIBLE")[0]->severity == Severity::kError);
}

namespace {

// Steps 100.. of two tensors: `a`'s update RMS and g^2/v as given, `b` steady.
std::vector<StepUpdateStats> update_series(const std::vector<double>& a_rms, const std::vector<double>& a_lag) {
  std::vector<StepUpdateStats> steps;
  for (size_t i = 0; i < a_rms.size(); ++i) {
    TensorUpdateStats a{"a.weight", a_rms[i], a_lag[i], a_lag[i] * 10, a_lag[i] * 2};
    TensorUpdateStats b{"b.weight", 1e-3, 1.0, 5.0, 1.5};
    steps.push_back({static_cast<int64_t>(100 + i), {a, b}});
  }
  return steps;
}

}  // namespace

TEST_CASE("NUMERIC_UPDATE_SPIKE names the tensor whose update jumped first, up to the incident", "[verdict]") {
  const TriageThresholds t = default_thresholds(Compute::kFp32);
  // Steady updates: nothing, whatever the incident.
  CHECK(update_spike_findings(update_series({1e-3, 1e-3, 1.1e-3, 0.9e-3}, {1, 1, 2, 1}), 103, t).empty());
  // a's update RMS jumps 10x at step 102, before the incident at 103.
  const auto jumped = update_spike_findings(update_series({1e-3, 1e-3, 1e-2, 1e-2}, {1, 1, 2, 1}), 103, t);
  REQUIRE(jumped.size() == 1);
  CHECK(jumped[0].code == FindingCode::kNumericUpdateSpike);
  CHECK(jumped[0].severity == Severity::kInfo);
  CHECK(jumped[0].evidence.text(K::kParam) == "a.weight");
  CHECK(jumped[0].evidence.integer(K::kStep) == 102);
  CHECK(jumped[0].evidence.integer(K::kIncidentStep) == 103);
  CHECK(jumped[0].evidence.number(K::kUpdateRatio).value_or(0) == Approx(10.0));
  CHECK(jumped[0].evidence.number(K::kTypical).value_or(0) == Approx(1e-3));
  CHECK(jumped[0].evidence.number(K::kG2OverV) == 2.0);
  // Not read past the incident; too little history for the ratio at the second step.
  CHECK(update_spike_findings(update_series({1e-3, 1e-3, 1e-2}, {1, 1, 2}), 101, t).empty());
  CHECK(update_spike_findings(update_series({1e-3, 1e-1}, {1, 1}), 101, t).empty());
  // Adam's g^2 far above v jumps on its own, from the second update on; null ratio without history.
  const auto lagged = update_spike_findings(update_series({1e-3, 1.2e-3}, {std::nan(""), 500}), 101, t);
  REQUIRE(lagged.size() == 1);
  CHECK(lagged[0].evidence.integer(K::kStep) == 101);
  CHECK(evidence_json(lagged[0].evidence)["update_ratio"].is_null());
  CHECK(evidence_json(lagged[0].evidence)["g2_over_v"] == 500.0);
  // A tensor the update check found changed outside the optimizer is neither judged nor history.
  std::vector<StepUpdateStats> rewritten = update_series({1e-3, 1e-3, 1e-2, 1e-2}, {1, 1, 2, 1});
  rewritten[2].tensors[0].outside_optimizer = true;
  CHECK(update_spike_findings(rewritten, 102, t).empty());
  const auto after = update_spike_findings(rewritten, 103, t);  // 103's jump against 100-101's median
  REQUIRE(after.size() == 1);
  CHECK(after[0].evidence.integer(K::kStep) == 103);
  CHECK(after[0].evidence.number(K::kTypical).value_or(0) == Approx(1e-3));
}
