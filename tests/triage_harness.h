// Writes a synthetic bundle with `nanreplay synth`, replays it with
// `nanreplay run` and checks that `nanreplay bisect` names the same origin:
// what the triage and verdict tests start from.
#pragma once

#include <string>
#include <vector>

#include "tests/bisect_agreement.h"
#include "tests/cli_harness.h"

namespace nanreplay_test {

struct Triaged {
  nlohmann::json planted;
  nlohmann::json report;
  int status = -1;
  std::string verdict;
};

inline Triaged run_bundle(const ScratchDir& dir, const std::vector<std::string>& run_extra = {}) {
  std::vector<std::string> args = {"run", (dir / "bundle").string(), "--out", (dir / "out").string()};
  args.insert(args.end(), run_extra.begin(), run_extra.end());
  const auto run = run_cli(args);
  INFO(run.err);
  Triaged t;
  t.status = run.status;
  t.verdict = run.out;
  t.report = read_json(dir / "out" / "report.json");
  check_bisect_agrees_with_run(dir / "bundle", t.report);
  return t;
}

// `synth_extra`: more arguments to synth (e.g. --corpus FILE); `run_extra`:
// more arguments to run (e.g. --what-if W).
inline Triaged triage(const ScratchDir& dir, const std::string& preset,
                      const std::vector<std::string>& synth_extra = {},
                      const std::vector<std::string>& run_extra = {}) {
  std::vector<std::string> args = {"synth", preset, (dir / "bundle").string()};
  args.insert(args.end(), synth_extra.begin(), synth_extra.end());
  const auto synth = run_cli(args);
  INFO(synth.err);
  REQUIRE(synth.status == 0);
  Triaged t = run_bundle(dir, run_extra);
  t.planted = nlohmann::json::parse(synth.out);
  return t;
}

inline std::vector<nlohmann::json> with_code(const nlohmann::json& report, const std::string& code) {
  std::vector<nlohmann::json> found;
  for (const auto& f : report["findings"]) {
    if (f["code"] == code) found.push_back(f);
  }
  return found;
}

inline std::vector<nlohmann::json> with_severity(const nlohmann::json& report, const std::string& severity) {
  std::vector<nlohmann::json> found;
  for (const auto& f : report["findings"]) {
    if (f["severity"] == severity) found.push_back(f);
  }
  return found;
}

}  // namespace nanreplay_test
