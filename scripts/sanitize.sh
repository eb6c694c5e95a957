#!/usr/bin/env bash
# Builds the project in its own directory with AddressSanitizer and
# UndefinedBehaviorSanitizer (-DNANREPLAY_SANITIZE=ON) and runs the CTest
# suite there: unit tests, CLI end-to-end tests and the PyTorch cross-checks,
# all through instrumented nanreplay code. LibTorch itself is not instrumented,
# nor is the CUDA kernel (nvcc takes no -fsanitize; it is left out here).
#   scripts/sanitize.sh [CTEST ARGS...]     e.g. scripts/sanitize.sh -R loaders
# Environment: NANREPLAY_SANITIZE_DIR (default build-sanitize/), NANREPLAY_JOBS (2).
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build_dir="${NANREPLAY_SANITIZE_DIR:-$root/build-sanitize}"
jobs="${NANREPLAY_JOBS:-2}"

# Sanitizer runtime settings, exported before the build because
# catch_discover_tests runs the instrumented test binary to list its tests.
#  detect_leaks=0: LibTorch, OpenMP and HDF5 keep process-lifetime allocations
#    (operator registries, thread pools, type tables) that are never freed and
#    that LeakSanitizer, seeing every malloc, reports as leaks at exit; the
#    interrupt path also leaves through std::exit on purpose. A leak in our
#    own code is not a safety issue for a one-shot CLI; the fuzzers (which
#    run without LibTorch) keep leak detection on for the parsers.
#  abort_on_error=1, halt_on_error: any report fails the test that hit it.
#  strict_string_checks, detect_stack_use_after_return: cheap, catch more.
export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=0:abort_on_error=1:strict_string_checks=1:detect_stack_use_after_return=1}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"

# -O1 -g1: fast enough to run the end-to-end tests, line tables for reports,
# and far quicker to compile than -O2 -g over LibTorch's headers.
cmake -S "$root" -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g1" -DCMAKE_C_FLAGS_RELWITHDEBINFO="-O1 -g1" \
  -DNANREPLAY_SANITIZE=ON -DNANREPLAY_CUDA=OFF -DNANREPLAY_BUILD_BENCH=OFF
cmake --build "$build_dir" -j "$jobs"

cd "$build_dir"
ctest --output-on-failure -j "$jobs" "$@"
