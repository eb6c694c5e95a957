"""A replay split across processes against the single-process replay, through the CLI (docs/distributed.md).

The representative incident presets (preset_sweep.py; --all: every one), with --nproc 2, and one per replay path
with --nproc 3 too: rank 0's report.json
(all but the timings) and trace.h5 must be the single-process replay's, bit for bit, with the same exit
status; a mixture of experts, data-parallel ranks and a tied head with --nproc 2; --split layers and
--split ranks (streamed too) on bundles with data-parallel ranks; a rolled-forward window with --nproc 3; bisect --nproc 2. Two processes started by hand with RANK/WORLD_SIZE/MASTER_PORT (as
torchrun or srun would, reading one secret file) give the same report. Faults: a worker killed (exit 3, naming it), a worker that
stops answering (exit 3 after --dist-timeout), SIGINT on one worker (every process exits 130), bad input on
one process only (both exit 2); nothing written in --out in each case, no scratch left by the processes that
end by themselves. Debian's python3 (h5py for the trace).
"""
import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from preset_sweep import add_all_flag, swept
from replay_compare import check, children, cli_run, failures, listed_presets, report_difference, trace_difference

# Besides the incidents: a mixture of experts (router losses across processes), data-parallel ranks, a tied head,
# and a spike (its origin's sample, position and damage shape cross between processes with the records).
CLEAN_ALSO = ["clean-moe", "clean-dp", "clean-gpt2", "spike-token"]
# Both ways to share out a bundle with data-parallel ranks (by default its ranks), and the ranks streamed.
SPLITS = [("clean-dp", ("--split", "layers"), 3, "layers"), ("rank-mismatch", ("--split", "layers"), 2, "layers"),
          ("clean-dp", ("--split", "ranks", "--stream"), 3, "ranks"), ("clean-moe", ("--split", "ranks"), 2, "ranks")]
BISECTED = ["head-overflow", "router-overflow"]
# --nproc 3 (more processes than a 2-layer model has layers to share evenly) on one preset per replay path;
# every other incident with --nproc 2 only. --all runs both on every preset.
THREE_WAY = {"head-overflow", "router-overflow", "bit-flip", "rank-mismatch", "cascade", "fp8-scale-jump"}


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Reference:
    """The single-process run of a bundle, made once."""

    def __init__(self, cli, bundle, out):
        self.result = cli_run(cli, "run", bundle, "--out", out, "--json")
        self.out = out
        self.report = json.loads(self.result.stdout) if self.result.returncode in (0, 1) else None


def compare_split(cli, label, bundle, reference, work, nproc, extra=(), mode=None):
    """`mode`: what stderr must say the processes share (the layers or the ranks)."""
    name = f"{label}-np{nproc}" + "".join(extra).replace("-", "")
    label = f"{label} --nproc {nproc}" + "".join(" " + e for e in extra)
    out, scratch = work / name, work / (name + "-scratch")
    scratch.mkdir()
    got = cli_run(cli, "run", bundle, "--out", out, "--json", "--nproc", nproc, "--scratch", scratch, *extra)
    if mode:
        check(mode in got.stderr, f"{label}: says it spreads {mode} ({got.stderr.strip()[:160]})")
    same_exit = got.returncode == reference.result.returncode and reference.report is not None
    if not check(same_exit, f"{label}: exits {got.returncode}, one process "
                            f"{reference.result.returncode}" + ("" if same_exit else ": " + got.stderr.strip()[-400:])):
        return
    differ = report_difference(reference.report, json.loads(got.stdout))
    check(not differ, f"{label}: report.json the same{' but ' + str(differ) if differ else ''}")
    differ = trace_difference(reference.out / "trace.h5", out / "trace.h5")
    check(not differ, f"{label}: trace.h5 the same{' but ' + str(differ[:5]) if differ else ''}")
    check(not any(scratch.iterdir()), f"{label}: the scratch directory is gone")
    check(got.stderr.count("replaying across") == 1, f"{label}: one process speaks")


def compare_bisect(cli, label, bundle):
    a = cli_run(cli, "bisect", bundle, "--json")
    b = cli_run(cli, "bisect", bundle, "--json", "--nproc", 2)
    if not check(a.returncode == b.returncode, f"{label}: bisect exits {a.returncode}, --nproc 2 {b.returncode}"
                 + ("" if a.returncode == b.returncode else ": " + b.stderr.strip()[-300:])):
        return
    differ = report_difference(json.loads(a.stdout), json.loads(b.stdout))
    check(not differ, f"{label}: bisect --json the same with --nproc 2{' but ' + str(differ) if differ else ''}")


def shared_secret(work):
    """The file every process started by hand reads (docs/distributed.md, "Who may join")."""
    path = work / "run-secret"
    if not path.exists():
        path.write_bytes(os.urandom(32).hex().encode())
        path.chmod(0o600)
    return str(path)


def launched_by_hand(cli, bundle, reference, work):
    """As torchrun or srun start them: two processes, each told its RANK, WORLD_SIZE and MASTER_PORT."""
    port = str(free_port())
    procs = []
    for rank in (0, 1):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                   NANREPLAY_DIST_SECRET_FILE=shared_secret(work))
        procs.append(subprocess.Popen([cli, "run", str(bundle), "--out", str(work / f"by-hand-{rank}"), "--json"],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))
    outs = [p.communicate(timeout=600) for p in procs]
    codes = [p.returncode for p in procs]
    if not check(codes == [reference.result.returncode] * 2, f"RANK/WORLD_SIZE by hand: exits {codes}: "
                 + outs[1][1].strip()[-300:]):
        return
    check(not report_difference(reference.report, json.loads(outs[0][0])), "RANK/WORLD_SIZE by hand: the same report")
    check(outs[1][0] == "" and not (work / "by-hand-1").exists(), "RANK/WORLD_SIZE by hand: rank 1 writes nothing")


def paused_worker(cli, bundle, out, scratch, rank, extra=()):
    """--nproc 2 with worker `rank` stopped (SIGSTOP) at step 101: (launcher, the stopped worker's pid)."""
    env = dict(os.environ, NANREPLAY_TEST_PAUSE_AT_STEP="101", NANREPLAY_TEST_PAUSE_RANK=str(rank))
    proc = subprocess.Popen([cli, "run", str(bundle), "--out", str(out), "--nproc", "2", "--scratch", str(scratch),
                             *map(str, extra)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.time() + 120
    while time.time() < deadline:
        stopped = [pid for pid, state in children(proc.pid) if state == "T"]
        if stopped:
            return proc, stopped[0]
        time.sleep(0.05)
    proc.kill()
    return proc, None


def check_faults(cli, bundle, work):
    # A worker killed: the other loses it and says so, exit 3, nothing in --out.
    scratch = work / "killed-scratch"
    scratch.mkdir()
    proc, worker = paused_worker(cli, bundle, work / "killed", scratch, 1)
    if check(worker is not None, "a worker paused at step 101"):
        os.kill(worker, signal.SIGKILL)
        _, err = proc.communicate(timeout=120)
        check(proc.returncode == 3 and "rank 1" in err and not (work / "killed").exists(),
              f"a worker killed: exit {proc.returncode}, rank 1 named, nothing written ({err.strip()[-300:]})")
    # A worker that stops answering: the others give up after --dist-timeout.
    scratch = work / "silent-scratch"
    scratch.mkdir()
    started = time.time()
    # 10 s: long enough that two busy processes on a loaded CI machine never drift that far apart before the pause.
    proc, worker = paused_worker(cli, bundle, work / "silent", scratch, 1, ("--dist-timeout", 10))
    if check(worker is not None, "a worker paused at step 101"):
        _, err = proc.communicate(timeout=120)
        if Path(f"/proc/{worker}").exists():  # the launcher ends it; never leave one stopped behind
            os.kill(worker, signal.SIGCONT)
        lines = [line for line in err.splitlines() if "did not answer within 10 s" in line]
        check(proc.returncode == 3 and lines and "rank 1" in lines[0] and not (work / "silent").exists(),
              f"a silent worker: exit {proc.returncode} after {time.time() - started:.0f} s, "
              f"rank 1 named ({err.strip()[-300:]})")
        check(not any(scratch.iterdir()), "a silent worker: no scratch left")
    # SIGINT on one worker ends every process with 130.
    for rank in (1, 0):
        scratch = work / f"interrupted-{rank}-scratch"
        scratch.mkdir()
        proc, worker = paused_worker(cli, bundle, work / f"interrupted-{rank}", scratch, rank)
        if check(worker is not None, f"worker {rank} paused at step 101"):
            os.kill(worker, signal.SIGINT)
            os.kill(worker, signal.SIGCONT)
            _, err = proc.communicate(timeout=120)
            check(proc.returncode == 130 and f"interrupted on rank {rank}" in err
                  and not (work / f"interrupted-{rank}").exists() and not any(scratch.iterdir()),
                  f"SIGINT on rank {rank}: exit {proc.returncode}, nothing left ({err.strip()[-300:]})")


def check_bad_input_on_one(cli, bundle, work):
    """Rank 1's copy of the bundle is truncated: it exits 2 naming the file, and so does rank 0."""
    broken = work / "broken-copy"
    subprocess.run(["cp", "-r", str(bundle), str(broken)], check=True)
    shard = sorted((broken / "data").glob("*"))[0]
    shard.write_bytes(shard.read_bytes()[:7])
    port = str(free_port())
    procs = []
    for rank, path in ((0, bundle), (1, broken)):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                   NANREPLAY_DIST_SECRET_FILE=shared_secret(work))
        procs.append(subprocess.Popen([cli, "run", str(path), "--out", str(work / f"bad-{rank}")],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))
    errs = [p.communicate(timeout=300)[1] for p in procs]
    codes = [p.returncode for p in procs]
    rank0_errors = [line for line in errs[0].splitlines() if "error" in line]
    check(codes == [2, 2] and shard.name in errs[1] and len(rank0_errors) == 1 and "rank 1" in rank0_errors[0]
          and not (work / "bad-0").exists(),
          f"bad input on rank 1 only: exits {codes} ({errs[0].strip()[-200:]} | {errs[1].strip()[-200:]})")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cli", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--only", help="comma-separated presets (while developing); default every incident preset")
    ap.add_argument("--shard", default="0/1", help="K/N: the presets' K-th of N parts, and the rest of the checks "
                                                  "with part 0 (CTest runs two, so -j2 shares them out)")
    add_all_flag(ap)
    args = ap.parse_args()
    shard, shards = map(int, args.shard.split("/"))
    cli, work = args.cli, Path(args.work)
    if work.exists():
        subprocess.run(["rm", "-rf", str(work)], check=True)
    work.mkdir(parents=True)
    presets = listed_presets(cli)
    incidents = [p for p in presets if not p.startswith("clean")]
    check(len(incidents) >= 20, f"synth --help lists {len(incidents)} incident presets")
    chosen = swept(incidents, args.all, listed=presets) + CLEAN_ALSO
    if args.only:
        chosen = [p for p in chosen if p in args.only.split(",")] + ["head-overflow", "router-overflow"]
    chosen = [p for i, p in enumerate(dict.fromkeys(chosen)) if i % shards == shard]
    if shard == 0:  # the rest of the checks use these
        chosen = list(dict.fromkeys(chosen + ["head-overflow", "router-overflow"]))
    bundles = {}
    for preset in chosen:
        bundle = work / preset
        if not check(cli_run(cli, "synth", preset, bundle).returncode == 0, f"synth {preset}"):
            continue
        bundles[preset] = bundle
        reference = Reference(cli, bundle, work / (preset + "-one"))
        for nproc in ((2, 3) if preset in THREE_WAY or args.all else (2,)):
            compare_split(cli, preset, bundle, reference, work, nproc)
        for split_preset, extra, nproc, mode in SPLITS:
            if split_preset == preset:
                compare_split(cli, preset, bundle, reference, work, nproc, extra, mode)
    if shard != 0:
        print(f"{len(failures)} failure(s)")
        sys.exit(1 if failures else 0)
    rolled = work / "head-overflow-rolled"
    if check(cli_run(cli, "synth", "head-overflow", rolled, "--checkpoint-every", 10).returncode == 0,
             "synth head-overflow --checkpoint-every 10"):
        compare_split(cli, "head-overflow-rolled", rolled, Reference(cli, rolled, work / "rolled-one"), work, 3)
    for preset in BISECTED:
        compare_bisect(cli, preset, bundles[preset])
    launched_by_hand(cli, bundles["head-overflow"], Reference(cli, bundles["head-overflow"], work / "hand-one"), work)
    check_faults(cli, bundles["head-overflow"], work)
    check_bad_input_on_one(cli, bundles["head-overflow"], work)
    print(f"{len(failures)} failure(s)")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
