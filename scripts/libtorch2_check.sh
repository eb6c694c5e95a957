#!/usr/bin/env bash
# The whole CPU suite against LibTorch 2.x: the code keeps to the API that
# LibTorch 1.13 (Debian 12, what CI builds against) and 2.x share, and this
# proves it at run time, not only at compile time.
#
# Makes a Debian 13 (trixie) root with debootstrap under build-libtorch2/
# (LibTorch 2.6, PyTorch 2.6 and GCC 14 from trixie's packages; Catch2 v2
# from this Debian 12 host, as trixie ships v3), copies the working tree in,
# builds it there and runs every test but the GPU ones. Needs root (chroot,
# mounts) and network to Debian's mirror; the mounts are the root's own
# (proc, a fresh devpts instance, tmpfs) and are undone on exit. About 12
# minutes on 2 cores, a third of it the first time only.
#
# Environment: NANREPLAY_LIBTORCH2_DIR (default build-libtorch2/),
# NANREPLAY_JOBS (default 2), DEBIAN_MIRROR (default http://deb.debian.org/debian),
# NANREPLAY_LIBTORCH2_CTEST_ARGS (more ctest arguments, e.g. "-R distributed": a part of the suite).
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
work="${NANREPLAY_LIBTORCH2_DIR:-$root/build-libtorch2}"
rootfs="$work/rootfs"
mirror="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
jobs="${NANREPLAY_JOBS:-2}"
ctest_args="${NANREPLAY_LIBTORCH2_CTEST_ARGS:-}"
[[ $(id -u) == 0 ]] || { echo "libtorch2_check: needs root (debootstrap, chroot, mount)" >&2; exit 2; }
command -v debootstrap > /dev/null || apt-get install -y -q debootstrap > /dev/null

# Everything the build and tests need; as scripts/bootstrap.sh, less Catch2 v3,
# the fuzzers' clang and the HTML check's chromium (skipped without it).
packages=(g++ cmake ninja-build pkg-config libtorch-dev libgloo-dev libopenblas0-pthread libopenblas0-openmp libhdf5-dev hdf5-tools
  libcxxopts-dev nlohmann-json3-dev libssl-dev python3-torch python3-h5py python3-numpy util-linux git)

mkdir -p "$work"
if [[ ! -x "$rootfs/usr/bin/cmake" ]]; then
  debootstrap --variant=minbase --components=main trixie "$rootfs" "$mirror" > "$work/debootstrap.log"
fi

mounted=()
cleanup() {
  local i
  for ((i = ${#mounted[@]} - 1; i >= 0; i--)); do umount "${mounted[i]}" || true; done
}
trap cleanup EXIT
mount -t proc proc "$rootfs/proc" && mounted+=("$rootfs/proc")
mount -t devpts devpts "$rootfs/dev/pts" -o newinstance,ptmxmode=0666 && mounted+=("$rootfs/dev/pts")
mount -t tmpfs tmpfs "$rootfs/tmp" && mounted+=("$rootfs/tmp")
ln -sfn pts/ptmx "$rootfs/dev/ptmx"  # the root's own node, pointing into its own devpts
cp /etc/resolv.conf "$rootfs/etc/resolv.conf"

in_root() { chroot "$rootfs" /usr/bin/env -i HOME=/root PATH=/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8 "$@"; }
if [[ ! -x "$rootfs/usr/bin/cmake" ]]; then
  in_root bash -c "export DEBIAN_FRONTEND=noninteractive; apt-get update -q && apt-get install -y -q --no-install-recommends ${packages[*]}" \
    > "$work/apt.log"
fi
if [[ ! -f "$rootfs/usr/include/catch2/catch.hpp" ]]; then
  (cd "$work" && apt-get download catch2 > /dev/null)  # this host's Catch2 v2
  dpkg-deb -x "$(ls "$work"/catch2_2*.deb | head -n 1)" "$rootfs"
fi

# The working tree as it is (tracked and untracked files git does not ignore).
rm -rf "$rootfs/root/nanreplay"
mkdir -p "$rootfs/root/nanreplay"
(cd "$root" && git ls-files -z --cached --others --exclude-standard | tar --null -T - -cf -) |
  tar -xf - -C "$rootfs/root/nanreplay"

in_root bash -c "cd /root/nanreplay && cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release > /dev/null &&
  ninja -C build -j $jobs > build.log || { tail -n 40 build.log; exit 1; }"
status=0
in_root bash -c "cd /root/nanreplay/build && ctest -j $jobs -E '^gpu\\.' --output-on-failure $ctest_args" > "$work/ctest.log" 2>&1 ||
  status=$?
tail -n 8 "$work/ctest.log"
versions=$(in_root dpkg-query -W -f '${Package} ${Version}\n' libtorch-dev python3-torch g++ | tr '\n' ',' | sed 's/,$//; s/,/, /g')
echo "libtorch2_check: ctest status $status against $versions (log: $work/ctest.log)"
exit "$status"
