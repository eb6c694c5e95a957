#!/usr/bin/env bash
# Every executable given lists the C++ runtime (libstdc++) among its needed
# libraries (DT_NEEDED) before any LibTorch library (libtorch*, libc10*), so
# no C++ runtime symbol can bind to the copies a PyTorch wheel's libtorch.so
# exports (CMakeLists.txt says why). Read with readelf: it fails on a CPU
# build as well as on a GPU one.
#   scripts/check_cxx_runtime_first.sh EXECUTABLE...
set -euo pipefail
(($#)) || { echo "usage: $0 EXECUTABLE..." >&2; exit 2; }
status=0
for exe in "$@"; do
  mapfile -t needed < <(readelf -d "$exe" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p')
  runtime=-1 torch=-1
  for i in "${!needed[@]}"; do
    case "${needed[$i]}" in
      libstdc++.so*) ((runtime < 0)) && runtime=$i ;;
      libtorch*.so* | libc10*.so*) ((torch < 0)) && torch=$i ;;
    esac
  done
  name="$(basename "$exe")"
  if ((runtime < 0)); then
    echo "FAIL $name: libstdc++ is not among its needed libraries: ${needed[*]}"
    status=1
  elif ((torch >= 0 && torch < runtime)); then
    echo "FAIL $name: ${needed[$torch]} (#$torch) is needed before libstdc++ (#$runtime)"
    status=1
  else
    echo "ok   $name: libstdc++ is needed library #$runtime; the first LibTorch library is #$torch"
  fi
done
exit "$status"
