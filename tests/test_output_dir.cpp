// OutputDir: results appear whole or not at all, replace an earlier run's
// (report-v1: `run --out DIR` writes into DIR whether or not it exists),
// never mix two runs, and survive a run that fails.
#include <catch2/catch.hpp>

#include <fstream>

#include "loaders/error.h"
#include "reports/output_dir.h"
#include "tests/cli_harness.h"

using nanreplay::OutputDir;
using nanreplay_test::ScratchDir;
using nanreplay_test::slurp;
namespace fs = std::filesystem;

namespace {

const std::vector<std::string> kResults{"report.json", "trace.h5"};

std::vector<std::string> entries(const fs::path& dir) {
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

}  // namespace

TEST_CASE("a commit replaces earlier results and drops the ones this run did not write", "[output]") {
  ScratchDir scratch("outdir-replace");
  const fs::path out = scratch / "out";
  fs::create_directories(out);
  std::ofstream(out / "report.json") << "old report";
  std::ofstream(out / "trace.h5") << "old trace";
  std::ofstream(out / "notes.txt") << "the user's";
  {
    OutputDir dir(out, scratch / "bundle", true, kResults);
    dir.write_text("report.json", "new report");
    CHECK(slurp(out / "report.json") == "old report");  // nothing moves before commit()
    dir.commit();
  }
  CHECK(slurp(out / "report.json") == "new report");
  CHECK(entries(out) == std::vector<std::string>{"notes.txt", "report.json"});  // no stale trace, no staging
}

TEST_CASE("a run that fails leaves earlier results and the user's files as they were", "[output]") {
  ScratchDir scratch("outdir-abandon");
  const fs::path out = scratch / "out";
  fs::create_directories(out);
  std::ofstream(out / "report.json") << "old report";
  {
    OutputDir dir(out, scratch / "bundle", true, kResults);
    dir.write_text("report.json", "half");
  }  // destroyed without commit(): a failure
  CHECK(slurp(out / "report.json") == "old report");
  CHECK(entries(out) == std::vector<std::string>{"report.json"});

  const fs::path fresh = scratch / "fresh" / "deeper";
  {
    OutputDir dir(fresh, scratch / "bundle", true, kResults);
    CHECK(fs::is_directory(fresh));
  }
  CHECK_FALSE(fs::exists(fresh));  // created by the failed run, so removed with it
}

TEST_CASE("OutputDir refuses the bundle itself and, when told not to replace, earlier results", "[output]") {
  ScratchDir scratch("outdir-refuse");
  fs::create_directories(scratch / "bundle");
  CHECK_THROWS_AS(OutputDir(scratch / "bundle" / "out", scratch / "bundle", true, kResults), nanreplay::UsageError);
  CHECK_THROWS_AS(OutputDir(scratch / "bundle", scratch / "bundle", true, kResults), nanreplay::UsageError);
  CHECK_FALSE(fs::exists(scratch / "bundle" / "out"));

  fs::create_directories(scratch / "out");
  OutputDir empty_is_fine(scratch / "out", scratch / "bundle", false, kResults);
  empty_is_fine.abandon();
  std::ofstream(scratch / "out" / "trace.h5") << "old";
  CHECK_THROWS_AS(OutputDir(scratch / "out", scratch / "bundle", false, kResults), nanreplay::UsageError);
  CHECK(entries(scratch / "out") == std::vector<std::string>{"trace.h5"});
}
