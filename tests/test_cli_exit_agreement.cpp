// `run` and `bisect` exit alike on the same bundle (docs/commands.md): on the
// presets where only `run`'s checks used to find something (a flipped bit the
// update check sees, recorded samples against the sampler, one rank's logged
// loss, a shard's checksum, a bundle that does not reproduce the logged
// losses), on a clean one and on one that goes NaN. bisect names what it
// found in its JSON's `findings`, as run's report.json does.
#include <algorithm>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include "tests/cli_harness.h"

using nanreplay_test::read_json;
using nanreplay_test::run_cli;
using nanreplay_test::ScratchDir;

namespace {

struct ExitAgreement {
  const char* preset;
  int status;             // both commands' exit status
  const char* bisect_code;  // a finding bisect must name, or "" for none
};

std::vector<std::string> error_codes(const nlohmann::json& findings) {
  std::vector<std::string> codes;
  for (const auto& f : findings) {
    if (f["severity"] == "error") codes.push_back(f["code"]);
  }
  return codes;
}

}  // namespace

TEST_CASE("run and bisect exit alike on the presets only run's checks used to catch", "[cli][bisect][exit-status]") {
  const std::vector<ExitAgreement> cases = {
      {"silent-bit-flip", 1, "SYSTEM_BIT_FLIP"},
      {"sampler-mismatch", 1, "DATA_SAMPLER_MISMATCH"},
      {"rank-mismatch", 1, "SYSTEM_RANK_MISMATCH"},
      {"checksum-mismatch", 1, "BUNDLE_CHECKSUM_MISMATCH"},
      {"wrong-seed", 1, "BUNDLE_DOES_NOT_REPRODUCE"},
      {"clean-fp32", 0, ""},
      {"zero-embedding", 1, ""},  // NaN: the origin decides, for both
      // Judged by run's full probe pass in bisect too (bisect_verdict.h): a spike's origin, a site mismatch.
      {"spike-token", 1, ""},
      {"spike-logit-growth", 1, ""},  // a head's scores, named by both
      {"site-mismatch", 1, "SYSTEM_SITE_MISMATCH"},
      {"spike-bad-update", 1, "SYSTEM_UPDATE_MISMATCH"},  // a spike whose root cause is the update
  };
  for (const ExitAgreement& c : cases) {
    DYNAMIC_SECTION(c.preset) {
      ScratchDir dir(std::string("exit-") + c.preset);
      const std::string bundle = (dir / "bundle").string();
      REQUIRE(run_cli({"synth", c.preset, bundle}).status == 0);
      const auto run = run_cli({"run", bundle, "--out", (dir / "out").string()});
      const auto bisect = run_cli({"bisect", bundle, "--json", "--no-samples"});
      INFO(run.err << bisect.err);
      CHECK(run.status == c.status);
      CHECK(bisect.status == run.status);
      const nlohmann::json report = read_json(dir / "out" / "report.json");
      const nlohmann::json bisected = nlohmann::json::parse(bisect.out);
      REQUIRE(bisected["findings"].is_array());
      // A spike incident: the same spike and origin (null elsewhere), and the same root cause.
      CHECK(bisected["spike"] == report["spike"]);
      if (!report["spike"].is_null() || !report["spike_check"].is_null()) {
        CHECK(bisected["spike_check"] == report["spike_check"]);
        CHECK(bisected["root_cause"] == report["root_cause"]);
      }
      const std::vector<std::string> found = error_codes(bisected["findings"]);
      if (std::string(c.bisect_code).empty()) {
        CHECK(found.empty());
      } else {
        // The same finding run names, from the same rule.
        CHECK(std::find(found.begin(), found.end(), c.bisect_code) != found.end());
        const std::vector<std::string> by_run = error_codes(report["findings"]);
        CHECK(std::find(by_run.begin(), by_run.end(), c.bisect_code) != by_run.end());
      }
    }
  }
}

// Issue 42: q_proj and k_proj of layer 1 multiplied by 1e20 outside the
// optimizer before the last step. The rewritten tensors, with how far the
// checkpoint is from the update the optimizer computed, are the root cause in
// run and bisect alike; the overflow they cause is its consequence; and
// minimize keeps the step before, whose update is that evidence.
TEST_CASE("weights rewritten outside the optimizer outrank the overflow they cause", "[cli][bisect][exit-status]") {
  ScratchDir dir("exit-rewritten");
  const std::string bundle = (dir / "bundle").string();
  REQUIRE(run_cli({"synth", "rewritten-weights", bundle}).status == 0);
  const auto run = run_cli({"run", bundle, "--out", (dir / "out").string()});
  const auto bisect = run_cli({"bisect", bundle, "--json", "--no-samples"});
  INFO(run.err << bisect.err);
  CHECK(run.status == 1);
  CHECK(bisect.status == 1);
  const nlohmann::json report = read_json(dir / "out" / "report.json");
  const nlohmann::json bisected = nlohmann::json::parse(bisect.out);
  for (const nlohmann::json* r : {&report, &bisected}) {
    const nlohmann::json& cause = (*r)["root_cause"];
    INFO(cause.dump());
    CHECK(cause["code"] == "SYSTEM_UPDATE_MISMATCH");
    const std::string summary = cause["summary"];
    CHECK(summary.find("model.layers.1.self_attn.q_proj.weight (||found|| / ||expected|| 1") != std::string::npos);
    CHECK(summary.find("model.layers.1.self_attn.k_proj.weight") != std::string::npos);
    CHECK(summary.find("is its consequence") != std::string::npos);
    std::vector<std::string> rewritten;
    for (const auto& f : (*r)["findings"]) {
      if (f["code"] != "SYSTEM_UPDATE_MISMATCH" || f["severity"] != "error") continue;
      rewritten.push_back(f["evidence"]["param"]);
      CHECK(f["evidence"]["step"] == 103);
      CHECK(f["evidence"]["rewritten"] == true);
      CHECK(f["evidence"]["norm_ratio"].get<double>() > 1e19);
      CHECK(f["evidence"]["max_abs_diff"].get<double>() > 1e17);
    }
    CHECK(rewritten == std::vector<std::string>{"model.layers.1.self_attn.q_proj.weight",
                                                "model.layers.1.self_attn.k_proj.weight"});
  }
  CHECK(bisected["origin"]["step"] == report["first_nonfinite"]["step"]);
  // The runbook: infra, resume from the checkpoint before the rewrite, bisect confirms.
  CHECK(report["next_step"]["kind"] == "rewritten_weights");
  CHECK(report["runbook"]["layer"] == "infra");
  CHECK(report["runbook"]["resume_from"]["step"] == 102);
  CHECK(report["runbook"]["confirm"] == "nanreplay bisect " + bundle);
  CHECK(bisected["replays"]["checks"].get<int>() > 0);  // the step before, replayed for the update check
  for (const auto& f : report["findings"]) {  // the overflow: a consequence, not a cause
    if (f["code"] == "NUMERIC_OVERFLOW") {
      CHECK(f["severity"] == "info");
      CHECK(f["evidence"]["consequence"] == true);
    }
  }
  const auto minimized = run_cli({"minimize", bundle, "--out", (dir / "min").string(), "--json"});
  INFO(minimized.err);
  REQUIRE(minimized.status == 0);
  CHECK(nlohmann::json::parse(minimized.out)["after"]["steps"] == 2);
  const auto again = run_cli({"bisect", (dir / "min").string(), "--json", "--no-samples"});
  CHECK(nlohmann::json::parse(again.out)["root_cause"]["code"] == "SYSTEM_UPDATE_MISMATCH");
}
