// The check behind "bisect names the same origin as the full probe pass":
// given a bundle and the report.json `nanreplay run` wrote for it, runs
// `nanreplay bisect --json` (samples stage off: ddmin has its own tests) and
// requires the same first non-finite value, fewer replays than the full
// pass, and the exit status run's rules give. The triage and incident tests
// call it on every bundle they replay, so every incident preset is covered.
#pragma once

#include <filesystem>
#include <map>
#include <set>

#include <catch2/catch.hpp>

#include "tests/cli_harness.h"

namespace nanreplay_test {

// Returns bisect's JSON for further checks.
inline nlohmann::json check_bisect_agrees_with_run(const std::filesystem::path& bundle, const nlohmann::json& run_report) {
  const CliResult result = run_cli({"bisect", bundle.string(), "--json", "--no-samples"});
  INFO("bisect " << bundle.string() << ": " << result.err);
  REQUIRE((result.status == 0 || result.status == 1));
  const nlohmann::json bisect = nlohmann::json::parse(result.out);
  const nlohmann::json& first = run_report["first_nonfinite"];
  const nlohmann::json& origin = bisect["origin"];
  if (first.is_null()) {
    CHECK(origin.is_null());
  } else {
    REQUIRE(origin.is_object());
    for (const char* key : {"step", "phase", "site", "layer", "head", "expert", "rank", "micro_batch", "sample", "position",
                            "index", "kind", "shape", "producer", "token"}) {
      INFO(key);
      CHECK(origin[key] == first[key]);
    }
    if (first.contains("checkpoint_nonfinite_params")) {
      CHECK(origin["checkpoint_nonfinite_params"] == first["checkpoint_nonfinite_params"]);
    }
    // In order (rolling forward), every step up to the bad one once with
    // flags, then one block with full probes.
    const bool in_order = bisect["stages"]["step"]["method"] == "in_order";
    CHECK(bisect["replays"]["origin"].get<int>() <
          bisect["replays"]["full_probe_pass"].get<int>() + (in_order ? 2 : 0));
  }
  CHECK(bisect["reproduced"] == run_report["reproduced"]);
  CHECK(bisect["stages"]["samples"].is_null());  // --no-samples
  CHECK(bisect["replays"]["samples"] == 0);
  // Steps bisect could not replay are steps run could not replay either.
  std::set<int64_t> unreplayed_by_run;
  int64_t replayed_by_run = 0;
  for (const auto& step : run_report["steps"]) {
    if (step["replayed"] == false) unreplayed_by_run.insert(step["step"].get<int64_t>());
    replayed_by_run += step["replayed"] == true;
  }
  for (const auto& skipped : bisect["not_replayed"]) CHECK(unreplayed_by_run.count(skipped["step"].get<int64_t>()) == 1);
  CHECK(bisect["replays"]["full_probe_pass"] == replayed_by_run * bisect["passes_per_step"].get<int64_t>());
  // As run: a logged non-finite loss no replayed step reproduces is run's SYSTEM_NOT_REPRODUCIBLE, exit 1;
  // so is an error finding of the checks bisect makes through run's triage (its `findings`).
  const bool not_reproducible = !origin.is_object() && !bisect["logged_nonfinite_steps"].empty();
  bool error_finding = false;
  for (const auto& f : bisect["findings"]) error_finding = error_finding || f["severity"] == "error";
  // A spike origin, named by run's own full pass in bisect (bisect_verdict.h), exits 1 as in run.
  const bool spike_origin = bisect["spike"].is_object() && !bisect["spike"]["site"].is_null();
  CHECK(bisect["spike"] == run_report["spike"]);
  CHECK(result.status ==
        (origin.is_object() || !bisect["not_replayed"].empty() || not_reproducible || error_finding || spike_origin
             ? 1 : 0));
  // The step search saw what run saw: a step is bad exactly where run's
  // replay of it holds a non-finite value the loss scaler does not absorb.
  std::map<int64_t, bool> bad_by_run;
  for (const auto& step : run_report["steps"]) {
    bad_by_run[step["step"].get<int64_t>()] =
        step["replayed"] == true && step["finite"] == false && step["handled_overflow"] == false;
  }
  const nlohmann::json& tested_steps = bisect["stages"]["step"]["tested"];
  int64_t replayed_tests = 0;
  for (const auto& tested : tested_steps) {
    INFO("tested step " << tested["step"]);
    CHECK(tested["bad"] == bad_by_run.at(tested["step"].get<int64_t>()));
    replayed_tests += tested["replayed"] == true;
  }
  if (bisect["stages"]["step"]["method"] == "in_order") {
    // Rolling forward: every step from the first, in order, up to the bad one.
    const nlohmann::json& steps = run_report["steps"];
    REQUIRE(tested_steps.size() <= steps.size());
    for (size_t i = 0; i < tested_steps.size(); ++i) CHECK(tested_steps[i]["step"] == steps[i]["step"]);
    if (origin.is_null()) CHECK(tested_steps.size() == steps.size());
  } else if (origin.is_null()) {
    // The last step first, then only the steps the log marks: P passes each
    // (none for a step that cannot be replayed).
    REQUIRE_FALSE(tested_steps.empty());
    CHECK(tested_steps[0]["step"] == run_report["steps"].back()["step"]);
    CHECK(bisect["replays"]["step"] == replayed_tests * bisect["passes_per_step"].get<int64_t>());
  }
  if (!origin.is_null()) {
    CHECK(bisect["stages"]["step"]["first_bad_step"] == first["step"]);
    CHECK(bisect["replays"]["site"] == (first["phase"] == "grad" ? 0 : 1));
  }
  return bisect;
}

}  // namespace nanreplay_test
