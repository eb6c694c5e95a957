"""A replay split across two local processes against the same replay in one process, through the CLI.

One clean bundle (scripts/make_llama_bundle.py, default hidden 512, 8 layers, seq 128, micro-batch 1,
vocab 8192, 3 steps, fp32 storage and compute; made once in --work and reused) is replayed with
`nanreplay run` in one process and with `nanreplay run --nproc 2` (the launcher starts two workers that
split the layers and pass the activations forward and their gradients back through c10d Gloo over
loopback), interleaved (the order alternating by repetition), each run a fresh child. Medians of --reps of
the wall time of each mode and their ratio one / two. Peak RSS of the largest process of each mode: the
rusage os.wait4 returns for the child, whose ru_maxrss on Linux is the largest of the child's own and of
every descendant it has waited for (the launcher waits for its workers), so for --nproc 2 it is the
largest of launcher, rank 0 and rank 1; each process's VmHWM in /proc/<pid>/status, polled every 50 ms
while it runs (both modes alike), breaks it down and cross-checks it. Every report.json, apart from
"timings" and "elapsed_seconds", must equal the first one-process report: the split promises bit-identical
results; any difference exits 1.

On a 2-core machine this measures what the split costs (the exchanges, and two processes sharing two
cores), not a speed-up: the split is for models whose layers do not fit one machine's memory.

Usage: /usr/bin/python3 bench/bench_distributed.py [--nanreplay build/nanreplay --work bench-work/distributed
       --layers 8 --hidden 512 --seq 128 --vocab 8192 --steps 3 --nproc 2 --reps 3 --threads N]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
IGNORED = ("timings", "elapsed_seconds")  # the only report fields allowed to differ between runs


def bundle_for(a):
    """The bundle of this shape in --work, made on first use (the name holds every option that shapes it)."""
    path = a.work / f"llama-h{a.hidden}-l{a.layers}-s{a.seq}-v{a.vocab}-n{a.steps}"
    if not path.exists():
        subprocess.run([sys.executable, str(ROOT / "scripts" / "make_llama_bundle.py"), str(path),
                        "--hidden", str(a.hidden), "--layers", str(a.layers), "--vocab", str(a.vocab),
                        "--seq-len", str(a.seq), "--micro-batch", "1", "--steps", str(a.steps),
                        "--storage", "fp32", "--compute", "fp32"],
                       check=True, stdout=subprocess.DEVNULL)
    for f in path.rglob("*.safetensors"):  # into the page cache, so the first timed run does not pay the disk
        with open(f, "rb") as fh:
            while fh.read(1 << 24):
                pass
    return path


class TreeSampler(threading.Thread):
    """Every 50 ms, the VmHWM (peak RSS so far, kept by the kernel) of `root` and of each of its descendants.

    A process is in the tree when its parent is (each pid's parent read once: the launcher's workers have it
    as their parent from the start). peaks: pid ->
    (label, VmHWM bytes), the label "launcher" / "process" for the root and "rank R" (from the worker's
    environment) for the others. The last 50 ms of a process's life may escape it: os.wait4's figure is
    the exact one."""

    def __init__(self, root):
        super().__init__(daemon=True)
        self.root, self.tree, self.parent, self.peaks = root, {root}, {}, {}
        self.done = threading.Event()

    def label(self, pid):
        if pid == self.root:
            return "root"
        try:
            env = dict(e.split("=", 1) for e in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in e)
            return f"rank {env['RANK']}" if "RANK" in env else f"pid {pid}"
        except (OSError, ValueError):
            return f"pid {pid}"

    def sample(self):
        for name in os.listdir("/proc"):
            if name.isdigit() and int(name) not in self.parent:
                try:
                    stat = Path(f"/proc/{name}/stat").read_text()
                    self.parent[int(name)] = int(stat[stat.rindex(")") + 2:].split()[1])  # after "pid (comm) state"
                except (OSError, ValueError):
                    pass
        grown = True
        while grown:  # a grandchild may be listed before its parent
            new = {pid for pid, ppid in self.parent.items() if ppid in self.tree} - self.tree
            self.tree |= new
            grown = bool(new)
        for pid in self.tree:
            try:
                for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                    if line.startswith("VmHWM:"):
                        hwm = int(line.split()[1]) * 1024
                        label, peak = self.peaks.get(pid, ("pid", 0))
                        if label.startswith("pid"):  # until its exec a worker is the launcher's: look again
                            fresh = self.label(pid)
                            label, peak = fresh, peak if fresh == label else 0
                        self.peaks[pid] = (label, max(peak, hwm))
            except (OSError, ValueError):
                pass  # gone, or a zombie (no VmHWM line)

    def run(self):
        while not self.done.is_set():
            self.sample()
            self.done.wait(0.05)


def replay(a, bundle, nproc):
    """One `nanreplay run` in a fresh child: (wall s, largest process's peak RSS bytes from wait4,
    {label: polled VmHWM bytes}, report.json, stderr text)."""
    out = a.work / f"out-nproc{nproc}"
    cmd = [str(a.nanreplay), "run", str(bundle), "--out", str(out), "-q"]
    if a.threads:
        cmd += ["--threads", str(a.threads)]
    if nproc > 1:
        cmd += ["--nproc", str(nproc)]
    t0 = time.perf_counter()
    child = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    sampler = TreeSampler(child.pid)
    sampler.start()
    err = child.stderr.read()  # -q: only errors; EOF once the launcher and every worker have closed it
    child.stderr.close()
    _, status, usage = os.wait4(child.pid, 0)  # ru_maxrss: the largest of the child and its reaped children
    wall = time.perf_counter() - t0
    sampler.done.set()
    sampler.join()
    child.returncode = os.waitstatus_to_exitcode(status)
    text = err.decode(errors="replace")
    if child.returncode not in (0, 1):  # 1: a finding (none expected on this clean bundle, but not a failure)
        sys.exit(f"bench_distributed: {' '.join(cmd)} exited {child.returncode}: {text}")
    report = json.loads((out / "report.json").read_text())
    root_label = "launcher" if nproc > 1 else "process"
    polled = {(root_label if label == "root" else label): hwm for label, hwm in sampler.peaks.values()}
    return wall, usage.ru_maxrss * 1024, polled, report, text  # ru_maxrss is in KiB on Linux


def differences(x, y, path="", found=None):
    """The paths (up to 10) where two JSON values differ."""
    found = [] if found is None else found
    if len(found) >= 10:
        return found
    if isinstance(x, dict) and isinstance(y, dict):
        for k in sorted(set(x) | set(y)):
            if k not in x or k not in y:
                found.append(f"{path}/{k}: only in {'the one-process' if k in x else 'this'} report")
            else:
                differences(x[k], y[k], f"{path}/{k}", found)
    elif isinstance(x, list) and isinstance(y, list) and len(x) == len(y):
        for i, (u, v) in enumerate(zip(x, y)):
            differences(u, v, f"{path}[{i}]", found)
    elif x != y or type(x) is not type(y):
        found.append(f"{path or '/'}: {json.dumps(x)[:80]} != {json.dumps(y)[:80]}")
    return found


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nanreplay", type=Path, default=ROOT / "build" / "nanreplay")
    ap.add_argument("--work", type=Path, default=ROOT / "bench-work" / "distributed")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--nproc", type=int, default=2, help="processes of the split mode")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0,
                    help="nanreplay --threads, of every process (0: its default, all cores each)")
    a = ap.parse_args()
    a.work = a.work.absolute()
    a.work.mkdir(parents=True, exist_ok=True)
    usage = subprocess.run([str(a.nanreplay), "run", "--help"], capture_output=True, text=True).stdout
    if "--nproc" not in usage:
        sys.exit(f"bench_distributed: {a.nanreplay} run has no --nproc (an older build?)")
    bundle = bundle_for(a)
    # Untimed: loads the binary and LibTorch into the page cache, so the first timed run does not pay for it.
    subprocess.run([str(a.nanreplay), "inspect", str(bundle)], check=True, stdout=subprocess.DEVNULL)

    modes = [1, a.nproc]
    runs = {n: [] for n in modes}  # nproc -> [(wall, wait4 rss, polled, report, stderr)]
    for rep in range(a.reps):
        for n in (modes if rep % 2 == 0 else modes[::-1]):  # alternate who goes first
            runs[n].append(replay(a, bundle, n))

    def med(n, i):
        return statistics.median(r[i] for r in runs[n])

    threads = a.threads or f"all cores ({os.cpu_count()}) in each process"
    print(f"hidden {a.hidden}, {a.layers} layers, seq {a.seq}, vocab {a.vocab}, {a.steps} steps, fp32; "
          f"--threads {threads}; median of {a.reps}, interleaved; {a.nanreplay}")
    print(f"{'mode':<34} {'wall s':>8} {'(min-max)':>13} {'peak RSS MiB':>13}  polled VmHWM MiB, each process")
    for n in modes:
        walls = [r[0] for r in runs[n]]
        polled = {}
        for r in runs[n]:
            for label, hwm in r[2].items():
                polled.setdefault(label, []).append(hwm)
        each = ", ".join(f"{label} {statistics.median(v) / 2**20:.1f}" for label, v in sorted(polled.items()))
        mode = "one process" if n == 1 else f"--nproc {n} (launcher + {n} workers)"
        print(f"{mode:<34} {med(n, 0):>8.2f} {f'({min(walls):.2f}-{max(walls):.2f})':>13} "
              f"{med(n, 1) / 2**20:>13.1f}  {each}")
    print(f"time one process / {a.nproc} processes: {med(1, 0) / med(a.nproc, 0):.2f}  (> 1: the split is faster)")
    print(f"peak RSS of the largest process, {a.nproc} processes / one: {med(a.nproc, 1) / med(1, 1):.2f}")
    print("peak RSS: ru_maxrss from os.wait4 on the child, which on Linux is the largest of the child's own and of "
          "its reaped descendants' (for --nproc: the largest of launcher and workers, not their sum); the polled "
          "VmHWM columns (every 50 ms, per process, median over reps) break it down.")
    print(f"On this {os.cpu_count()}-core machine this shows the cost of the communication and of {a.nproc} processes "
          f"sharing {os.cpu_count()} cores, not a speed-up: the split is for models that do not fit one machine's "
          "memory.")

    def stripped(report):
        return {k: v for k, v in report.items() if k not in IGNORED}

    reference = stripped(runs[1][0][3])
    mismatches = [(n, i, differences(reference, stripped(r[3])))
                  for n in modes for i, r in enumerate(runs[n])]
    mismatches = [m for m in mismatches if m[2]]
    for n in modes:
        for i, r in enumerate(runs[n]):
            if r[4].strip():
                print(f"stderr of {'one process' if n == 1 else f'--nproc {n}'}, rep {i + 1}: {r[4].strip()}")
    losses = [s.get("loss") for s in reference.get("steps", [])]
    if mismatches:
        for n, i, diff in mismatches:
            print(f"report.json of {'one process' if n == 1 else f'--nproc {n}'}, rep {i + 1}, differs from the "
                  f"first one-process report: " + "; ".join(diff))
        print("reports: DIFFER (the split must give bit-identical results)")
        sys.exit(1)
    print(f"reports: identical apart from {' and '.join(IGNORED)} ({len(modes) * a.reps} runs; losses {losses})")


if __name__ == "__main__":
    main()
