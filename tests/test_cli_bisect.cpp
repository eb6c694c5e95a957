// `nanreplay bisect` end to end, on the presets built for it and its
// what-ifs: the origin must equal `nanreplay run`'s first_nonfinite, with
// replay counts derived by hand (a replay is one pass: forward and backward of
// one rank's micro-batch) and fewer than the full probe pass; the samples
// stage must find the planted sample; each what-if must remove, or not, the
// failure of the bundle built for it. (Every other incident preset is
// bisected by the triage and incident tests, tests/bisect_agreement.h.)
// Counts for a 4-step bundle whose last step fails in micro-batch 0 (1 rank x
// 2 micro-batches): the last step stops after 1 pass, then 101 and 102 are
// clean (2 + 2): 5 for the step stage, 1 full probe pass of one block for the
// site, 6 in all against run's 8.
#include <algorithm>
#include <functional>

#include <catch2/catch.hpp>

#include "tests/cli_harness.h"

using nanreplay_test::read_json;
using nanreplay_test::run_cli;
using nanreplay_test::ScratchDir;

namespace {

struct Bisected {
  nlohmann::json planted;  // what `synth` injected
  nlohmann::json run;      // run's report.json
  std::string run_text;    // run's verdict
  nlohmann::json bisect;   // bisect --json
  int run_status = -1;
  int bisect_status = -1;
};

using ExtraArgs = std::function<std::vector<std::string>(const nlohmann::json& planted)>;

// Writes `preset`, replays it with `run`, then bisects it with the extra
// arguments `extra` makes from what synth planted.
Bisected synth_run_bisect(const ScratchDir& dir, const std::string& preset, const ExtraArgs& extra = {},
                          const std::vector<std::string>& run_extra = {}) {
  const auto synth = run_cli({"synth", preset, (dir / "bundle").string()});
  INFO(synth.err);
  REQUIRE(synth.status == 0);
  Bisected b;
  b.planted = nlohmann::json::parse(synth.out);
  std::vector<std::string> run_args = {"run", (dir / "bundle").string(), "--out", (dir / "out").string()};
  run_args.insert(run_args.end(), run_extra.begin(), run_extra.end());
  const auto run = run_cli(run_args);
  INFO(run.err);
  b.run_status = run.status;
  b.run_text = run.out;
  b.run = read_json(dir / "out" / "report.json");
  std::vector<std::string> args = {"bisect", (dir / "bundle").string(), "--json"};
  if (extra) {
    const std::vector<std::string> more = extra(b.planted);
    args.insert(args.end(), more.begin(), more.end());
  }
  const auto bisect = run_cli(args);
  INFO(bisect.err);
  b.bisect_status = bisect.status;
  REQUIRE_NOTHROW(b.bisect = nlohmann::json::parse(bisect.out));
  return b;
}

// Fixed extra arguments.
ExtraArgs with(std::vector<std::string> args) {
  return [args](const nlohmann::json&) { return args; };
}

// The coordinates report-v1 gives the origin, plus index, kind and producer.
void check_same_origin(const Bisected& b) {
  const nlohmann::json& run = b.run["first_nonfinite"];
  const nlohmann::json& origin = b.bisect["origin"];
  REQUIRE(run.is_object());
  REQUIRE(origin.is_object());
  for (const char* key : {"step", "phase", "site", "layer", "head", "rank", "micro_batch", "sample", "position",
                          "index", "kind", "shape", "producer", "token"}) {
    INFO(key);
    CHECK(origin[key] == run[key]);
  }
  CHECK(b.bisect["reproduced"] == true);
  CHECK(b.bisect_status == 1);
  CHECK(b.run_status == 1);
}

void check_replays(const Bisected& b, int step, int site, int samples, int full) {
  const nlohmann::json& r = b.bisect["replays"];
  CHECK(r["step"] == step);
  CHECK(r["layer"] == 0);
  CHECK(r["site"] == site);
  CHECK(r["origin"] == step + site);
  CHECK(r["samples"] == samples);
  CHECK(r["full_probe_pass"] == full);
  CHECK(r["origin"].get<int>() < r["full_probe_pass"].get<int>());
  CHECK(b.bisect["stages"]["step"]["replays"] == step);
  CHECK(b.bisect["stages"]["site"]["replays"] == site);
  CHECK(b.bisect["stages"]["samples"]["replays"] == samples);
}

std::vector<std::pair<int64_t, bool>> tested(const Bisected& b) {
  std::vector<std::pair<int64_t, bool>> out;
  for (const auto& t : b.bisect["stages"]["step"]["tested"]) out.emplace_back(t["step"], t["bad"]);
  return out;
}

const nlohmann::json& what_if(const Bisected& b, const std::string& spec) {
  for (const auto& w : b.bisect["what_if"]) {
    if (w["what_if"] == spec) return w;
  }
  FAIL("no what-if " << spec);
  throw std::logic_error("unreachable");
}

void check_resolved(const Bisected& b, const std::string& spec, bool resolved, int replays) {
  INFO(spec);
  const nlohmann::json& w = what_if(b, spec);
  CHECK(w["resolved"] == resolved);
  CHECK(w["step"] == b.bisect["origin"]["step"]);
  CHECK(w["first_nonfinite_before"] == b.bisect["origin"]);
  CHECK(w["first_nonfinite_after"].is_null() == resolved);
  if (resolved) CHECK(w["loss_after"].is_number());
  CHECK(w["replays"] == replays);
}

}  // namespace

TEST_CASE("bisect names run's origin for an fp16 head overflow, with what-ifs on attention", "[cli][bisect]") {
  ScratchDir dir("bisect-head");
  const Bisected b = synth_run_bisect(dir, "head-overflow",
                                      with({"--what-if", "stable-softmax", "--what-if", "fp32-layers=1", "--what-if",
                                            "fp32-layers=0", "--what-if", "norm-eps=1e-3"}));
  check_same_origin(b);
  CHECK(b.bisect["origin"]["site"] == "layers.1.attn.scores");
  // ddmin's one test ({a}, the origin's sample) is known to fail without a replay, and the site
  // stage saw the damage in a's one token row: data-dependent, nothing replayed.
  check_replays(b, 5, 1, 0, 8);
  CHECK(b.bisect["stages"]["samples"]["data_dependent"] == true);
  CHECK(tested(b) == std::vector<std::pair<int64_t, bool>>{{103, true}, {101, false}, {102, false}});
  CHECK(b.bisect["stages"]["step"]["clean_predecessor"] == 102);
  CHECK(b.bisect["stages"]["layer"]["layer"] == 1);
  CHECK(b.bisect["stages"]["samples"]["minimal"] == nlohmann::json::array({b.planted["first_sample"]}));
  CHECK(b.bisect["bisect_version"] == 1);
  CHECK(b.bisect["replay_unit"] == "pass");
  CHECK(b.bisect["passes_per_step"] == 2);
  // A resolved what-if replays the step's 2 passes; one that is not adds the pass that locates the origin.
  check_resolved(b, "stable-softmax", true, 2);  // q k^T in fp32 never meets fp16's limit
  check_resolved(b, "fp32-layers=1", true, 2);
  check_resolved(b, "fp32-layers=0", false, 3);
  check_resolved(b, "norm-eps=1e-3", false, 3);
  CHECK(what_if(b, "fp32-layers=0")["first_nonfinite_after"]["site"] == "layers.1.attn.scores");
  CHECK(b.bisect["replays"]["what_if"] == 10);
  CHECK(b.bisect["replays"]["total"] == 6 + 0 + 10);
  CHECK_FALSE(b.run.contains("what_if"));  // run without --what-if: report v1 readers see nothing new

  const auto text = run_cli({"bisect", (dir / "bundle").string(), "--no-samples"});
  INFO(text.err);
  CHECK(text.status == 1);
  for (const char* expected : {"ORIGIN  step 103, forward, layers.1.attn.scores", "step      5", "layer     0",
                               "site      1", "skipped (--no-samples)", "replays: 6 to name the origin",
                               "the full probe pass (nanreplay run) replays 8"}) {
    CHECK(text.out.find(expected) != std::string::npos);
  }
  CHECK(text.err.empty());  // no progress line when stderr is not a terminal
}

TEST_CASE("bisect names a zero-norm NaN, run and bisect agree that norm-eps removes it", "[cli][bisect][what-if]") {
  ScratchDir dir("bisect-zero");
  const std::vector<std::string> what_ifs = {"--what-if", "norm-eps=1e-5", "--what-if", "stable-softmax"};
  const Bisected b = synth_run_bisect(dir, "zero-embedding", with(what_ifs), what_ifs);
  check_same_origin(b);
  CHECK(b.bisect["origin"]["site"] == "layers.0.attn_norm");
  check_replays(b, 5, 1, 0, 8);  // the origin's sample is known to fail; its damage confined to it
  CHECK(b.bisect["stages"]["samples"]["data_dependent"] == true);
  CHECK(b.bisect["stages"]["samples"]["minimal"] == nlohmann::json::array({b.planted["first_sample"]}));
  check_resolved(b, "norm-eps=1e-5", true, 2);
  check_resolved(b, "stable-softmax", false, 3);  // an fp32 bundle: nothing to change
  CHECK(what_if(b, "norm-eps=1e-5")["change"] == "norm eps 0 -> 1e-05");
  // run --what-if: the same outcomes in report.json, report.md, report.html and the verdict.
  REQUIRE(b.run["what_if"].size() == 2);
  CHECK(b.run["what_if"] == b.bisect["what_if"]);
  CHECK(b.run_text.find("norm-eps=1e-5   RESOLVED") != std::string::npos);
  const std::string md = nanreplay_test::slurp(dir / "out" / "report.md");
  CHECK(md.find("## What-if replays") != std::string::npos);
  CHECK(md.find("| `norm-eps=1e-5` | **gone** |") != std::string::npos);
  CHECK(nanreplay_test::slurp(dir / "out" / "report.html").find("<h2>What-if replays</h2>") != std::string::npos);
}

TEST_CASE("bisect blames the checkpoint of a flipped bit like run does", "[cli][bisect]") {
  ScratchDir dir("bisect-flip");
  const Bisected b = synth_run_bisect(dir, "bit-flip");
  check_same_origin(b);
  CHECK(b.bisect["origin"]["producer"] == false);
  CHECK(b.bisect["origin"]["checkpoint_nonfinite_params"] == b.run["first_nonfinite"]["checkpoint_nonfinite_params"]);
  // A NaN weight makes every sample fail: no sample is named, and none is replayed to say so.
  check_replays(b, 5, 1, 0, 8);
  CHECK(b.bisect["stages"]["samples"]["data_dependent"] == false);
  CHECK(b.bisect["stages"]["samples"]["minimal"].is_null());
}

TEST_CASE("bisect on data parallel: the glitch-token sample on rank 1, found by ddmin, and dropping it", "[cli][bisect][what-if]") {
  ScratchDir dir("bisect-glitch");
  const Bisected b = synth_run_bisect(dir, "glitch-token", [](const nlohmann::json& planted) {
    return std::vector<std::string>{"--what-if", "drop-samples=" + planted["fault_sample"].dump(), "--what-if",
                                    "stable-softmax"};
  });
  const int64_t bad = b.planted["fault_sample"];
  check_same_origin(b);
  const nlohmann::json& origin = b.bisect["origin"];
  CHECK(origin["site"] == "embed");
  CHECK(origin["rank"] == 1);
  CHECK(origin["micro_batch"] == 1);
  CHECK(origin["sample"] == bad);
  CHECK(origin["position"] == 9);
  // 2 ranks x 2 micro-batches = 4 passes a step; the bad one is the step's last pass.
  check_replays(b, 12, 1, 2, 16);
  // ddmin over the pass's 4 samples [a, b, c, bad]: {a, b} passes, {c, bad} fails, {c} passes, {bad} fails;
  // the two that hold the origin's sample are known without a replay.
  const nlohmann::json& samples = b.bisect["stages"]["samples"];
  REQUIRE(samples["candidates"].size() == 4);
  CHECK(samples["candidates"][3] == bad);
  CHECK(samples["minimal"] == nlohmann::json::array({bad}));
  CHECK(samples["data_dependent"] == true);  // {a, b} passed
  check_resolved(b, "drop-samples=" + std::to_string(bad), true, 4);
  check_resolved(b, "stable-softmax", false, 5);
}

TEST_CASE("bisect searches a 6-step window whose failure starts mid-way, and fp32-layers removes it", "[cli][bisect][what-if]") {
  ScratchDir dir("bisect-mlp");
  const Bisected b = synth_run_bisect(dir, "mlp-overflow",
                                      with({"--what-if", "fp32-layers=1", "--what-if", "fp32-layers=0", "--what-if",
                                            "stable-softmax"}));
  check_same_origin(b);
  CHECK(b.bisect["origin"]["step"] == 102);
  CHECK(b.bisect["origin"]["site"] == "layers.1.mlp.up");
  // 105 bad (1 pass), 102 bad (1), 101 clean (2): 4 against run's 12.
  // The edited row overflows on every sample: both fail alone, not data-dependent ({a} is the
  // origin's, known to fail; {b} is replayed).
  check_replays(b, 4, 1, 1, 12);
  CHECK(b.bisect["stages"]["samples"]["data_dependent"] == false);
  CHECK(tested(b) == std::vector<std::pair<int64_t, bool>>{{105, true}, {102, true}, {101, false}});
  check_resolved(b, "fp32-layers=1", true, 2);
  check_resolved(b, "fp32-layers=0", false, 3);
  check_resolved(b, "stable-softmax", false, 3);
}

TEST_CASE("bisect names an fp8 scale collapse, and damping the scale change removes it", "[cli][bisect][what-if]") {
  ScratchDir dir("bisect-fp8");
  const Bisected b = synth_run_bisect(dir, "fp8-scale-collapse",
                                      with({"--what-if", "damp-fp8-scale=3", "--what-if", "stable-softmax",
                                            "--what-if", "fp32-layers=0"}));
  check_same_origin(b);
  CHECK(b.bisect["origin"]["site"] == "layers.0.attn.q");
  check_replays(b, 5, 1, 2, 8);  // a scale of 0 fails every sample: not data-dependent
  CHECK(b.bisect["stages"]["samples"]["data_dependent"] == false);
  check_resolved(b, "damp-fp8-scale=3", true, 2);
  CHECK(what_if(b, "damp-fp8-scale=3")["change"].get<std::string>().find(
            "model.layers.0.self_attn.q_proj input 0 -> 0.333333") != std::string::npos);
  check_resolved(b, "stable-softmax", false, 3);  // fp8 attention scores are fp32 already
  check_resolved(b, "fp32-layers=0", true, 2);    // no fp8 quantization in layer 0
}

TEST_CASE("with nothing non-finite bisect says so, notes a logged NaN and replays no what-if", "[cli][bisect]") {
  ScratchDir dir("bisect-none");
  REQUIRE(run_cli({"synth", "not-reproducible", (dir / "bundle").string()}).status == 0);
  const auto text = run_cli({"bisect", (dir / "bundle").string(), "--what-if", "stable-softmax"});
  INFO(text.err);
  CHECK(text.status == 1);  // as run, whose SYSTEM_NOT_REPRODUCIBLE is an error finding
  CHECK(text.out.find("NOT REPRODUCED") != std::string::npos);
  CHECK(text.out.find("the job logged a non-finite loss at step 103") != std::string::npos);
  CHECK(text.out.find("stable-softmax  not replayed: nothing went non-finite") != std::string::npos);
  CHECK(text.out.find("replays: 2 to look for an origin") != std::string::npos);
}

TEST_CASE("a malformed what-if is exit 2 with one line, and nothing is written", "[cli][what-if]") {
  ScratchDir dir("whatif-bad");
  REQUIRE(run_cli({"synth", "zero-embedding", (dir / "bundle").string()}).status == 0);
  const std::string bundle = (dir / "bundle").string();
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"run", bundle, "--out", (dir / "a").string(), "--what-if", "flip-coins"}, "unknown kind 'flip-coins'"},
      {{"run", bundle, "--out", (dir / "b").string(), "--what-if", "fp32-layers=9"}, "layer 9 is out of range"},
      {{"run", bundle, "--out", (dir / "c").string(), "--what-if", "norm-eps=-1"}, "eps must be >= 0"},
      // Known only once the bad step is: step 103 does not read sample 100000.
      {{"run", bundle, "--out", (dir / "d").string(), "--what-if", "drop-samples=100000"},
       "sample 100000 is not read by step 103"},
      {{"run", bundle, "--out", (dir / "e").string(), "--no-probes", "--what-if", "stable-softmax"},
       "drop --no-probes"},
      {{"bisect", bundle, "--what-if", "damp-fp8-scale"}, "no fp8 scales to damp"},
  };
  for (const auto& [args, message] : cases) {
    INFO(args[0] << " " << args.back());
    const auto result = run_cli(args);
    CHECK(result.status == 2);
    CHECK(result.err.find(message) != std::string::npos);
    CHECK(std::count(result.err.begin(), result.err.end(), '\n') == 1);
    CHECK(result.out.empty());
  }
  for (const char* out : {"a", "b", "c", "d", "e"}) CHECK_FALSE(std::filesystem::exists(dir / out));
}

TEST_CASE("bisect refuses a missing bundle with exit 2 naming it", "[cli][bisect]") {
  ScratchDir dir("bisect-usage");
  const auto missing = run_cli({"bisect", (dir / "nope").string()});
  CHECK(missing.status == 2);
  CHECK(missing.err.find("nope") != std::string::npos);
  CHECK(std::count(missing.err.begin(), missing.err.end(), '\n') == 1);
  CHECK(run_cli({"bisect"}).status == 2);
  const auto help = run_cli({"bisect", "--help"});
  CHECK(help.status == 0);
  CHECK(help.out.find("damp-fp8-scale=3") != std::string::npos);
}
