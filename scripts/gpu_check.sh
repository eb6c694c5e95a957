#!/usr/bin/env bash
# The GPU check, in two halves, for a GPU machine that has no network:
#
#   scripts/gpu_check.sh prepare   on a Debian 12 machine with network: downloads
#                                  the Debian packages the build needs beyond a
#                                  CUDA PyTorch (HDF5, cxxopts, nlohmann-json,
#                                  Catch2, OpenSSL headers) into .gpu-deps/debs/
#   scripts/gpu_check.sh run       on the GPU machine: unpacks them into
#                                  .gpu-deps/root/ (never into /), configures
#                                  against the CUDA LibTorch of the Python that
#                                  has torch, builds, runs the tests tagged gpu
#                                  and the CLI on a GPU, end to end
#
# Copy or carry .gpu-deps/ along with the checkout. Logs go to $OUT (when set)
# or build-gpu/, and the exit status is that of the first failing stage.
# Environment: NANREPLAY_GPU_PYTHON (default: the first python3 whose torch has
# CUDA), NANREPLAY_GPU_BUILD (default build-gpu/), NANREPLAY_JOBS (default nproc).
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
deps="$root/.gpu-deps"
# libgloo-dev: Gloo's headers only (a PyTorch wheel ships none; its Gloo code is inside libtorch_cpu).
packages=(libgloo-dev libhdf5-dev libhdf5-103-1 libhdf5-hl-100 libhdf5-cpp-103-1 libsz2 libaec0
  libcxxopts-dev nlohmann-json3-dev catch2 libssl-dev libssl3
  libcurl4 libnghttp2-14 librtmp1 libssh2-1 libpsl5 libbrotli1 libldap-2.5-0 libsasl2-2
  libidn2-0 libunistring2)

prepare() {
  mkdir -p "$deps/debs"
  (cd "$deps/debs" && apt-get download "${packages[@]}")
  echo "gpu_check: $(ls "$deps/debs" | wc -l) packages in $deps/debs ($(du -sh "$deps/debs" | cut -f 1))"
}

find_cuda_python() {
  local candidate
  for candidate in "${NANREPLAY_GPU_PYTHON:-}" python3 /opt/torch/.venv/bin/python3 /usr/bin/python3; do
    [[ -n "$candidate" ]] || continue
    if "$candidate" -c 'import torch, sys; sys.exit(0 if torch.version.cuda else 1)' 2>/dev/null; then
      echo "$candidate"
      return
    fi
  done
  echo "gpu_check: no python3 with a CUDA build of torch found (set NANREPLAY_GPU_PYTHON)" >&2
  exit 2
}

run() {
  local logs="${OUT:-$root/${NANREPLAY_GPU_BUILD:-build-gpu}-logs}"
  local build="$root/${NANREPLAY_GPU_BUILD:-build-gpu}"
  local prefix="$deps/root"
  local jobs="${NANREPLAY_JOBS:-$(nproc)}"
  mkdir -p "$logs" "$prefix"
  exec > >(tee "$logs/gpu_check.log") 2>&1

  echo "== machine"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
  (. /etc/os-release && echo "$PRETTY_NAME"); g++ --version | head -n 1; cmake --version | head -n 1

  echo "== unpack $(ls "$deps"/debs/*.deb | wc -l) Debian packages into $prefix"
  for deb in "$deps"/debs/*.deb; do dpkg-deb -x "$deb" "$prefix"; done
  local arch_lib="$prefix/usr/lib/x86_64-linux-gnu"
  export LD_LIBRARY_PATH="$arch_lib:$arch_lib/hdf5/serial${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

  local python torch_prefix
  python="$(find_cuda_python)"
  torch_prefix="$("$python" -c 'import torch.utils; print(torch.utils.cmake_prefix_path)')"
  "$python" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "devices", torch.cuda.device_count(), "cxx11 abi", torch.compiled_with_cxx11_abi())'

  echo "== configure and build"
  cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_PREFIX_PATH="$torch_prefix;$prefix/usr" \
    -DHDF5_ROOT="$arch_lib/hdf5/serial" \
    -DOPENSSL_INCLUDE_DIR="$prefix/usr/include" \
    -DOPENSSL_CRYPTO_LIBRARY="$arch_lib/libcrypto.so" -DOPENSSL_SSL_LIBRARY="$arch_lib/libssl.so" \
    -DCMAKE_CXX_FLAGS="-isystem $prefix/usr/include/x86_64-linux-gnu" \
    -DNANREPLAY_PYTHON="$python" -DNANREPLAY_CUDA=ON -DCMAKE_EXPORT_COMPILE_COMMANDS=ON
  local started=$SECONDS
  # The CLI and the GPU tests only: the CPU suite runs in CI, not on the GPU's time.
  local targets=(nanreplay nanreplay_gpu_replay_tests)
  # The CUDA statistics kernel's own tests exist when nvcc was found.
  ninja -C "$build" -t targets all | grep -q '^nanreplay_gpu_tests:' && targets+=(nanreplay_gpu_tests)
  cmake --build "$build" -j "$jobs" --target "${targets[@]}"
  echo "gpu_check: build took $((SECONDS - started))s"
  # The flags that decide struct layouts, per target: they must agree.
  "$python" - "$build/compile_commands.json" <<'PY'
import json, re, sys
for entry in json.load(open(sys.argv[1])):
    if re.search(r"(synthetic_bundle|replay_engine|step|test_gpu_replay)\.cpp$", entry["file"]):
        flags = sorted(set(re.findall(r"(-std=\S+|-D_GLIBCXX\S*|-fsanitize\S*|-m\S+)", entry["command"])))
        print(entry["file"].split("/")[-1], " ".join(flags))
PY

  # Two OpenMP runtimes in one process (the compiler's libgomp and the wheel's
  # own) crash at teardown; CMake links the wheel's. Exactly one should show.
  echo "OpenMP runtimes the replay tests load:"
  ldd "$build/tests/nanreplay_gpu_replay_tests" | grep -Ei 'gomp|libomp' || echo "  (none found by ldd)"

  local failed=0
  echo "== the C++ runtime comes before LibTorch in every executable"
  local executables=("$build/nanreplay" "$build/tests/nanreplay_gpu_replay_tests")
  [[ -x "$build/tests/nanreplay_gpu_tests" ]] && executables+=("$build/tests/nanreplay_gpu_tests")
  "$root/scripts/check_cxx_runtime_first.sh" "${executables[@]}" || failed=1

  echo "== tests tagged gpu"
  (cd "$build" && ctest -L gpu --output-on-failure --timeout 300) || failed=1
  if ((failed)); then
    # Each test case on its own, so one crash hides no other result; no gdb on
    # such machines, but cuda-gdb debugs host code too: where did it stop?
    local name
    while IFS= read -r name; do
      [[ -n "$name" ]] || continue
      echo "-- $name"
      name="${name//,/\\,}"  # a comma separates Catch test specs
      if ! "$build/tests/nanreplay_gpu_replay_tests" "$name"; then
        # With one OpenMP thread no runtime starts a pool: does it pass then?
        echo "-- $name, again with OMP_NUM_THREADS=1"
        OMP_NUM_THREADS=1 "$build/tests/nanreplay_gpu_replay_tests" "$name" && echo "   passes with one OpenMP thread"
        command -v cuda-gdb >/dev/null &&
          cuda-gdb -batch -ex run -ex bt --args "$build/tests/nanreplay_gpu_replay_tests" "$name" 2>&1 | tail -n 40
      fi
    done < <("$build/tests/nanreplay_gpu_replay_tests" --list-test-names-only | grep -v '^ *$' | grep -v 'matching test')
  fi

  echo "== the CLI on the GPU, end to end"
  NANREPLAY_CLI="$build/nanreplay" NANREPLAY_GPU_LOGS="$logs" "$root/scripts/gpu_cli_check.sh" || failed=1

  echo "== the GPU benchmark (bench/bench_gpu.py): is the replay GPU-bound?"
  "$python" "$root/bench/bench_gpu.py" --cli "$build/nanreplay" --work "$build/bench-gpu" \
    --json "$logs/bench_gpu.json" || failed=1
  if ((failed)); then
    echo "gpu_check: FAILED (see above)"
    return 1
  fi
  echo "gpu_check: all GPU checks passed"
}

case "${1:-}" in
  prepare) prepare ;;
  run) run ;;
  *) echo "usage: scripts/gpu_check.sh prepare | run" >&2; exit 2 ;;
esac
