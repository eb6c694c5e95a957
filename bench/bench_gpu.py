"""Is the GPU replay GPU-bound? One run prints four ratios, each measured side by side:

  1. replay step / bare forward+backward   nanreplay's step (report.json timings, the fastest step) against the
                                           same step's passes in eager PyTorch with the weights already on the
                                           device (tests/py/reference_model.py's llama; target <= 1.3)
  2. probes on / off                       `run` against `run --no-probes`, replay step (target <= 1.05)
  3. SM utilisation over the replay phase  nvidia-smi sampled every 100 ms over the run's replay phase
                                           (target >= 60 %)
  4. whole run / whole eager replay        `nanreplay run` from start to exit against bench/eager_replay.py
                                           --device from start to exit (target < 1.0)

The bundle is issue 36's 0.94B-parameter llama (scripts/make_llama_bundle.py --hidden 2048 --layers 16 --heads 16
--vocab 32000 --seq-len 1024 --micro-batch 4 --steps 2, bf16 storage, fp32 compute), made once in --work.
Needs a CUDA build of torch and of nanreplay (scripts/gpu_check.sh runs it). TF32 stays off on both sides:
the replay is bit-faithful fp32 (docs/gpu.md). --device cpu and a smaller --shape run the same code without a
GPU (no utilisation), to check the script itself.
Usage: python3 bench/bench_gpu.py --cli build-gpu/nanreplay --work DIR [--device cuda:0] [--reps 3] [--json F]
"""
import argparse
import contextlib
import json
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "py"))
import reference_model  # noqa: E402

SHAPES = {
    "issue36": dict(hidden=2048, layers=16, heads=16, vocab=32000, seq_len=1024, micro_batch=4, steps=2),
    "small": dict(hidden=256, layers=2, heads=4, vocab=512, seq_len=64, micro_batch=2, steps=2),
}


def make_bundle(work, shape):
    path = Path(work) / f"llama-{shape}-bf16"
    if not path.exists():
        Path(work).mkdir(parents=True, exist_ok=True)
        args = [f"--{k.replace('_', '-')}={v}" for k, v in SHAPES[shape].items()]
        subprocess.run([sys.executable, str(ROOT / "scripts" / "make_llama_bundle.py"), str(path), *args,
                        "--storage", "bf16", "--compute", "fp32"], check=True, stdout=subprocess.DEVNULL)
    return path


class Utilisation:
    """nvidia-smi's utilization.gpu (the share of time a kernel ran) every 100 ms, with host timestamps."""

    def __init__(self, device):
        self.samples = []
        self.proc = None
        if device.type != "cuda" or shutil.which("nvidia-smi") is None:
            return
        index = device.index or 0
        self.proc = subprocess.Popen(["nvidia-smi", "-i", str(index), "--query-gpu=utilization.gpu",
                                      "--format=csv,noheader,nounits", "-lms", "100"],
                                     stdout=subprocess.PIPE, text=True)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for line in self.proc.stdout:
            if line.strip().isdigit():
                self.samples.append((time.monotonic(), int(line)))

    def mean_between(self, begin, end):
        inside = [u for t, u in self.samples if begin <= t <= end]
        return statistics.mean(inside) if inside else None

    def stop(self):
        if self.proc:
            self.proc.terminate()
            self.proc.wait()


def run_replay(cli, bundle, out, device, probes, utilisation=None):
    """Whole-process seconds, the fastest step's seconds, and the replay phase's mean utilisation."""
    shutil.rmtree(out, ignore_errors=True)
    command = [str(cli), "run", str(bundle), "--out", str(out), "--device", str(device), "--timings"]
    if not probes:
        command.append("--no-probes")
    started = time.monotonic()
    done = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    whole = time.monotonic() - started
    if done.returncode not in (0, 1):
        sys.exit(f"bench_gpu: {' '.join(command)} exited {done.returncode}: {done.stderr.strip()[-400:]}")
    timings = json.loads((Path(out) / "report.json").read_text())["timings"]
    step = min(s["seconds"] for s in timings["steps"])
    util = None
    if utilisation is not None:
        # The replay phase starts once the bundle is loaded and checked: load, then the data checks.
        seconds = timings["seconds"]
        begin = started + seconds.get("load", 0.0) + seconds.get("data checks", 0.0)
        util = utilisation.mean_between(begin, begin + seconds.get("replay", 0.0))
    return whole, step, util


def on_device(device):
    """Tensors the model makes (rotary tables, masks) are made on `device` (torch >= 2.0; the CPU needs nothing)."""
    return contextlib.nullcontext() if device.type == "cpu" else torch.device(device)


def bare_step_seconds(bundle_dir, device, reps):
    """The bundle's first step's passes, forward and backward, in eager PyTorch with the weights on the device."""
    bundle = reference_model.Bundle(bundle_dir)
    m = bundle.manifest
    entry = sorted(m["steps"], key=lambda e: e["step"])[0]
    stored = reference_model.read_safetensors(bundle.root / entry["dir"] / "model.safetensors")
    params = {k: v.to(device).float().requires_grad_(True) for k, v in stored.items()}
    d = m["data"]
    accum, mbs = d.get("grad_accum_steps", 1), d["micro_batch_size"]
    batches = []
    for ids in bundle.samples(entry["step"]):
        for micro in range(accum):
            inputs, targets = bundle.batch(ids[micro * mbs:(micro + 1) * mbs])
            batches.append((inputs.long().to(device), targets.long().to(device)))

    def step():
        for p in params.values():
            p.grad = None
        with on_device(device):
            for inputs, targets in batches:
                (reference_model.llama_loss(m["model"], params, inputs, targets) / accum).backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    step()  # warm-up: kernels chosen, memory cached
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
    return min(times)


def eager_whole_seconds(bundle, device):
    started = time.monotonic()
    subprocess.run([sys.executable, str(ROOT / "bench" / "eager_replay.py"), "--bundle", str(bundle),
                    "--threads", str(torch.get_num_threads()), "--device", str(device)],
                   check=True, stdout=subprocess.DEVNULL)
    return time.monotonic() - started


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cli", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="issue36")
    ap.add_argument("--json", help="write the figures here too")
    args = ap.parse_args()
    device = torch.device(args.device)
    torch.backends.cuda.matmul.allow_tf32 = False  # as the replay: bit-faithful fp32
    torch.backends.cudnn.allow_tf32 = False
    work = Path(args.work)
    bundle = make_bundle(work, args.shape)
    utilisation = Utilisation(device)
    runs = {"on": [], "off": [], "eager": []}
    try:
        for _ in range(args.reps):  # interleaved, so drift touches every side alike
            runs["on"].append(run_replay(args.cli, bundle, work / "out-on", device, True, utilisation))
            runs["off"].append(run_replay(args.cli, bundle, work / "out-off", device, False))
            runs["eager"].append(eager_whole_seconds(bundle, device))
    finally:
        utilisation.stop()
    bare = bare_step_seconds(bundle, device, args.reps)
    step_on = statistics.median(r[1] for r in runs["on"])
    step_off = statistics.median(r[1] for r in runs["off"])
    whole_on = statistics.median(r[0] for r in runs["on"])
    eager = statistics.median(runs["eager"])
    utils = [r[2] for r in runs["on"] if r[2] is not None]
    figures = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "shape": SHAPES[args.shape],
        "replay_step_seconds": step_on, "replay_step_no_probes_seconds": step_off, "bare_step_seconds": bare,
        "whole_run_seconds": whole_on, "whole_eager_seconds": eager,
        "replay_step_over_bare": step_on / bare, "probes_on_over_off": step_on / step_off,
        "sm_utilisation_percent": statistics.median(utils) if utils else None,
        "whole_run_over_eager": whole_on / eager,
    }
    print(f"bench_gpu on {figures['device']}, median of {args.reps} interleaved runs ({args.shape} bundle):")
    print(f"  replay step / bare forward+backward  {figures['replay_step_over_bare']:.2f}"
          f"   ({step_on:.3f} s / {bare:.3f} s; target <= 1.3)")
    print(f"  probes on / off                      {figures['probes_on_over_off']:.3f}"
          f"  ({step_on:.3f} s / {step_off:.3f} s; target <= 1.05)")
    util = figures["sm_utilisation_percent"]
    print("  SM utilisation over the replay phase " +
          (f"{util:.0f} %  (target >= 60 %)" if util is not None else "not measured (no CUDA device or nvidia-smi)"))
    print(f"  whole run / whole eager replay       {figures['whole_run_over_eager']:.2f}"
          f"   ({whole_on:.2f} s / {eager:.2f} s; target < 1.0)")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
