"""What the CLI tests that compare two replays share: a checklist, the CLI run, the presets `synth --help`
lists, report.json and trace.h5 compared bit for bit, and the workers a launcher started
(test_stream_presets.py, test_distributed.py, test_distributed_security.py).
Debian's python3 (h5py for the trace)."""
from pathlib import Path

import h5py
import numpy as np

import synth_cache

VOLATILE = ("timings", "elapsed_seconds")  # the report keys two replays of one bundle may differ in

failures = []


def children(pid):
    """(pid, state) of each process whose parent is `pid`, read from /proc: the workers a launcher started."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append((int(entry.name), fields[0]))
    return found


def check(ok, what):
    print(("ok   " if ok else "FAIL ") + what, flush=True)
    if not ok:
        failures.append(what)
    return ok


def cli_run(cli, *args, env=None, timeout=600):
    """`cli args...`, captured as text; a plain `synth` comes from the tests' cache (synth_cache.py)."""
    return synth_cache.run(cli, args, env=env, timeout=timeout)


def listed_presets(cli):
    text = cli_run(cli, "synth", "--help").stdout
    lines = text.split("presets:", 1)[1].splitlines() if "presets:" in text else []
    return [line.split()[0] for line in lines if line.strip()]


def trace_items(path):
    """Every dataset and attribute of a trace, but the file's creation time."""
    items = {}
    with h5py.File(path, "r") as f:
        def visit(name, obj):
            if isinstance(obj, h5py.Dataset):
                items[name] = obj[()]
            for key, value in obj.attrs.items():
                items[name + "@" + key] = value
        f.visititems(visit)
        for key, value in f.attrs.items():
            if key != "created_utc":
                items["@" + key] = value
    return items


def same_value(a, b):
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return np.array_equal(a, b, equal_nan=a.dtype.kind == "f")


def trace_difference(a, b):
    """The trace items (datasets, attributes) that differ between two traces, sorted."""
    x, y = trace_items(a), trace_items(b)
    return sorted(k for k in set(x) | set(y) if k not in x or k not in y or not same_value(x[k], y[k]))


def report_difference(a, b):
    """The top-level report.json keys that differ, but the volatile ones, sorted."""
    return sorted(k for k in set(a) | set(b) if k not in VOLATILE and a.get(k) != b.get(k))


def stable(report):
    return {k: v for k, v in report.items() if k not in VOLATILE}
