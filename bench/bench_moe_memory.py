"""What a replay of a DeepSeek-V3-shaped mixture of experts holds in memory, streamed and not, through the CLI.

DeepSeek-V3's layout at reduced width (defaults: hidden 512 = 7168 / 14, 256 routed experts of width 128, top 8,
one shared expert of the same width, the first of every 4 layers dense; seq 128, vocab 8192, bf16 storage,
fp32 compute; scripts/make_llama_bundle.py --experts ...) at two depths, each replayed by `nanreplay run` in a
fresh child, in memory and with --stream, its own peak RSS from os.wait4. One MoE layer's fp32 parameters are
printed beside: a streamed replay holds one block at a time (that block's experts, its gradients and rounded
copies), so its peak should stay near a few of them at any depth, while in memory it grows with every layer.
`inspect --json`'s two estimates are printed beside what was measured. The router's kind does not change what
is held (the experts are the bytes), so the bundle routes as Qwen3-MoE does.

Usage: /usr/bin/python3 bench/bench_moe_memory.py [--nanreplay build/nanreplay --work bench-work/moe-memory
       --layers 4,8 --hidden 512 --experts 256 --top-k 8 --expert-width 128 --reps 1]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def bundle_for(a, layers):
    path = a.work / f"moe-l{layers}-h{a.hidden}-e{a.experts}-k{a.top_k}-w{a.expert_width}"
    if not path.exists():
        subprocess.run([sys.executable, str(ROOT / "scripts" / "make_llama_bundle.py"), str(path),
                        f"--hidden={a.hidden}", f"--heads={a.hidden // 128}", f"--layers={layers}",
                        f"--vocab={a.vocab}", f"--seq-len={a.seq}", "--storage=bf16", "--compute=fp32",
                        f"--experts={a.experts}", f"--top-k={a.top_k}", f"--expert-intermediate={a.expert_width}",
                        f"--shared-intermediate={a.expert_width}", f"--first-dense={max(1, layers // 4)}"],
                       check=True, stdout=subprocess.DEVNULL)
    return path


def peak_rss(a, bundle, streamed):
    """One `nanreplay run` in a fresh child: (peak RSS bytes, its report.json)."""
    out = a.work / f"out-{bundle.name}-{'stream' if streamed else 'memory'}"
    cmd = [str(a.nanreplay), "run", str(bundle), "--out", str(out), "-q"]
    if streamed:
        cmd += ["--stream", "--scratch", str(a.work / "scratch")]
    child = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    err = child.stderr.read()
    _, status, usage = os.wait4(child.pid, 0)
    if os.waitstatus_to_exitcode(status) not in (0, 1):
        sys.exit(f"bench_moe_memory: {' '.join(cmd)} failed: {err.decode(errors='replace')}")
    return usage.ru_maxrss * 1024, json.loads((out / "report.json").read_text())


def estimates(a, bundle):
    got = subprocess.run([str(a.nanreplay), "inspect", str(bundle), "--json"], check=True, capture_output=True,
                         text=True)
    return json.loads(got.stdout).get("memory", {})


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nanreplay", type=Path, default=ROOT / "build" / "nanreplay")
    ap.add_argument("--work", type=Path, default=ROOT / "bench-work" / "moe-memory")
    ap.add_argument("--layers", default="4,8")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--expert-width", type=int, default=128)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=1)
    a = ap.parse_args()
    a.work = a.work.absolute()
    (a.work / "scratch").mkdir(parents=True, exist_ok=True)
    layer_bytes = 4 * (a.experts * 3 * a.hidden * a.expert_width + 3 * a.hidden * a.expert_width
                       + a.experts * a.hidden)
    print(f"hidden {a.hidden}, {a.experts} experts of width {a.expert_width} + 1 shared, top {a.top_k}, "
          f"seq {a.seq}, vocab {a.vocab}; one MoE layer's fp32 parameters {layer_bytes / 2**20:.1f} MiB")
    print(f"{'layers':>6} {'MoE':>4}  {'mode':<10} {'peak RSS MiB':>13} {'estimate MiB':>13} {'experts run':>12}  loss")
    for layers in sorted({int(x) for x in a.layers.split(",")}):
        bundle = bundle_for(a, layers)
        manifest = json.loads((bundle / "manifest.json").read_text())
        moe_layers = len(manifest["model"]["moe"]["layers"])
        est = estimates(a, bundle)
        for streamed in (False, True):
            runs = [peak_rss(a, bundle, streamed) for _ in range(a.reps)]
            rss = statistics.median(r[0] for r in runs)
            step = runs[0][1]["steps"][0]
            counts = [c for layer in step.get("expert_tokens") or [] for c in layer]
            ran = f"{sum(1 for c in counts if c)}/{len(counts)}" if counts else "-"
            mode = "streamed" if streamed else "in memory"
            key = "streamed_bytes" if streamed else "in_memory_bytes"
            estimate = est.get(key)
            print(f"{layers:>6} {moe_layers:>4}  {mode:<10} {rss / 2**20:>13.1f} "
                  f"{(estimate / 2**20 if estimate else float('nan')):>13.1f} {ran:>12}  {step['loss']}")


if __name__ == "__main__":
    main()
