#!/usr/bin/env bash
# The CLI on a GPU, end to end (called by scripts/gpu_check.sh run): the demo
# incident replayed on cuda:0 names the origin the CPU replay names, a split
# over two devices and --cross-check work, and asking for a missing device is
# a clear usage error, and GPU probes through the CUDA statistics kernel agree
# with LibTorch reductions, and the layer-streamed replay on a GPU matches the
# in-memory one. Prints the CPU and GPU replay times side by side.
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
# Layer-streamed on the GPU: each block's parameters copied from host memory as it runs, the gradients back
# to scratch files on the host. The same origin, and the same losses and trace records as the in-memory GPU
# replay except the parameter gradients' (reduced on the host instead of the device).
t_stream=$(timed "$cli" run "$work/demo/bundle" --out "$work/gpu_stream" --device cuda:0 --stream --scratch "$work" -q)
echo "origin gpu streamed: $(origin "$work/gpu_stream/report.json")"
[[ "$(origin "$work/gpu/report.json")" == "$(origin "$work/gpu_stream/report.json")" ]]
"$cli" trace "$work/gpu_stream/trace.h5" --json --limit 1000000 >"$work/gpu_stream_trace.json"
python3 - "$work/gpu_trace.json" "$work/gpu_stream_trace.json" "$work/gpu/report.json" "$work/gpu_stream/report.json" <<'PY'
import json, sys
a, b = (json.load(open(p))["rows"] for p in sys.argv[1:3])
ra, rb = (json.load(open(p)) for p in sys.argv[3:5])
sites = lambda rows: [r for r in rows if r["phase"] != "grad"]
differ = sum(x != y for x, y in zip(sites(a), sites(b)))
print(f"gpu streamed vs in memory: {len(sites(a))} site records, {differ} differ")
assert len(sites(a)) == len(sites(b)) and differ == 0
assert [s["loss"] for s in ra["steps"]] == [s["loss"] for s in rb["steps"]]
PY
ls "$work" | grep -q nanreplay-scratch- && { echo "scratch left behind"; exit 1; }
echo "demo replay wall time streamed on the gpu: ${t_stream}s"
set +e
"$cli" run "$work/demo/bundle" --out "$work/none" --device cuda:9 2>"$work/none.err"
status=$?
set -e
echo "cuda:9 -> exit $status: $(cat "$work/none.err")"
[[ $status -eq 2 && ! -e "$work/none" ]]
# Every model option's preset and an incident in a model with options: the GPU replays to the CPU's losses
# and origin (a sliding window takes LibTorch's reductions: the CUDA kernel knows full causal rows only).
for preset in clean-qwen2 clean-qwen3 clean-olmo2 clean-gemma2 clean-llama3 clean-combined qwen2-head-overflow; do
  "$cli" synth "$preset" "$work/$preset" >/dev/null
  "$cli" run "$work/$preset" --out "$work/$preset-cpu" -q || [[ $? -eq 1 ]]
  "$cli" run "$work/$preset" --out "$work/$preset-gpu" --device cuda:0 -q || [[ $? -eq 1 ]]
  python3 - "$preset" "$work/$preset-cpu/report.json" "$work/$preset-gpu/report.json" <<'PY'
import json, sys
preset, a, b = sys.argv[1], *(json.load(open(p)) for p in sys.argv[2:4])
key = lambda f: f and (f["step"], f["site"], f["head"], f["sample"], f["position"])
assert key(a["first_nonfinite"]) == key(b["first_nonfinite"]), (preset, a["first_nonfinite"], b["first_nonfinite"])
gap = max(abs(x["loss"] - y["loss"]) / max(abs(x["loss"]), 1e-12) for x, y in zip(a["steps"], b["steps"]) if x["replayed"])
print(f"{preset}: gpu origin {key(b['first_nonfinite'])} = cpu's, loss gap {gap:.1e}")
assert gap <= 1e-2, gap
PY
done
echo "demo replay wall time: cpu ${t_cpu}s, gpu ${t_gpu}s"
cp "$work/gpu/report.json" "$logs/gpu_report.json"
cp "$work/cross/report.json" "$logs/cross_report.json"
echo "gpu_cli_check: passed"
