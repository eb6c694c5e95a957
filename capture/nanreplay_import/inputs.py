"""Bounded reading of the user's files: a FIFO or device refused before it is opened, JSON and
the log refused by size and depth before they are parsed, a tensor shape checked before it is
allocated. Hostile input ends as BadInput, never as a hang or an exhausted machine."""

import json
import math
import os
import stat

from .outcome import BadInput


def _check_regular(path, key):
    """A FIFO, device or socket given as a file would block or never end: refused before it is opened."""
    try:
        mode = os.stat(path).st_mode
    except OSError as e:
        raise BadInput(path, key, f"cannot be read ({e.strerror})") from None
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
        kind = "a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else "a device"
        raise BadInput(path, key, f"is {kind}, not a file")


# Bounds on the text inputs, far above any real one, so a hostile file is refused by its size before
# it is parsed (json.loads holds the whole text and its objects in memory).
_MAX_JSON_BYTES = 64 * 2**20      # config.json, params.json, model.safetensors.index.json, trainer_state.json
_MAX_SAMPLES_BYTES = 512 * 2**20  # --samples: per-step, per-rank sample lists
_MAX_LOG_BYTES = 2**30            # --log: read line by line, each line bounded too
_MAX_LOG_LINE = 2**20
_MAX_JSON_DEPTH = 32              # real configs nest 3 or 4 levels
_MAX_DCP_METADATA_BYTES = 2**30   # a DCP .metadata: one entry per tensor chunk per rank


def _parse_json(text, path, key="json"):
    try:
        obj = json.loads(text)
    except RecursionError:
        raise BadInput(path, key, f"nested deeper than {_MAX_JSON_DEPTH} levels") from None
    except ValueError as e:
        raise BadInput(path, key, f"not valid JSON ({e})") from None
    stack = [(obj, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > _MAX_JSON_DEPTH:
            raise BadInput(path, key, f"nested deeper than {_MAX_JSON_DEPTH} levels")
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return obj


def _read_json(path, limit=_MAX_JSON_BYTES):
    _check_regular(path, "file")
    size = os.stat(path).st_size
    if size > limit:
        raise BadInput(path, "file", f"{size} bytes, more than the {limit >> 20} MiB any real one needs; "
                                     "refused before reading")
    try:
        with open(path, "rb") as f:
            return _parse_json(f.read(limit + 1).decode("utf-8"), path)
    except OSError as e:
        raise BadInput(path, "file", f"cannot be read ({e.strerror})") from None
    except UnicodeDecodeError as e:
        raise BadInput(path, "json", f"not UTF-8 text ({e.reason} at byte {e.start})") from None


def bounded_lines(path, max_bytes, max_line, too_big, too_long):
    """(line number, text) of a text file, streamed: refused before reading when over `max_bytes`
    (`too_big(size)` says why), each line at most `max_line` bytes (`too_long` says why) and UTF-8."""
    size = os.stat(path).st_size
    if size > max_bytes:
        raise BadInput(path, "file", too_big(size))
    try:
        with open(path, "rb") as f:
            for n, raw in enumerate(iter(lambda: f.readline(max_line + 1), b""), 1):
                if len(raw) > max_line:
                    raise BadInput(path, f"line {n}", too_long)
                try:
                    yield n, raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise BadInput(path, f"line {n}", f"not UTF-8 text ({e.reason})") from None
    except OSError as e:
        raise BadInput(path, "file", f"cannot be read ({e.strerror})") from None


def _log_lines(path):
    """(line number, text) of a JSON-lines log, streamed: the file's size and each line bounded."""
    _check_regular(path, "--log")
    return bounded_lines(
        path, _MAX_LOG_BYTES, _MAX_LOG_LINE,
        lambda size: (f"{size} bytes, more than the {_MAX_LOG_BYTES >> 30} GiB a log of the steps to import needs "
                      "(cut it to the steps around them); refused before reading"),
        f"longer than {_MAX_LOG_LINE >> 20} MiB: not a log line")


def _check_shape(path, name, shape):
    """A shape torch can hold: at most 8 dimensions, none negative, and (zeros aside) fewer than 2^40
    elements, so a zero-size tensor cannot name dimensions whose strides overflow."""
    if len(shape) > 8 or any(s < 0 for s in shape) or math.prod(s for s in shape if s) >= 2**40:
        raise BadInput(path, name, f"shape {shape[:9]} is not a tensor's (at most 8 dimensions, each >= 0, "
                                   "fewer than 2^40 elements)")
