#!/usr/bin/env bash
# One entry point for a fresh Debian 12 machine: installs whatever is missing,
# builds nanreplay in Release (-j2), then either runs the demo incident or the
# whole test suite.
#   scripts/bootstrap.sh demo [DIR]   install, build the CLI alone, run `nanreplay demo`
#   scripts/bootstrap.sh test         install, build once (Release, no benchmarks),
#                                     run every test against that one build: the
#                                     Catch2 suite (unit and CLI end to end), the
#                                     PyTorch cross-checks, then the fuzzers (bounded,
#                                     under ASan and UBSan)
#   scripts/bootstrap.sh build        install and build everything, benchmarks included
# Environment for `test`: NANREPLAY_FUZZ_SECONDS (per fuzz target, default 15;
# 0 skips), NANREPLAY_SANITIZE (default 0; 1 also builds the ASan + UBSan tree
# and runs the Catch2 suite there, scripts/sanitize.sh: about twice CI's
# budget on two cores, so it is a developer's check, CONTRIBUTING.md).
set -euo pipefail

mode="${1:-demo}"
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build_dir="${NANREPLAY_BUILD_DIR:-$root/build}"
jobs="${NANREPLAY_JOBS:-2}"

# Debian packages the build, the tests and the PyTorch cross-checks need.
# libopenblas0-pthread: without an OpenBLAS LibTorch falls back to the reference BLAS (~35x slower
# matmuls); libopenblas0-openmp: the one nanreplay loads, on LibTorch's own OpenMP pool
# (docs/performance.md, bench/bench_blas.sh); the pthread one stays the system's default.
packages=(
  g++ cmake ninja-build pkg-config
  libtorch-dev libgloo-dev libopenblas0-pthread libopenblas0-openmp
  libhdf5-dev hdf5-tools
  libcxxopts-dev nlohmann-json3-dev catch2 libssl-dev
  python3-torch python3-h5py python3-numpy
  clang libclang-rt-14-dev
  chromium
)
# chromium: headless rendering check of report.html (tests/py/test_html_report.py).
# clang + libclang-rt-14-dev: libFuzzer and the sanitizer runtimes for scripts/fuzz.sh.

# Each stage prints its wall and CPU time (children's user + sys, from the
# `times` builtin), so CI's budget can be watched stage by stage even on a
# shared runner where wall time alone misleads.
times_file="$(mktemp)"
trap 'rm -f "$times_file"' EXIT
read_children_cpu() {  # sets children_cpu; `times` must run in this shell, not in a $(...) subshell
  times >"$times_file"
  children_cpu=$(awk 'END { total = 0
    for (i = 1; i <= 2; i++) { split($i, part, "m"); sub("s", "", part[2]); total += part[1] * 60 + part[2] }
    printf "%d", total }' "$times_file")
}
read_children_cpu
stage_start=$SECONDS
stage_cpu=$children_cpu
stage() {
  read_children_cpu
  echo "bootstrap: [$1] took $((SECONDS - stage_start))s wall, $((children_cpu - stage_cpu))s CPU"
  stage_start=$SECONDS
  stage_cpu=$children_cpu
}

missing=()
for pkg in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if ((${#missing[@]})); then
  echo "bootstrap: installing ${missing[*]}"
  sudo_cmd=()
  [[ $(id -u) -eq 0 ]] || sudo_cmd=(sudo)
  "${sudo_cmd[@]}" apt-get update -qq
  DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
stage "install packages"

sanitize="${NANREPLAY_SANITIZE:-0}"
# The test suite needs no benchmark: CI builds one tree, and nothing in it twice.
bench=ON
[[ "$mode" == test ]] && bench=OFF
cmake -S "$root" -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=Release -DNANREPLAY_BUILD_BENCH="$bench"
if [[ "$mode" == demo ]]; then
  # The demo runs the CLI alone: the tests and benchmarks wait for `test` or `build`.
  cmake --build "$build_dir" -j "$jobs" --target nanreplay
else
  cmake --build "$build_dir" -j "$jobs"
fi
stage "build (Release)"

case "$mode" in
  demo)
    "$build_dir/nanreplay" demo "${2:-nanreplay-demo}"
    stage "demo"
    echo "bootstrap: the demo took ${SECONDS}s in all; the CLI is $build_dir/nanreplay" \
      "(cmake --install $build_dir puts it on PATH)"
    ;;
  test)
    # One CTest run for both suites: the longest tests start first
    # (tests/CMakeLists.txt gives CTest their costs), so -j2 never ends on one alone.
    (cd "$build_dir" && ctest --output-on-failure -j "$jobs")
    stage "test suite (Release): Catch2 units and CLI end to end, PyTorch cross-checks"
    if [[ "$sanitize" != 0 ]]; then
      "$root/scripts/sanitize.sh" -E '^py\.'
      stage "sanitizer build and Catch2 suite (ASan + UBSan)"
    fi
    # A short smoke run per fuzzer keeps CI within its budget; fuzz longer with scripts/fuzz.sh SECONDS.
    fuzz_seconds="${NANREPLAY_FUZZ_SECONDS:-15}"
    if ((fuzz_seconds > 0)); then
      "$root/scripts/fuzz.sh" "$fuzz_seconds"
      stage "fuzzers, ${fuzz_seconds}s each (ASan + UBSan)"
    fi
    echo "bootstrap: all stages passed in ${SECONDS}s"
    ;;
  build)
    ;;
  *)
    echo "usage: scripts/bootstrap.sh demo [DIR] | test | build" >&2
    exit 2
    ;;
esac
