"""The steps' window: the log, the samples (or token offsets) and the data shards."""

import hashlib
import json
import math
import os
from pathlib import Path

import nanreplay_capture as _capture

from .inputs import _MAX_SAMPLES_BYTES, _log_lines, _read_json
from .outcome import BadInput


_TOKEN_WIDTH = {"uint16": 2, "uint32": 4}


def _number(value, where, key):
    if isinstance(value, str) and value.lower() in ("nan", "inf", "+inf", "-inf", "infinity", "-infinity", "+infinity"):
        return float(value.lower().replace("infinity", "inf"))
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    raise BadInput(where, key, f"must be a number (or \"nan\", \"inf\", \"-inf\"), got {value!r}")


def read_log(path, first, last):
    """{step: {lr, loss, grad_norm?, loss_scale?, skipped?}} for FIRST..LAST from JSON lines."""
    entries = {}
    for n, line in _log_lines(path):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError as e:
            raise BadInput(path, f"line {n}", f"not a JSON object ({e})")
        if not isinstance(obj, dict) or not isinstance(obj.get("step"), int) or isinstance(obj.get("step"), bool):
            raise BadInput(path, f"line {n}.step", "every line needs an integer step")
        step = obj["step"]
        if not first <= step <= last:
            continue
        if step in entries:
            raise BadInput(path, f"line {n}.step", f"step {step} logged twice")
        e = {}
        for key in ("lr", "aux_lr", "loss", "grad_norm", "loss_scale"):
            if obj.get(key) is not None:
                e[key] = _number(obj[key], path, f"step {step}.{key}")
        if obj.get("skipped") is not None:
            if not isinstance(obj["skipped"], bool):
                raise BadInput(path, f"step {step}.skipped", "must be true or false")
            e["skipped"] = obj["skipped"]
        entries[step] = e
    for step in range(first, last + 1):
        if step not in entries:
            raise BadInput(path, f"step {step}", f"missing: the log needs every step from {first} to {last}")
        e = entries[step]
        if "loss" not in e:
            raise BadInput(path, f"step {step}.loss", "missing")
        if step < last or "lr" in e:
            if "lr" not in e:
                raise BadInput(path, f"step {step}.lr", "missing: the replay applies this step's update with it")
            for key in ("lr", "aux_lr"):
                if key in e and not (math.isfinite(e[key]) and 0 < e[key] <= 1e3):
                    raise BadInput(path, f"step {step}.{key}", f"{e[key]} is not in (0, 1e3]")
    return entries


def read_samples(path, first, last, world, per_rank):
    """({step: per-rank rows}, "samples" or "offsets"): sample indices, or (a step's value
    {"offsets": [...]}) each row's first token in the concatenated shards, for loaders that read at
    arbitrary offsets (nanoGPT's get_batch: its ix)."""
    obj = _read_json(path, _MAX_SAMPLES_BYTES)
    if not isinstance(obj, dict):
        raise BadInput(path, "samples", "must be a JSON object from step to per-rank sample lists")
    out, kinds = {}, set()
    for step in range(first, last + 1):
        rows = obj.get(str(step))
        if rows is None:
            raise BadInput(path, str(step), f"missing: every step from {first} to {last} needs its samples")
        kinds.add("offsets" if isinstance(rows, dict) else "samples")
        if isinstance(rows, dict):
            if set(rows) != {"offsets"}:
                raise BadInput(path, str(step), "an object must be {\"offsets\": [per-rank token offsets]}")
            rows = rows["offsets"]
        if world == 1 and isinstance(rows, list) and rows and not isinstance(rows[0], list):
            rows = [rows]
        if not isinstance(rows, list) or len(rows) != world or any(
                not isinstance(r, list) or len(r) != per_rank or any(
                    not isinstance(i, int) or isinstance(i, bool) or i < 0 for i in r) for r in rows):
            raise BadInput(path, str(step), f"needs {world} rank list(s) of micro_batch_size * grad_accum = {per_rank} "
                                            "non-negative sample indices (or token offsets)")
        out[step] = rows
    if len(kinds) > 1:
        raise BadInput(path, "samples", "mixes sample lists and {\"offsets\": ...} between steps; use one for all")
    return out, kinds.pop()


def copy_windows(args, offsets, out_dir):
    """Rows given as token offsets: one compact shard data/window.bin of the windows read, the rows
    rewritten as its sample indices, exactly as the capture helper's window copy does (its code)."""
    from types import SimpleNamespace
    L = args.seq_len
    try:
        source = _capture._TokenSource({"shards": [{"path": str(p), "dtype": d}
                                                   for p, d in zip(args.data, args.token_dtypes)]})
    except (_capture.CaptureError, OSError) as e:
        raise BadInput(args.data[0], "--data", str(e))
    for step, rows in offsets.items():
        for r in rows:
            for o in r:
                if o + L + 1 > source.total_tokens:
                    raise BadInput(args.samples, str(step), f"offset {o}: tokens [{o}, {o + L + 1}) lie past the "
                                                            f"data's {source.total_tokens} tokens")
    slots = [SimpleNamespace(rows=offsets[s]) for s in sorted(offsets)]
    shard, runs, index = _capture.Recorder._copy_windows(SimpleNamespace(data={"seq_len": L}, source=source),
                                                        out_dir, slots)
    samples = {s: [[index[o] for o in r] for r in offsets[s]] for s in offsets}
    return [shard], shard["tokens"], samples, {s: offsets[s] for s in offsets}


def copy_shards(paths, dtypes, out_dir):
    """The shards into data/, in the order given, each with its own token width: hard-linked when the
    filesystem allows (a symlink resolved first: linking the link itself would dangle), else copied."""
    shards, used, total = [], set(), 0
    for i, (given, dtype) in enumerate(zip(paths, dtypes)):
        width = _TOKEN_WIDTH[dtype]
        given, src = Path(given), Path(given).resolve()
        if not src.is_file():
            raise BadInput(given, "--data", "does not exist or is not a file")
        size = src.stat().st_size
        if size == 0 or size % width:
            raise BadInput(given, "--data", f"{size} bytes is not a whole number of {dtype} tokens")
        name = given.name if given.name not in used else f"{i:03d}_{given.name}"
        used.add(name)
        rel = f"data/{name}"
        dst = out_dir / rel
        digest = hashlib.sha256()
        try:
            os.link(src, dst)  # same filesystem: no copy
            with open(src, "rb") as f:
                for chunk in iter(lambda: f.read(8 * 2**20), b""):
                    digest.update(chunk)
        except OSError:
            with open(src, "rb") as f, open(dst, "wb") as o:
                for chunk in iter(lambda: f.read(8 * 2**20), b""):
                    digest.update(chunk)
                    o.write(chunk)
        shards.append({"path": rel, "dtype": dtype, "tokens": size // width, "sha256": digest.hexdigest()})
        total += size // width
    return shards, total
