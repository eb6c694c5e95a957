// The CLI's choice of OpenMP spin (cli/openmp_wait.cpp): commands that replay
// re-execute themselves with a short GOMP_SPINCOUNT where LibTorch's libgomp
// pool and OpenBLAS's pthread pool share the cores, and leave a user's own
// setting alone. libgomp prints the value it runs with under OMP_DISPLAY_ENV.
#include <catch2/catch.hpp>

#include "replay/replay_engine.h"
#include "tests/cli_harness.h"

using nanreplay_test::run_cli;
using nanreplay_test::ScratchDir;

namespace {

// The GOMP_SPINCOUNT libgomp reported last (the re-executed process reports after the first).
std::string last_spin_count(const std::string& err) {
  const std::string key = "GOMP_SPINCOUNT = '";
  const size_t at = err.rfind(key);
  if (at == std::string::npos) return "";
  const size_t begin = at + key.size();
  return err.substr(begin, err.find('\'', begin) - begin);
}

const std::string kNoUserSetting = "env -u GOMP_SPINCOUNT -u OMP_WAIT_POLICY OMP_DISPLAY_ENV=verbose";

}  // namespace

TEST_CASE("openmp spin: replaying commands run with a short spin unless the user chose one", "[cli]") {
  if (!nanreplay::blas_has_own_thread_pool()) {
    WARN("this LibTorch's BLAS has no pthread pool of its own: the CLI keeps libgomp's default");
    return;
  }
  ScratchDir dir("openmp-spin");
  const auto synth = run_cli({"synth", "clean-fp32", (dir / "bundle").string()}, kNoUserSetting);
  INFO(synth.err);
  REQUIRE(synth.status == 0);
  CHECK(last_spin_count(synth.err) == "10000");

  SECTION("a user's GOMP_SPINCOUNT is kept") {
    const auto run = run_cli({"run", (dir / "bundle").string(), "--out", (dir / "out").string(), "--quiet"},
                             "env -u OMP_WAIT_POLICY OMP_DISPLAY_ENV=verbose GOMP_SPINCOUNT=77");
    INFO(run.err);
    CHECK(run.status == 0);
    CHECK(last_spin_count(run.err) == "77");
  }
  SECTION("commands that do not replay start once, with libgomp's default") {
    const auto inspect = run_cli({"inspect", (dir / "bundle").string()}, kNoUserSetting);
    INFO(inspect.err);
    CHECK(inspect.status == 0);
    CHECK_FALSE(last_spin_count(inspect.err).empty());
    CHECK(last_spin_count(inspect.err) != "10000");
  }
}
