// The BLAS a replay runs on (CMakeLists.txt, nanreplay_use_openmp_blas):
// where Debian's OpenMP build of OpenBLAS is installed, the executables load
// it before LibTorch asks for libblas.so.3, so matrix products run on
// LibTorch's own libgomp pool. A replay then starts once (libgomp reports its
// settings once per process start) and runs with the user's OpenMP settings
// as given. libgomp prints them under OMP_DISPLAY_ENV.
#include <catch2/catch.hpp>

#include <filesystem>

#include "replay/step/runtime.h"
#include "tests/cli_harness.h"

using nanreplay_test::run_cli;
using nanreplay_test::ScratchDir;

namespace {

size_t count_of(const std::string& text, const std::string& what) {
  size_t count = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++count;
  return count;
}

// The GOMP_SPINCOUNT libgomp reported.
std::string spin_count(const std::string& err) {
  const std::string key = "GOMP_SPINCOUNT = '";
  const size_t at = err.rfind(key);
  if (at == std::string::npos) return "";
  const size_t begin = at + key.size();
  return err.substr(begin, err.find('\'', begin) - begin);
}

const bool kOpenmpBlasInstalled = std::filesystem::exists(NANREPLAY_OPENMP_BLAS_DIR "/libblas.so.3");

}  // namespace

TEST_CASE("blas: matrix products run on LibTorch's OpenMP pool where the OpenMP OpenBLAS is installed", "[cli]") {
  if (!kOpenmpBlasInstalled) {
    WARN("libopenblas0-openmp is not installed: the system BLAS is used (scripts/bootstrap.sh installs it)");
    return;
  }
  CHECK(nanreplay::blas_in_use().threading == "OpenMP");  // this test binary links it as the CLI does
  const auto version = run_cli({"version"});
  REQUIRE(version.status == 0);
  CHECK(version.out.find("(threads: OpenMP), " NANREPLAY_OPENMP_BLAS_DIR "/") != std::string::npos);
}

TEST_CASE("blas: a replay starts once and keeps the user's OpenMP settings", "[cli]") {
  ScratchDir dir("blas");
  const std::string display = "env -u OMP_WAIT_POLICY -u GOMP_SPINCOUNT OMP_DISPLAY_ENV=verbose";
  const auto synth = run_cli({"synth", "clean-fp32", (dir / "bundle").string()}, display);
  INFO(synth.err);
  REQUIRE(synth.status == 0);
  CHECK(count_of(synth.err, "OPENMP DISPLAY ENVIRONMENT BEGIN") == 1);
  CHECK(spin_count(synth.err) == "300000");  // libgomp's own default: nothing set behind the user's back

  const auto run = run_cli({"run", (dir / "bundle").string(), "--out", (dir / "out").string(), "--quiet"},
                           display + " GOMP_SPINCOUNT=77");
  INFO(run.err);
  CHECK(run.status == 0);
  CHECK(count_of(run.err, "OPENMP DISPLAY ENVIRONMENT BEGIN") == 1);
  CHECK(spin_count(run.err) == "77");
}
