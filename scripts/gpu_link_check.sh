#!/usr/bin/env bash
# The GPU build, compiled and linked on a machine without a GPU: the part of
# the GPU check that needs no device, so a compile or link error in the CUDA
# paths shows up before a GPU session (whose time is scarce) starts.
#
# Downloads Debian 13's CUDA LibTorch (contrib: libtorch-cuda-2.x and its -dev
# package, ~480 MB) and unpacks it under build-gpu-link/ (never into /);
# configures against it with nvcc (/usr/local/cuda, or CUDACXX), so both
# NANREPLAY_TORCH_CUDA and the CUDA statistics kernel are on; builds every
# target. That LibTorch's own dependencies (cuBLAS 12, cuDNN, Debian 13's
# libstdc++...) are not installed, so the link ignores symbols missing from
# LibTorch's shared libraries (--unresolved-symbols=ignore-in-shared-libs):
# every symbol nanreplay's own objects need must still resolve. Nothing built
# here can run; scripts/gpu_check.sh is the check that runs on a GPU. Takes
# about 6 minutes on 2 cores.
#
# Environment: NANREPLAY_GPU_LINK_DIR (default build-gpu-link/),
# NANREPLAY_JOBS (default 2), DEBIAN_MIRROR (default http://deb.debian.org/debian).
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
work="${NANREPLAY_GPU_LINK_DIR:-$root/build-gpu-link}"
mirror="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
jobs="${NANREPLAY_JOBS:-2}"
export PATH="$PATH:/usr/local/cuda/bin"

mkdir -p "$work/debs" "$work/root"
if ! ls "$work"/debs/libtorch-cuda-dev_*.deb > /dev/null 2>&1; then
  # The pool's file names change with each upload: read them from the index.
  curl -fsS "$mirror/dists/trixie/contrib/binary-amd64/Packages.xz" | xz -dc > "$work/Packages"
  files=$(awk '/^Package: /{p = ($2 ~ /^libtorch-cuda-(dev|[0-9.]+)$/)} p && /^Filename: /{print $2}' "$work/Packages")
  [[ -n "$files" ]] || { echo "gpu_link_check: no libtorch-cuda packages in trixie/contrib" >&2; exit 1; }
  for f in $files; do
    echo "gpu_link_check: downloading $f"
    curl -fsS -o "$work/debs/$(basename "$f")" "$mirror/$f"
  done
fi
if [[ ! -f "$work/root/usr/include/torch/script.h" ]]; then
  for deb in "$work"/debs/*.deb; do dpkg-deb -x "$deb" "$work/root"; done
fi

build="$work/build"
# Catch2 lists a test executable's cases by running it after the link; these
# cannot run here, so the suite registers as one test instead.
cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$work/root/usr" -DNANREPLAY_CUDA=ON \
  -DCMAKE_EXE_LINKER_FLAGS="-Wl,--unresolved-symbols=ignore-in-shared-libs" \
  -DNANREPLAY_DISCOVER_TESTS=OFF | tee "$work/configure.log"
grep -q 'nanreplay: LibTorch .* with CUDA: GPU replay enabled' "$work/configure.log" ||
  { echo "gpu_link_check: configure did not find the CUDA LibTorch" >&2; exit 1; }
grep -q 'nanreplay: CUDA statistics kernel ON' "$work/configure.log" ||
  { echo "gpu_link_check: configure did not enable the CUDA statistics kernel" >&2; exit 1; }
cmake --build "$build" -j "$jobs"

# The replay's probes must go through the kernel in this build, not the
# CPU-only stub: the binary holds the kernel's buffer and the stub's message
# is absent.
# (Listed to files first: `grep -q` closing a pipe early fails it under pipefail.)
cli="$build/nanreplay"
nm -C "$cli" > "$work/nanreplay.symbols"
strings "$cli" > "$work/nanreplay.strings"
grep -q 'nanreplay::cuda::DeviceStatsBuffer::add_heads' "$work/nanreplay.symbols" ||
  { echo "gpu_link_check: $cli lacks the CUDA statistics kernel" >&2; exit 1; }
if grep -q 'built without the CUDA statistics kernel' "$work/nanreplay.strings"; then
  echo "gpu_link_check: $cli carries the CPU-only probe stub" >&2
  exit 1
fi
# No C++ runtime symbol may bind into LibTorch (CMakeLists.txt says why).
"$root/scripts/check_cxx_runtime_first.sh" "$cli" "$build"/tests/nanreplay_tests "$build"/tests/nanreplay_gpu_replay_tests
version=$(sed -n 's/^set(PACKAGE_VERSION "\(.*\)")$/\1/p' "$work"/root/usr/lib/*/cmake/Torch/TorchConfigVersion.cmake)
echo "gpu_link_check: every target compiled and linked against LibTorch $version with CUDA" \
  "(GPU replay enabled, CUDA statistics kernel ON); the CLI's probes go through the kernel"
