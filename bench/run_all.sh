#!/usr/bin/env bash
# Runs every benchmark with the arguments docs/performance.md records and
# prints the issue's ratios, each measured side by side in one run:
#   1. statistics kernel / plain sum, / LibTorch abs().max()+isfinite().all()  (bench_stats)
#   2. replay step probes on / off                                              (bench_replay)
#   3. replay step / eager PyTorch (Debian's /usr/bin/python3, python3-torch)  (bench_replay)
#      2 and 3 for the dense llama and for its mixture-of-experts twin, and one
#      MoE layer / Hugging Face's Qwen3MoeSparseMoeBlock                      (bench_replay --model both)
#   4. peak RSS of a 10-step / a 1-step bundle                                  (bench_replay)
#   5. whole `nanreplay run` / whole eager PyTorch replay, 3 and 10 steps       (bench_whole_run)
#   6. OpenBLAS on OpenMP / on pthreads, replay step and whole run            (bench_blas.sh)
#   7. layer-streamed run: peak RSS 64 / 4 layers, time in memory / streamed   (bench_stream.py)
#      and a DeepSeek-V3-shaped MoE at 4 and 8 layers, in memory and streamed  (bench_moe_memory.py)
#   8. run across 2 processes (split by layers, by ranks) / one process         (bench_distributed.py)
#   9. bisect / run: replays and wall time, rolled-forward and per-step windows (bench_bisect.py)
#  10. replay step and whole run of each model family / plain llama; with
#      NANREPLAY_BENCH_BASELINE_CLI=OLD also plain llama's, this CLI / OLD         (bench_families.py)
# The first run writes the bundles of a hidden-512, 8-layer llama (~4 GB) and
# a 1-step bundle of its MoE twin (~1 GB) into the work directory and
# reuses them afterwards.
#   bench/run_all.sh [BUILD_DIR] [WORK_DIR]     (defaults: build, bench-work)
# Environment: NANREPLAY_BENCH_THREADS (2), NANREPLAY_BENCH_REPS (9), NANREPLAY_BENCH_BASELINE_CLI (unset).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${1:-$root/build}"
work="${2:-$root/bench-work}"
threads="${NANREPLAY_BENCH_THREADS:-2}"
reps="${NANREPLAY_BENCH_REPS:-9}"

cmake --build "$build" --target bench_stats bench_replay bench_whole_run nanreplay
echo "== statistics kernel (256 MiB buffers, $threads threads)"
"$build/bench/bench_stats" 256 "$reps" "$threads"
echo
echo "== replay, dense and MoE (hidden 512, 8 layers, seq 256; 8 experts, top 2; $threads threads)"
"$build/bench/bench_replay" --model both --work "$work" --reps "$reps" --threads "$threads"
echo
echo "== whole run against a whole eager replay (27M-parameter llama; $threads threads)"
"$build/bench/bench_whole_run" --work "$work" --reps "$reps" --threads "$threads"
echo
echo "== OpenBLAS on OpenMP against OpenBLAS on pthreads"
NANREPLAY_BENCH_REPS="$reps" NANREPLAY_BENCH_THREADS="$threads" "$root/bench/bench_blas.sh" "$build" "$work"
echo
echo "== layer by layer: peak RSS against depth, time against the in-memory replay (hidden 512, seq 128)"
/usr/bin/python3 "$root/bench/bench_stream.py" --nanreplay "$build/nanreplay" --work "$work/stream" \
  --reps "$(( reps < 5 ? reps : 5 ))" --threads "$threads"
echo; echo "== a DeepSeek-V3-shaped mixture of experts (hidden 512, 256 experts, top 8): peak RSS in memory and streamed"
/usr/bin/python3 "$root/bench/bench_moe_memory.py" --nanreplay "$build/nanreplay" --work "$work/moe-memory"
echo; echo "== split across 2 local processes, by layers and by data-parallel ranks, against one (hidden 512, 8 layers, 4 ranks, 3 steps; the cores shared evenly)"; /usr/bin/python3 "$root/bench/bench_distributed.py" --nanreplay "$build/nanreplay" --work "$work/distributed" --reps "$(( reps < 5 ? reps : 5 ))"
echo; echo "== bisect against run, rolled forward from one checkpoint and per step (synthetic presets; $threads threads)"
/usr/bin/python3 "$root/bench/bench_bisect.py" --nanreplay "$build/nanreplay" --work "$work/bisect" \
  --reps "$(( reps < 5 ? reps : 5 ))" --threads "$threads"
echo; echo "== model families against plain llama, one replay step (hidden 512, 8 layers, seq 256, micro-batch 2; $threads threads)"
/usr/bin/python3 "$root/bench/bench_families.py" --nanreplay "$build/nanreplay" --work "$work/families" \
  --reps "$reps" --threads "$threads" ${NANREPLAY_BENCH_BASELINE_CLI:+--baseline-cli "$NANREPLAY_BENCH_BASELINE_CLI"}
