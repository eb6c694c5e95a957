// The "Next:" advice of every verdict, through the real binary: the terminal,
// report.md, report.html and report.json say the same thing, its commands
// run, a clean window reads as clean (no root cause), consequences come last,
// and a compact bundle's sample is named in the run's numbering too.
#include <catch2/catch.hpp>

#include <sstream>

#include "tests/cli_harness.h"

using nanreplay_test::CliResult;
using nanreplay_test::contains;
using nanreplay_test::read_json;
using nanreplay_test::run_cli;
using nanreplay_test::ScratchDir;
using nanreplay_test::slurp;

namespace {

// A preset written and replayed into dir/out, every output read back.
struct PresetOutputs {
  CliResult run;
  std::string md, html;
  nlohmann::json report;
};

PresetOutputs replay_preset(const ScratchDir& dir, const std::string& preset, int expected_status) {
  const CliResult synth = run_cli({"synth", preset, (dir / "bundle").string()});
  INFO(synth.err);
  REQUIRE(synth.status == 0);
  PresetOutputs r;
  r.run = run_cli({"run", (dir / "bundle").string(), "--out", (dir / "out").string()});
  INFO(r.run.err);
  REQUIRE(r.run.status == expected_status);
  r.md = slurp(dir / "out" / "report.md");
  r.html = slurp(dir / "out" / "report.html");
  r.report = read_json(dir / "out" / "report.json");
  return r;
}

std::string line_starting(const std::string& text, const std::string& start) {
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) {
    if (line.rfind(start, 0) == 0) return line;
  }
  return "";
}

// The same advice in all four outputs: the terminal's and report.md's Next:
// lines hold the JSON text (report.md with code spans), report.html its commands as code.
void check_same_advice(const PresetOutputs& r) {
  const nlohmann::json& next = r.report["next_step"];
  REQUIRE(next.is_object());
  const std::string text = next["text"];
  CHECK_FALSE(text.empty());
  const std::string terminal = line_starting(r.run.out, "Next: ");
  REQUIRE_FALSE(terminal.empty());
  const std::string md = line_starting(r.md, "**Next:** ");
  REQUIRE_FALSE(md.empty());
  CHECK(contains(r.html, "<p class=\"next\" id=\"next\"><b>Next:</b> "));
  for (const auto& command : next["commands"]) {
    const std::string c = command;
    CHECK(contains(md, "`" + c + "`"));
    CHECK(contains(r.html, "<code>" + c + "</code>"));
  }
  // The terminal names trace.h5 where `run` put it; the files name it beside them.
  if (!contains(text, "trace.h5")) CHECK(terminal == "Next: " + text);
}

std::vector<std::string> words_of(const std::string& command) {
  std::istringstream in(command);
  std::vector<std::string> words;
  for (std::string w; in >> w;) words.push_back(w);
  return words;
}

}  // namespace

TEST_CASE("an fp16 attention origin advises qk-norm and stable-softmax, and the advice runs", "[cli][report][next]") {
  ScratchDir dir("next-origin");
  const PresetOutputs r = replay_preset(dir, "head-overflow", 1);
  check_same_advice(r);
  const nlohmann::json& next = r.report["next_step"];
  CHECK(next["kind"] == "attention_overflow");
  REQUIRE(next["commands"].size() == 2);
  const std::string bisect = next["commands"][0];
  CHECK(contains(bisect, "nanreplay bisect "));
  CHECK(contains(bisect, "--what-if qk-norm --what-if stable-softmax"));
  CHECK(next["commands"][1] == "nanreplay trace trace.h5 --site layers.1.attn.scores");
  // The terminal names the trace under the --out directory (OUT until the CLI passes it).
  CHECK(contains(line_starting(r.run.out, "Next: "), "/trace.h5 --site layers.1.attn.scores`"));
  CHECK(contains(r.run.out, "most likely root cause (numeric)"));
  // The runbook: the job's numerics, resume from the failing step's own checkpoint, the advice's bisect confirms.
  const nlohmann::json& book = r.report["runbook"];
  REQUIRE(book.is_object());
  CHECK(book["layer"] == "job");
  CHECK(book["resume_from"]["step"] == 103);
  CHECK(book["skip"].empty());
  CHECK(book["confirm"] == bisect);
  CHECK(contains(line_starting(r.run.out, "Runbook: "), "confirm with `" + bisect + "`"));
  CHECK(contains(line_starting(r.md, "**Runbook:** "), "`" + bisect + "`"));
  CHECK(contains(r.html, "<p class=\"runbook\" id=\"runbook\"><b>Runbook:</b> "));

  // The advised bisect is a real command: it names the same origin and replays both what-ifs.
  std::vector<std::string> args = words_of(bisect);
  args.erase(args.begin());  // "nanreplay"
  args.push_back("--json");
  const CliResult advised = run_cli(args);
  INFO(advised.err);
  REQUIRE(advised.status == 1);
  const nlohmann::json bisected = nlohmann::json::parse(advised.out);
  CHECK(bisected["origin"]["site"] == "layers.1.attn.scores");
  REQUIRE(bisected["what_if"].size() == 2);
  CHECK(bisected["what_if"][1]["what_if"] == "stable-softmax");
  CHECK(bisected["what_if"][1]["resolved"] == true);

  // The advised trace query finds the origin's site in the trace run wrote.
  const CliResult trace = run_cli({"trace", (dir / "out" / "trace.h5").string(), "--site", "layers.1.attn.scores",
                                   "--first-nonfinite"});
  INFO(trace.err);
  CHECK(trace.status == 0);
  CHECK(contains(trace.out, "layers.1.attn.scores"));
}

TEST_CASE("a clean window has no root cause and advises widening the window", "[cli][report][next]") {
  ScratchDir dir("next-clean");
  const PresetOutputs r = replay_preset(dir, "clean-fp32", 0);
  check_same_advice(r);
  CHECK(r.report["next_step"]["kind"] == "widen_window");
  CHECK(r.report["next_step"]["commands"].empty());
  CHECK(r.report["runbook"].is_null());  // no cause named: nothing to run
  CHECK(line_starting(r.run.out, "Runbook: ").empty());
  const std::string next = r.report["next_step"]["text"];
  CHECK(contains(next, "capture a wider one"));
  CHECK(contains(next, "step numbers the job logged"));
  CHECK_FALSE(contains(r.run.out, "root cause"));
  CHECK(contains(r.run.out, "clean window: no fault found in the replayed window"));
  CHECK(contains(r.md, "**Clean window**"));
  CHECK_FALSE(contains(r.md, "**Root cause**"));
  CHECK(contains(r.html, "<b>Clean window</b>"));
  CHECK_FALSE(contains(r.html, "Most likely root cause"));
}

TEST_CASE("a failure the replay does not reproduce sends the reader to the system layer", "[cli][report][next]") {
  ScratchDir dir("next-notrepro");
  const PresetOutputs r = replay_preset(dir, "not-reproducible", 1);
  check_same_advice(r);
  CHECK(r.report["root_cause"]["code"] == "SYSTEM_NOT_REPRODUCIBLE");
  CHECK(r.report["next_step"]["kind"] == "check_system");
  const std::string next = r.report["next_step"]["text"];
  CHECK(contains(next, "does not reproduce"));
  CHECK(contains(next, "system layer first"));
  REQUIRE(r.report["next_step"]["commands"].size() == 1);
  CHECK(contains(r.report["next_step"]["commands"][0].get<std::string>(), "nanreplay inspect "));
  CHECK(r.report["runbook"]["layer"] == "infra");  // not the model or the data
  CHECK(r.report["runbook"]["resume_from"]["step"] == 103);
  CHECK(r.report["runbook"]["confirm"].get<std::string>().rfind("nanreplay bisect ", 0) == 0);
  CHECK(contains(r.run.out, "most likely root cause (system)"));
  CHECK(contains(r.md, "system layer first"));
  CHECK(contains(r.html, "system layer first"));
}

TEST_CASE("a clean window's warning is worth a look, not a root cause", "[cli][report][next]") {
  ScratchDir dir("next-worth");
  const PresetOutputs r = replay_preset(dir, "router-collapse", 0);
  check_same_advice(r);
  const std::string summary = r.report["root_cause"]["summary"];
  CHECK(summary.rfind("nothing went non-finite; worth a look: ", 0) == 0);
  CHECK(r.report["root_cause"]["code"] == "NUMERIC_ROUTER_COLLAPSE");  // report v1's key keeps its code
  CHECK(r.report["next_step"]["kind"] == "worth_a_look");
  for (const std::string& text : {r.run.out, r.md, r.html}) {
    CHECK_FALSE(contains(text, "nothing went non-finite, but"));
    CHECK_FALSE(contains(text, "oot cause"));  // neither "root cause" nor "Root cause"
  }
  CHECK(contains(r.run.out, "clean window (numeric): nothing went non-finite; worth a look: step 100"));
  CHECK(contains(r.md, "**Clean window** (numeric, `NUMERIC_ROUTER_COLLAPSE`): nothing went non-finite; worth a look"));
  CHECK(contains(r.html, "<b>Clean window</b> (numeric"));
}

TEST_CASE("consequences come last in report.md and folded in report.html", "[cli][report][next]") {
  ScratchDir dir("next-consequences");
  const PresetOutputs r = replay_preset(dir, "repeat-run", 1);
  CHECK(r.report["next_step"]["kind"] == "drop_sample");
  CHECK(contains(r.report["next_step"]["text"].get<std::string>(), "--what-if drop-samples=46`"));
  const nlohmann::json& book = r.report["runbook"];  // the data finding names the sample to skip
  CHECK(book["layer"] == "job");
  REQUIRE(book["skip"].size() == 1);
  CHECK(book["skip"][0]["step"] == 103);
  CHECK(book["skip"][0]["sample"] == 46);
  CHECK(contains(book["confirm"].get<std::string>(), "--what-if drop-samples=46"));
  CHECK(contains(line_starting(r.run.out, "Runbook: "), "skip sample 46 of step 103"));
  const size_t system = r.md.find("### system");
  const size_t consequences = r.md.find("### Consequences of the first non-finite value");
  const size_t entry = r.md.find("consequences, not properties of those samples");
  REQUIRE(system != std::string::npos);
  REQUIRE(consequences != std::string::npos);
  CHECK(system < consequences);
  CHECK(consequences < entry);
  CHECK(r.md.find("consequences, not properties", entry + 1) == std::string::npos);  // listed once
  const size_t folded = r.html.find("<details class=\"consequences\"><summary>");
  REQUIRE(folded != std::string::npos);
  CHECK(folded < r.html.find("consequences, not properties"));
}

TEST_CASE("a compact bundle's sample is named in the run's numbering by run, bisect and minimize",
          "[cli][report][next]") {
  ScratchDir dir("next-numbering");
  REQUIRE(run_cli({"synth", "head-overflow", (dir / "bundle").string()}).status == 0);
  const CliResult first = run_cli({"minimize", (dir / "bundle").string(), "--out", (dir / "min").string()});
  INFO(first.err);
  REQUIRE(std::filesystem::exists(dir / "min" / "manifest.json"));
  // The original bundle has no other numbering: its index is the run's.
  CHECK(contains(first.out, "sample 46 of the bundle (also the run's index)"));
  CHECK_FALSE(contains(first.out, "original ind"));
  CHECK(contains(first.out, "samples {46} (the run's dataset indices)"));

  // MIN holds sample 46 as its sample 0 and records the run's index.
  const CliResult run = run_cli({"run", (dir / "min").string(), "--out", (dir / "out").string()});
  REQUIRE(run.status == 1);
  CHECK(contains(run.out, "sample 0 (run's sample 46)"));
  const nlohmann::json report = read_json(dir / "out" / "report.json");
  CHECK(report["first_nonfinite"]["sample"] == 0);
  CHECK(report["first_nonfinite"]["original_sample"] == 46);
  bool outlier_named = false;
  for (const auto& f : report["findings"]) {
    if (f["code"] != "DATA_LOSS_OUTLIER") continue;
    outlier_named = true;
    CHECK(f["evidence"]["sample"] == 0);
    CHECK(f["evidence"]["original_sample"] == 46);
    CHECK(contains(f["message"].get<std::string>(), "sample 0 (the run's sample 46)"));
  }
  CHECK(outlier_named);

  const CliResult bisect = run_cli({"bisect", (dir / "min").string(), "--json"});
  REQUIRE(bisect.status == 1);
  const nlohmann::json bisected = nlohmann::json::parse(bisect.out);
  CHECK(bisected["origin"]["sample"] == 0);
  CHECK(bisected["origin"]["original_sample"] == 46);
  if (bisected["stages"]["samples"]["minimal"].is_array()) {
    CHECK(bisected["stages"]["samples"]["minimal"] == nlohmann::json::array({0}));
    CHECK(bisected["stages"]["samples"]["minimal_original_samples"] == nlohmann::json::array({46}));
  }
  CHECK(contains(run_cli({"bisect", (dir / "min").string()}).out, "sample 0 (run's sample 46)"));

  const CliResult again = run_cli({"minimize", (dir / "min").string(), "--out", (dir / "min2").string(), "--json"});
  REQUIRE(std::filesystem::exists(dir / "min2" / "manifest.json"));
  const nlohmann::json minimized = nlohmann::json::parse(again.out);
  CHECK(minimized["origin"]["original_sample"] == 46);
  CHECK(minimized["original_sample"] == 46);
  CHECK(minimized["original_offset"].is_null());
}

// ---- units: decide_next_step on reports built by hand ----------------------

#include "reports/outputs/next_step.h"

namespace {

nanreplay::ReplayReport origin_report(nanreplay::Arch arch, nanreplay::Compute precision, nanreplay::SiteId site) {
  using namespace nanreplay;
  ReplayReport r;
  r.bundle = "/incidents/run 7";  // a space: the commands must quote it
  r.arch = arch;
  r.precision = precision;
  r.reproduced = true;
  FirstNonfinite f;
  f.step = 12;
  f.site = {site, 3};
  f.layer = 3;
  f.sample = 9;
  r.first_nonfinite = f;
  r.root_cause = RootCause{TriageLayer::kNumeric, FindingCode::kNumericOverflow, "numeric overflow: ..."};
  return r;
}

}  // namespace

TEST_CASE("next step: one row per verdict kind, real what-ifs, quoted paths", "[report][next]") {
  using namespace nanreplay;
  SECTION("an fp16 llama attention origin: qk-norm and stable-softmax, the bundle quoted") {
    const NextStep s = decide_next_step(origin_report(Arch::kLlama, Compute::kFp16, SiteId::kAttnScores));
    CHECK(s.name == "attention_overflow");
    REQUIRE(s.commands.size() == 2);
    CHECK(s.commands[0] == "nanreplay bisect '/incidents/run 7' --what-if qk-norm --what-if stable-softmax");
    CHECK(s.commands[1] == "nanreplay trace trace.h5 --site layers.3.attn.scores");
  }
  SECTION("gpt2 has no qk-norm: stable-softmax and its own block in fp32") {
    const NextStep s = decide_next_step(origin_report(Arch::kGpt2, Compute::kBf16, SiteId::kAttnScores));
    REQUIRE_FALSE(s.commands.empty());
    CHECK(s.commands[0] == "nanreplay bisect '/incidents/run 7' --what-if stable-softmax --what-if fp32-layers=3");
  }
  SECTION("an MLP overflow: that block in fp32; the same origin in fp32 only asks for its trace") {
    CHECK(decide_next_step(origin_report(Arch::kLlama, Compute::kFp16, SiteId::kMlpNorm)).commands.at(0) ==
          "nanreplay bisect '/incidents/run 7' --what-if fp32-layers=3");
    const NextStep fp32 = decide_next_step(origin_report(Arch::kLlama, Compute::kFp32, SiteId::kAttnScores));
    CHECK(fp32.name == "origin");
    CHECK(fp32.commands.at(0) == "nanreplay trace trace.h5 --site layers.3.attn.scores");
    CHECK(fp32.commands.at(1) == "nanreplay minimize '/incidents/run 7' --out '/incidents/run 7-min'");
  }
  SECTION("a poisoned sample: drop it by the bundle's index, scan the shards") {
    ReplayReport r = origin_report(Arch::kLlama, Compute::kFp16, SiteId::kAttnScores);
    r.root_cause = RootCause{TriageLayer::kData, FindingCode::kDataRepeatRun, "poisoned sample 9"};
    const NextStep s = decide_next_step(r);
    CHECK(s.name == "drop_sample");
    CHECK(s.commands.at(0) == "nanreplay bisect '/incidents/run 7' --what-if drop-samples=9");
    CHECK(s.commands.at(1) == "nanreplay scan-data '/incidents/run 7'");
  }
  SECTION("what the bundle or the machine did comes before the origin") {
    ReplayReport r = origin_report(Arch::kLlama, Compute::kFp16, SiteId::kAttnScores);
    r.root_cause = RootCause{TriageLayer::kSystem, FindingCode::kBundleDoesNotReproduce, "..."};
    CHECK(decide_next_step(r).name == "fix_bundle");
    r.root_cause = RootCause{TriageLayer::kSystem, FindingCode::kSystemBitFlip, "..."};
    CHECK(decide_next_step(r).name == "check_machine");
  }
  SECTION("clean windows: handled overflow, a warning worth a look, nothing at all") {
    ReplayReport r;
    r.bundle = "/b";
    r.root_cause = RootCause{TriageLayer::kNumeric, FindingCode::kNumericLossScaleOverflow, "only handled"};
    CHECK(decide_next_step(r).name == "nothing_to_fix");
    r.root_cause = RootCause{TriageLayer::kData, FindingCode::kDataLossOutlier, "nothing went non-finite; worth a look"};
    r.findings.push_back(make_finding(FindingCode::kDataLossOutlier, "step 3: sample 5 has loss 9", {}));
    const NextStep look = decide_next_step(r);
    CHECK(look.name == "worth_a_look");
    CHECK(contains(look.text, "`DATA_LOSS_OUTLIER` above as context, not as a cause"));
    CHECK_FALSE(verdict_names_a_cause(r));
    r.root_cause = RootCause{TriageLayer::kNumeric, std::nullopt, "no fault found in the replayed window"};
    r.findings.clear();
    const NextStep widen = decide_next_step(r);
    CHECK(widen.name == "widen_window");
    CHECK(widen.commands.empty());  // import --steps FIRST:LAST is an example to fill in, not a command
  }
  SECTION("a system error without an origin: the system layer first") {
    ReplayReport r;
    r.bundle = "/b";
    r.root_cause = RootCause{TriageLayer::kSystem, FindingCode::kSystemNotReproducible, "not reproducible: ..."};
    r.findings.push_back(make_finding(FindingCode::kSystemNotReproducible, Severity::kError, "logged nan", {}));
    CHECK(decide_next_step(r).name == "check_system");
    CHECK(verdict_names_a_cause(r));
  }
  SECTION("split_code_spans cuts at backticks: prose, code, prose...") {
    CHECK(split_code_spans("run `a b` then `c`") == std::vector<std::string>{"run ", "a b", " then ", "c", ""});
  }
}
