#!/usr/bin/env bash
# Is `nanreplay scan-data` limited by the disk or by the CPU? Measured side by
# side in one run, on the same shard files:
#   disk   cold sequential read of every shard (dd, 8 MiB blocks) after
#          dropping the files from the page cache
#   cold   scan-data straight after dropping them again (disk + scan overlap)
#   warm   scan-data with the shards cached: the scan's own (CPU) speed
# The scan is disk-limited when warm / disk >= 1 and cold / disk is close to 1.
#   bench/bench_scan.sh [BUNDLE] [--threads N]
# Without BUNDLE it writes a 600 MB bundle of Zipf-distributed uint16 tokens
# (vocab 32000, seq_len 2048) under ${TMPDIR:-/tmp} with Debian's python3.
# Pages are dropped per file with `dd iflag=nocache` (posix_fadvise
# DONTNEED): no root needed, but only clean, unmapped pages go.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cli="${NANREPLAY_CLI:-$root/build/nanreplay}"
bundle=""
threads=0
while (($#)); do
  case "$1" in
    --threads) threads="$2"; shift 2 ;;
    *) bundle="$1"; shift ;;
  esac
done

if [[ -z "$bundle" ]]; then
  bundle="${TMPDIR:-/tmp}/nanreplay-bench-scan"
  if [[ ! -f "$bundle/manifest.json" ]]; then
    mkdir -p "$bundle"
    "$cli" synth clean-fp32 "$bundle.base" >/dev/null
    rm -rf "$bundle" && mv "$bundle.base" "$bundle"
    /usr/bin/python3 - "$bundle" <<'EOF'
import json, sys, numpy as np
bundle = sys.argv[1]
rng = np.random.default_rng(0)
manifest = json.load(open(f"{bundle}/manifest.json"))
shards = []
for i in range(2):
    tokens = (rng.zipf(1.2, size=150_000_000) % 32000).astype(np.uint16)
    path = f"data/scan_{i:03d}.bin"
    tokens.tofile(f"{bundle}/{path}")
    shards.append({"path": path, "dtype": "uint16", "tokens": int(tokens.size)})
manifest["data"]["shards"] = shards
manifest["data"]["seq_len"] = 2048
manifest["data"]["sampler"] = {"kind": "randperm", "seed": 1, "epoch": 0,
                               "epoch_start_step": manifest["steps"][0]["step"]}
manifest["model"]["vocab_size"] = 32000
manifest["model"]["max_seq_len"] = 4096
json.dump(manifest, open(f"{bundle}/manifest.json", "w"))
EOF
  fi
fi

shards=()
while IFS= read -r path; do shards+=("$bundle/$path"); done < <(
  /usr/bin/python3 -c 'import json,sys; [print(s["path"]) for s in json.load(open(sys.argv[1]))["data"]["shards"]]' \
    "$bundle/manifest.json")

drop_cache() { for f in "${shards[@]}"; do dd if="$f" iflag=nocache count=0 status=none; done; }
scan_gbps() { "$cli" scan-data "$bundle" --threads "$threads" --json | /usr/bin/python3 -c 'import json,sys; print(json.load(sys.stdin)["gb_per_s"])'; }

bytes=$(du -cb "${shards[@]}" | tail -n 1 | cut -f 1)
best_disk=0 best_cold=0 best_warm=0
for round in 1 2 3; do
  drop_cache
  start=$(date +%s.%N)
  for f in "${shards[@]}"; do dd if="$f" of=/dev/null bs=8M status=none; done
  end=$(date +%s.%N)
  disk=$(echo "$bytes / ($end - $start) / 1000000000" | bc -l)
  drop_cache
  cold=$(scan_gbps)
  warm=$(scan_gbps)
  printf 'round %d: disk %.2f GB/s  cold scan %.2f GB/s  warm scan %.2f GB/s\n' "$round" "$disk" "$cold" "$warm"
  best_disk=$(echo "if ($disk > $best_disk) $disk else $best_disk" | bc -l)
  best_cold=$(echo "if ($cold > $best_cold) $cold else $best_cold" | bc -l)
  best_warm=$(echo "if ($warm > $best_warm) $warm else $best_warm" | bc -l)
done
printf 'best of 3 over %.0f MB (threads %s, %s cores): disk %.2f, cold scan %.2f, warm scan %.2f GB/s\n' \
  "$(echo "$bytes / 1000000" | bc -l)" "$threads" "$(nproc)" "$best_disk" "$best_cold" "$best_warm"
printf 'ratio warm scan / disk read = %.2f (>= 1: the disk is the limit)\n' "$(echo "$best_warm / $best_disk" | bc -l)"
printf 'ratio cold scan / disk read = %.2f\n' "$(echo "$best_cold / $best_disk" | bc -l)"
