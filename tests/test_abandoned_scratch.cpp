// A streamed replay's scratch directory left by a process killed outright:
// found through the process's open descriptors while it lives, removed once
// it is gone, kept while it lives (replay/step/abandoned_scratch.h; the
// --nproc launcher does this for a worker it has to SIGKILL).
#include <catch2/catch.hpp>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>

#include "cli_harness.h"
#include "loaders/base/directory_lock.h"
#include "replay/step/abandoned_scratch.h"

namespace nanreplay {

namespace {

// A child process holding `dir`'s lock as a streamed replay does, stopped
// until killed; returns once it holds it.
pid_t child_holding_lock(const std::filesystem::path& dir) {
  int ready[2];
  REQUIRE(::pipe(ready) == 0);
  const pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    ::close(ready[0]);
    const DirectoryLock lock(dir, false);
    const char held = lock.held() ? 'y' : 'n';
    if (::write(ready[1], &held, 1) != 1) ::_exit(1);
    for (;;) ::pause();
  }
  ::close(ready[1]);
  char held = 0;
  REQUIRE(::read(ready[0], &held, 1) == 1);
  ::close(ready[0]);
  REQUIRE(held == 'y');
  return pid;
}

}  // namespace

TEST_CASE("a killed process's scratch directory: found while it lives, removed once it is gone", "[stream][scratch]") {
  const nanreplay_test::ScratchDir parent("abandoned");
  const std::filesystem::path dir = parent.path() / (std::string(kScratchPrefix) + "killed");
  std::filesystem::create_directories(dir);
  std::ofstream(dir / "rank-gradients-0.f32") << "x";
  const pid_t pid = child_holding_lock(dir);
  const std::vector<std::filesystem::path> held = scratch_dirs_held_by(pid);
  CHECK(std::find(held.begin(), held.end(), dir) != held.end());
  remove_if_abandoned(held);
  CHECK(std::filesystem::exists(dir));  // its owner lives
  ::kill(pid, SIGKILL);
  int status = 0;
  REQUIRE(::waitpid(pid, &status, 0) == pid);
  remove_if_abandoned(held);
  CHECK_FALSE(std::filesystem::exists(dir));
  CHECK(scratch_dirs_held_by(pid).empty());  // reaped: no descriptors to read
}

TEST_CASE("abandoned scratch in a parent: only unlocked directories of the scratch name go", "[stream][scratch]") {
  const nanreplay_test::ScratchDir parent("abandoned-parent");
  const std::filesystem::path left = parent.path() / (std::string(kScratchPrefix) + "left");
  const std::filesystem::path owned = parent.path() / (std::string(kScratchPrefix) + "owned");
  const std::filesystem::path other = parent.path() / "results";
  for (const auto& d : {left, owned, other}) std::filesystem::create_directories(d);
  const pid_t pid = child_holding_lock(owned);
  remove_abandoned_scratch(parent.path());
  CHECK_FALSE(std::filesystem::exists(left));
  CHECK(std::filesystem::exists(owned));
  CHECK(std::filesystem::exists(other));
  ::kill(pid, SIGKILL);
  int status = 0;
  REQUIRE(::waitpid(pid, &status, 0) == pid);
}

}  // namespace nanreplay
