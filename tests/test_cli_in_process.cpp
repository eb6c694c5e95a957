// The CLI driven in process through run_cli (cli/cli.h), with string streams
// as its CommandIo: run, trace, inspect, bisect and minimize --json on a synthetic
// bundle written here, usage errors and "did you mean"; and the incident entry
// points a stop request ends (replay/workflows/incident.h, reports/outputs/run_outputs.h).
// The end-to-end tests through the real binary stay in test_cli_*.cpp (signals,
// the OpenMP re-exec, exit codes as a shell sees them). run_cli installs
// nanreplay's SIGINT/SIGTERM handlers in this process too; nothing here signals.
#include <filesystem>
#include <sstream>
#include <string>
#include <vector>

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include "cli/cli.h"
#include "cli/command_table.h"
#include "loaders/base/error.h"
#include "nanreplay_version.h"
#include "probes/sites.h"
#include "replay/workflows/incident.h"
#include "reports/outputs/run_outputs.h"
#include "synth/synthetic_bundle.h"
#include "tests/cli_harness.h"

using nanreplay_test::line_count;
using nanreplay_test::read_json;
using nanreplay_test::ScratchDir;

namespace fs = std::filesystem;

namespace {

struct InProcess {
  int status = -1;
  std::string out;
  std::string err;
};

InProcess cli(const std::vector<std::string>& args) {
  std::ostringstream out;
  std::ostringstream err;
  nanreplay::CommandIo io{out, err};
  InProcess result;
  result.status = nanreplay::run_cli(args, io);
  result.out = out.str();
  result.err = err.str();
  return result;
}

fs::path write_bundle(const ScratchDir& dir, const std::string& preset) {
  const fs::path bundle = dir / "bundle";
  nanreplay::write_synthetic_bundle(bundle, nanreplay::synthetic_preset(preset));
  return bundle;
}

}  // namespace

TEST_CASE("run_cli in process: run, trace, inspect, bisect and minimize --json on one bundle", "[cli][in-process]") {
  ScratchDir dir("in-process");
  const nanreplay::SyntheticSpec spec = nanreplay::synthetic_preset("head-overflow");
  const fs::path bundle = write_bundle(dir, "head-overflow");
  const fs::path out = dir / "out";

  const InProcess run = cli({"run", bundle.string(), "--out", out.string(), "--threads", "2"});
  INFO(run.err);
  REQUIRE(run.status == static_cast<int>(nanreplay::ExitStatus::kFound));
  CHECK(run.err.empty());
  CHECK(run.out.find("wrote " + (out / "report.json").string() + ", report.md, report.html and " +
                     (out / "trace.h5").string() + "\n") != std::string::npos);
  for (const char* name : {"report.json", "report.md", "report.html", "trace.h5"}) CHECK(fs::exists(out / name));
  const nlohmann::json report = read_json(out / "report.json");
  const nlohmann::json& origin = report["first_nonfinite"];
  REQUIRE(origin.is_object());
  CHECK(origin["step"] == spec.fault.step);
  CHECK(origin["site"] == nanreplay::site_name({nanreplay::SiteId::kAttnScores, spec.fault.layer}));
  CHECK(origin["head"] == spec.fault.head);

  const InProcess trace = cli({"trace", (out / "trace.h5").string(), "--first-nonfinite", "--json"});
  INFO(trace.err);
  REQUIRE(trace.status == 0);
  const nlohmann::json rows = nlohmann::json::parse(trace.out)["rows"];
  REQUIRE(rows.size() == 1);
  CHECK(rows[0]["step"] == origin["step"]);
  CHECK(rows[0]["site"] == origin["site"]);

  const InProcess inspect = cli({"inspect", bundle.string(), "--json"});
  INFO(inspect.err);
  REQUIRE(inspect.status == 0);
  CHECK(nlohmann::json::parse(inspect.out)["valid"] == true);

  const InProcess bisect = cli({"bisect", bundle.string(), "--json", "--threads", "2"});
  INFO(bisect.err);
  REQUIRE(bisect.status == static_cast<int>(nanreplay::ExitStatus::kFound));
  CHECK(bisect.err.empty());
  const nlohmann::json bisected = nlohmann::json::parse(bisect.out);
  for (const char* key : {"step", "phase", "site", "layer", "head", "rank", "micro_batch", "sample", "position"}) {
    INFO(key);
    CHECK(bisected["origin"][key] == origin[key]);
  }

  const InProcess minimize = cli({"minimize", bundle.string(), "--out", (dir / "min").string(), "--json"});
  INFO(minimize.err);
  REQUIRE(minimize.status == static_cast<int>(nanreplay::ExitStatus::kClean));  // MIN written
  const nlohmann::json minimized = nlohmann::json::parse(minimize.out);
  CHECK(minimized["origin_after"]["site"] == origin["site"]);
  CHECK(minimized["after"]["bytes"].get<int64_t>() < minimized["before"]["bytes"].get<int64_t>());
  CHECK(nlohmann::json::parse(cli({"inspect", (dir / "min").string(), "--json"}).out)["valid"] == true);
}

TEST_CASE("run_cli in process: usage errors are one line and exit 2, unknown commands a suggestion",
          "[cli][in-process][usage]") {
  const InProcess missing = cli({"run"});
  CHECK(missing.status == static_cast<int>(nanreplay::ExitStatus::kBadInput));
  CHECK(missing.out.empty());
  CHECK(missing.err == "nanreplay: error: run: missing BUNDLE (see nanreplay run --help)\n");

  const InProcess bad_flag = cli({"bisect", "bundle", "--no-such-flag"});
  CHECK(bad_flag.status == static_cast<int>(nanreplay::ExitStatus::kBadInput));
  CHECK(line_count(bad_flag.err) == 1);
  CHECK(bad_flag.err.find("(see nanreplay bisect --help)") != std::string::npos);

  // Checked before the bundle is opened: a what-if needs the probes that find its step.
  const InProcess no_probes = cli({"run", "no-such-bundle", "--no-probes", "--what-if", "stable-softmax"});
  CHECK(no_probes.status == static_cast<int>(nanreplay::ExitStatus::kBadInput));
  CHECK(no_probes.err ==
        "nanreplay: error: --what-if replays the first non-finite step, which only probes find: drop --no-probes\n");

  const InProcess unknown = cli({"rnu"});
  CHECK(unknown.status == static_cast<int>(nanreplay::ExitStatus::kBadInput));
  CHECK(unknown.err == "nanreplay: error: unknown command 'rnu'; did you mean 'run'? (see nanreplay --help)\n");

  const InProcess nothing = cli({});
  CHECK(nothing.status == static_cast<int>(nanreplay::ExitStatus::kBadInput));
  for (const nanreplay::Command& command : nanreplay::command_table()) {
    INFO(command.name);
    CHECK(nothing.out.find("  " + std::string(command.name) + " ") != std::string::npos);
  }
  const InProcess version = cli({"version"});
  CHECK(version.status == 0);
  CHECK(version.out.rfind(std::string("nanreplay ") + NANREPLAY_VERSION + "\nBLAS: ", 0) == 0);
}

TEST_CASE("Incident: a stop request ends the replay with Interrupted and RunOutputs keeps nothing",
          "[cli][in-process][interrupt]") {
  ScratchDir dir("in-process-stop");
  nanreplay::IncidentSettings settings;
  settings.bundle = write_bundle(dir, "clean-fp32");
  settings.threads = 2;
  const nanreplay::Incident incident(settings, nanreplay::IncidentUse::kReplay);
  REQUIRE(incident.steps_to_replay() == 4);
  const fs::path out = dir / "out";
  nanreplay::IncidentHooks stop;
  stop.stop_requested = [] { return true; };

  SECTION("during the replay: the staged directory is removed while the exception unwinds") {
    const auto replay_into_out = [&] {
      nanreplay::RunOutputs outputs(out, incident.bundle().root(), true);
      REQUIRE(fs::exists(out));
      incident.replay(stop);
    };
    CHECK_THROWS_MATCHES(replay_into_out(), nanreplay::Interrupted,
                         Catch::Matchers::Message("interrupted after 0 of 4 steps; nothing was written"));
    CHECK_FALSE(fs::exists(out));
  }
  SECTION("while the outputs are written: none of them is committed") {
    nanreplay::ReplayReport report = incident.replay({});
    nanreplay::RunOutputs outputs(out, incident.bundle().root(), true);
    CHECK_THROWS_MATCHES(
        outputs.write_and_commit(report, incident.steps_to_replay(), stop.stop_requested), nanreplay::Interrupted,
        Catch::Matchers::Message("interrupted after all 4 steps, while writing the outputs; nothing was written"));
    CHECK_FALSE(fs::exists(out));
  }
}
