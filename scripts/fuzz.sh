#!/usr/bin/env bash
# Builds the libFuzzer targets in fuzz/ with Debian's clang (fuzzer, address and
# undefined sanitizers) from torch-free sources only, then runs each for a
# bounded time from its seed corpus. Fails on any crash, sanitizer report,
# leak, timeout or uncaught exception.
#   scripts/fuzz.sh [SECONDS_PER_TARGET] [TARGET...]   (default: 60, all four)
# NANREPLAY_FUZZ_TRACE_RESEAL=1 also fuzzes HDF5's parser behind a valid
# integrity block (not in CI: each resealed input costs a fork; see fuzz_trace_reader.cpp).
# Environment: NANREPLAY_FUZZ_DIR (build and work dir, default build-fuzz/).
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
seconds="${1:-60}"
shift || true
targets=("$@")
((${#targets[@]})) || targets=(fuzz_manifest fuzz_step_state fuzz_safetensors_header fuzz_trace_reader)
work="${NANREPLAY_FUZZ_DIR:-$root/build-fuzz}"

cxx=""
for candidate in clang++-14 clang++; do
  if command -v "$candidate" >/dev/null; then cxx="$candidate"; break; fi
done
if [[ -z "$cxx" ]]; then
  echo "fuzz: clang++ not found (apt-get install clang libclang-rt-14-dev)" >&2
  exit 2
fi

# The parsers and what they call; none of it needs LibTorch. The trace reader
# also links Debian's HDF5 (uninstrumented, like everywhere else) and OpenSSL.
parsers=(loaders/base/json_util loaders/arch/manifest_values loaders/arch/model_options loaders/arch/llama_options loaders/arch/latent_attention_option loaders/arch/mtp_option loaders/arch/moe_option loaders/bundle/manifest loaders/bundle/optimizer_manifest loaders/bundle/spike_settings loaders/bundle/provenance loaders/bundle/bundle_paths loaders/bundle/step_state loaders/formats/safetensors
         loaders/base/mapped_file loaders/base/mapping_faults)
trace_reader=(reports/outputs/trace/trace_writer reports/outputs/trace/trace_file_driver reports/outputs/trace/trace_reader reports/outputs/trace/trace_parse_isolation reports/outputs/trace/trace_integrity loaders/base/sha256 probes/probe_record probes/sites
             probes/param_table loaders/arch/manifest_values loaders/arch/model_options loaders/arch/llama_options loaders/arch/latent_attention_option loaders/arch/mtp_option loaders/arch/moe_option loaders/bundle/manifest loaders/bundle/optimizer_manifest loaders/bundle/spike_settings loaders/bundle/provenance loaders/base/json_util loaders/bundle/bundle_paths)
hdf5_include="$(pkg-config --cflags-only-I hdf5 2>/dev/null || echo -I/usr/include/hdf5/serial)"
hdf5_libs="$(pkg-config --libs-only-L hdf5 2>/dev/null || echo -L/usr/lib/x86_64-linux-gnu/hdf5/serial)"
flags=(-std=c++17 -O1 -g -fno-omit-frame-pointer -I"$root" $hdf5_include
       -fsanitize=address,undefined -fno-sanitize-recover=undefined)

mkdir -p "$work/obj" "$work/artifacts"
jobs="${NANREPLAY_JOBS:-2}"
# Sources (paths relative to the repository, without .cpp) to their objects,
# appended to the array named first; what changed is compiled, $jobs at a time
# (any newer header rebuilds all).
stale=()
collect() {
  local -n into=$1
  shift
  local name src obj
  for name in "$@"; do
    src="$root/$name.cpp"
    obj="$work/obj/${name//\//_}.o"
    if [[ ! -f "$obj" || "$src" -nt "$obj" ||
          -n "$(find "$root/loaders" "$root/reports" "$root/probes" "$root/kernels" -name '*.h' -newer "$obj")" ]]; then
      [[ " ${stale[*]} " == *" $name "* ]] || stale+=("$name")
    fi
    into+=("$obj")
  done
}
parser_objects=()
trace_objects=()
collect parser_objects "${parsers[@]}"
collect trace_objects "${trace_reader[@]}"
running=0
for name in "${stale[@]}"; do
  "$cxx" "${flags[@]}" -fsanitize=fuzzer-no-link -c "$root/$name.cpp" -o "$work/obj/${name//\//_}.o" &
  running=$((running + 1))
  if ((running >= jobs)); then
    wait -n
    running=$((running - 1))
  fi
done
while ((running > 0)); do
  wait -n
  running=$((running - 1))
done

export ASAN_OPTIONS="${ASAN_OPTIONS:-abort_on_error=1:detect_leaks=1}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"
# One target: link it, fuzz it for $seconds; returns nonzero on any finding.
fuzz_one() {
  local target=$1
  local objects=("${parser_objects[@]}")
  local libraries=()
  local options=(-max_len=65536 -dict="$root/fuzz/json.dict")
  local run_env=()
  if [[ "$target" == fuzz_trace_reader ]]; then
    objects=("${trace_objects[@]}")
    libraries=($hdf5_libs -lhdf5 -lcrypto)
    # The seeds are real traces of up to ~70 KB. For NANREPLAY_FUZZ_TRACE_RESEAL=1
    # (fuzz_trace_reader.cpp), where inputs reach HDF5 (not instrumented): it
    # sizes some allocations from a damaged file's headers and checks for
    # failure, so a huge malloc fails as it does outside the sanitizer instead
    # of being reported; the blocks HDF5 itself leaks on those paths are
    # ignored; per-input leak checks are off (HDF5's free lists make every
    # input look like it leaked), leaks are still checked at exit.
    options=(-max_len=131072 -malloc_limit_mb=1048576 -detect_leaks=0)
    run_env=(ASAN_OPTIONS="$ASAN_OPTIONS:allocator_may_return_null=1"
             LSAN_OPTIONS="suppressions=$root/fuzz/lsan_hdf5.supp")
  fi
  "$cxx" "${flags[@]}" -fsanitize=fuzzer "$root/fuzz/$target.cpp" "${objects[@]}" "${libraries[@]}" \
    -o "$work/$target" || return 1
  # New inputs go to a work corpus outside the repository; the seeds are read only.
  mkdir -p "$work/corpus/$target"
  echo "fuzz: $target for ${seconds}s"
  local start
  start=$(date +%s)
  if ! env "${run_env[@]}" "$work/$target" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 \
      "${options[@]}" -print_final_stats=1 \
      -artifact_prefix="$work/artifacts/$target-" \
      "$work/corpus/$target" "$root/fuzz/corpus/$target" >"$work/$target.log" 2>&1; then
    echo "fuzz: $target FAILED; the input is in $work/artifacts/, the log in $work/$target.log" >&2
    tail -n 40 "$work/$target.log" >&2
    return 1
  fi
  local runs
  runs=$(grep -Eo 'stat::number_of_executed_units: *[0-9]+' "$work/$target.log" | grep -Eo '[0-9]+$' || echo "?")
  echo "fuzz: $target ok: $runs executions in $(( $(date +%s) - start ))s, no crash"
}

# $jobs targets at a time: each fuzzer is one process, so two cores fuzz two
# targets in the wall time of one (CI's budget).
status=0
pending=()
for target in "${targets[@]}"; do
  fuzz_one "$target" &
  pending+=($!)
  if ((${#pending[@]} >= jobs)); then
    wait "${pending[0]}" || status=1
    pending=("${pending[@]:1}")
  fi
done
for pid in "${pending[@]}"; do
  wait "$pid" || status=1
done
exit "$status"
