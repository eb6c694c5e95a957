#!/usr/bin/env bash
# Runs every benchmark with the arguments docs/performance.md records and
# prints the issue's ratios, each measured side by side in one run:
#   1. statistics kernel / plain sum, / LibTorch abs().max()+isfinite().all()  (bench_stats)
#   2. replay step probes on / off                                              (bench_replay)
#   3. replay step / eager PyTorch (Debian's /usr/bin/python3, python3-torch)  (bench_replay)
#   4. peak RSS of a 10-step / a 1-step bundle                                  (bench_replay)
# The first run writes two bundles of a hidden-512, 8-layer llama (~4 GB) into
# the work directory and reuses them afterwards.
#   bench/run_all.sh [BUILD_DIR] [WORK_DIR]     (defaults: build, bench-work)
# Environment: NANREPLAY_BENCH_THREADS (2), NANREPLAY_BENCH_REPS (9).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${1:-$root/build}"
work="${2:-$root/bench-work}"
threads="${NANREPLAY_BENCH_THREADS:-2}"
reps="${NANREPLAY_BENCH_REPS:-9}"

cmake --build "$build" --target bench_stats bench_replay nanreplay
echo "== statistics kernel (256 MiB buffers, $threads threads)"
"$build/bench/bench_stats" 256 "$reps" "$threads"
echo
echo "== replay (hidden 512, 8 layers, seq 256; $threads threads)"
"$build/bench/bench_replay" --work "$work" --reps "$reps" --threads "$threads"
