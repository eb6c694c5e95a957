"""`nanreplay bisect` against `nanreplay run` on the same bundle, rolled-forward and per-step windows side by side.

For each synthetic preset (tiny models: the ratios, not the seconds, are the point) two bundles from the same
training run are written once into --work: one with a checkpoint at every step, one rolled forward from its
first checkpoint (`synth --checkpoint-every 1000`). On each, `nanreplay bisect --json` and `nanreplay run`
run as fresh children, interleaved and alternating which goes first, --reps times. Printed per bundle: the
replays (passes) bisect needed to name the origin (stages step + site), its samples stage apart, the passes
run replays (every pass of every step, plus its determinism self-check), and the median wall-time ratio
bisect / run. Both must name the same origin (checked on every repetition).

Usage: /usr/bin/python3 bench/bench_bisect.py [--nanreplay build/nanreplay --work bench-work/bisect
       --presets demo,head-overflow,mlp-overflow --reps 5 --threads 2]
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def synth(a, preset, rolled):
    out = a.work / f"{preset}-{'rolled' if rolled else 'per-step'}"
    if not (out / "manifest.json").exists():
        shutil.rmtree(out, ignore_errors=True)
        cmd = [str(a.nanreplay), "synth", preset, str(out)] + (["--checkpoint-every", "1000"] if rolled else [])
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return out


def timed(cmd, env):
    t0 = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    if done.returncode not in (0, 1):
        sys.exit(f"bench_bisect: {' '.join(cmd)} exited {done.returncode}: {done.stderr}")
    return wall, done.stdout


def origin_of(first):
    return None if first is None else (first["step"], first["phase"], first["site"], first.get("index"))


def measure(a, bundle, env):
    bisect_cmd = [str(a.nanreplay), "bisect", str(bundle), "--json"]
    out = a.work / (bundle.name + "-out")
    run_cmd = [str(a.nanreplay), "run", str(bundle), "--out", str(out), "-q"]
    times = {"bisect": [], "run": []}
    for rep in range(a.reps):
        order = ("bisect", "run") if rep % 2 == 0 else ("run", "bisect")
        for which in order:
            if which == "run":
                shutil.rmtree(out, ignore_errors=True)
                wall, _ = timed(run_cmd, env)
                report = json.loads((out / "report.json").read_text())
            else:
                wall, text = timed(bisect_cmd, env)
                bisected = json.loads(text)
            times[which].append(wall)
        if origin_of(bisected.get("origin")) != origin_of(report.get("first_nonfinite")):
            sys.exit(f"bench_bisect: {bundle.name}: bisect and run name different origins")
    replays = bisected["replays"]
    data = json.loads((bundle / "manifest.json").read_text())["data"]
    det = report.get("determinism") or {}
    # run's self-check replays the origin's micro-batch again (the whole step for a gradient origin)
    recheck = 0 if not det else (data["world_size"] * data["grad_accum_steps"] if det.get("replayed") == "step" else 1)
    return {"origin": replays["origin"], "samples": replays["samples"], "run": replays["full_probe_pass"] + recheck,
            "ratio": statistics.median(times["bisect"]) / statistics.median(times["run"]),
            "bisect_s": statistics.median(times["bisect"]), "run_s": statistics.median(times["run"])}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nanreplay", type=Path, default=ROOT / "build" / "nanreplay")
    ap.add_argument("--work", type=Path, default=ROOT / "bench-work" / "bisect")
    ap.add_argument("--presets", default="demo,head-overflow,mlp-overflow")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    a.work.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads), NO_COLOR="1", NANREPLAY_PROGRESS_INTERVAL="3600")
    env.setdefault("GOMP_SPINCOUNT", "10000")
    print(f"{'bundle':<26}{'bisect origin':>14}{'+ samples':>10}{'run':>6}{'bisect s':>10}{'run s':>8}"
          f"{'bisect / run':>14}")
    for preset in a.presets.split(","):
        for rolled in (True, False):
            bundle = synth(a, preset, rolled)
            m = measure(a, bundle, env)
            print(f"{bundle.name:<26}{m['origin']:>14}{m['samples']:>10}{m['run']:>6}{m['bisect_s']:>10.2f}"
                  f"{m['run_s']:>8.2f}{m['ratio']:>14.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
