// OutputDir: results appear whole or not at all, replace an earlier run's
// (report-v1: `run --out DIR` writes into DIR whether or not it exists),
// never mix two runs, and survive a run that fails: unique locked staging,
// stale staging removed, commits serialised and rolled back on failure (or
// after a crash), created directories removed, never inside the bundle.
#include <catch2/catch.hpp>

#include <fcntl.h>
#include <linux/fs.h>
#include <sys/file.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <thread>

#include "loaders/base/error.h"
#include "reports/outputs/output_dir.h"
#include "tests/cli_harness.h"

using nanreplay::OutputDir;
using nanreplay_test::ScratchDir;
using nanreplay_test::slurp;
namespace fs = std::filesystem;

namespace {

const std::vector<std::string> kWrittenResults{"report.json", "trace.h5"};

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
    OutputDir dir(out, scratch / "bundle", true, kWrittenResults);
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
    OutputDir dir(out, scratch / "bundle", true, kWrittenResults);
    dir.write_text("report.json", "half");
  }  // destroyed without commit(): a failure
  CHECK(slurp(out / "report.json") == "old report");
  CHECK(entries(out) == std::vector<std::string>{"report.json"});

  const fs::path fresh = scratch / "fresh" / "deeper";
  {
    OutputDir dir(fresh, scratch / "bundle", true, kWrittenResults);
    CHECK(fs::is_directory(fresh));
  }
  CHECK_FALSE(fs::exists(fresh));  // created by the failed run, so removed with it
}

TEST_CASE("OutputDir refuses the bundle itself and, when told not to replace, earlier results", "[output]") {
  ScratchDir scratch("outdir-refuse");
  fs::create_directories(scratch / "bundle");
  CHECK_THROWS_AS(OutputDir(scratch / "bundle" / "out", scratch / "bundle", true, kWrittenResults), nanreplay::UsageError);
  CHECK_THROWS_AS(OutputDir(scratch / "bundle", scratch / "bundle", true, kWrittenResults), nanreplay::UsageError);
  CHECK_FALSE(fs::exists(scratch / "bundle" / "out"));

  fs::create_directories(scratch / "out");
  OutputDir empty_is_fine(scratch / "out", scratch / "bundle", false, kWrittenResults);
  empty_is_fine.abandon();
  std::ofstream(scratch / "out" / "trace.h5") << "old";
  CHECK_THROWS_AS(OutputDir(scratch / "out", scratch / "bundle", false, kWrittenResults), nanreplay::UsageError);
  CHECK(entries(scratch / "out") == std::vector<std::string>{"trace.h5"});
}

namespace {

std::vector<std::string> hidden_entries(const fs::path& dir) {
  std::vector<std::string> names;
  for (const std::string& name : entries(dir)) {
    if (name.rfind(".nanreplay-", 0) == 0) names.push_back(name);
  }
  return names;
}

// FS_IMMUTABLE_FL on one file (a rename of it fails with EPERM, even for
// root) until destroyed. ok() is false where the file system or the
// privileges do not allow it; the test then skips.
class ImmutableFile {
 public:
  explicit ImmutableFile(const fs::path& path) : path_(path) { ok_ = set(true); }
  ~ImmutableFile() {
    if (ok_) set(false);
  }
  ImmutableFile(const ImmutableFile&) = delete;
  ImmutableFile& operator=(const ImmutableFile&) = delete;
  bool ok() const { return ok_; }

 private:
  bool set(bool immutable) {
    const int fd = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return false;
    int flags = 0;
    bool done = ::ioctl(fd, FS_IOC_GETFLAGS, &flags) == 0;
    flags = immutable ? flags | FS_IMMUTABLE_FL : flags & ~FS_IMMUTABLE_FL;
    done = done && ::ioctl(fd, FS_IOC_SETFLAGS, &flags) == 0;
    ::close(fd);
    return done;
  }
  fs::path path_;
  bool ok_ = false;
};

void write_previous_set(const fs::path& out) {
  fs::create_directories(out);
  std::ofstream(out / "report.json") << "old report";
  std::ofstream(out / "trace.h5") << "old trace";
}

}  // namespace

TEST_CASE("two OutputDirs into one directory in one process never share a staging directory", "[output]") {
  // What PIDs cannot give: two runs in two containers are both PID 1.
  ScratchDir scratch("outdir-twins");
  const fs::path out = scratch / "out";
  OutputDir first(out, scratch / "bundle", true, kWrittenResults);
  OutputDir second(out, scratch / "bundle", true, kWrittenResults);
  CHECK(first.staging_path("report.json").parent_path() != second.staging_path("report.json").parent_path());
  first.write_text("report.json", "first");
  second.write_text("report.json", "second");
  CHECK(hidden_entries(out).size() == 2);  // the second did not take the first's for stale
  first.commit();
  CHECK(slurp(out / "report.json") == "first");
  CHECK(fs::exists(second.staging_path("report.json")));
  second.commit();
  CHECK(slurp(out / "report.json") == "second");
  CHECK(entries(out) == std::vector<std::string>{"report.json"});
}

TEST_CASE("staging directories of dead runs are removed, those of live runs are kept", "[output]") {
  ScratchDir scratch("outdir-stale");
  const fs::path out = scratch / "out";
  write_previous_set(out);
  // A run killed by SIGKILL (its lock went with it), one of an older version named by PID, a live one.
  fs::create_directories(out / ".nanreplay-staging-Ab12Cd");
  std::ofstream(out / ".nanreplay-staging-Ab12Cd" / "trace.h5") << "half";
  fs::create_directories(out / ".nanreplay-staging-4242");
  fs::create_directories(out / ".nanreplay-staging-LiveOn");
  const int live = ::open((out / ".nanreplay-staging-LiveOn").c_str(), O_RDONLY | O_DIRECTORY);
  REQUIRE(live >= 0);
  REQUIRE(::flock(live, LOCK_EX) == 0);
  {
    OutputDir dir(out, scratch / "bundle", true, kWrittenResults);
    const std::vector<std::string> hidden = hidden_entries(out);
    CHECK(hidden.size() == 2);  // ours and the live one
    CHECK(std::count(hidden.begin(), hidden.end(), ".nanreplay-staging-LiveOn") == 1);
    dir.abandon();
  }
  ::close(live);
  CHECK(entries(out) == std::vector<std::string>{".nanreplay-staging-LiveOn", "report.json", "trace.h5"});
  CHECK(slurp(out / "trace.h5") == "old trace");
}

TEST_CASE("a result name taken by a directory fails the commit and leaves the previous set", "[output]") {
  ScratchDir scratch("outdir-directory");
  const fs::path out = scratch / "out";
  write_previous_set(out);
  OutputDir dir(out, scratch / "bundle", true, kWrittenResults);
  dir.write_text("report.json", "new report");
  dir.write_text("trace.h5", "new trace");
  fs::remove(out / "trace.h5");
  fs::create_directories(out / "trace.h5" / "someone's");  // appears while the run replays
  REQUIRE_THROWS_AS(dir.commit(), nanreplay::OutputError);
  CHECK(slurp(out / "report.json") == "old report");
  CHECK(fs::is_directory(out / "trace.h5" / "someone's"));
  dir.abandon();
  CHECK(entries(out) == std::vector<std::string>{"report.json", "trace.h5"});
  // And up front: a run refuses such a directory before it replays anything.
  CHECK_THROWS_AS(OutputDir(out, scratch / "bundle", true, kWrittenResults), nanreplay::OutputError);
}

TEST_CASE("a rename failing half-way through a commit puts the previous set back", "[output]") {
  ScratchDir scratch("outdir-rename");
  const fs::path out = scratch / "out";
  write_previous_set(out);
  std::ofstream(out / "report.md") << "old summary";
  const std::vector<std::string> results{"report.json", "trace.h5", "report.md"};

  SECTION("while the old set moves aside") {
    OutputDir dir(out, scratch / "bundle", true, results);
    for (const std::string& name : results) dir.write_text(name, "new");
    const ImmutableFile stuck(out / "report.md");  // report.json and trace.h5 move aside first
    if (!stuck.ok()) {
      WARN("cannot set FS_IMMUTABLE_FL here (not root, or the file system lacks it); skipped");
      return;
    }
    REQUIRE_THROWS_AS(dir.commit(), nanreplay::OutputError);
  }
  SECTION("while the new set moves in") {
    OutputDir dir(out, scratch / "bundle", true, results);
    for (const std::string& name : results) dir.write_text(name, "new");
    const ImmutableFile stuck(dir.staging_path("report.md"));  // after report.json and trace.h5 moved in
    if (!stuck.ok()) {
      WARN("cannot set FS_IMMUTABLE_FL here (not root, or the file system lacks it); skipped");
      return;
    }
    REQUIRE_THROWS_AS(dir.commit(), nanreplay::OutputError);
  }
  CHECK(slurp(out / "report.json") == "old report");
  CHECK(slurp(out / "trace.h5") == "old trace");
  CHECK(slurp(out / "report.md") == "old summary");
  CHECK(entries(out) == std::vector<std::string>{"report.json", "report.md", "trace.h5"});
}

TEST_CASE("concurrent commits into one directory are serialised: always one whole set", "[output]") {
  ScratchDir scratch("outdir-concurrent");
  const fs::path out = scratch / "out";
  const std::vector<std::string> results{"report.json", "trace.h5", "report.md", "report.html"};
  for (int round = 0; round < 20; ++round) {
    std::vector<std::thread> runs;
    for (const std::string writer : {"a", "b", "c"}) {
      runs.emplace_back([&, writer] {
        OutputDir dir(out, scratch / "bundle", true, results);
        for (const std::string& name : results) dir.write_text(name, writer);
        dir.commit();
      });
    }
    for (std::thread& run : runs) run.join();
    const std::string winner = slurp(out / "report.json");
    INFO("round " << round);
    for (const std::string& name : results) CHECK(slurp(out / name) == winner);
    CHECK(entries(out).size() == results.size());  // nothing hidden left behind
  }
}

TEST_CASE("a commit killed half-way is rolled back, or finished, by the next run", "[output]") {
  ScratchDir scratch("outdir-recovery");
  const fs::path out = scratch / "out";
  fs::create_directories(out);
  const fs::path aside = out / ".nanreplay-previous-Zz9Yy8";
  fs::create_directories(aside);

  SECTION("killed while the old set moved aside") {
    std::ofstream(out / "trace.h5") << "old trace";
    std::ofstream(aside / "report.json") << "old report";
    OutputDir(out, scratch / "bundle", true, kWrittenResults).abandon();
    CHECK(slurp(out / "report.json") == "old report");
    CHECK(slurp(out / "trace.h5") == "old trace");
  }
  SECTION("killed while the new set moved in") {
    std::ofstream(aside / "report.json") << "old report";
    std::ofstream(aside / "trace.h5") << "old trace";
    std::ofstream(aside / ".old-set-aside");
    std::ofstream(out / "report.json") << "half of a new set";
    OutputDir(out, scratch / "bundle", true, kWrittenResults).abandon();
    CHECK(slurp(out / "report.json") == "old report");
    CHECK(slurp(out / "trace.h5") == "old trace");
  }
  SECTION("killed after the new set was in") {
    std::ofstream(aside / "report.json") << "old report";
    std::ofstream(aside / ".old-set-aside");
    std::ofstream(aside / ".new-set-in");
    std::ofstream(out / "report.json") << "new report";
    std::ofstream(out / "trace.h5") << "new trace";
    OutputDir(out, scratch / "bundle", true, kWrittenResults).abandon();
    CHECK(slurp(out / "report.json") == "new report");
    CHECK(slurp(out / "trace.h5") == "new trace");
  }
  CHECK(entries(out) == std::vector<std::string>{"report.json", "trace.h5"});
}

TEST_CASE("a failed run removes the --out it created, parents included, and nothing else", "[output]") {
  ScratchDir scratch("outdir-parents");
  const fs::path out = scratch / "new" / "deeper" / "out";
  { OutputDir dir(out, scratch / "bundle", true, kWrittenResults); }
  CHECK_FALSE(fs::exists(scratch / "new"));

  fs::create_directories(scratch / "kept");
  { OutputDir dir(scratch / "kept" / "x" / "../y", scratch / "bundle", true, kWrittenResults); }
  CHECK(entries(scratch / "kept").empty());  // "x" and "y" both went
}

TEST_CASE("OutputDir refuses the bundle by device and inode through symlinks and bind mounts", "[output]") {
  ScratchDir scratch("outdir-inside");
  const fs::path bundle = scratch / "bundle";
  fs::create_directories(bundle / "steps");
  fs::create_symlink(bundle / "steps", scratch / "link-into-bundle");
  CHECK_THROWS_AS(OutputDir(scratch / "link-into-bundle" / "out", bundle, true, kWrittenResults), nanreplay::UsageError);
  CHECK_THROWS_AS(OutputDir(scratch / "elsewhere" / ".." / "bundle" / "x" / "out", bundle, true, kWrittenResults),
                  nanreplay::UsageError);
  CHECK_FALSE(fs::exists(scratch / "elsewhere"));
  CHECK(entries(bundle) == std::vector<std::string>{"steps"});

  const fs::path mount = scratch / "bind";
  fs::create_directories(mount);
  if (::geteuid() != 0 || ::mount(bundle.c_str(), mount.c_str(), nullptr, MS_BIND, nullptr) != 0) {
    WARN("bind mounts need root (and CAP_SYS_ADMIN); the bind-mount case is skipped");
    return;
  }
  CHECK_THROWS_AS(OutputDir(mount / "out", bundle, true, kWrittenResults), nanreplay::UsageError);
  ::umount(mount.c_str());
  CHECK(entries(bundle) == std::vector<std::string>{"steps"});
}
