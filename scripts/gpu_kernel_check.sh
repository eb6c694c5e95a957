#!/usr/bin/env bash
# Builds and runs the CUDA statistics kernel's [gpu] tests and its benchmark
# on a GPU machine that has nvcc and g++ but not necessarily CMake, LibTorch,
# HDF5 or Catch2 (the kernel and its tests need none of them). Binaries go to
# build-gpu/; ones already there (built on another machine) are reused when
# they start. Catch2's single header comes from /usr/include/catch2 or
# build-gpu/catch2/. The CMake build (NANREPLAY_CUDA=AUTO/ON) builds the same
# targets: nanreplay_gpu_tests (ctest -L gpu) and bench_stats_cuda.
#   scripts/gpu_kernel_check.sh [--rebuild]
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="$root/build-gpu"
mkdir -p "$out"
cd "$root"

build() {
  local nvcc cuda include=() arch
  nvcc="$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)"
  cuda="$(dirname "$(dirname "$nvcc")")"
  [[ -f /usr/include/catch2/catch.hpp ]] || include=(-I"$out")
  arch=(-gencode arch=compute_80,code=sm_80 -gencode "arch=compute_90,code=[sm_90,compute_90]")
  local cxx=(g++ -std=c++17 -O2 -I. "${include[@]}" -Wall -Wextra)
  local link=(-L"$cuda/lib64" -lcudart_static -ldl -lrt -lpthread -static-libstdc++ -static-libgcc
              -Wl,-Bstatic -lgomp -Wl,-Bdynamic)
  "$nvcc" -std=c++17 -O3 "${arch[@]}" -I. -c kernels/tensor_stats_cuda.cu -o "$out/tensor_stats_cuda.o" &&
    "$nvcc" -std=c++17 -O3 "${arch[@]}" -I. -c bench/bench_stats_cuda.cu -o "$out/bench_stats_cuda.o" &&
    "${cxx[@]}" -fopenmp -c kernels/tensor_stats.cpp -o "$out/tensor_stats.o" &&
    "${cxx[@]}" -c tests/catch/catch_session.cpp -o "$out/catch_session.o" &&
    "${cxx[@]}" -I"$cuda/include" -c tests/gpu/gpu_main.cpp -o "$out/gpu_main.o" &&
    "${cxx[@]}" -I"$cuda/include" -c tests/gpu/test_gpu_tensor_stats.cpp -o "$out/test_gpu.o" &&
    g++ -fopenmp "$out"/{catch_session,gpu_main,test_gpu,tensor_stats_cuda,tensor_stats}.o -o "$out/nanreplay_gpu_tests" "${link[@]}" &&
    g++ -fopenmp "$out"/{bench_stats_cuda,tensor_stats_cuda,tensor_stats}.o -o "$out/bench_stats_cuda" "${link[@]}"
}

# A prebuilt binary may not start here (missing, or built against a newer glibc).
runs() {
  [[ -x "$1" ]] || return 1
  local complaint
  complaint="$("$1" --help 2>&1 >/dev/null)"
  ! grep -qE "not found|error while loading" <<<"$complaint"
}
if [[ "${1:-}" == --rebuild ]] || ! runs "$out/nanreplay_gpu_tests" || ! runs "$out/bench_stats_cuda"; then
  echo "gpu_kernel_check: building in $out"
  build || { echo "gpu_kernel_check: build failed"; exit 2; }
fi

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null
"$out/nanreplay_gpu_tests" --durations yes
tests=$?
"$out/bench_stats_cuda" 1024 21
bench=$?
echo "gpu_kernel_check: tests exit $tests, bench exit $bench"
exit $((tests != 0 ? tests : bench))
