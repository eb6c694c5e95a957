#!/usr/bin/env bash
# The CLI on a GPU, end to end (called by scripts/gpu_check.sh run): the demo
# incident replayed on cuda:0 names the origin the CPU replay names, a split
# over two devices and --cross-check work, and asking for a missing device is
# a clear usage error, and GPU probes through the CUDA statistics kernel agree
# with LibTorch reductions. Prints the CPU and GPU replay times side by side.
set -euo pipefail
cli="${NANREPLAY_CLI:?set NANREPLAY_CLI}"
logs="${NANREPLAY_GPU_LOGS:-$(mktemp -d)}"
work="$(mktemp -d)"
second=cuda:0
[[ "$(nvidia-smi -L | wc -l)" -gt 1 ]] && second=cuda:1

"$cli" demo "$work/demo" -q || [[ $? -eq 1 ]]
origin() { /usr/bin/env python3 -c 'import json,sys; f=json.load(open(sys.argv[1]))["first_nonfinite"]; print(f["step"], f["site"], f["head"], f["sample"], f["position"])' "$1"; }
timed() { local start=$SECONDS; "$@" || [[ $? -eq 1 ]]; echo "$((SECONDS - start))"; }

t_cpu=$(timed "$cli" run "$work/demo/bundle" --out "$work/cpu" -q)
t_gpu=$(timed "$cli" run "$work/demo/bundle" --out "$work/gpu" --device cuda:0 -q)
"$cli" run "$work/demo/bundle" --out "$work/split" --device "cuda:0,$second" -q || [[ $? -eq 1 ]]
"$cli" run "$work/demo/bundle" --out "$work/cross" --device "cuda:0,$second" --cross-check -q || [[ $? -eq 1 ]]
echo "origin cpu:   $(origin "$work/cpu/report.json")"
echo "origin gpu:   $(origin "$work/gpu/report.json")"
echo "origin split: $(origin "$work/split/report.json")"
[[ "$(origin "$work/cpu/report.json")" == "$(origin "$work/gpu/report.json")" ]]
[[ "$(origin "$work/cpu/report.json")" == "$(origin "$work/split/report.json")" ]]
"$cli" bisect "$work/demo/bundle" --device cuda:0 --json >"$work/bisect.json" || [[ $? -eq 1 ]]
bisect_origin=$(python3 -c 'import json,sys; f=json.load(open(sys.argv[1]))["origin"]; print(f["step"], f["site"], f["head"], f["sample"], f["position"])' "$work/bisect.json")
echo "origin bisect: $bisect_origin"
[[ "$(origin "$work/cpu/report.json")" == "$bisect_origin" ]]
python3 -c 'import json,sys; r=json.load(open(sys.argv[1])); c=r["cross_check"]; print("cross-check:", c); assert c["bitwise_identical"]; print("low_precision:", r["low_precision"])' "$work/cross/report.json"
# GPU probes through the CUDA statistics kernel (the default where it is
# built) against LibTorch reductions (NANREPLAY_GPU_STATS=torch): same origin;
# per record the same max |x| and NaN/Inf counts, and the same rms to 1e-4 (sums in another order).
NANREPLAY_GPU_STATS=torch "$cli" run "$work/demo/bundle" --out "$work/gpu_torch" --device cuda:0 -q || [[ $? -eq 1 ]]
echo "origin gpu, LibTorch reductions: $(origin "$work/gpu_torch/report.json")"
[[ "$(origin "$work/gpu/report.json")" == "$(origin "$work/gpu_torch/report.json")" ]]
"$cli" trace "$work/gpu/trace.h5" --json --limit 1000000 >"$work/gpu_trace.json"
"$cli" trace "$work/gpu_torch/trace.h5" --json --limit 1000000 >"$work/gpu_torch_trace.json"
python3 - "$work/gpu_trace.json" "$work/gpu_torch_trace.json" <<'PY'
import json, math, sys
a, b = (json.load(open(p))["rows"] for p in sys.argv[1:3])
assert len(a) == len(b), (len(a), len(b))
bad = 0
for x, y in zip(a, b):
    same = all(x[k] == y[k] for k in ("site", "phase", "head", "max_abs", "nan_count", "inf_count"))
    rms_ok = x["rms"] == y["rms"] or (math.isfinite(x["rms"]) and abs(x["rms"] - y["rms"]) <= 1e-4 * max(abs(y["rms"]), 1e-30))
    if not (same and rms_ok):
        bad += 1
        if bad <= 5: print("differs:", x, y)
print(f"kernel vs LibTorch reductions: {len(a)} records, {bad} differ")
assert bad == 0
PY
set +e
"$cli" run "$work/demo/bundle" --out "$work/none" --device cuda:9 2>"$work/none.err"
status=$?
set -e
echo "cuda:9 -> exit $status: $(cat "$work/none.err")"
[[ $status -eq 2 && ! -e "$work/none" ]]
echo "demo replay wall time: cpu ${t_cpu}s, gpu ${t_gpu}s"
cp "$work/gpu/report.json" "$logs/gpu_report.json"
cp "$work/cross/report.json" "$logs/cross_report.json"
echo "gpu_cli_check: passed"
