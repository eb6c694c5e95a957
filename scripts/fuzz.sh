#!/usr/bin/env bash
# Builds the libFuzzer targets in fuzz/ with Debian's clang (fuzzer, address and
# undefined sanitizers) from the torch-free loader sources only, then runs each
# for a bounded time from its seed corpus. Fails on any crash, sanitizer
# report, leak, timeout or uncaught exception.
#   scripts/fuzz.sh [SECONDS_PER_TARGET] [TARGET...]   (default: 60, all three)
# Environment: NANREPLAY_FUZZ_DIR (build and work dir, default build-fuzz/).
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
seconds="${1:-60}"
shift || true
targets=("$@")
((${#targets[@]})) || targets=(fuzz_manifest fuzz_step_state fuzz_safetensors_header)
work="${NANREPLAY_FUZZ_DIR:-$root/build-fuzz}"

cxx=""
for candidate in clang++-14 clang++; do
  if command -v "$candidate" >/dev/null; then cxx="$candidate"; break; fi
done
if [[ -z "$cxx" ]]; then
  echo "fuzz: clang++ not found (apt-get install clang libclang-rt-14-dev)" >&2
  exit 2
fi

# The parsers and what they call; none of it needs LibTorch, HDF5 or OpenSSL.
sources=(json_util manifest bundle_paths step_state safetensors mapped_file)
flags=(-std=c++17 -O1 -g -fno-omit-frame-pointer -I"$root"
       -fsanitize=address,undefined -fno-sanitize-recover=undefined)

mkdir -p "$work/obj" "$work/artifacts"
objects=()
for name in "${sources[@]}"; do
  src="$root/loaders/$name.cpp"
  obj="$work/obj/$name.o"
  # Rebuild only what changed (the headers are few; any newer header rebuilds all).
  if [[ ! -f "$obj" || "$src" -nt "$obj" || -n "$(find "$root/loaders" -name '*.h' -newer "$obj")" ]]; then
    "$cxx" "${flags[@]}" -fsanitize=fuzzer-no-link -c "$src" -o "$obj"
  fi
  objects+=("$obj")
done

export ASAN_OPTIONS="${ASAN_OPTIONS:-abort_on_error=1:detect_leaks=1}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"
status=0
for target in "${targets[@]}"; do
  "$cxx" "${flags[@]}" -fsanitize=fuzzer "$root/fuzz/$target.cpp" "${objects[@]}" -o "$work/$target"
  # New inputs go to a work corpus outside the repository; the seeds are read only.
  mkdir -p "$work/corpus/$target"
  echo "fuzz: $target for ${seconds}s"
  start=$(date +%s)
  if ! "$work/$target" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 \
      -max_len=65536 -dict="$root/fuzz/json.dict" -print_final_stats=1 \
      -artifact_prefix="$work/artifacts/$target-" \
      "$work/corpus/$target" "$root/fuzz/corpus/$target" >"$work/$target.log" 2>&1; then
    echo "fuzz: $target FAILED; the input is in $work/artifacts/, the log in $work/$target.log" >&2
    tail -n 40 "$work/$target.log" >&2
    status=1
    continue
  fi
  runs=$(grep -Eo 'stat::number_of_executed_units: *[0-9]+' "$work/$target.log" | grep -Eo '[0-9]+$' || echo "?")
  echo "fuzz: $target ok: $runs executions in $(( $(date +%s) - start ))s, no crash"
done
exit "$status"
