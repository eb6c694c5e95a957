// Faults injected around the real CLI, as a cluster in trouble makes them:
// an --out that resolves into the bundle (from inside it, through a symlink,
// a bind mount), a disk that fills or is read-only while the outputs are
// written, a result name taken by a directory, a checkpoint or shard
// truncated while the replay reads it, a stop signal during start-up, two
// runs in two PID namespaces (both PID 1) into one --out. The bar: exit 2
// (130 for a signal) with one line naming the file, never a crash, nothing
// left in the bundle, and --out holding the previous set or nothing new.
// Cases that need root (mounts, namespaces) warn and skip without it.
#include <catch2/catch.hpp>

#include <fcntl.h>
#include <signal.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "loaders/base/directory_lock.h"
#include "reports/outputs/trace/trace_writer.h"
#include "tests/cli_harness.h"

namespace {

namespace fs = std::filesystem;
using nanreplay_test::check_one_error_line;
using nanreplay_test::CliResult;
using nanreplay_test::Finished;
using nanreplay_test::line_count;
using nanreplay_test::read_json;
using nanreplay_test::run_cli;
using nanreplay_test::ScratchDir;
using nanreplay_test::shared_clean_bundle;
using nanreplay_test::slurp;
using nanreplay_test::spawn_cli;
using nanreplay_test::SpawnOptions;
using nanreplay_test::Spawned;
using nanreplay_test::wait_cli;

fs::path copy_bundle(const ScratchDir& scratch, const std::string& name) {
  fs::copy(shared_clean_bundle(), scratch / name, fs::copy_options::recursive);
  return scratch / name;
}

// Every path under `root` with its size and modification time: what "unchanged" means.
std::map<std::string, std::string> snapshot(const fs::path& root) {
  std::map<std::string, std::string> files;
  for (const auto& entry : fs::recursive_directory_iterator(root)) {
    struct stat info {};
    ::lstat(entry.path().c_str(), &info);
    files[fs::relative(entry.path(), root).string()] =
        std::to_string(info.st_size) + "@" + std::to_string(info.st_mtim.tv_sec) + "." +
        std::to_string(info.st_mtim.tv_nsec);
  }
  return files;
}

std::vector<std::string> names_in(const fs::path& dir) {
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(dir)) names.push_back(entry.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

const std::vector<std::string> kRunOutputs{"report.html", "report.json", "report.md", "trace.h5"};

bool running_as_root() { return ::geteuid() == 0; }

SpawnOptions in_directory(const fs::path& cwd) {
  SpawnOptions options;
  options.cwd = cwd;
  return options;
}

SpawnOptions with_env(const std::vector<std::string>& set, const std::vector<std::string>& unset = {}) {
  SpawnOptions options;
  options.set_env = set;
  options.unset_env = unset;
  return options;
}

// A tmpfs of `size` at `where` for the test's duration (root only).
class TmpfsMount {
 public:
  TmpfsMount(const fs::path& where, const std::string& size) : where_(where) {
    fs::create_directories(where);
    mounted_ = running_as_root() &&
               ::mount("tmpfs", where.c_str(), "tmpfs", 0, ("size=" + size + ",mode=0755").c_str()) == 0;
  }
  ~TmpfsMount() {
    if (mounted_) ::umount2(where_.c_str(), MNT_DETACH);
  }
  TmpfsMount(const TmpfsMount&) = delete;
  TmpfsMount& operator=(const TmpfsMount&) = delete;
  bool mounted() const { return mounted_; }
  bool remount_read_only() {
    return ::mount("tmpfs", where_.c_str(), "tmpfs", MS_REMOUNT | MS_RDONLY, nullptr) == 0;
  }

 private:
  fs::path where_;
  bool mounted_ = false;
};

// The value of a field of /proc/<pid>/status ("State", "SigCgt", ...), "" once gone.
std::string proc_status(pid_t pid, const std::string& field) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind(field + ":", 0) == 0) {
      const size_t value = line.find_first_not_of(" \t", field.size() + 1);
      return value == std::string::npos ? "" : line.substr(value);
    }
  }
  return "";
}

// Waits (up to a minute) until `pid` has stopped itself with SIGSTOP.
bool wait_until_stopped(pid_t pid) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (std::chrono::steady_clock::now() < deadline) {
    const std::string state = proc_status(pid, "State");
    if (state.rfind("T", 0) == 0) return true;
    if (state.empty() || state.rfind("Z", 0) == 0) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  return false;
}

// Waits until the forked child runs nanreplay itself: before its exec it is
// a copy of this test process, whose signal handlers are Catch's.
bool wait_until_exec(pid_t pid) {
  const fs::path cli = fs::canonical(NANREPLAY_CLI_PATH);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (std::chrono::steady_clock::now() < deadline) {
    std::error_code ec;
    if (fs::read_symlink("/proc/" + std::to_string(pid) + "/exe", ec) == cli) return true;
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
  return false;
}

// Whether signal `number` is set in a /proc signal mask (hex text).
bool mask_has(const std::string& hex, int number) {
  if (hex.empty()) return false;
  return ((std::stoull(hex, nullptr, 16) >> (number - 1)) & 1u) != 0;
}

}  // namespace

TEST_CASE("run never writes into the bundle: from inside it, through a symlink or a bind mount",
          "[cli][faults][bundle]") {
  ScratchDir scratch("faults-inside");
  const fs::path bundle = copy_bundle(scratch, "bundle");
  const auto before = snapshot(bundle);

  // `cd bundle && nanreplay run .`: the default --out nanreplay-out does not exist yet.
  const Finished from_inside = wait_cli(spawn_cli(scratch, {"run", "."}, in_directory(bundle)));
  check_one_error_line(from_inside.result, {"--out nanreplay-out is inside the bundle"});
  fs::create_directory_symlink(bundle / "steps", scratch / "into-bundle");
  check_one_error_line(run_cli({"run", bundle.string(), "--out", (scratch / "into-bundle" / "new" / "out").string()}),
                       {"inside the bundle"});
  check_one_error_line(run_cli({"run", bundle.string(), "--out", (scratch / "gone" / ".." / "into-bundle").string()}),
                       {"inside the bundle"});
  check_one_error_line(run_cli({"demo", (bundle / "demo").string()}), {"inside the bundle"});
  check_one_error_line(run_cli({"synth", "clean-fp32", (bundle / "steps" / "more").string()}), {"inside the bundle"});
  CHECK(snapshot(bundle) == before);
  CHECK_FALSE(fs::exists(scratch / "gone"));

  const fs::path mount = scratch / "bind";
  fs::create_directories(mount);
  if (!running_as_root() || ::mount(bundle.c_str(), mount.c_str(), nullptr, MS_BIND, nullptr) != 0) {
    WARN("bind mounts need root; the bind-mount case is skipped");
    return;
  }
  const CliResult through_mount = run_cli({"run", bundle.string(), "--out", (mount / "out").string()});
  ::umount2(mount.c_str(), MNT_DETACH);
  check_one_error_line(through_mount, {"inside the bundle"});
  CHECK(snapshot(bundle) == before);
}

TEST_CASE("a disk that fills while the outputs are written: exit 2, one line, previous set kept",
          "[cli][faults][disk]") {
  ScratchDir scratch("faults-full");
  TmpfsMount disk(scratch / "disk", "1m");
  if (!disk.mounted()) {
    WARN("a tmpfs mount needs root; skipped");
    return;
  }
  const fs::path out = scratch / "disk" / "triage";
  // A small previous set, then fill the disk to within 100 KiB: the full trace (~220 KB) cannot fit.
  REQUIRE(run_cli({"run", shared_clean_bundle().string(), "--out", out.string(), "--no-probes", "--quiet"}).status == 0);
  const std::string previous_report = slurp(out / "report.json");
  struct statvfs space {};
  REQUIRE(::statvfs(out.c_str(), &space) == 0);
  const uint64_t free_bytes = uint64_t{space.f_bavail} * space.f_frsize;
  REQUIRE(free_bytes > 100 * 1024);
  std::ofstream(scratch / "disk" / "filler") << std::string(free_bytes - 100 * 1024, 'f');

  const CliResult full = run_cli({"run", shared_clean_bundle().string(), "--out", out.string(), "--quiet"});
  INFO(full.err);
  CHECK(full.status == 2);  // 139 (SIGSEGV in HDF5's shutdown) before
  CHECK(line_count(full.err) == 1);
  CHECK(full.err.find("No space left on device") != std::string::npos);
  CHECK(full.err.find(out.string() + "/") != std::string::npos);  // names the file
  CHECK(slurp(out / "report.json") == previous_report);
  CHECK(names_in(out) == kRunOutputs);

  // A fresh nested --out on the full disk: created, then removed with its parents.
  const CliResult nested = run_cli({"run", shared_clean_bundle().string(), "--out", (scratch / "disk" / "a" / "b").string()});
  CHECK(nested.status == 2);
  CHECK(names_in(scratch / "disk") == std::vector<std::string>{"filler", "triage"});
}

TEST_CASE("a layer-streamed replay whose scratch disk fills: exit 2, one line naming the file, nothing left",
          "[cli][faults][disk][stream]") {
  ScratchDir scratch("faults-scratch-full");
  const fs::path out = scratch / "out";
  const CliResult not_dir = run_cli({"run", shared_clean_bundle().string(), "--out", out.string(), "--stream",
                                     "--scratch", (scratch / "missing").string()});
  check_one_error_line(not_dir, {"--scratch", "not a directory"});
  CHECK_FALSE(fs::exists(out));

  TmpfsMount disk(scratch / "disk", "64k");
  if (!disk.mounted()) {
    WARN("a tmpfs mount needs root; the full scratch disk is skipped");
    return;
  }
  const CliResult full = run_cli({"run", shared_clean_bundle().string(), "--out", out.string(), "--stream", "--quiet",
                                  "--scratch", (scratch / "disk").string()});
  INFO(full.err);
  CHECK(full.status == 2);
  CHECK(line_count(full.err) == 1);
  CHECK(full.err.find("No space left on device") != std::string::npos);
  CHECK(full.err.find((scratch / "disk" / "nanreplay-scratch-").string()) != std::string::npos);
  CHECK(names_in(scratch / "disk").empty());
  CHECK_FALSE(fs::exists(out));
}

TEST_CASE("a read-only --out or a result name taken by a directory: exit 2, nothing changed",
          "[cli][faults][disk]") {
  ScratchDir scratch("faults-readonly");
  const fs::path out = scratch / "out";
  fs::create_directories(out / "trace.h5");
  std::ofstream(out / "report.json") << "previous";
  check_one_error_line(run_cli({"run", shared_clean_bundle().string(), "--out", out.string(), "--no-probes"}),
                       {(out / "trace.h5").string(), "is not a file an earlier run wrote"});
  CHECK(slurp(out / "report.json") == "previous");
  CHECK(names_in(out) == std::vector<std::string>{"report.json", "trace.h5"});

  TmpfsMount disk(scratch / "ro", "1m");
  if (!disk.mounted()) {
    WARN("a tmpfs mount needs root; the read-only case is skipped");
    return;
  }
  const fs::path ro_out = scratch / "ro" / "out";
  REQUIRE(run_cli({"run", shared_clean_bundle().string(), "--out", ro_out.string(), "--no-probes", "--quiet"}).status == 0);
  const auto before = snapshot(ro_out);
  REQUIRE(disk.remount_read_only());
  check_one_error_line(run_cli({"run", shared_clean_bundle().string(), "--out", ro_out.string(), "--no-probes"}),
                       {ro_out.string(), "Read-only file system"});
  CHECK(snapshot(ro_out) == before);
}

TEST_CASE("a checkpoint or shard truncated while the replay reads it: exit 2 naming it, nothing left",
          "[cli][faults][mapped]") {
  ScratchDir scratch("faults-truncated");
  struct Case {
    std::string name;
    std::string file;  // relative to the bundle
    uintmax_t keep;    // bytes left
  };
  // The F32 checkpoint is used in place (its tensors point into the mapping); the shard is read per batch.
  for (const Case& c : {Case{"checkpoint", "steps/101/model.safetensors", 8192},
                        Case{"shard", "data/shard_000.bin", 0}}) {
    DYNAMIC_SECTION(c.name) {
      const fs::path bundle = copy_bundle(scratch, c.name);
      const fs::path out = scratch / (c.name + "-out");
      // The previous set stays as it was.
      REQUIRE(run_cli({"run", bundle.string(), "--out", out.string(), "--no-probes", "--quiet"}).status == 0);
      const auto previous = snapshot(out);
      const Spawned child = spawn_cli(scratch, {"run", bundle.string(), "--out", out.string(), "--threads", "1"},
                                      with_env({"NANREPLAY_TEST_PAUSE_AT_STEP=101"}));
      REQUIRE(wait_until_stopped(child.pid));  // step 101's checkpoint is mapped, its replay about to start
      fs::resize_file(bundle / c.file, c.keep);
      REQUIRE(::kill(child.pid, SIGCONT) == 0);
      const Finished done = wait_cli(child);
      check_one_error_line(done.result, {c.file + ": changed while being read"});
      CHECK(done.result.err.find("a read past its end failed") != std::string::npos);  // the SIGBUS was absorbed
      CHECK(snapshot(out) == previous);  // no staging directory left, the previous set untouched
    }
  }
}

TEST_CASE("a stop signal during start-up exits 130 with one line and writes nothing", "[cli][faults][signals]") {
  ScratchDir scratch("faults-early-signal");
  const fs::path out = scratch / "out";
  // As soon as the handlers are in place (before LibTorch has finished initialising).
  const Spawned child = spawn_cli(scratch, {"run", shared_clean_bundle().string(), "--out", out.string()});
  REQUIRE(wait_until_exec(child.pid));
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (!mask_has(proc_status(child.pid, "SigCgt"), SIGTERM) && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  REQUIRE(::kill(child.pid, SIGTERM) == 0);
  const Finished done = wait_cli(child);
  INFO(done.result.err);
  CHECK(done.result.status == 130);  // 143 before
  CHECK(line_count(done.result.err) == 1);
  CHECK(done.result.err.find("nothing was written") != std::string::npos);
  CHECK_FALSE(fs::exists(out));
}

TEST_CASE("two runs in two PID namespaces (both PID 1) into one --out: both finish, one whole set",
          "[cli][faults][output]") {
  ScratchDir scratch("faults-pid-namespaces");
  const fs::path first = copy_bundle(scratch, "first");
  const fs::path second = copy_bundle(scratch, "second");
  const fs::path out = scratch / "out";
  SpawnOptions options;
  if (running_as_root() && std::system("/usr/bin/unshare --pid --fork true >/dev/null 2>&1") == 0) {
    options.wrapper = {"/usr/bin/unshare", "--pid", "--fork"};
  } else {
    WARN("PID namespaces need root; the two runs share this namespace");
  }
  const Spawned a = spawn_cli(scratch, {"run", first.string(), "--out", out.string(), "--quiet"}, options);
  const Spawned b = spawn_cli(scratch, {"run", second.string(), "--out", out.string(), "--quiet"}, options);
  const Finished done_a = wait_cli(a);
  const Finished done_b = wait_cli(b);
  INFO(done_a.result.err << done_b.result.err);
  CHECK(done_a.result.status == 0);  // one exited 3 when the other deleted its staging directory
  CHECK(done_b.result.status == 0);
  CHECK(names_in(out) == kRunOutputs);  // no staging directory left
  // One set: the report and the trace come from the same run.
  const std::string report_bundle = read_json(out / "report.json")["bundle"];
  CHECK(nanreplay::read_trace((out / "trace.h5").string()).header.bundle == report_bundle);
}

TEST_CASE("a checkpoint rewritten in place during a replay with its size and modification time restored: exit 2",
          "[cli][faults][mapped]") {
  ScratchDir scratch("faults-rewritten");
  const fs::path bundle = copy_bundle(scratch, "bundle");
  const fs::path out = scratch / "out";
  const std::string file = "steps/101/model.safetensors";
  const Spawned child = spawn_cli(scratch, {"run", bundle.string(), "--out", out.string(), "--threads", "1"},
                                  with_env({"NANREPLAY_TEST_PAUSE_AT_STEP=101"}));
  REQUIRE(wait_until_stopped(child.pid));  // step 101's checkpoint is mapped, its replay about to start
  struct stat was {};
  REQUIRE(::stat((bundle / file).c_str(), &was) == 0);
  std::string bytes = slurp(bundle / file);
  bytes[bytes.size() - 2] = static_cast<char>(bytes[bytes.size() - 2] ^ 0x01);  // one float of the last tensor
  {
    std::ofstream rewrite(bundle / file, std::ios::binary | std::ios::trunc);  // truncated, same inode
    rewrite.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  }
  const timespec times[2] = {was.st_atim, was.st_mtim};
  REQUIRE(::utimensat(AT_FDCWD, (bundle / file).c_str(), times, 0) == 0);
  struct stat now {};
  REQUIRE(::stat((bundle / file).c_str(), &now) == 0);
  REQUIRE(now.st_ino == was.st_ino);
  REQUIRE(now.st_size == was.st_size);
  REQUIRE(now.st_mtim.tv_nsec == was.st_mtim.tv_nsec);
  REQUIRE(::kill(child.pid, SIGCONT) == 0);
  const Finished done = wait_cli(child);
  check_one_error_line(done.result, {file + ": changed while being read", "change time moved"});
  CHECK_FALSE(fs::exists(out));
}

TEST_CASE("scratch left by a streamed run killed outright is removed by the next streamed run; live scratch is kept",
          "[cli][faults][stream]") {
  ScratchDir scratch("faults-stale-scratch");
  const fs::path parent = scratch / "scratch";
  fs::create_directories(parent / "nanreplay-scratch-live");
  const nanreplay::DirectoryLock live(parent / "nanreplay-scratch-live", false);  // another run, alive
  REQUIRE(live.held());
  const std::vector<std::string> args{"run", shared_clean_bundle().string(), "--out", (scratch / "out").string(),
                                      "--stream", "--scratch", parent.string(), "--no-probes", "--quiet"};
  const Spawned killed = spawn_cli(scratch, args, with_env({"NANREPLAY_TEST_PAUSE_AT_STEP=101"}));
  REQUIRE(wait_until_stopped(killed.pid));
  REQUIRE(::kill(killed.pid, SIGKILL) == 0);
  CHECK(wait_cli(killed).result.status == 128 + SIGKILL);
  const std::vector<std::string> left = names_in(parent);
  REQUIRE(left.size() == 2);  // SIGKILL leaves the killed run's scratch behind
  const CliResult next = run_cli(args);
  INFO(next.err);
  CHECK(next.status == 0);
  CHECK(names_in(parent) == std::vector<std::string>{"nanreplay-scratch-live"});
}
