#!/usr/bin/env bash
# Which OpenBLAS a replay should load, measured side by side in one run:
#   openmp   Debian's libopenblas0-openmp: matmuls on libgomp, the pool
#            LibTorch's element-wise ops already use (one pool, no spin fight)
#   pthread  Debian's libopenblas0-pthread (its own pool) with the short
#            libgomp spin (GOMP_SPINCOUNT=10000) that pool needs on 2 cores
#   openmp-short-spin  the OpenMP build with that short spin too (what a user
#            sharing the machine with other busy processes may set)
# Each repetition runs, alternating which goes first, both libraries' replay
# step (bench_replay --only on, median of its 3 steps) and a whole
# `nanreplay run` of a 3-step bundle (start to exit); medians and ratios at
# the end. The library is chosen with LD_LIBRARY_PATH, which comes before the
# executables' own RUNPATH.
#   bench/bench_blas.sh [BUILD_DIR] [WORK_DIR]   (defaults: build, bench-work)
# Environment: NANREPLAY_BENCH_REPS (5), NANREPLAY_BENCH_THREADS (2).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${1:-$root/build}"
work="${2:-$root/bench-work}"
reps="${NANREPLAY_BENCH_REPS:-5}"
threads="${NANREPLAY_BENCH_THREADS:-2}"
lib=/usr/lib/x86_64-linux-gnu
for kind in openmp pthread; do
  [[ -f $lib/openblas-$kind/libblas.so.3 ]] || { echo "bench_blas: install libopenblas0-$kind" >&2; exit 2; }
done
[[ -x $build/nanreplay && -x $build/bench/bench_replay ]] ||
  { echo "bench_blas: build first: cmake --build $build --target nanreplay bench_replay" >&2; exit 2; }
"$build/bench/bench_replay" --work "$work" --only on --reps 1 --threads "$threads" > /dev/null  # writes the bundle once
bundle="$(ls -d "$work"/llama-h512-*-10steps | head -n 1)"
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT

with_blas() {  # KIND COMMAND...: the command with that OpenBLAS and its OpenMP setting
  local kind=$1
  shift
  if [[ $kind == openmp ]]; then
    env -u GOMP_SPINCOUNT -u OMP_WAIT_POLICY LD_LIBRARY_PATH="$lib/openblas-openmp" "$@"
  elif [[ $kind == openmp-short-spin ]]; then
    env -u OMP_WAIT_POLICY GOMP_SPINCOUNT=10000 LD_LIBRARY_PATH="$lib/openblas-openmp" "$@"
  else
    env -u OMP_WAIT_POLICY GOMP_SPINCOUNT=10000 LD_LIBRARY_PATH="$lib/openblas-pthread" "$@"
  fi
}
step_seconds() {  # KIND: median of 3 replay steps
  with_blas "$1" "$build/bench/bench_replay" --work "$work" --only on --reps 3 --threads "$threads" |
    awk '/replay step, probes on/ {print $(NF-1)}' | sort -g | sed -n 2p
}
run_seconds() {  # KIND: a whole `nanreplay run` of the bundle's first 3 steps
  local start end
  start=$(date +%s.%N)
  with_blas "$1" "$build/nanreplay" run "$bundle" --steps 100-102 --out "$out/$1" --quiet --threads "$threads" > /dev/null
  end=$(date +%s.%N)
  awk -v a="$start" -v b="$end" 'BEGIN {printf "%.3f", b - a}' 
}
median() { sort -g | awk '{v[NR] = $1} END {print v[int((NR + 1) / 2)]}'; }

declare -A steps runs
for ((i = 0; i < reps; i++)); do
  kinds=(openmp pthread openmp-short-spin)
  order=("${kinds[@]:i % 3}" "${kinds[@]:0:i % 3}")
  for kind in "${order[@]}"; do
    steps[$kind]+="$(step_seconds "$kind") "
    runs[$kind]+="$(run_seconds "$kind") "
  done
done
for kind in openmp pthread openmp-short-spin; do
  s=$(tr ' ' '\n' <<< "${steps[$kind]}" | grep . | median)
  r=$(tr ' ' '\n' <<< "${runs[$kind]}" | grep . | median)
  printf '%-17s replay step %.3f s (all: %s)  whole run, 3 steps %.3f s (all: %s)\n' "$kind" "$s" "${steps[$kind]}" "$r" "${runs[$kind]}"
  eval "median_step_${kind//-/_}=$s median_run_${kind//-/_}=$r"
done
ratio() { awk -v a="$1" -v b="$2" 'BEGIN {printf "%.3f", a / b}'; }
echo "RATIO replay step, openmp / pthread+spin: $(ratio "$median_step_openmp" "$median_step_pthread")"
echo "RATIO whole run,   openmp / pthread+spin: $(ratio "$median_run_openmp" "$median_run_pthread")"
echo "RATIO replay step, openmp with the short spin / pthread+spin: $(ratio "$median_step_openmp_short_spin" "$median_step_pthread")"
echo "RATIO whole run,   openmp with the short spin / pthread+spin: $(ratio "$median_run_openmp_short_spin" "$median_run_pthread")"
