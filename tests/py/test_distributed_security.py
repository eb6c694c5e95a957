"""Who may join a replay across processes (docs/distributed.md, "Who may join"), through the CLI.

A stranger connects to the rendezvous store of a running `--nproc 2` replay (torch.distributed.TCPStore
from Debian's python3, the same wire protocol): the keys the run used before this release are not there to
read, a forged "end" key does not stop the run (its report is the one-process replay's), and every listener
but the store's is on 127.0.0.1. Two processes started by hand (RANK/WORLD_SIZE, as torchrun would): a
stranger's claim to rank 1 is refused with one line naming it, a process with another secret file stops
(exit 3, one line: the rendezvous does not prove it holds its secret), and the real rank 1 then joins and the report is the one-process replay's. Usage errors:
no secret file, a secret file others can read, a backend this build lacks.
"""
import argparse
import datetime
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from replay_compare import check, children, cli_run, failures, report_difference

PRESET = "head-overflow"  # the preset the other distributed tests pause at step 101


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def secret_file(path, text, mode=0o600):
    path.write_text(text)
    path.chmod(mode)
    return path


def stranger(port, joining=False):
    """A client of the run's store that holds no secret; `joining`: counted among the processes rank 0's
    store waits for, as a process posing as a rank would be."""
    from torch.distributed import TCPStore
    return TCPStore("127.0.0.1", port, 2, is_master=False, wait_for_workers=joining,
                    timeout=datetime.timedelta(seconds=60))


def present(store, key):
    try:
        store.wait([key], datetime.timedelta(milliseconds=200))
        return True
    except RuntimeError:
        return False


def sockets(pids):
    """(local address, port, state) of every TCP socket the processes `pids` hold; 0A: listening."""
    inodes = set()
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    found = []
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[9] not in inodes:
                continue
            address, port = fields[1].split(":")
            if width == 8:
                address = socket.inet_ntop(socket.AF_INET, bytes.fromhex(address)[::-1])
            else:
                raw = b"".join(bytes.fromhex(address[i:i + 8])[::-1] for i in range(0, 32, 8))
                address = socket.inet_ntop(socket.AF_INET6, raw)
            found.append((address, int(port, 16), fields[3]))
    return found


def paused_run(cli, bundle, out, extra_env=None):
    """--nproc 2 with rank 1 stopped (SIGSTOP) at step 101: (launcher, stopped worker, store port)."""
    env = dict(os.environ, NANREPLAY_TEST_PAUSE_AT_STEP="101", NANREPLAY_TEST_PAUSE_RANK="1", **(extra_env or {}))
    proc = subprocess.Popen([cli, "run", str(bundle), "--out", str(out), "--nproc", "2", "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.time() + 120
    while time.time() < deadline:
        workers = children(proc.pid)
        stopped = [pid for pid, state in workers if state == "T"]
        if stopped:
            port = int(Path(f"/proc/{stopped[0]}/environ").read_bytes().split(b"MASTER_PORT=")[1].split(b"\0")[0])
            return proc, [pid for pid, _ in workers], stopped[0], port
        time.sleep(0.05)
    proc.kill()
    return proc, [], None, None


def check_stranger_on_store(cli, bundle, reference, work):
    proc, workers, stopped, port = paused_run(cli, bundle, work / "strangers")
    if not check(stopped is not None, "a worker paused at step 101"):
        return
    held = sockets(workers)
    loopback = ("127.0.0.1", "::ffff:127.0.0.1", "::1")
    others = [(a, p, state) for a, p, state in held if not (p == port and state == "0A")]
    check(len(others) >= 2 and all(a in loopback for a, _, _ in others),
          f"every socket of the processes but the store's listener is on loopback (Gloo's too): {sorted(others)}")
    store_bound = [a for a, p, state in held if p == port and state == "0A"]
    print(f"note: the store on port {port} listens on {store_bound} (LibTorch 1.13 cannot bind it to loopback)")
    store = stranger(port)
    old_keys = ["nanreplay/end", "nanreplay/end-claims", "nanreplay/host/0", "nanreplay/host/1",
                "nanreplay/memory/0", "nanreplay/memory/1", "nanreplay/left", "0"]
    readable = [k for k in old_keys if present(store, k)]
    check(not readable, f"a stranger finds none of the run's keys by their old names (found {readable})")
    store.set("nanreplay/end", "3\tforged by a stranger")  # before this release: every process exited 3
    time.sleep(0.5)
    os.kill(stopped, signal.SIGCONT)
    out, err = proc.communicate(timeout=300)
    same = proc.returncode == reference["code"]
    check(same and not report_difference(reference["report"], json.loads(out)),
          f"a forged 'end' key: the run goes on, exit {proc.returncode} and the one-process report "
          f"({err.strip()[-300:]})")
    check("forged" not in err, "a forged 'end' key under an old name is never read")


def by_hand(cli, bundle, out, rank, port, secret, stderr_path):
    env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port), NANREPLAY_DIST_SECRET_FILE=str(secret))
    return subprocess.Popen([cli, "run", str(bundle), "--out", str(out), "--json", "--dist-timeout", "120"],
                            stdout=subprocess.PIPE, stderr=open(stderr_path, "w"), text=True, env=env)


def wait_for(path, text, seconds=60):
    deadline = time.time() + seconds
    while time.time() < deadline:
        if text in path.read_text():
            return True
        time.sleep(0.05)
    return False


def check_forged_peers(cli, bundle, reference, work):
    secret = secret_file(work / "secret", "a shared secret of this test run, 44 chars long")
    other = secret_file(work / "other-secret", "another secret than the run's, as long as one")
    port = free_port()
    err0 = work / "rank0.err"
    rank0 = by_hand(cli, bundle, work / "hand", 0, port, secret, err0)
    deadline = time.time() + 60
    store = None
    while store is None and time.time() < deadline:
        try:
            store = stranger(port, joining=True)
        except Exception:
            time.sleep(0.1)
    if not check(store is not None, "a stranger connects to rank 0's store"):
        rank0.kill()
        return
    store.wait(["nanreplay/admit/challenge"], datetime.timedelta(seconds=60))
    slot = store.add("nanreplay/admit/1/claims", 1)
    store.set(f"nanreplay/admit/1/{slot}", b"\0" * 32 + b"00" * 16 + b"\t1e9\tforger-host")
    named = wait_for(err0, "forger-host")
    lines = [line for line in err0.read_text().splitlines() if "forger-host" in line]
    check(named and len(lines) == 1 and "refused a process claiming rank 1" in lines[0],
          f"a stranger's claim to rank 1: refused in one line naming it ({lines})")
    err1 = work / "rank1-other.err"
    wrong = by_hand(cli, bundle, work / "hand-wrong", 1, port, other, err1)
    wrong.communicate(timeout=120)
    text = err1.read_text().strip()
    check(wrong.returncode == 3 and len(text.splitlines()) == 1 and "does not prove it holds this run's secret" in text,
          f"a process with another secret file: exit {wrong.returncode}, one line ({text[-300:]})")
    err1 = work / "rank1.err"
    rank1 = by_hand(cli, bundle, work / "hand-1", 1, port, secret, err1)
    out0, _ = rank0.communicate(timeout=300)
    rank1.communicate(timeout=60)
    same = rank0.returncode == reference["code"] and rank1.returncode == reference["code"]
    check(same and not report_difference(reference["report"], json.loads(out0)),
          f"the real rank 1 joins after both: exits {rank0.returncode}, {rank1.returncode}, the one-process report "
          f"({err0.read_text().strip()[-300:]} | {err1.read_text().strip()[-300:]})")


def check_usage(cli, bundle, work):
    env = dict(os.environ, RANK="1", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    env.pop("NANREPLAY_DIST_SECRET_FILE", None)
    got = cli_run(cli, "run", bundle, "--out", work / "no-secret", env=env, timeout=60)
    check(got.returncode == 2 and len(got.stderr.strip().splitlines()) == 1 and "--secret-file" in got.stderr,
          f"RANK/WORLD_SIZE without a secret: exit {got.returncode}, one line ({got.stderr.strip()[-200:]})")
    loose = secret_file(work / "loose-secret", "a secret anybody on this host may read, too long", 0o644)
    got = cli_run(cli, "run", bundle, "--out", work / "loose", "--nproc", "2", "--secret-file", loose, timeout=60)
    check(got.returncode == 2 and str(loose) in got.stderr and "chmod 600" in got.stderr
          and len(got.stderr.strip().splitlines()) == 1,
          f"a secret file others can read: exit {got.returncode} ({got.stderr.strip()[-200:]})")
    short = secret_file(work / "short-secret", "short\n")
    got = cli_run(cli, "run", bundle, "--out", work / "short", "--nproc", "2", "--secret-file", short, timeout=60)
    check(got.returncode == 2 and "shorter than 16 bytes" in got.stderr,
          f"a secret file too short: exit {got.returncode} ({got.stderr.strip()[-200:]})")
    got = cli_run(cli, "run", bundle, "--out", work / "nccl", "--nproc", "2", "--dist-backend", "nccl", timeout=60)
    check(got.returncode == 2 and "nccl" in got.stderr and len(got.stderr.strip().splitlines()) == 1
          and not (work / "nccl").exists(),
          f"--dist-backend nccl on this build: exit {got.returncode} ({got.stderr.strip()[-200:]})")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cli", required=True)
    ap.add_argument("--work", required=True)
    args = ap.parse_args()
    cli, work = args.cli, Path(args.work)
    if work.exists():
        subprocess.run(["rm", "-rf", str(work)], check=True)
    work.mkdir(parents=True)
    bundle = work / PRESET
    if not check(cli_run(cli, "synth", PRESET, bundle).returncode == 0, f"synth {PRESET}"):
        sys.exit(1)
    one = cli_run(cli, "run", bundle, "--out", work / "one", "--json")
    reference = {"code": one.returncode, "report": json.loads(one.stdout) if one.returncode in (0, 1) else None}
    check_usage(cli, bundle, work)
    check_stranger_on_store(cli, bundle, reference, work)
    check_forged_peers(cli, bundle, reference, work)
    print(f"{len(failures)} failure(s)")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
