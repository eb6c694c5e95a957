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
