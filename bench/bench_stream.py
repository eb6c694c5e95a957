"""The layer-streamed replay against depth and against the in-memory replay, through the CLI.

For one width (default hidden 512, seq 128, micro-batch 1, vocab 8192, fp32 storage and compute), clean
one-step bundles of 4, 16 and 64 layers (scripts/make_llama_bundle.py, made once in --work and reused) are
replayed with `nanreplay run --stream`, each run a fresh child whose wall time and peak RSS (its own
rusage from os.wait4) are measured. The streamed peak RSS should barely grow with depth: the ratio
deepest / shallowest (target <= 1.3). At the --compare depths (default 4 and 16) the in-memory replay
runs too, interleaved with the streamed one (the order alternating by repetition); the time ratio
in-memory / streamed should be >= 0.7 (streaming costs a second forward of each block and the gradients'
trips to scratch files). Medians of --reps. Each run's loss is shown: both modes must agree.

Usage: /usr/bin/python3 bench/bench_stream.py [--nanreplay build/nanreplay --work bench-work/stream
       --layers 4,16,64 --compare 4,16 --hidden 512 --seq 128 --vocab 8192 --reps 3 --threads N
       --stream-flag=--stream]   (--stream-flag= : no flag, both modes in memory, for a CLI without it)
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from llama_bundles import cached_llama_bundle

ROOT = Path(__file__).resolve().parents[1]


def bundle_for(a, layers):
    return cached_llama_bundle(a.work, hidden=a.hidden, layers=layers, seq_len=a.seq, vocab=a.vocab)


def replay(a, bundle, layers, streamed):
    """One `nanreplay run` in a fresh child: (wall seconds, peak RSS bytes, loss)."""
    out = a.work / f"out-l{layers}-{'stream' if streamed else 'memory'}"
    cmd = [str(a.nanreplay), "run", str(bundle), "--out", str(out), "-q"]
    if a.threads:
        cmd += ["--threads", str(a.threads)]
    if streamed and a.stream_flag:
        cmd += [a.stream_flag, "--scratch", str(a.work / "scratch")]
    t0 = time.perf_counter()
    child = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    err = child.stderr.read()  # -q: only errors, so this cannot fill the pipe while the child runs
    child.stderr.close()
    _, status, usage = os.wait4(child.pid, 0)  # this child's own rusage, not every child's maximum so far
    wall = time.perf_counter() - t0
    child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode not in (0, 1):  # 1: a finding (none expected on these clean bundles, but not a failure)
        sys.exit(f"bench_stream: {' '.join(cmd)} exited {child.returncode}: {err.decode(errors='replace')}")
    loss = json.loads((out / "report.json").read_text())["steps"][0]["loss"]
    return wall, usage.ru_maxrss * 1024, loss  # ru_maxrss is in KiB on Linux


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nanreplay", type=Path, default=ROOT / "build" / "nanreplay")
    ap.add_argument("--work", type=Path, default=ROOT / "bench-work" / "stream")
    ap.add_argument("--layers", default="4,16,64", help="depths replayed streamed")
    ap.add_argument("--compare", default="4,16", help="depths also replayed in memory")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="nanreplay --threads (0: its default, all cores)")
    ap.add_argument("--stream-flag", default="--stream", help="the flag that forces streaming; empty: none")
    a = ap.parse_args()
    a.work = a.work.absolute()
    (a.work / "scratch").mkdir(parents=True, exist_ok=True)
    depths = sorted({int(x) for x in a.layers.split(",")})
    compare = sorted({int(x) for x in a.compare.split(",") if x} & set(depths))
    bundles = {n: bundle_for(a, n) for n in depths}
    # Untimed: loads the binary and LibTorch into the page cache, so the first timed run does not pay for it.
    subprocess.run([str(a.nanreplay), "inspect", str(bundles[depths[0]])], check=True, stdout=subprocess.DEVNULL)

    runs = {}  # (layers, streamed) -> [(wall, rss, loss)]
    for rep in range(a.reps):
        for n in depths:
            modes = [True, False] if n in compare else [True]
            for streamed in (modes if rep % 2 == 0 else modes[::-1]):  # alternate who goes first
                runs.setdefault((n, streamed), []).append(replay(a, bundles[n], n, streamed))

    def med(n, streamed, i):
        return statistics.median(r[i] for r in runs[(n, streamed)])

    label = "streamed" if a.stream_flag else "streamed (no flag: in memory)"
    print(f"hidden {a.hidden}, seq {a.seq}, vocab {a.vocab}, fp32; median of {a.reps}; {a.nanreplay}")
    print(f"{'layers':>6}  {'mode':<30} {'wall s':>8} {'(min-max)':>13} {'peak RSS MiB':>13}  loss")
    for n in depths:
        for streamed in (False, True):
            if (n, streamed) in runs:
                walls = [r[0] for r in runs[(n, streamed)]]
                print(f"{n:>6}  {label if streamed else 'in memory':<30} {med(n, streamed, 0):>8.2f} "
                      f"{f'({min(walls):.2f}-{max(walls):.2f})':>13} {med(n, streamed, 1) / 2**20:>13.1f}  "
                      f"{runs[(n, streamed)][0][2]}")
    rss = med(depths[-1], True, 1) / med(depths[0], True, 1)
    speed = [(n, med(n, False, 0) / med(n, True, 0)) for n in compare]
    print(f"peak RSS streamed {depths[-1]}/{depths[0]} layers {rss:.2f} (target <= 1.3, "
          f"{'ok' if rss <= 1.3 else 'MISSED'}); time in-memory/streamed "
          + ", ".join(f"{n} layers {r:.2f}" for n, r in speed)
          + f" (target >= 0.7, {'ok' if all(r >= 0.7 for _, r in speed) else 'MISSED'})")


if __name__ == "__main__":
    main()
