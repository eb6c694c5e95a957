#!/usr/bin/env bash
# The three Python sweeps over every synthetic preset, not the representative
# set CI runs (tests/py/preset_sweep.py): streamed against in memory, split
# across processes, minimized. About half an hour on two cores.
#   bench/sweep_presets.sh [BUILD_DIR] [WORK_DIR]    (defaults: build, sweep-work)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${1:-$root/build}"
work="${2:-$root/sweep-work}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}" GOMP_SPINCOUNT=10000 NO_COLOR=1
cmake --build "$build" --target nanreplay
status=0
for sweep in test_stream_presets test_distributed test_minimize_presets; do
  echo "== $sweep --all"
  start=$SECONDS
  /usr/bin/python3 "$root/tests/py/$sweep.py" --cli "$build/nanreplay" --work "$work/$sweep" --all || status=1
  echo "== $sweep: $((SECONDS - start)) s"
done
exit "$status"
