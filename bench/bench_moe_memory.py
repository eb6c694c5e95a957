"""What a replay of a DeepSeek-V3-shaped mixture of experts holds in memory, streamed and not, through the CLI.

DeepSeek-V3's layout at reduced width (defaults: hidden 512 = 7168 / 14, 256 routed experts of width 128, top 8,
one shared expert of the same width, the first of every 4 layers dense; seq 128, vocab 8192, bf16 storage,
fp32 compute; scripts/make_llama_bundle.py --experts ...) at two depths, each replayed by `nanreplay run` in a
fresh child, in memory and with --stream, its own peak RSS from os.wait4. One MoE layer's fp32 parameters are
printed beside: a streamed replay holds one block at a time (that block's experts, its gradients and rounded
copies), so its peak should stay near a few of them at any depth, while in memory it grows with every layer.
`inspect --json`'s two estimates are printed beside what was measured. The router's kind does not change what
is held (the experts are the bytes), so the bundle routes as Qwen3-MoE does.

A streamed block loads only the experts its router sent a token to: "experts run" counts the (layer, expert)
slots with a token in the step (report.json's expert_tokens), "expert tensors loaded" is what the streamed run's
`--timings` says it loaded against what loading every expert of each block would have. `--baseline-cli OLD`
runs the streamed side with an older CLI too, each depth's runs one after the other.

Usage: /usr/bin/python3 bench/bench_moe_memory.py [--nanreplay build/nanreplay --work bench-work/moe-memory
       --layers 4,8 --hidden 512 --experts 256 --top-k 8 --expert-width 128 --reps 1 --baseline-cli OLD]
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


def peak_rss(a, bundle, streamed, cli):
    """One `nanreplay run` in a fresh child: (peak RSS bytes, its report.json, its stderr)."""
    out = a.work / f"out-{bundle.name}-{'stream' if streamed else 'memory'}"
    cmd = [str(cli), "run", str(bundle), "--out", str(out), "-q"]
    if streamed:
        cmd += ["--stream", "--scratch", str(a.work / "scratch"), "--timings"]
    child = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    err = child.stderr.read()
    _, status, usage = os.wait4(child.pid, 0)
    if os.waitstatus_to_exitcode(status) not in (0, 1):
        sys.exit(f"bench_moe_memory: {' '.join(cmd)} failed: {err.decode(errors='replace')}")
    return usage.ru_maxrss * 1024, json.loads((out / "report.json").read_text()), err.decode(errors="replace")


def expert_loads(stderr):
    """`--timings`' "streamed experts: N expert tensors loaded, of M ..." as "N/M" ("-": no such line)."""
    for line in stderr.splitlines():
        if line.startswith("streamed experts: "):
            words = line.split()
            return f"{words[2]}/{words[7]}"
    return "-"


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
    ap.add_argument("--baseline-cli", type=Path, help="an older CLI whose streamed replay runs beside")
    a = ap.parse_args()
    a.work = a.work.absolute()
    (a.work / "scratch").mkdir(parents=True, exist_ok=True)
    layer_bytes = 4 * (a.experts * 3 * a.hidden * a.expert_width + 3 * a.hidden * a.expert_width
                       + a.experts * a.hidden)
    print(f"hidden {a.hidden}, {a.experts} experts of width {a.expert_width} + 1 shared, top {a.top_k}, "
          f"seq {a.seq}, vocab {a.vocab}; one MoE layer's fp32 parameters {layer_bytes / 2**20:.1f} MiB")
    print(f"{'layers':>6} {'MoE':>4}  {'mode':<19} {'peak RSS MiB':>13} {'estimate MiB':>13} {'experts run':>12} "
          f"{'expert tensors loaded':>22}  loss")
    sides = [(False, a.nanreplay, "in memory"), (True, a.nanreplay, "streamed")]
    if a.baseline_cli:
        sides.append((True, a.baseline_cli, "streamed, baseline"))
    for layers in sorted({int(x) for x in a.layers.split(",")}):
        bundle = bundle_for(a, layers)
        manifest = json.loads((bundle / "manifest.json").read_text())
        moe_layers = len(manifest["model"]["moe"]["layers"])
        est = estimates(a, bundle)
        losses = set()
        for streamed, cli, mode in sides:
            runs = [peak_rss(a, bundle, streamed, cli) for _ in range(a.reps)]
            rss = statistics.median(r[0] for r in runs)
            step = runs[0][1]["steps"][0]
            counts = [c for layer in step.get("expert_tokens") or [] for c in layer]
            ran = f"{sum(1 for c in counts if c)}/{len(counts)}" if counts else "-"
            loaded = expert_loads(runs[0][2]) if streamed else "-"
            key = "streamed_bytes" if streamed else "in_memory_bytes"
            estimate = est.get(key)
            print(f"{layers:>6} {moe_layers:>4}  {mode:<19} {rss / 2**20:>13.1f} "
                  f"{(estimate / 2**20 if estimate else float('nan')):>13.1f} {ran:>12} {loaded:>22}  {step['loss']}",
                  flush=True)
            losses.add(step["loss"])
        if len(losses) != 1:
            sys.exit(f"bench_moe_memory: {layers} layers: the modes' losses differ: {sorted(losses)}")


if __name__ == "__main__":
    main()
