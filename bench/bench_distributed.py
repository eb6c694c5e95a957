"""A replay split across two local processes against the same replay in one process, through the CLI.

One clean bundle (scripts/make_llama_bundle.py, default hidden 512, 8 layers, seq 128, micro-batch 1,
4 data-parallel ranks, vocab 8192, 3 steps, fp32 storage and compute; made once in --work and reused) is
replayed with `nanreplay run` in one process, with `--nproc 2 --split layers` (the two workers split the
layers and pass the activations forward and their gradients back through c10d Gloo over loopback) and
with `--nproc 2 --split ranks` (each worker replays two of the four data-parallel ranks whole, then they
exchange probes and gradient shares), interleaved (the order rotating by repetition), each run a fresh
child. The cores are shared alike: one process computes on all of them, each of N processes on 1/N of
them (--threads), unless --threads says otherwise. Medians of --reps of the wall time of each mode and its
ratio to one process. Peak RSS of the largest process of each mode: the
rusage os.wait4 returns for the child, whose ru_maxrss on Linux is the largest of the child's own and of
every descendant it has waited for (the launcher waits for its workers), so for --nproc 2 it is the
largest of launcher, rank 0 and rank 1; each process's VmHWM in /proc/<pid>/status, polled every 50 ms
while it runs (both modes alike), breaks it down and cross-checks it. Every report.json, apart from
"timings" and "elapsed_seconds", must equal the first one-process report: the split promises bit-identical
results; any difference exits 1.

On a 2-core machine the layer split shows what it costs (the exchanges, and two processes taking turns
on two cores), not a speed-up: it is for models whose layers do not fit one machine's memory. The rank
split divides the arithmetic; on one 2-core machine each process has one core, so its gain here is what
a second host would give, less the exchange.

Usage: /usr/bin/python3 bench/bench_distributed.py [--nanreplay build/nanreplay --work bench-work/distributed
       --layers 8 --hidden 512 --seq 128 --vocab 8192 --world-size 4 --steps 3 --nproc 2 --reps 3 --threads N]
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

from llama_bundles import cached_llama_bundle

ROOT = Path(__file__).resolve().parents[1]
IGNORED = ("timings", "elapsed_seconds")  # the only report fields allowed to differ between runs


def bundle_for(a):
    return cached_llama_bundle(a.work, hidden=a.hidden, layers=a.layers, seq_len=a.seq, vocab=a.vocab,
                               steps=a.steps, world_size=a.world_size)


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


def threads_of(a, nproc):
    """Each process's --threads: as given, else the cores shared evenly among the processes."""
    return a.threads or max(1, (os.cpu_count() or 1) // nproc)


def replay(a, bundle, nproc, split, threads=None):
    """One `nanreplay run` in a fresh child: (wall s, largest process's peak RSS bytes from wait4,
    {label: polled VmHWM bytes}, report.json, stderr text)."""
    threads = threads or threads_of(a, nproc)
    out = a.work / f"out-nproc{nproc}-{split}-t{threads}"
    cmd = [str(a.nanreplay), "run", str(bundle), "--out", str(out), "-q", "--threads", str(threads)]
    if nproc > 1:
        cmd += ["--nproc", str(nproc), "--split", split]
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
    ap.add_argument("--world-size", type=int, default=4, help="the bundle's data-parallel ranks")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--nproc", type=int, default=2, help="processes of the split mode")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0,
                    help="nanreplay --threads of every process (0: the cores shared evenly among the processes)")
    a = ap.parse_args()
    a.work = a.work.absolute()
    a.work.mkdir(parents=True, exist_ok=True)
    usage = subprocess.run([str(a.nanreplay), "run", "--help"], capture_output=True, text=True).stdout
    if "--nproc" not in usage:
        sys.exit(f"bench_distributed: {a.nanreplay} run has no --nproc (an older build?)")
    bundle = bundle_for(a)
    # Untimed: loads the binary and LibTorch into the page cache, so the first timed run does not pay for it.
    subprocess.run([str(a.nanreplay), "inspect", str(bundle)], check=True, stdout=subprocess.DEVNULL)

    modes = [(1, "-"), (a.nproc, "layers"), (a.nproc, "ranks")]
    runs = {m: [] for m in modes}  # (nproc, split) -> [(wall, wait4 rss, polled, report, stderr)]
    for rep in range(a.reps):
        for m in modes[rep % len(modes):] + modes[:rep % len(modes)]:  # rotate who goes first
            runs[m].append(replay(a, bundle, *m))

    def med(m, i):
        return statistics.median(r[i] for r in runs[m])

    def name(m):
        return "one process" if m[0] == 1 else f"--nproc {m[0]} --split {m[1]}"

    one = modes[0]
    print(f"hidden {a.hidden}, {a.layers} layers, seq {a.seq}, vocab {a.vocab}, {a.world_size} data-parallel ranks, "
          f"{a.steps} steps, fp32; --threads {threads_of(a, 1)} for one process, {threads_of(a, a.nproc)} for each "
          f"of {a.nproc}; {os.cpu_count()} cores; median of {a.reps}, interleaved; {a.nanreplay}")
    print(f"{'mode':<26} {'wall s':>8} {'(min-max)':>13} {'one / this':>10} {'steps s':>8} {'one / this':>10} "
          f"{'peak RSS MiB':>13}  polled VmHWM MiB, each process")

    def steps_s(m):  # the step replays alone (report.json's timings.steps), without start-up and checks
        return statistics.median(sum(t["seconds"] for t in r[3]["timings"]["steps"]) for r in runs[m])

    for m in modes:
        walls = [r[0] for r in runs[m]]
        polled = {}
        for r in runs[m]:
            for label, hwm in r[2].items():
                polled.setdefault(label, []).append(hwm)
        each = ", ".join(f"{label} {statistics.median(v) / 2**20:.1f}" for label, v in sorted(polled.items()))
        print(f"{name(m):<26} {med(m, 0):>8.2f} {f'({min(walls):.2f}-{max(walls):.2f})':>13} "
              f"{med(one, 0) / med(m, 0):>10.2f} {steps_s(m):>8.2f} {steps_s(one) / steps_s(m):>10.2f} "
              f"{med(m, 1) / 2**20:>13.1f}  {each}")
    print("one / this > 1: faster than one process. steps s: the step replays of rank 0's report.json timings, "
          "without start-up, data checks and the determinism re-run, which every process does whole. peak RSS: ru_maxrss from os.wait4 on the child, which on Linux "
          "is the largest of the child's own and of its reaped descendants' (for --nproc: the largest of launcher and "
          "workers, not their sum); the polled VmHWM columns (every 50 ms, per process, median over reps) break it "
          "down.")
    print(f"On this {os.cpu_count()}-core machine the layer split shows the cost of the exchanges and of {a.nproc} "
          "processes taking turns, not a speed-up: it is for models that do not fit one machine's memory. The rank "
          "split divides the arithmetic among the processes, here on one core each.")

    def stripped(report):
        return {k: v for k, v in report.items() if k not in IGNORED}

    # Bit for bit with one process computing on as many threads: LibTorch's reductions split their work by
    # thread count, so one process on 2 threads and one on 1 differ in the last bits (docs/distributed.md).
    reference = {threads_of(a, 1): stripped(runs[one][0][3])}
    reference.setdefault(threads_of(a, a.nproc), stripped(replay(a, bundle, 1, "-", threads_of(a, a.nproc))[3]))
    mismatches = [(m, i, differences(reference[threads_of(a, m[0])], stripped(r[3])))
                  for m in modes for i, r in enumerate(runs[m])]
    mismatches = [x for x in mismatches if x[2]]
    for m in modes:
        for i, r in enumerate(runs[m]):
            if r[4].strip():
                print(f"stderr of {name(m)}, rep {i + 1}: {r[4].strip()}")
    losses = [s.get("loss") for s in reference[threads_of(a, 1)].get("steps", [])]
    if mismatches:
        for m, i, diff in mismatches:
            print(f"report.json of {name(m)}, rep {i + 1}, differs from one process's on {threads_of(a, m[0])} "
                  "threads: " + "; ".join(diff))
        print("reports: DIFFER (the split must give bit-identical results)")
        sys.exit(1)
    print(f"reports: identical apart from {' and '.join(IGNORED)} to one process's on as many threads "
          f"({len(modes) * a.reps} runs; losses {losses})")


if __name__ == "__main__":
    main()
