"""The layer-streamed replay against the in-memory one, through the CLI (docs/performance.md, "Two modes").

Every preset `nanreplay synth --help` lists (but the clean ones test_crosscheck_pytorch.py already replays
streamed), and a few rolled-forward windows: `run --stream` must give the
report.json of `run` (all but the timings) and the same trace.h5 records, bit for bit, with the same exit
status. On router-collapse, whose first step routes no token to two experts of layer 0, the streamed run's
`--timings` must count those experts' tensors as not loaded. bisect --stream must name what bisect names.
A memory limit between the two estimates (read from `inspect --json`) must stream by itself; a limit below
both is refused with both estimates; a scratch directory inside the bundle is refused; an interrupted streamed
run leaves no scratch directory behind.
Debian's python3 (h5py for the trace).
"""
import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from preset_sweep import add_all_flag, swept
from replay_compare import (check, cli_run, failures, listed_presets, report_difference, stable,
                            trace_difference)

# Compared streamed by test_crosscheck_pytorch.py (report.json, with PyTorch's numbers beside): not again here.
CROSS_CHECKED = {"clean-fp32", "clean-dp", "clean-gqa", "clean-gpt2", "clean-bf16", "clean-qwen2", "clean-qwen3",
                 "clean-olmo2", "clean-gemma2", "clean-llama3", "clean-combined", "clean-moe"}
# Rolled forward (synth --checkpoint-every 10): the derived steps stream from the parameters rolled in memory.
ROLLED = ["head-overflow", "cascade", "bit-flip"]
# bisect's answer, streamed and not, on these (an origin in a layer, in the head, in an expert, none).
BISECTED = ["head-overflow", "router-overflow", "zero-embedding", "clean-gpt2", "glitch-token"]
# Layer 0's router is zero at the first step, so every token goes to experts 0 and 1: the streamed replay
# must not load experts 2 and 3 there, and still give every expert the in-memory update.
UNRUN_EXPERTS = "router-collapse"


def compare_runs(cli, label, bundle, work):
    plain, streamed, scratch = work / (label + "-mem"), work / (label + "-stream"), work / (label + "-scratch")
    scratch.mkdir()
    a = cli_run(cli, "run", bundle, "--out", plain, "--json")
    b = cli_run(cli, "run", bundle, "--out", streamed, "--json", "--stream", "--scratch", scratch, "--timings")
    same_exit = a.returncode == b.returncode and a.returncode in (0, 1)
    if not check(same_exit, f"{label}: run exits {a.returncode}, streamed {b.returncode}"
                            + ("" if same_exit else ": " + b.stderr.strip()[-300:])):
        return None
    differ = report_difference(json.loads(a.stdout), json.loads(b.stdout))
    check(not differ, f"{label}: report.json the same streamed{' but ' + str(differ) if differ else ''}")
    differ = trace_difference(plain / "trace.h5", streamed / "trace.h5")
    check(not differ, f"{label}: trace.h5 the same streamed{' but ' + str(differ[:5]) if differ else ''}")
    check(not any(scratch.iterdir()), f"{label}: the scratch directory is gone")
    return b


def check_unrun_experts_not_loaded(cli, work):
    """Streamed, an expert no token reached in a step is loaded in none of its passes (forward, backward):
    `run --timings` counts the expert tensors loaded, and at least those expert-passes must be missing."""
    label = UNRUN_EXPERTS + "-experts"  # apart from the sweep's own run of it (--all)
    bundle = work / label
    if not check(cli_run(cli, "synth", UNRUN_EXPERTS, bundle).returncode == 0, f"synth {UNRUN_EXPERTS}"):
        return
    streamed = compare_runs(cli, label, bundle, work)
    if streamed is None:
        return
    manifest = json.loads((bundle / "manifest.json").read_text())
    passes = manifest["data"]["world_size"] * manifest["data"]["grad_accum_steps"]
    per_expert = 3  # gate, up and down projections (no expert biases in this preset)
    unrun = sum(1 for step in json.loads(streamed.stdout)["steps"] for layer in step.get("expert_tokens") or []
                for tokens in layer if tokens == 0)
    line = next((l for l in streamed.stderr.splitlines() if l.startswith("streamed experts: ")), "")
    words = line.split()
    if not check(len(words) > 6 and unrun > 0, f"{UNRUN_EXPERTS}: {unrun} unrun experts, `{line}`"):
        return
    loaded, of = int(words[2]), int(words[7])
    check(of - loaded >= 2 * passes * per_expert * unrun and loaded > 0,
          f"{UNRUN_EXPERTS}: {loaded} of {of} expert tensors loaded streamed, "
          f"{2 * passes * per_expert * unrun} or more not ({unrun} experts with no token in a step)")


def compare_bisects(cli, label, bundle):
    a = cli_run(cli, "bisect", bundle, "--json")
    b = cli_run(cli, "bisect", bundle, "--json", "--stream")
    if not check(a.returncode == b.returncode, f"{label}: bisect exits {a.returncode}, streamed {b.returncode}"):
        return
    differ = report_difference(json.loads(a.stdout), json.loads(b.stdout))
    check(not differ, f"{label}: bisect --json the same streamed{' but ' + str(differ) if differ else ''}")


def check_memory_limits(cli, bundle, work):
    memory = json.loads(cli_run(cli, "inspect", bundle, "--json").stdout)["memory"]
    in_memory, streamed = memory["in_memory_bytes"], memory["streamed_bytes"]
    if not check(streamed < in_memory, f"inspect: streamed {streamed:.0f} < in memory {in_memory:.0f} bytes"):
        return
    between = str(int((in_memory + streamed) / 2))
    forced = cli_run(cli, "run", bundle, "--out", work / "limited", "--json", "--max-memory", between,
                     "--scratch", work)
    plain = cli_run(cli, "run", bundle, "--out", work / "unlimited", "--json")
    check(forced.returncode == plain.returncode == 1, f"--max-memory {between}: exits {forced.returncode}")
    check("layer by layer" in forced.stderr, "--max-memory between the estimates: says it streams")
    check(stable(json.loads(forced.stdout)) == stable(json.loads(plain.stdout)),
          "--max-memory between the estimates: the same report")
    refused = cli_run(cli, "run", bundle, "--out", work / "refused", "--max-memory", str(int(streamed / 2)))
    check(refused.returncode == 2 and "streamed layer by layer" in refused.stderr and "in memory" in refused.stderr
          and "neither fits" in refused.stderr and not (work / "refused").exists(),
          f"--max-memory below both: exit 2, both estimates named ({refused.stderr.strip()[:200]})")
    inside = cli_run(cli, "run", bundle, "--out", work / "inside", "--stream", "--scratch", bundle)
    check(inside.returncode == 2 and "inside the bundle" in inside.stderr, "--scratch inside the bundle: exit 2")


def check_interrupt(cli, bundle, work):
    """SIGINT while the streamed replay holds its scratch files: exit 130, nothing written, no scratch left."""
    scratch = work / "interrupted-scratch"
    scratch.mkdir()
    env = dict(os.environ, NANREPLAY_TEST_PAUSE_AT_STEP="101")
    proc = subprocess.Popen([cli, "run", str(bundle), "--out", str(work / "interrupted"), "--stream",
                             "--scratch", str(scratch)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)
    deadline = time.time() + 60
    while time.time() < deadline:
        state = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        if state == "T":
            break
        time.sleep(0.05)
    held = list(scratch.iterdir())
    proc.send_signal(signal.SIGINT)
    proc.send_signal(signal.SIGCONT)
    _, err = proc.communicate(timeout=60)
    check(len(held) == 1 and held[0].name.startswith("nanreplay-scratch-"), f"a streamed run holds {held}")
    check(proc.returncode == 130 and not list(scratch.iterdir()) and not (work / "interrupted").exists(),
          f"SIGINT: exit {proc.returncode}, scratch and --out gone ({err.strip()[-200:]})")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cli", required=True)
    ap.add_argument("--work", required=True)
    add_all_flag(ap)
    args = ap.parse_args()
    cli, work = args.cli, Path(args.work)
    if work.exists():
        subprocess.run(["rm", "-rf", str(work)], check=True)
    work.mkdir(parents=True)
    presets = listed_presets(cli)
    check(len(presets) >= 30, f"synth --help lists {len(presets)} presets")
    bundles = {}
    for preset in presets:
        if preset in CROSS_CHECKED and preset not in BISECTED:
            continue
        if preset not in BISECTED and preset not in ROLLED and not swept([preset], args.all, listed=presets):
            continue
        bundle = work / preset
        if not check(cli_run(cli, "synth", preset, bundle).returncode == 0, f"synth {preset}"):
            continue
        bundles[preset] = bundle
        compare_runs(cli, preset, bundle, work)
    for preset in ROLLED:
        bundle = work / (preset + "-rolled")
        if check(cli_run(cli, "synth", preset, bundle, "--checkpoint-every", 10).returncode == 0,
                 f"synth {preset} --checkpoint-every 10"):
            compare_runs(cli, preset + "-rolled", bundle, work)
    for preset in BISECTED:
        if preset in bundles:
            compare_bisects(cli, preset, bundles[preset])
    check_unrun_experts_not_loaded(cli, work)
    check_memory_limits(cli, bundles["head-overflow"], work)
    check_interrupt(cli, bundles["head-overflow"], work)
    print(f"{len(failures)} failure(s)")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
