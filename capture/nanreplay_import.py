"""nanreplay import: write a rolling-forward bundle (bundle v1 and its extensions) from a checkpoint
a user already has, in their framework's format and parameter naming, plus the token data, the data
order and what the training log says.

    /usr/bin/python3 capture/nanreplay_import.py --checkpoint PATH [--optimizer PATH]
        [--format auto|hf|torch|dcp] [--naming auto|hf|meta|torchtitan|megatron|nanogpt] [--config FILE]
        --data SHARD... [--token-dtype uint16|uint32] --seq-len N --micro-batch-size N [--grad-accum N]
        [--world-size N] (--sampler-seed N [--epoch N] [--epoch-start-step N] | --samples FILE)
        --log FILE --steps FIRST:LAST [--precision fp32|bf16|fp16|fp8] [--grad-clip X]
        [--betas B1,B2] [--eps X] [--weight-decay X] [--trust-pickle] --out DIR

`nanreplay import` (the C++ command) runs this script with the same flags into a fresh staging
directory, validates the result as `inspect` does and renames it into place. Run directly, the
script writes DIR itself (created; refused when it exists and is not empty). Bad input: exit 2 with
one line `nanreplay: error: <file>: <key>: <what is wrong>` on stderr. Needs torch (1.13 or later)
and the standard library only. Every pickle (torch.save files, torch.distributed.checkpoint
directories, whose format is parsed here) is read by a restricted unpickler that refuses anything but
tensors, plain data and a named list of framework classes; --trust-pickle lifts that for a file the
user trusts. --data may be repeated (shards in order); --token-dtype once, or once per shard.

Reference: docs/import.md in the nanreplay repository.
"""

import argparse
import hashlib
import io
import json
import math
import os
import pickle
import re
import shutil
import stat
import sys
from pathlib import Path

# `nanreplay import` sets this to a file: the helper writes its outcome there (the lines it printed, its
# warnings, or its one error) and leaves printing the error to the command, which prints every command's
# errors the same way (one stderr line, and under --json one object on stdout).
_RESULT_ENV = "NANREPLAY_IMPORT_RESULT"
_outcome = {"notes": [], "warnings": []}


def _write_outcome(extra=None):
    path = os.environ.get(_RESULT_ENV)
    if path:
        with open(path, "w", encoding="utf-8") as f:
            json.dump({**_outcome, **(extra or {})}, f)
    return bool(path)


def fail(exit_code, kind, what, file=None, key=None):
    """One error, exit_code returned: told to `nanreplay import` through its file, or printed here when run
    alone, as `nanreplay: error: <file>: <key>: <what>`."""
    message = ": ".join(str(p) for p in (file, key, what) if p)
    error = {"exit_code": exit_code, "kind": kind, "message": message, "what": str(what)}
    if file is not None:
        error.update(file=str(file), key=str(key or ""))
    if not _write_outcome({"error": error}):
        print(f"nanreplay: error: {message}", file=sys.stderr, flush=True)
    return exit_code


def warn(text):
    """Something the user should know that does not stop the import: always stderr, never stdout."""
    _outcome["warnings"].append(text)
    print(f"nanreplay: warning: {text}", file=sys.stderr, flush=True)


try:
    import torch
except ImportError as _e:  # one line, as for any input the import cannot use
    sys.exit(fail(2, "bad_input", f"cannot be imported ({_e}); the import needs PyTorch (Debian: apt-get install "
                                  "python3-torch; or set NANREPLAY_PYTHON to a Python that has it)",
                  sys.executable, "torch"))

sys.path.insert(0, str(Path(__file__).resolve().parent))
import nanreplay_capture as _capture  # noqa: E402  (safetensors writer, the bundle's parameter table, HF options)

IMPORT_VERSION = 1
FORMATS = ("auto", "hf", "torch", "dcp")
NAMINGS = ("auto", "hf", "meta", "torchtitan", "megatron", "nanogpt")
_TOKEN_WIDTH = {"uint16": 2, "uint32": 4}
_ST_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool}
_FLOAT_TYPES = (torch.float32, torch.bfloat16, torch.float16)


class BadInput(Exception):
    """Input that cannot make a valid bundle: names the file and the key."""

    def __init__(self, file, key, what):
        super().__init__(f"{file}: {key}: {what}")
        self.file, self.key, self.what = str(file), str(key), str(what)

    def line(self):
        return f"nanreplay: error: {self.file}: {self.key}: {self.what}"


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


def _log_lines(path):
    """(line number, text) of a JSON-lines log, streamed: the file's size and each line bounded."""
    _check_regular(path, "--log")
    size = os.stat(path).st_size
    if size > _MAX_LOG_BYTES:
        raise BadInput(path, "file", f"{size} bytes, more than the {_MAX_LOG_BYTES >> 30} GiB a log of the steps "
                                     "to import needs (cut it to the steps around them); refused before reading")
    try:
        with open(path, "rb") as f:
            for n, raw in enumerate(iter(lambda: f.readline(_MAX_LOG_LINE + 1), b""), 1):
                if len(raw) > _MAX_LOG_LINE:
                    raise BadInput(path, f"line {n}", f"longer than {_MAX_LOG_LINE >> 20} MiB: not a log line")
                try:
                    yield n, raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise BadInput(path, f"line {n}", f"not UTF-8 text ({e.reason})") from None
    except OSError as e:
        raise BadInput(path, "file", f"cannot be read ({e.strerror})") from None


def say(*parts):
    _outcome["notes"].append(" ".join(str(p) for p in parts))
    print(*parts, flush=True)


# ---------------------------------------------------------------------------
# Reading checkpoints: safetensors, torch.save, torch.distributed.checkpoint.

def _check_shape(path, name, shape):
    """A shape torch can hold: at most 8 dimensions, none negative, and (zeros aside) fewer than 2^40
    elements, so a zero-size tensor cannot name dimensions whose strides overflow."""
    if len(shape) > 8 or any(s < 0 for s in shape) or math.prod(s for s in shape if s) >= 2**40:
        raise BadInput(path, name, f"shape {shape[:9]} is not a tensor's (at most 8 dimensions, each >= 0, "
                                   "fewer than 2^40 elements)")


def read_safetensors(path):
    """{name: tensor} of a safetensors file (8-byte LE header length, JSON header, raw LE data)."""
    path = Path(path)
    _check_regular(path, "file")
    size = path.stat().st_size
    out = {}
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise BadInput(path, "header", "shorter than the 8-byte header length")
        n = int.from_bytes(head, "little")
        if n > min(100 * 2**20, size - 8):
            raise BadInput(path, "header", f"header length {n} does not fit the {size}-byte file")
        try:
            header = _parse_json(f.read(n).decode("utf-8"), path, "header")
        except UnicodeDecodeError as e:
            raise BadInput(path, "header", f"not UTF-8 JSON ({e.reason})") from None
        if not isinstance(header, dict):
            raise BadInput(path, "header", "not a JSON object")
        base = 8 + n
        for name, info in header.items():
            if name == "__metadata__":
                continue
            try:
                dtype = _ST_DTYPES[info["dtype"]]
                shape = [int(s) for s in info["shape"]]
                begin, end = (int(x) for x in info["data_offsets"])
            except (KeyError, TypeError, ValueError, OverflowError):
                raise BadInput(path, name, "needs dtype (F32, F16, BF16, ...), shape and data_offsets") from None
            _check_shape(path, name, shape)
            numel = math.prod(shape)
            width = torch.empty((), dtype=dtype).element_size()
            if end - begin != numel * width or begin < 0 or base + end > size:
                raise BadInput(path, name, f"data_offsets [{begin}, {end}] do not hold shape {shape} of {info['dtype']}")
            f.seek(base + begin)
            buf = bytearray(f.read(end - begin))
            t = torch.frombuffer(buf, dtype=dtype) if buf else torch.empty(0, dtype=dtype)
            out[name] = t.reshape(shape)
    return out


# ---------------------------------------------------------------------------
# Reading pickles without running them. A pickle names callables and classes that the reader calls
# while loading; a crafted checkpoint names os.system. Every pickle here (torch.save zip and legacy,
# DCP .metadata and items) goes through _SafeUnpickler, whose table holds only what checkpoints
# legitimately store. --trust-pickle is the user's explicit opt-out, said and recorded.

class PickleRefused(pickle.UnpicklingError):
    """A global outside the table: names it, so the one line can."""

    def __init__(self, module, name):
        super().__init__(f"refusing global {module}.{name}")
        self.global_name = f"{module}.{name}"


class _Stub:
    """Inert stand-in for a class of a framework namespace (DCP's metadata dataclasses, Megatron's
    enums, ...), pickled by copyreg.__newobj__ and BUILD; TensorProperties pickles a tuple. Calling
    it only records its arguments: no framework code is imported or run."""

    def __init__(self, *args, **kwargs):
        self._args = args
        self.__dict__.update(kwargs)

    def __setstate__(self, state):
        if isinstance(state, dict):
            self.__dict__.update(state)
        elif isinstance(state, tuple) and len(state) == 2 and isinstance(state[1], dict) \
                and (state[0] is None or isinstance(state[0], dict)):
            self.__dict__.update(state[0] or {})
            self.__dict__.update(state[1])
        else:
            self._state = state


def _layout_by_name(name):
    layout = getattr(torch, str(name).rsplit(".", 1)[-1], None)
    if not isinstance(layout, torch.layout):
        raise pickle.UnpicklingError(f"unknown tensor layout {name!r}")
    return layout


def _from_data(kind):
    """bytes / bytearray of given data only: bytes(N) from a pickle would allocate N bytes."""
    def make(*args):
        if args and not isinstance(args[0], (bytes, bytearray, str)):
            raise pickle.UnpicklingError(f"{kind.__name__} of a {type(args[0]).__name__}")
        return kind(*args)
    return make


def _safe_table():
    """(module, name) -> object: tensors and their storages, dtypes and friends, plain containers,
    and the few framework classes real checkpoints hold (argparse.Namespace: Megatron's args;
    io.BytesIO: TransformerEngine's and torchtitan's extra state; numpy arrays: Megatron's RNG state)."""
    import _codecs
    import argparse as _argparse
    import builtins
    import collections
    import copyreg
    table = {("torch", n): getattr(torch, n) for n in dir(torch)
             if isinstance(getattr(torch, n, None), (torch.dtype, torch.layout, torch.memory_format))
             or (n.endswith("Storage") and isinstance(getattr(torch, n, None), type))}
    table.update({("torch", "Size"): torch.Size, ("torch", "device"): torch.device,
                  ("torch.serialization", "_get_layout"): _layout_by_name})
    for module, owner in (("torch.storage", torch.storage), ("torch._utils", torch._utils)):
        for n in ("TypedStorage", "UntypedStorage", "_rebuild_tensor", "_rebuild_tensor_v2", "_rebuild_tensor_v3",
                  "_rebuild_parameter", "_rebuild_parameter_with_state", "_rebuild_meta_tensor_no_storage"):
            if hasattr(owner, n):
                table[(module, n)] = getattr(owner, n)
    table.update({("builtins", n): getattr(builtins, n) for n in ("set", "frozenset", "tuple", "list", "dict",
                                                                   "slice", "complex", "int", "float", "str", "bool",
                                                                   "object")})
    table[("builtins", "bytes")], table[("builtins", "bytearray")] = _from_data(bytes), _from_data(bytearray)
    table.update({("collections", "OrderedDict"): collections.OrderedDict, ("_codecs", "encode"): _codecs.encode,
                  ("copyreg", "_reconstructor"): copyreg._reconstructor, ("argparse", "Namespace"): _argparse.Namespace,
                  ("_io", "BytesIO"): io.BytesIO, ("io", "BytesIO"): io.BytesIO})
    try:
        import numpy
        core = getattr(numpy, "_core", None) or numpy.core
        for name in ("numpy.core.multiarray", "numpy._core.multiarray"):
            table[(name, "_reconstruct")] = core.multiarray._reconstruct
            table[(name, "scalar")] = core.multiarray.scalar
        table[("numpy", "ndarray")], table[("numpy", "dtype")] = numpy.ndarray, numpy.dtype
        dtypes = getattr(numpy, "dtypes", None)  # numpy >= 1.25 pickles some dtypes by their class
        table.update({("numpy.dtypes", n): getattr(dtypes, n) for n in dir(dtypes) if n.endswith("DType")})
    except (ImportError, AttributeError):
        pass
    return table


_SAFE_TABLE = _safe_table()
# Whole namespaces whose classes load as inert _Stub records (never imported): DCP's metadata, and the
# training frameworks whose checkpoints hold their own small classes (enums, config records).
_STUB_NAMESPACES = ("torch.distributed.checkpoint.", "torch.distributed._shard.", "megatron.", "olmo_core.",
                    "torchtitan.", "pathlib.")
_STUBS = {}


def _safe_global(module, name):
    import _compat_pickle  # protocol 2 writes Python 2's names (__builtin__.set): what find_class would map
    if (module, name) in _compat_pickle.NAME_MAPPING:
        module, name = _compat_pickle.NAME_MAPPING[(module, name)]
    module = _compat_pickle.IMPORT_MAPPING.get(module, module)
    found = _SAFE_TABLE.get((module, name))
    if found is not None:
        return found
    if (module + ".").startswith(_STUB_NAMESPACES) and name.isidentifier() and not name.startswith("__"):
        key = (module, name)
        if key not in _STUBS:
            _STUBS[key] = type(name, (_Stub,), {"_module": module})
        return _STUBS[key]
    raise PickleRefused(module, name)


class _SafeUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        return _safe_global(module, name)


class _SafePickleModule:
    """What torch.load's pickle_module= needs (zip and legacy formats both unpickle through it)."""
    __name__ = "nanreplay_safe_pickle"
    Unpickler = _SafeUnpickler
    UnpicklingError = pickle.UnpicklingError

    @staticmethod
    def load(f, **kwargs):
        return _SafeUnpickler(f, **kwargs).load()


_trust_pickle = False  # set once from --trust-pickle by build(); read by every loader below


def _refusal(where, e):
    return BadInput(where, "pickle", f"refused: it loads {e.global_name}, which a checkpoint does not need and "
                                     "could run code (--trust-pickle loads it anyway, for a file you trust)")


def _is_torchscript(source):
    """torch.load hands a TorchScript archive to torch.jit.load, which runs its code: asked the way
    torch.load asks (its own zip reader), so the two cannot disagree."""
    ser = torch.serialization
    f = source if isinstance(source, io.BytesIO) else open(source, "rb")
    start = f.tell()
    try:
        if not ser._is_zipfile(f):
            return False
        f.seek(start)
        with ser._open_zipfile_reader(f) as z:
            return ser._is_torchscript_zip(z)
    except RuntimeError:
        return False  # not a zip torch can read: torch.load says so
    except AttributeError:  # a torch without these helpers: the archive's marker file, read with zipfile
        import zipfile
        f.seek(start)
        try:
            return any(n.rsplit("/", 1)[-1] == "constants.pkl" for n in zipfile.ZipFile(f).namelist())
        except (zipfile.BadZipFile, OSError, ValueError):
            return False
    finally:
        if f is source:
            f.seek(start)
        else:
            f.close()


def _load_public(source):
    return torch.load(source, map_location="cpu", weights_only=False, pickle_module=_SafePickleModule)


def _load_internal(source):
    """torch.load's own two readers, called with the safe unpickler: torch 1.13's torch.load drops
    pickle_module= unless weights_only is set, and its weights_only table cannot be extended."""
    ser = torch.serialization
    f = source if isinstance(source, io.BytesIO) else open(source, "rb")
    try:
        if ser._is_zipfile(f):
            with ser._open_zipfile_reader(f) as z:
                return ser._load(z, "cpu", _SafePickleModule, encoding="utf-8")
        return ser._legacy_load(f, "cpu", _SafePickleModule, encoding="utf-8")
    finally:
        if f is not source:
            f.close()


_safe_loader = None  # the first of the two that this torch proves to honour the safe unpickler


def _proven_safe_loader():
    """Which way of loading really goes through _SafeUnpickler here, proven on a harmless pickle the
    table refuses (collections.Counter), in both the zip and the legacy format; None: neither does."""
    global _safe_loader
    if _safe_loader is None:
        import collections
        probes = []
        for zipped in (True, False):
            buf = io.BytesIO()
            try:
                torch.save({"probe": collections.Counter()}, buf, _use_new_zipfile_serialization=zipped)
            except Exception:  # noqa: BLE001  (a torch that no longer writes the legacy format)
                continue
            probes.append(buf)
        _safe_loader = False
        for candidate in (_load_public, _load_internal):
            refused = 0
            for buf in probes:
                buf.seek(0)
                try:
                    candidate(buf)
                except PickleRefused:
                    refused += 1
                except Exception as e:
                    refused += isinstance(e.__cause__ or e.__context__, PickleRefused)
            if probes and refused == len(probes):
                _safe_loader = candidate
                break
    return _safe_loader or None


def _torch_load(source, where):
    if not isinstance(source, io.BytesIO):
        _check_regular(source, "file")
    try:
        if _trust_pickle:
            return torch.load(source, map_location="cpu", weights_only=False)
        if _is_torchscript(source):
            raise BadInput(where, "torch.load", "a TorchScript archive (torch.jit.save), not a checkpoint")
        loader = _proven_safe_loader()
        if loader is None:
            raise BadInput(where, "pickle", f"torch {torch.__version__} cannot load it through a restricted unpickler; "
                                            "only --trust-pickle loads it (for a file you trust)")
        return loader(source)
    except BadInput:
        raise
    except PickleRefused as e:
        raise _refusal(where, e) from None
    except RecursionError:
        raise BadInput(where, "torch.load", "nested deeper than the unpickler allows") from None
    except Exception as e:
        refused = e.__cause__ or e.__context__
        if isinstance(refused, PickleRefused):
            raise _refusal(where, refused) from None
        raise BadInput(where, "torch.load", f"cannot be read ({type(e).__name__}: {e})") from None


def _dcp_reader_available():
    try:
        from torch.distributed.checkpoint import FileSystemReader  # noqa: F401
        from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner  # noqa: F401
        from torch.distributed.checkpoint.state_dict_loader import _load_state_dict  # noqa: F401
        return True
    except Exception:
        return False


def read_dcp_with_torch(path):
    """PyTorch's own reader (torch >= 2.2): the whole checkpoint as a nested state dict."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
    sd = {}
    _load_state_dict(sd, storage_reader=FileSystemReader(str(path)), planner=_EmptyStateDictLoadPlanner(),
                     no_dist=True)
    return sd


def read_dcp_metadata(path):
    meta_path = Path(path) / ".metadata"
    _check_regular(meta_path, ".metadata")
    size = os.stat(meta_path).st_size
    if size > _MAX_DCP_METADATA_BYTES:
        raise BadInput(meta_path, "file", f"{size} bytes, more than the {_MAX_DCP_METADATA_BYTES >> 30} GiB any real "
                                          "DCP metadata needs; refused before unpickling")
    try:
        with open(meta_path, "rb") as f:
            md = _SafeUnpickler(f).load()
    except PickleRefused as e:
        raise _refusal(meta_path, e) from None
    except RecursionError:
        raise BadInput(meta_path, "pickle", "nested deeper than the unpickler allows") from None
    except (pickle.UnpicklingError, EOFError, AttributeError, ValueError, TypeError, IndexError) as e:
        raise BadInput(meta_path, "pickle", f"not a torch.distributed.checkpoint metadata file ({e})")
    for attr in ("state_dict_metadata", "storage_data"):
        if not isinstance(getattr(md, attr, None), dict):
            raise BadInput(meta_path, attr, "missing: not a torch.distributed.checkpoint Metadata")
    return md


def read_dcp_from_format(path):
    """torch.distributed.checkpoint's on-disk format read directly (for a torch without that module):
    `.metadata` is a pickled Metadata (state_dict_metadata: fqn -> TensorStorageMetadata(properties,
    size, chunks) or BytesStorageMetadata; storage_data: MetadataIndex(fqn, offset) -> _StorageInfo(
    relative_path, offset, length); planner_data: flattened key -> path in the nested state dict),
    and each stored item is a torch.save blob at (relative_path, offset, length) of a .distcp file:
    one chunk of a tensor, placed at the chunk's offsets, or a pickled object."""
    root = Path(path)
    md = read_dcp_metadata(root)
    meta_path = root / ".metadata"
    by_fqn = {}
    for index, info in md.storage_data.items():
        fqn = getattr(index, "fqn", None)
        if not isinstance(fqn, str):
            raise BadInput(meta_path, "storage_data", "an index without fqn")
        by_fqn.setdefault(fqn, []).append((index, info))
    files = {}

    def blob(fqn, info):
        rel = getattr(info, "relative_path", None)
        if not isinstance(rel, str) or "/" in rel or rel in ("", ".", ".."):
            raise BadInput(meta_path, fqn, f"storage file {rel!r} is not a file name inside the checkpoint")
        if getattr(info, "transform_descriptors", None):
            raise BadInput(meta_path, fqn, f"stored with transforms {info.transform_descriptors}, which this reader "
                                           "does not undo (read it with torch >= 2.8's own reader)")
        if rel not in files:
            p = root / rel
            if not p.is_file():
                raise BadInput(p, fqn, "storage file missing")
            files[rel] = (open(p, "rb"), p.stat().st_size)  # read item by item: checkpoints are large
        f, size = files[rel]
        off, length = int(info.offset), int(info.length)
        if off < 0 or length < 0 or off + length > size:
            raise BadInput(root / rel, fqn, f"item at [{off}, {off + length}) lies outside the {size}-byte file")
        f.seek(off)
        return f.read(length)

    flat = {}
    for fqn, item in md.state_dict_metadata.items():
        pieces = by_fqn.get(fqn, [])
        try:
            if type(item).__name__ == "BytesStorageMetadata":
                if len(pieces) != 1:
                    raise BadInput(meta_path, fqn, f"{len(pieces)} stored items for a bytes entry")
                flat[fqn] = _torch_load(io.BytesIO(blob(fqn, pieces[0][1])), root / pieces[0][1].relative_path)
            else:
                flat[fqn] = _assemble_tensor(root, meta_path, fqn, item, pieces, blob)
        except (AttributeError, TypeError, ValueError, OverflowError) as e:  # a hostile .metadata's odd fields
            raise BadInput(meta_path, fqn, f"not a DCP entry ({type(e).__name__}: {e})") from None
    for f, _ in files.values():
        f.close()
    try:
        return _unflatten(flat, getattr(md, "planner_data", None), meta_path)
    except (AttributeError, TypeError, IndexError) as e:  # paths that mix a list and a dict at one place
        raise BadInput(meta_path, "planner_data", f"not a nested state dict's paths ({type(e).__name__}: {e})") from None


def _assemble_tensor(root, meta_path, fqn, item, pieces, blob):
    """One tensor from its stored chunks, which must tile it exactly (no overlap, no gap: a gap would
    be uninitialised memory in the bundle). Its size is checked against the bytes stored for it
    before the tensor is allocated."""
    props = getattr(item, "properties", None)
    state = getattr(props, "_state", None)
    dtype = state[0] if isinstance(state, tuple) and state else getattr(props, "dtype", None)
    if not isinstance(dtype, torch.dtype):
        raise BadInput(meta_path, fqn, "tensor entry without a dtype")
    size = [int(s) for s in item.size]
    _check_shape(meta_path, fqn, size)
    stored = sum(int(info.length) for _, info in pieces)
    if math.prod(size) * torch.empty((), dtype=dtype).element_size() > stored:
        raise BadInput(meta_path, fqn, f"size {size} of {dtype} needs more bytes than the {stored} stored for it")
    full = torch.empty(size, dtype=dtype)
    boxes = []
    for index, info in pieces:
        chunk = _torch_load(io.BytesIO(blob(fqn, info)), root / info.relative_path)
        if not isinstance(chunk, torch.Tensor):
            raise BadInput(root / info.relative_path, fqn, "stored item is not a tensor")
        offsets = [int(o) for o in (index.offset or [0] * len(size))]
        box = [(o, o + s) for o, s in zip(offsets, chunk.shape)]
        if len(offsets) != len(size) or len(chunk.shape) != len(size) or any(
                o < 0 or end > n for (o, end), n in zip(box, size)):
            raise BadInput(root / info.relative_path, fqn,
                           f"chunk {list(chunk.shape)} at {offsets} does not fit the tensor's {size}")
        if any(all(lo < e and o < hi for (o, e), (lo, hi) in zip(box, other)) for other in boxes if box):
            raise BadInput(root / info.relative_path, fqn, f"chunk {list(chunk.shape)} at {offsets} overlaps another")
        boxes.append(box)
        view = full
        for dim, (o, s) in enumerate(zip(offsets, chunk.shape)):
            view = view.narrow(dim, o, s)
        view.copy_(chunk)
    covered = sum(math.prod(e - o for o, e in box) for box in boxes)
    if covered != full.numel():
        raise BadInput(meta_path, fqn, f"stored chunks cover {covered} of {full.numel()} elements")
    return full


def _unflatten(flat, planner_data, where=".metadata"):
    """The nested state dict DCP flattened (planner_data: flat key -> path of keys and list indices)."""
    if not isinstance(planner_data, dict) or not planner_data:
        return flat
    out = {}
    for key, value in flat.items():
        path = planner_data.get(key)
        if not isinstance(path, (tuple, list)) or not path:
            out[key] = value
            continue
        if not all(isinstance(p, str) or (isinstance(p, int) and not isinstance(p, bool) and 0 <= p <= len(flat))
                   for p in path) or not (isinstance(path[0], str) and len(path) <= _MAX_JSON_DEPTH):
            # a list index past the number of entries would only pad with holes (or exhaust memory)
            raise BadInput(where, f"planner_data.{key}", f"path {list(path)[:_MAX_JSON_DEPTH]} is not a nested state dict's")
        node = out
        for part, nxt in zip(path[:-1], path[1:]):
            container = [] if isinstance(nxt, int) else {}
            if isinstance(node, list):
                while len(node) <= part:
                    node.append(None)
                if node[part] is None:
                    node[part] = container
                node = node[part]
            else:
                node = node.setdefault(part, container)
        last = path[-1]
        if isinstance(node, list):
            while len(node) <= last:
                node.append(None)
            node[last] = value
        else:
            node[last] = value
    return out


def read_dcp(path):
    """PyTorch's own reader unpickles .metadata and bytes items with the full unpickler, so it is
    used only under --trust-pickle; otherwise the format is parsed here, every pickle restricted."""
    if _trust_pickle and _dcp_reader_available():
        try:
            return read_dcp_with_torch(path), "PyTorch's torch.distributed.checkpoint reader (--trust-pickle)"
        except Exception:
            pass  # fall back to the format itself (e.g. a planner this torch does not know)
    return read_dcp_from_format(path), "parsed from the DCP file format"


def detect_format(path):
    p = Path(path)
    if not p.exists():
        raise BadInput(p, "--checkpoint", "does not exist")
    if p.is_dir():
        if (p / ".metadata").is_file():
            return "dcp", ".metadata"
        for name in ("model.safetensors.index.json", "model.safetensors", "config.json", "pytorch_model.bin"):
            if (p / name).is_file():
                return "hf", name
        if any(p.glob("*.safetensors")):
            return "hf", "*.safetensors"
        raise BadInput(p, "--checkpoint", "a directory with neither .metadata (DCP) nor config.json / *.safetensors "
                                          "(Hugging Face)")
    with open(p, "rb") as f:
        head = f.read(8)
    if p.suffix == ".safetensors":
        return "hf", "*.safetensors file"
    if head[:2] == b"PK" or head[:1] == b"\x80":
        return "torch", "torch.save file (zip)" if head[:2] == b"PK" else "torch.save file (legacy pickle)"
    raise BadInput(p, "--checkpoint", "neither a torch.save file, a safetensors file nor a checkpoint directory")


def read_hf(path):
    """(state dict, config dict or None, files read) of a Hugging Face directory or a safetensors file."""
    p = Path(path)
    if p.is_file():
        return read_safetensors(p), None, [p.name]
    config = None
    if (p / "config.json").is_file():
        config = _read_json(p / "config.json")
    index = p / "model.safetensors.index.json"
    sd, files = {}, []
    if index.is_file():
        index_json = _read_json(index)
        weight_map = index_json.get("weight_map") if isinstance(index_json, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise BadInput(index, "weight_map", "missing or empty")
        for name in dict.fromkeys(weight_map.values()):  # each shard once, in first-mention order
            if not isinstance(name, str) or "/" in name or name in ("", ".", ".."):
                raise BadInput(index, "weight_map", f"{name!r} is not a file name in the directory")
            if not (p / name).is_file():
                raise BadInput(index, "weight_map", f"shard {name} does not exist")
            part = read_safetensors(p / name)
            for key in part:
                if weight_map.get(key) != name:
                    raise BadInput(p / name, key, f"not listed for this shard in {index.name}")
            sd.update(part)
            files.append(name)
        missing = sorted(set(weight_map) - set(sd))
        if missing:
            raise BadInput(index, "weight_map", f"{missing[0]} is listed but in no shard")
    elif (p / "model.safetensors").is_file():
        sd, files = read_safetensors(p / "model.safetensors"), ["model.safetensors"]
    elif (p / "pytorch_model.bin").is_file():
        sd, files = _torch_load(p / "pytorch_model.bin", p / "pytorch_model.bin"), ["pytorch_model.bin"]
    else:
        shards = sorted(p.glob("*.safetensors"))
        if not shards:
            raise BadInput(p, "--checkpoint", "no model.safetensors.index.json, model.safetensors or *.safetensors")
        for s in shards:
            sd.update(read_safetensors(s))
        files = [s.name for s in shards]
    return sd, config, files


# ---------------------------------------------------------------------------
# Finding the model's and the optimizer's state in what was loaded.

_MODEL_KEYS = ("model", "state_dict", "model_state_dict", "module", "net", "params", "app", "weights")
_OPTIM_KEYS = ("optimizer", "optim", "optimizer_state_dict", "optimizer_state", "opt")


def _tensor_count(d):
    return sum(isinstance(v, torch.Tensor) for v in d.values()) if isinstance(d, dict) else 0


def find_model_state(obj, where):
    """The state dict inside a loaded checkpoint: the object itself, or nested under a key such as
    `model` (nanoGPT, llama2.c), `state_dict`, `module`, `app.model` (DCP)."""
    if not isinstance(obj, dict):
        raise BadInput(where, "state dict", f"the checkpoint holds a {type(obj).__name__}, not a dict of tensors")
    path = []
    node = obj
    for _ in range(4):
        if _tensor_count(node) >= 2:
            return {k: v for k, v in node.items() if isinstance(v, torch.Tensor)}, ".".join(path)
        nxt = next((k for k in _MODEL_KEYS if isinstance(node.get(k), dict)), None)
        if nxt is None:
            break
        path.append(nxt)
        node = node[nxt]
    raise BadInput(where, "state dict", "no dict of tensors at the top level or under "
                                        + ", ".join(repr(k) for k in _MODEL_KEYS))


def find_optimizer_state(obj):
    """(optimizer state dict, key path) nested in a loaded checkpoint, or (None, None)."""
    if not isinstance(obj, dict):
        return None, None
    if "state" in obj and "param_groups" in obj:
        return obj, ""
    if any(isinstance(k, str) and k.startswith("state.") for k in obj):  # flatten_optimizer_state_dict
        return obj, ""
    for key in _OPTIM_KEYS:
        if isinstance(obj.get(key), dict):
            found, path = find_optimizer_state(obj[key])
            if found is not None:
                return found, key + ("." + path if path else "")
    for key in _OPTIM_KEYS:  # a flat DCP state dict: "optimizer.state.<fqn>.exp_avg", ...
        inner = {k[len(key) + 1:]: v for k, v in obj.items() if isinstance(k, str) and k.startswith(key + ".state.")}
        if inner:
            inner.update({k[len(key) + 1:]: v for k, v in obj.items()
                          if isinstance(k, str) and k.startswith(key + ".param_groups.")})
            return inner, key
    return None, None


def _meta_config(obj):
    """A config dict carried inside a torch.save checkpoint (nanoGPT's and llama2.c's model_args)."""
    if isinstance(obj, dict):
        for key in ("model_args", "model_config", "config", "args", "hyper_parameters"):
            value = obj.get(key)
            if isinstance(value, dict) and value:
                return value, key
            if value is not None and hasattr(value, "__dict__") and not isinstance(value, torch.Tensor):
                return dict(vars(value)), key  # argparse.Namespace (Megatron's args)
    return None, None


# ---------------------------------------------------------------------------
# Naming presets: the user's framework's parameter names onto bundle v1's (HF llama, nanoGPT gpt2).

# Known non-parameter buffers, skipped by name: rotary caches (inv_freq, freqs_cis, HF's cos/sin caches),
# attention masks (llama2.c's attention.mask, nanoGPT's attn.bias, HF's causal_mask) and TE's _extra_state.
_IGNORED = re.compile(r"(.*\._extra_state|.*rotary_emb\.inv_freq|.*\.inv_freq|(?:.*\.)?freqs_cis|(?:.*\.)?freqs_cos|"
                      r"(?:.*\.)?freqs_sin|.*rotary_emb\.(?:cos|sin)_cached|(?:.*\.)?causal_mask|"
                      r".*\.attention\.mask|.*\.attn\.mask|"
                      r"rope\.freqs|.*\.attn\.bias|.*\.attn\.masked_bias|"
                      # a flat DCP state dict's other entries (no planner_data to nest them)
                      r"(?:optimizer|optim|rng_state|rerun_state_machine_state|lr_scheduler|train_state|dataloader)\..*)$")

_DETECT = [  # (naming, key regex): the first that matches any key of the state dict
    ("torchtitan", r"layers\.0\.attention\.qkv_linear\.wq\.weight"),
    ("meta", r"layers\.0\.attention\.wq\.weight"),
    ("megatron", r"decoder\.layers\.(0\.)?self_attention\.linear_qkv\.weight"),
    ("megatron", r"embedding\.word_embeddings\.weight"),
    ("nanogpt", r"transformer\.wte\.weight"),
    ("hf", r"model\.embed_tokens\.weight"),
    ("meta", r"tok_embeddings\.weight"),
]

_META = _capture.META_NAMES  # meta / torchtitan / llama2.c: the capture helper's preset table

_MEGATRON = [  # Megatron-core (GPTModel with TransformerEngine's fused LayerNormLinear, or the plain layer spec)
    (r"embedding\.word_embeddings\.weight", "model.embed_tokens.weight"),
    (r"decoder\.layers\.(\d+)\.self_attention\.linear_qkv\.layer_norm_weight", "model.layers.{0}.input_layernorm.weight"),
    (r"decoder\.layers\.(\d+)\.input_layernorm\.weight", "model.layers.{0}.input_layernorm.weight"),
    (r"decoder\.layers\.(\d+)\.self_attention\.linear_qkv\.weight", "qkv:model.layers.{0}.self_attn.{{}}_proj.weight"),
    (r"decoder\.layers\.(\d+)\.self_attention\.linear_qkv\.bias", "qkv:model.layers.{0}.self_attn.{{}}_proj.bias"),
    (r"decoder\.layers\.(\d+)\.self_attention\.linear_proj\.weight", "model.layers.{0}.self_attn.o_proj.weight"),
    (r"decoder\.layers\.(\d+)\.self_attention\.q_layernorm\.weight", "model.layers.{0}.self_attn.q_norm.weight"),
    (r"decoder\.layers\.(\d+)\.self_attention\.k_layernorm\.weight", "model.layers.{0}.self_attn.k_norm.weight"),
    (r"decoder\.layers\.(\d+)\.mlp\.linear_fc1\.layer_norm_weight", "model.layers.{0}.post_attention_layernorm.weight"),
    (r"decoder\.layers\.(\d+)\.pre_mlp_layernorm\.weight", "model.layers.{0}.post_attention_layernorm.weight"),
    (r"decoder\.layers\.(\d+)\.mlp\.linear_fc1\.weight", "fc1:model.layers.{0}.mlp.{{}}_proj.weight"),
    (r"decoder\.layers\.(\d+)\.mlp\.linear_fc2\.weight", "model.layers.{0}.mlp.down_proj.weight"),
    (r"decoder\.final_layernorm\.weight", "model.norm.weight"),
    (r"output_layer\.weight", "lm_head.weight"),
]

_HF_MOE = re.compile(r"model\.layers\.\d+\.mlp\.(gate\.weight|experts\.\d+\.(gate|up|down)_proj\.weight)")


def group_names(names, limit=12):
    """Names in one short line: layer indices folded ("layers.{0-31}.attention.wq.weight"), in first-seen
    order, at most `limit` groups then how many more. So an error can list every name it means."""
    groups = {}
    for name in names:
        m = re.search(r"(?:^|\.)(\d+)(?=\.)", name)
        if m is None:
            groups.setdefault(name, [])
            continue
        template = name[:m.start(1)] + "{}" + name[m.end(1):]
        groups.setdefault(template, []).append(int(m.group(1)))
    shown = []
    for template, idx in groups.items():
        if not idx:
            shown.append(template)
            continue
        idx = sorted(set(idx))
        contiguous = len(idx) > 1 and idx == list(range(idx[0], idx[-1] + 1))
        span = f"{idx[0]}-{idx[-1]}" if contiguous else ",".join(map(str, idx))
        shown.append(template.replace("{}", "{" + span + "}" if len(idx) > 1 else str(idx[0])))
    more = len(shown) - limit
    return ", ".join(shown[:limit]) + (f" and {more} more" if more > 0 else "")


def detect_naming(keys):
    for naming, pattern in _DETECT:
        rx = re.compile(r"(?:.*\.)?" + pattern)
        for key in keys:
            if rx.fullmatch(key):
                return naming, key
    raise BadInput("--checkpoint", "naming", "no known parameter naming (hf, meta, torchtitan, megatron, nanogpt) "
                                             f"matches keys such as {sorted(keys)[:3]}; pass --naming")


def strip_prefix(sd, naming):
    """Drop wrappers' prefixes (torch.compile's _orig_mod., DDP's module., a model. nesting of a
    non-HF naming) so the preset's names match."""
    out = {}
    for key, value in sd.items():
        k = key
        changed = True
        while changed:
            changed = False
            for prefix in ("_orig_mod.", "module.", "_fsdp_wrapped_module.", "_checkpoint_wrapped_module."):
                if k.startswith(prefix):
                    k, changed = k[len(prefix):], True
            k = k.replace("._orig_mod.", ".").replace("._fsdp_wrapped_module.", ".").replace(
                "._checkpoint_wrapped_module.", ".")
            if naming != "hf" and k.startswith("model.") and not k.startswith("model.embed_tokens"):
                k, changed = k[len("model."):], True
        if k in out:
            raise BadInput("--checkpoint", key, f"is {k} after removing wrapper prefixes, which another key also is")
        out[k] = value
    return out


def unstack_megatron_layers(sd, num_layers):
    """Megatron's torch_dist checkpoints store each layer parameter once for the whole decoder,
    `decoder.layers.<name>` with the layer as the leading axis; split it into decoder.layers.N.<name>."""
    out = {}
    for key, value in sd.items():
        m = re.fullmatch(r"decoder\.layers\.([a-z_]+\..*)", key)
        if m and not re.match(r"\d+\.", m.group(1)) and isinstance(value, torch.Tensor):
            if num_layers is None or value.dim() < 1 or value.shape[0] != num_layers:
                raise BadInput("--checkpoint", key, "a layer-stacked Megatron tensor needs num_layers in --config "
                                                    f"equal to its leading size {list(value.shape)[:1]}")
            for i in range(num_layers):
                out[f"decoder.layers.{i}.{m.group(1)}"] = value[i]
        else:
            out[key] = value
    return out


class Mapper:
    """Maps one framework's named tensors (parameters, or one AdamW moment of each) onto bundle v1's
    keys, the same way for both, so moments follow their parameters."""

    def __init__(self, naming, cfg):
        self.naming, self.cfg = naming, cfg
        table = {"meta": _META, "torchtitan": _META, "megatron": _MEGATRON}.get(naming)
        self.table = [(re.compile(p), t) for p, t in table] if table else None

    def target(self, key):
        """Bundle key (or a 'qkv:'/'fc1:' split template) for a source key; None when ignored."""
        if _IGNORED.fullmatch(key):
            return None
        if self.table is None:  # hf and nanogpt names are the bundle's own
            return key
        for rx, template in self.table:
            m = rx.fullmatch(key)
            if m:
                return template.format(*m.groups())
        return "?" + key

    def map(self, tensors, where, strict=True):
        out, unknown = {}, []
        for key, t in tensors.items():
            target = self.target(key)
            if target is None:
                continue
            if target.startswith("?"):
                unknown.append(key)
                continue
            if target.startswith("qkv:"):
                for part, piece in zip("qkv", self.split_qkv(t, key, where)):
                    out[target[4:].format(part)] = piece
            elif target.startswith("fc1:"):
                if t.shape[0] % 2:
                    raise BadInput(where, key, f"linear_fc1 has {t.shape[0]} rows: gate and up stacked need an even count")
                gate, up = t.split(t.shape[0] // 2, 0)
                out[target[4:].format("gate")], out[target[4:].format("up")] = gate, up
            else:
                if target in out:
                    raise BadInput(where, key, f"maps onto {target}, which another key also maps onto")
                out[target] = t
        if unknown and strict:
            unknown_set = set(unknown)
            known = [k for k in tensors if k not in unknown_set and self.target(k) is not None]
            raise BadInput(where, unknown[0], f"not a parameter of the {self.naming} naming's llama (bundle v1 has no "
                                              f"place for it); the checkpoint's names the preset does not know: "
                                              f"{group_names(unknown)}; those it maps: {group_names(known, 6)}")
        return out

    def split_qkv(self, t, key, where):
        """Megatron's linear_qkv: per query group g, [the group's H/G query heads, its key head, its
        value head] along the output rows."""
        H, G, C = self.cfg["num_heads"], self.cfg["num_kv_heads"], self.cfg["hidden_size"]
        D = C // H
        rows = (H + 2 * G) * D
        if t.shape[0] != rows:
            raise BadInput(where, key, f"has {t.shape[0]} rows; {H} query heads and {G} query groups of head_dim {D} "
                                       f"need (H + 2G) * D = {rows}")
        rest = tuple(t.shape[1:])
        per = t.reshape((G, (H // G + 2) * D) + rest)
        q = per[:, :H // G * D].reshape((H * D,) + rest)
        k = per[:, H // G * D:H // G * D + D].reshape((G * D,) + rest)
        v = per[:, H // G * D + D:].reshape((G * D,) + rest)
        return q.contiguous(), k.contiguous(), v.contiguous()


# ---------------------------------------------------------------------------
# The model config: read from config.json, params.json, model_args, Megatron args, or --config.

_ALIASES = {  # manifest key: source keys in order of preference
    "vocab_size": ("vocab_size", "padded_vocab_size"),
    "hidden_size": ("hidden_size", "dim", "n_embd", "d_model"),
    "num_layers": ("num_layers", "num_hidden_layers", "n_layers", "n_layer"),
    "num_heads": ("num_heads", "num_attention_heads", "n_heads", "n_head"),
    "num_kv_heads": ("num_kv_heads", "num_key_value_heads", "n_kv_heads", "num_query_groups"),
    "intermediate_size": ("intermediate_size", "ffn_hidden_size"),
    "max_seq_len": ("max_seq_len", "max_position_embeddings", "block_size", "seq_length", "max_seq_length"),
    "norm_eps": ("norm_eps", "rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "norm_epsilon",
                 "layernorm_epsilon"),
    "rope_theta": ("rope_theta", "rotary_base", "rope_base"),
}


def normalize_config(raw, where):
    """Manifest model keys from a framework's config dict; keys it does not give are left out."""
    cfg = {}
    if not isinstance(raw, dict):
        raise BadInput(where, "config", "not a JSON object")
    for key, names in _ALIASES.items():
        for name in names:
            value = raw.get(name)
            if value is not None:
                cfg[key] = (value, name)
                break
    params = raw.get("rope_parameters")  # transformers >= 5 keeps rope_theta there
    if "rope_theta" not in cfg and isinstance(params, dict) and params.get("rope_theta") is not None:
        cfg["rope_theta"] = (params["rope_theta"], "rope_parameters.rope_theta")
    if raw.get("group_query_attention") is False and "num_kv_heads" in cfg and cfg["num_kv_heads"][1] == "num_query_groups":
        del cfg["num_kv_heads"]  # Megatron keeps num_query_groups even when GQA is off
    for key, (value, name) in list(cfg.items()):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if key in ("norm_eps", "rope_theta"):
            if not ok or value < 0 or (key == "rope_theta" and value <= 0):
                raise BadInput(where, name, f"must be a finite number{' > 0' if key == 'rope_theta' else ' >= 0'}, got {value!r}")
            cfg[key] = (float(value), name)
        elif not ok or value != int(value) or value <= 0:
            raise BadInput(where, name, f"must be an integer > 0, got {value!r}")
        else:
            cfg[key] = (int(value), name)
    for name in ("tie_word_embeddings", "tie_embeddings"):
        if isinstance(raw.get(name), bool):
            cfg["tie_embeddings"] = (raw[name], name)
    if isinstance(raw.get("untie_embeddings_and_output_weights"), bool):
        cfg["tie_embeddings"] = (not raw["untie_embeddings_and_output_weights"], "untie_embeddings_and_output_weights")
    return cfg


_MOE_BOUNDS = {"num_experts": 2**16, "num_local_experts": 2**16, "num_experts_per_tok": 2**16,
               "moe_intermediate_size": 2**24}


def _moe_config(raw, where, num_layers, tensor_count=None):
    """model.moe from a Hugging Face MoE config (Qwen3-MoE / Qwen2-MoE / Mixtral names); None when dense.
    The capture helper's reading (nanreplay_capture.moe_from_config), its refusals as bad input. Sizes
    are checked by name first: the parameter list is built per expert, so an absurd expert count would
    take gigabytes before any tensor is compared."""
    for name, bound in _MOE_BOUNDS.items():
        value = raw.get(name) if isinstance(raw, dict) else None
        if value is not None and value is not False and value != 0 and not (
                isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= bound):
            raise BadInput(where, name, f"must be an integer in [1, {bound}], got {value!r}")
    try:
        moe = _capture.moe_from_config(raw)
    except _capture.MoeConfigRefusal as e:
        raise BadInput(where, e.key, e.what) from None
    if moe and tensor_count is not None and moe["num_experts"] * num_layers > tensor_count:
        name = "num_experts" if isinstance(raw, dict) and raw.get("num_experts") else "num_local_experts"
        raise BadInput(where, name, f"{moe['num_experts']} experts in each of {num_layers} layers need at least "
                                    f"{moe['num_experts'] * num_layers} expert tensors; the checkpoint holds "
                                    f"{tensor_count} tensors in all")
    return moe


FLAG_OF = {"num_heads": "--num-heads", "num_kv_heads": "--num-kv-heads", "norm_eps": "--norm-eps",
           "rope_theta": "--rope-theta", "tie_embeddings": "--tie-embeddings"}
FLAGS_WHERE = "command line"


def flag_config(args):
    """The model values given as flags, spelled as --config's manifest keys: the first config source."""
    raw = {k: getattr(args, k, None) for k in FLAG_OF}
    return {k: v for k, v in raw.items() if v is not None}


def _kind_of(where, args):
    """Provenance kind of a config source: a flag, the user's --config, or what the run saved."""
    if where == FLAGS_WHERE:
        return "flag"
    return "config" if args.config and where == args.config else "checkpoint"


def framework_defaults(configs, naming):
    """{key: (value, why)} a recognised framework fixes in its code but does not save: llama2.c's
    ModelArgs (norm_eps 1e-5, rotary theta 10000) and nanoGPT's LayerNorm (eps 1e-5). Only where its
    model_args are recognised by their own keys; these are recorded as defaulted, never silently."""
    for raw, where in configs:
        if not str(where).endswith(": model_args"):
            continue
        keys = set(raw)
        if naming == "meta" and {"dim", "n_layers", "n_heads", "multiple_of"} <= keys:
            why = "llama2.c's ModelArgs default, which its model_args do not save"
            return {"norm_eps": (1e-5, why), "rope_theta": (10000.0, why)}
        if naming == "nanogpt" and {"n_layer", "n_head", "n_embd", "block_size"} <= keys:
            return {"norm_eps": (1e-5, "nanoGPT's LayerNorm hard-codes eps 1e-5, which its model_args do not save")}
    return {}


def required_values(arch, configs, naming, where):
    """Every value that changes the math and cannot be read off the tensors, checked at once: the one
    line names all that no config, flag or known framework default gives, and what the configs hold."""
    have = set()
    for raw, w in configs:
        have |= set(normalize_config(raw, w))
    have |= set(framework_defaults(configs, naming))
    needed = ["num_heads", "norm_eps"] + (["rope_theta"] if arch == "llama" else [])
    missing = [k for k in needed if k not in have]
    if not missing:
        return
    read = "; ".join(f"{w} ({', '.join(sorted(map(str, raw))[:12]) or 'empty'})" for raw, w in configs
                     if w != FLAGS_WHERE) or "none (no --config, and the checkpoint carries none)"
    raise BadInput(where, ", ".join(missing),
                   "missing: they change the math, the tensors cannot say them and no config gives them; pass "
                   + " ".join(f"{FLAG_OF[k]} X" for k in missing) + " (or give them in --config); configs read: "
                   + read)


def settle_model(arch, sd, naming, sources, args):
    """The manifest's model section: shapes read off the tensors, the rest from flags and configs
    (the first source that gives a key wins; a contradiction with the tensors is bad input), or a
    recognised framework's own default. Returns (model, provenance {key: (kind, detail)})."""
    cfg, origin, overridden = {}, {}, {}
    for raw, where in sources:
        for key, (value, name) in normalize_config(raw, where).items():
            if key not in cfg:
                cfg[key], origin[key] = value, (where, name)
            elif origin[key][0] == FLAGS_WHERE and value != cfg[key] and key not in overridden:
                overridden[key] = f" (overrides {where}: {name} {value!r})"  # the flag wins, and says so
    prov = {k: (_kind_of(w, args), FLAG_OF[k] + overridden.get(k, "") if w == FLAGS_WHERE else f"{w}: {n}")
            for k, (w, n) in origin.items()}
    for key, (value, why) in framework_defaults(sources, naming).items():
        if key not in cfg:
            cfg[key] = value
            prov[key] = ("default", why)
    model = {"arch": arch}
    src = "--checkpoint"

    def need(key):
        if key not in cfg:
            raise BadInput(sources[0][1] if sources else "--config", key,
                           f"missing: it cannot be read off the tensors; pass {FLAG_OF.get(key, 'it in --config')}"
                           + (" (or give it in --config)" if key in FLAG_OF else ""))
        return cfg[key]

    def settle(key, value, why):
        if key in cfg and cfg[key] != value:
            where, name = origin.get(key, ("--config", key))
            raise BadInput(FLAG_OF[key] if where == FLAGS_WHERE and key in FLAG_OF else where, name,
                           f"is {cfg[key]!r} but the checkpoint's tensors say {value!r} ({why})")
        model[key] = value
        prov.setdefault(key, ("tensors", why))

    H = need("num_heads")
    if arch == "llama":
        _settle_llama(sd, cfg, origin, prov, model, settle, need, H, args)
    else:
        wte, wpe = sd.get("transformer.wte.weight"), sd.get("transformer.wpe.weight")
        if wte is None or wpe is None:
            raise BadInput(src, "transformer.wte.weight" if wte is None else "transformer.wpe.weight", "missing")
        L = 0
        while f"transformer.h.{L}.ln_1.weight" in sd:
            L += 1
        settle("vocab_size", int(wte.shape[0]), "wte rows")
        settle("hidden_size", int(wte.shape[1]), "wte width")
        settle("num_layers", L, "layers")
        model["num_heads"] = H
        settle("max_seq_len", int(wpe.shape[0]), "wpe rows")
        model["num_kv_heads"] = H
        prov.setdefault("num_kv_heads", ("naming", "gpt2 has one key/value head per query head"))
        model["norm_eps"] = need("norm_eps")
        model["tie_embeddings"] = True
        prov["tie_embeddings"] = ("naming", "bundle v1's gpt2 ties the head to wte")
        head = sd.get("lm_head.weight")
        if head is not None and not (head.data_ptr() == wte.data_ptr() or torch.equal(head, wte)):
            raise BadInput(src, "lm_head.weight", "differs from transformer.wte.weight: bundle v1's gpt2 ties them")
        if cfg.get("tie_embeddings") is False:
            raise BadInput(*origin["tie_embeddings"], "false: bundle v1's gpt2 ties the head to wte")
    if model["max_seq_len"] < args.seq_len:
        raise BadInput("command line", "--seq-len", f"{args.seq_len} exceeds the model's max_seq_len {model['max_seq_len']}"
                       + (f" ({prov['max_seq_len'][1]})" if "max_seq_len" in prov else ""))
    return model, prov


def _settle_llama(sd, cfg, origin, prov, model, settle, need, H, args):
    src = "--checkpoint"
    embed = sd.get("model.embed_tokens.weight")
    if embed is None:
        raise BadInput(src, "model.embed_tokens.weight", "missing (after the naming preset)")
    V, C = embed.shape
    L = 0
    while f"model.layers.{L}.input_layernorm.weight" in sd:
        L += 1
    if L == 0:
        raise BadInput(src, "model.layers.0.input_layernorm.weight", "missing (after the naming preset)")
    settle("vocab_size", int(V), "embedding rows")
    settle("hidden_size", int(C), "embedding width")
    settle("num_layers", L, "layers")
    model["num_heads"] = H
    if C % H:
        where, name = origin["num_heads"]
        raise BadInput(FLAG_OF["num_heads"] if where == FLAGS_WHERE else where, name, f"{H} does not divide hidden_size {C}")
    k = sd.get("model.layers.0.self_attn.k_proj.weight")
    if k is None:
        raise BadInput(src, "model.layers.0.self_attn.k_proj.weight", "missing (after the naming preset)")
    settle("num_kv_heads", int(k.shape[0]) // (C // H), "k_proj rows / head_dim")
    gate = sd.get("model.layers.0.mlp.gate_proj.weight")
    if gate is not None:
        settle("intermediate_size", int(gate.shape[0]), "gate_proj rows")
    else:
        model["intermediate_size"] = need("intermediate_size")
    model["max_seq_len"] = cfg.get("max_seq_len", args.seq_len)  # llama's math does not depend on it
    prov.setdefault("max_seq_len", ("flag", "--seq-len (llama's math does not depend on it)"))
    model["norm_eps"] = need("norm_eps")
    model["rope_theta"] = need("rope_theta")
    head = sd.get("lm_head.weight")
    aliased = head is None or (head.shape == embed.shape and head.data_ptr() == embed.data_ptr())
    equal = head is not None and head.shape == embed.shape and torch.equal(head, embed)
    said = cfg.get("tie_embeddings")
    if said is False and head is None:
        raise BadInput(*origin["tie_embeddings"], "says the head is separate, but the checkpoint has no output head")
    if said is True and not (aliased or equal):
        raise BadInput(*origin["tie_embeddings"], "says the head is the embedding, but the checkpoint's output head "
                                                  "differs from it")
    if said is None and equal and not aliased:
        raise BadInput(src, "tie_embeddings", "the output head equals the embedding but is a separate tensor, so the "
                                              "checkpoint cannot say whether they are one parameter (tied) or two that "
                                              "AdamW updates apart; pass --tie-embeddings true or false")
    model["tie_embeddings"] = bool(said if said is not None else aliased)
    if said is None:
        prov["tie_embeddings"] = ("tensors", "the checkpoint's head " + ("is the embedding" if head is not None else
                                                                         "is absent: the embedding serves") if aliased
                                  else "the checkpoint's head is a separate tensor")


_ACTIVATION_KEYS = ("hidden_act", "hidden_activation", "activation", "activation_function", "act_fn")
_LLAMA_ACTIVATIONS = ("silu", "swish", "swiglu")
_GPT2_ACTIVATIONS = ("gelu_tanh", "gelu_new", "gelu_pytorch_tanh")


def settle_activation(arch, naming, configs, args):
    """(the activation bundle v1 computes, provenance): llama's SwiGLU (silu) and gpt2's tanh-GELU are
    its only ones, so a flag or config naming another is bad input, and where none says, the naming's
    convention is recorded (for nanoGPT as a default: its nn.GELU() is the erf form)."""
    ok = _LLAMA_ACTIVATIONS if arch == "llama" else _GPT2_ACTIVATIONS
    value = "silu" if arch == "llama" else "gelu_tanh"
    if args.activation is not None:
        if args.activation not in ok:
            raise BadInput("command line", "--activation", f"{args.activation!r}: bundle v1's {arch} computes {value} only")
        return value, ("flag", "--activation")
    for raw, where in configs:
        for key in _ACTIVATION_KEYS:
            said = raw.get(key)
            if isinstance(said, str):
                if said.lower() not in ok:
                    raise BadInput(where, key, f"{said!r}: bundle v1's {arch} computes {value} only")
                return value, (_kind_of(where, args), f"{where}: {key}")
    if arch == "llama":
        return value, ("naming", f"{naming} naming: a llama's SwiGLU MLP (silu)")
    return value, ("default", "bundle v1's gpt2 computes GELU's tanh form; nanoGPT's nn.GELU() is the erf form, so "
                              "the replay differs a little (pass --activation gelu_tanh if the run used the tanh form)")


def model_options(naming, configs, model, args):
    """llama's model options: the rotary convention (--rope-style, else the config, else the naming's),
    and what a Hugging Face style config says (through the capture helper's own reading of transformers
    configs). Returns (options, provenance {key: (kind, detail)})."""
    if model["arch"] != "llama":
        return {}, {}
    opts, notes = {}, {}
    if naming in ("meta", "torchtitan"):
        opts["rope_style"], notes["rope_style"] = "interleaved", ("naming", f"{naming} naming: rotary over adjacent "
                                                                            "pairs, weights as stored")
    else:
        notes["rope_style"] = ("naming", f"{naming} naming: rotary over halves (rotate_half)")
    for raw, where in configs:
        kind = _kind_of(where, args)
        if isinstance(raw.get("rotary_interleaved"), bool) and naming not in ("meta", "torchtitan"):
            style = "interleaved" if raw["rotary_interleaved"] else "rotate_half"
            if style == "interleaved":
                opts["rope_style"] = style
            notes["rope_style"] = (kind, f"{where}: rotary_interleaved")
        for key, ok in (("normalization", "RMSNorm"), ("position_embedding_type", "rope")):
            if key in raw and raw[key] != ok:
                raise BadInput(where, key, f"{raw[key]!r}: bundle v1's llama needs {ok!r}")
        if raw.get("swiglu") is False:
            raise BadInput(where, "swiglu", "false: bundle v1's llama has a SwiGLU MLP")
        if raw.get("qk_layernorm") is True:
            raise BadInput(where, "qk_layernorm", "Megatron's QK layernorm: give qk_norm ('head' or 'full') in --config")
        if raw.get("add_qkv_bias") is True or raw.get("add_bias_linear") is True:
            if raw.get("add_bias_linear") is True:
                raise BadInput(where, "add_bias_linear", "biases on every linear are not bundle v1's llama")
            opts["attention_bias"], notes["attention_bias"] = True, (kind, f"{where}: add_qkv_bias")
        for key in _capture.LLAMA_OPTION_DEFAULTS if "model_type" not in raw else ():  # manifest-style --config
            if key in raw and raw[key] is not None and key not in opts:
                try:
                    value = _capture._option_value(key, raw[key], key)
                except _capture.CaptureError as e:
                    raise BadInput(where, key, str(e))
                if value != _capture.LLAMA_OPTION_DEFAULTS[key]:
                    opts[key], notes[key] = value, (kind, f"{where}: {key}")
        if "model_type" in raw:
            try:
                said = _capture._options_from_config(raw, model["num_layers"])
            except _capture.CaptureError as e:
                raise BadInput(where, "config", str(e))
            for key, (value, why) in said.items():
                if key == "rope_style" and naming in ("meta", "torchtitan"):
                    continue  # a Meta-layout checkpoint next to an HF config: the weights decide
                if value != _capture.LLAMA_OPTION_DEFAULTS[key] and key not in opts:
                    opts[key], notes[key] = value, (kind, f"{where}: {why.replace('model.config', 'config')}")
            head_dim = raw.get("head_dim")
            if isinstance(head_dim, int) and head_dim != model["hidden_size"] // model["num_heads"]:
                raise BadInput(where, "head_dim", f"{head_dim}, but bundle v1's head_dim is hidden_size / num_heads = "
                                                  f"{model['hidden_size'] // model['num_heads']}")
    if args.rope_style is not None:
        if args.rope_style == "interleaved":
            opts["rope_style"] = "interleaved"
        else:
            opts.pop("rope_style", None)
        notes["rope_style"] = ("flag", "--rope-style" + (f" (overrides {notes['rope_style'][1]})"
                                                         if notes.get("rope_style") else ""))
    return opts, notes


def expected_parameters(model):
    """[(key, shape)] bundle v1 needs, with model.moe's expert parameters in place of the dense MLP
    (the capture helper's list: nanreplay_capture.expected_parameters)."""
    return _capture.expected_parameters(model["arch"], model)


def check_parameters(sd, model, where):
    spec = expected_parameters(model)
    names = {k for k, _ in spec}
    missing, wrong = [], []
    for key, shape in spec:
        t = sd.get(key)
        if t is None:
            missing.append(key)
        elif tuple(t.shape) != tuple(shape):
            wrong.append(f"{key} is {list(t.shape)}, bundle v1 needs {list(shape)}")
    if missing:
        unused = [k for k in sd if k not in names and not (k == "lm_head.weight" and model.get("tie_embeddings"))]
        raise BadInput(where, missing[0], f"missing (bundle v1's {model['arch']} needs it{_why(missing[0])}); "
                                          f"all {len(missing)} missing: {group_names(missing)}; the checkpoint's own "
                                          f"names left over (after the naming preset): "
                                          + (group_names(unused) if unused else "none"))
    if wrong:
        raise BadInput(where, wrong[0].split(" ")[0], wrong[0].split(" ", 1)[1])
    extra = sorted(k for k in sd if k not in names and not (k == "lm_head.weight" and model.get("tie_embeddings")))
    if extra:
        raise BadInput(where, extra[0], "not a parameter of the bundle's model" + _extra_hint(extra[0])
                       + (f" ({len(extra) - 1} more)" if len(extra) > 1 else ""))
    for key, _ in spec:
        if sd[key].dtype not in _FLOAT_TYPES:
            if sd[key].dtype == torch.float64:
                sd[key] = sd[key].float()
            else:
                raise BadInput(where, key, f"is {sd[key].dtype}; bundle v1 stores F32, BF16 or F16")
    return [(k, sd[k].contiguous()) for k, _ in spec]


def _why(key):
    if key.endswith("_proj.bias"):
        return ", with attention_bias"
    if "_norm." in key:
        return ", with qk_norm"
    return ""


def _extra_hint(key):
    if key.endswith("_proj.bias") and "self_attn" in key:
        return ": q/k/v biases need attention_bias (config model_type qwen2, or attention_bias: true in --config)"
    if re.search(r"self_attn\.[qk]_norm", key):
        return ": QK-norm weights need qk_norm ('head' or 'full') in --config"
    if _HF_MOE.fullmatch(key):
        return ": expert weights need the config's num_experts / num_experts_per_tok"
    return ""


# ---------------------------------------------------------------------------
# The optimizer: AdamW state keyed by name, or a plain state_dict() with integer ids.

def _unflatten_optimizer(flat):
    """torch.distributed.checkpoint.state_dict's flatten_optimizer_state_dict layout
    ({"state.<fqn>.exp_avg": t, "param_groups.<fqn>.lr": x}) as the nested one."""
    state, groups = {}, {}
    for key, value in flat.items():
        if not isinstance(key, str):
            continue
        m = re.fullmatch(r"state\.(.+)\.(exp_avg|exp_avg_sq|step|max_exp_avg_sq)", key)
        if m:
            state.setdefault(m.group(1), {})[m.group(2)] = value
            continue
        m = re.fullmatch(r"param_groups\.(.+)\.([a-z_]+)", key)
        if m:
            groups.setdefault(m.group(1), {})[m.group(2)] = value
    by_settings = {}
    if groups and all(k.isdigit() and isinstance(v.get("params"), list) for k, v in groups.items()):
        return {"state": state, "param_groups": [groups[k] for k in sorted(groups, key=int)]}  # DCP-flattened list
    for fqn, settings in groups.items():
        sig = json.dumps({k: v for k, v in settings.items() if k != "params"}, sort_keys=True, default=str)
        by_settings.setdefault(sig, dict(settings, params=[]))["params"].append(fqn)
    return {"state": state, "param_groups": list(by_settings.values())}


def _recover_ids(opt, source_names, shapes, where):
    """Integer ids of a plain optimizer.state_dict() onto parameter names. The ids count the
    parameters in the order the param groups listed them; that order is recovered as one of:
      "model order": a single group over model.parameters() (the state dict's order, aliases dropped);
      "nanoGPT order": nanoGPT's and llama2.c's configure_optimizers, group 0 the parameters of two or
        more dimensions, group 1 the others, each in model order.
    The order must reproduce every group's size and every moment's shape; otherwise it is bad input."""
    groups = opt["param_groups"]
    ids = [list(g.get("params", [])) for g in groups]
    sizes = [len(g) for g in ids]
    candidates = []
    if len(groups) == 1:
        candidates.append(("model order (one param group over model.parameters())", [source_names]))
    decay = [n for n in source_names if len(shapes[n]) >= 2]
    nodecay = [n for n in source_names if len(shapes[n]) < 2]
    if len(groups) == 2:
        candidates.append(("nanoGPT/llama2.c order (configure_optimizers: >= 2-D parameters, then the rest)",
                           [decay, nodecay]))
    for label, order in candidates:
        if [len(o) for o in order] != sizes:
            continue
        mapping = {}
        for group_ids, group_names in zip(ids, order):
            for i, n in zip(group_ids, group_names):
                mapping[i] = n
        ok = all(tuple(s["exp_avg"].shape) == tuple(shapes[mapping[i]])
                 for i, s in opt["state"].items() if i in mapping and isinstance(s, dict) and "exp_avg" in s)
        if ok and set(opt["state"]) <= set(mapping):
            return mapping, label
    raise BadInput(where, "param_groups", f"integer parameter ids in groups of sizes {sizes} match neither a single "
                                          f"group in model order ({len(source_names)} parameters) nor nanoGPT's two "
                                          f"groups ({len(decay)} of >= 2 dimensions, {len(nodecay)} others); save the "
                                          "optimizer keyed by name (get_optimizer_state_dict)")


def read_optimizer(opt, where, source_sd, mapper, model, args):
    """(moments {bundle key: (exp_avg, exp_avg_sq)}, AdamW step count, hyper-parameters, notes)."""
    if not isinstance(opt, dict):
        raise BadInput(where, "optimizer", f"a {type(opt).__name__}, not an optimizer state dict")
    if "state" not in opt and any(isinstance(k, str) and k.startswith("state.") for k in opt):
        opt = _unflatten_optimizer(opt)
    state, groups = opt.get("state"), opt.get("param_groups")
    if not isinstance(state, dict) or not isinstance(groups, list) or not groups:
        raise BadInput(where, "state", "an AdamW state needs 'state' and 'param_groups'")
    notes = []
    # Source names of the parameters, in model order, aliases (tied weights) dropped.
    source_sd = strip_prefix(source_sd, mapper.naming)
    seen, source_names = {}, []
    for name, t in source_sd.items():
        if _IGNORED.fullmatch(name) or not t.is_floating_point():
            continue
        key = (t.data_ptr(), tuple(t.shape), t.dtype)
        if t.numel() and key in seen:
            continue
        seen[key] = name
        source_names.append(name)
    shapes = {n: tuple(source_sd[n].shape) for n in source_names}
    if all(isinstance(k, int) for k in state) and all(isinstance(i, int) for g in groups for i in g.get("params", [])):
        mapping, label = _recover_ids(opt, source_names, shapes, where)
        notes.append(f"integer ids, {label}")
        state = {mapping[i]: s for i, s in state.items()}
        groups = [dict(g, params=[mapping[i] for i in g.get("params", [])]) for g in groups]
    else:
        notes.append("keyed by parameter name")
        state = {strip_prefix({k: None}, mapper.naming).popitem()[0] if isinstance(k, str) else k: v
                 for k, v in state.items()}
        groups = [dict(g, params=[strip_prefix({p: None}, mapper.naming).popitem()[0] if isinstance(p, str) else p
                                  for p in g.get("params", [])]) for g in groups]
    steps, m, v = set(), {}, {}
    for name, s in state.items():
        if not isinstance(s, dict) or "exp_avg" not in s or "exp_avg_sq" not in s:
            raise BadInput(where, f"state.{name}", "needs exp_avg and exp_avg_sq (is this AdamW's state?)")
        if s.get("max_exp_avg_sq") is not None:
            raise BadInput(where, f"state.{name}.max_exp_avg_sq", "amsgrad is not bundle v1's AdamW")
        step = s.get("step", 0)
        steps.add(int(float(step.item() if isinstance(step, torch.Tensor) else step)))
        m[name], v[name] = s["exp_avg"], s["exp_avg_sq"]
    if len(steps) > 1:
        raise BadInput(where, "state.*.step", f"AdamW step counts differ across parameters ({sorted(steps)}); "
                                              "bundle v1 has one")
    if model["arch"] == "llama" and mapper.naming == "megatron":
        m = unstack_megatron_layers(m, model["num_layers"])
        v = unstack_megatron_layers(v, model["num_layers"])
    bm, bv = mapper.map(m, where, strict=False), mapper.map(v, where, strict=False)
    if model.get("tie_embeddings"):
        embed = "model.embed_tokens.weight" if model["arch"] == "llama" else "transformer.wte.weight"
        for d in (bm, bv):
            if "lm_head.weight" in d and embed not in d:
                d[embed] = d["lm_head.weight"]  # the tied parameter's state under the head's name
            d.pop("lm_head.weight", None)
    moments = {}
    if not state:  # saved before the first update: AdamW starts from zero moments, step 0
        notes.append("no per-parameter state yet (before the first update): zero moments")
        return None, 0, _hyper_parameters(groups, where, model, mapper, args, notes), notes
    for key, _ in expected_parameters(model):
        if key not in bm or key not in bv:
            raise BadInput(where, f"state.{key}", "no AdamW moments for this parameter (after the naming preset), "
                                                  "while others have some: bundle v1 has one step count for all")
        moments[key] = (bm[key], bv[key])
    hyper = _hyper_parameters(groups, where, model, mapper, args, notes)
    return moments, (steps.pop() if steps else 0), hyper, notes


def _group_param_keys(group, mapper, model):
    keys = []
    for p in group.get("params", []):
        if not isinstance(p, str):
            continue
        target = mapper.target(p)
        if mapper.naming == "megatron":
            m = re.fullmatch(r"decoder\.layers\.([a-z_]+\..*)", p)
            if m:  # layer-stacked: every layer
                keys += [k for i in range(model["num_layers"])
                         for k in _group_param_keys({"params": [f"decoder.layers.{i}.{m.group(1)}"]}, mapper, model)]
                continue
        if target is None or target.startswith("?"):
            continue
        if target.startswith("qkv:"):
            keys += [target[4:].format(x) for x in "qkv"]
        elif target.startswith("fc1:"):
            keys += [target[4:].format(x) for x in ("gate", "up")]
        else:
            keys.append(target)
    return keys


def _hyper_parameters(groups, where, model, mapper, args, notes):
    """betas, eps, weight_decay (and no_decay) from the param groups; flags where the groups do not
    say; PyTorch's AdamW defaults otherwise. A flag that contradicts the groups is bad input."""
    out = {}
    for key, flag, default in (("betas", args.betas, [0.9, 0.999]), ("eps", args.eps, 1e-8)):
        values = {json.dumps(list(g[key]) if key == "betas" else float(g[key])) for g in groups if key in g}
        if len(values) > 1:
            raise BadInput(where, f"param_groups.{key}", f"differs between groups ({sorted(values)}); bundle v1 has one")
        if values:
            value = json.loads(values.pop())
            value = [float(b) for b in value] if key == "betas" else float(value)
            if flag is not None and flag != value:
                raise BadInput("--" + key.replace("_", "-"), key, f"{flag} contradicts the optimizer state's {value}")
            out[key] = value
            notes.append(f"{key} {value} (param_groups)")
        else:
            out[key] = flag if flag is not None else default
            notes.append(f"{key} {out[key]} ({'flag' if flag is not None else 'PyTorch default'})")
    for g in groups:
        if g.get("amsgrad") or g.get("maximize"):
            raise BadInput(where, "param_groups.amsgrad" if g.get("amsgrad") else "param_groups.maximize",
                           "bundle v1's AdamW has neither amsgrad nor maximize")
    decays = {float(g["weight_decay"]) for g in groups if "weight_decay" in g}
    nonzero = sorted(d for d in decays if d != 0.0)
    if len(nonzero) > 1:
        raise BadInput(where, "param_groups.weight_decay", f"several non-zero values {nonzero}; bundle v1 has one "
                                                           "weight decay (plus parameters without decay)")
    if decays:
        wd = nonzero[0] if nonzero else 0.0
        if args.weight_decay is not None and args.weight_decay != wd:
            raise BadInput("--weight-decay", "weight_decay", f"{args.weight_decay} contradicts the optimizer state's {wd}")
        out["weight_decay"] = wd
        no_decay = []
        if nonzero:
            for g in groups:
                if float(g.get("weight_decay", wd)) == 0.0:
                    no_decay += _group_param_keys(g, mapper, model)
        if model.get("tie_embeddings"):
            no_decay = [k for k in no_decay if k != "lm_head.weight"]
        if no_decay:
            out["no_decay"] = no_decay
        notes.append(f"weight_decay {wd} (param_groups)" + (f", none on {len(no_decay)} parameters" if no_decay else ""))
    else:
        out["weight_decay"] = args.weight_decay if args.weight_decay is not None else 0.01
        notes.append(f"weight_decay {out['weight_decay']} ({'flag' if args.weight_decay is not None else 'PyTorch default'})")
    return out


# ---------------------------------------------------------------------------
# The log, the samples and the data.

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
        for key in ("lr", "loss", "grad_norm", "loss_scale"):
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
            if not (math.isfinite(e["lr"]) and 0 < e["lr"] <= 1e3):
                raise BadInput(path, f"step {step}.lr", f"{e['lr']} is not in (0, 1e3]")
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



# ---------------------------------------------------------------------------
# Where values came from, HF Trainer's files, the checkpoint's step counters and FIRST.

PROVENANCE_KINDS = ("tensors", "checkpoint", "config", "flag", "naming", "default")


def _provenance_entry(kind, detail, value):
    """One entry of the manifest's provenance block (docs/bundle-format.md, "Provenance")."""
    assert kind in PROVENANCE_KINDS, kind
    entry = {"from": kind, "detail": detail}
    if isinstance(value, (bool, int, float, str)) or (isinstance(value, list) and
                                                      all(isinstance(v, (int, float)) for v in value)):
        entry["value"] = _capture._json_number(value) if isinstance(value, float) else value
    return entry


def _hyper_provenance(opt_notes, hyper):
    """optimizer.betas / eps / weight_decay: the param groups, a flag, or PyTorch's default."""
    out = {}
    for key in ("betas", "eps", "weight_decay"):
        note = next((n for n in opt_notes if n.startswith(key + " ")), None)
        if note is None:
            continue
        kind = "checkpoint" if "(param_groups)" in note else ("flag" if "(flag)" in note else "default")
        detail = {"checkpoint": "the optimizer's param_groups", "flag": "--" + key.replace("_", "-"),
                  "default": "PyTorch's AdamW default (the param_groups do not say it)"}[kind]
        out[f"optimizer.{key}"] = _provenance_entry(kind, detail, hyper.get(key))
    return out


def hf_trainer_file(checkpoint, fmt, name):
    """HF Trainer's `name` (optimizer.pt, trainer_state.json) beside the weights of a checkpoint-N
    directory, or None."""
    p = Path(checkpoint)
    if fmt != "hf" or not p.is_dir() or not (p / name).is_file():
        return None
    return str(p / name)


def _counter_value(value):
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def checkpoint_counters(obj, checkpoint, fmt):
    """[(name, updates applied, the log numbering its framework uses)]: the checkpoint's own step
    counters. torchtitan's train_state.step and HF Trainer's global_step count the updates done (saved
    after step N's update, logged from 1); Megatron's iteration too; nanoGPT's and llama2.c's iter_num
    is the iteration about to run (saved before its update, logged from 0)."""
    out = []
    state_path = hf_trainer_file(checkpoint, fmt, "trainer_state.json")
    if state_path:
        state = _read_json(state_path)
        n = _counter_value(state.get("global_step")) if isinstance(state, dict) else None
        if n is None:
            raise BadInput(state_path, "global_step", "missing or not an integer >= 0")
        out.append(("trainer_state.json: global_step", n, "one"))
    if isinstance(obj, dict):
        train_state = obj.get("train_state")
        if isinstance(train_state, io.BytesIO):  # torchtitan pickles its TrainState into the DCP checkpoint
            train_state.seek(0)
            train_state = _torch_load(train_state, f"{checkpoint}: train_state")
        step = train_state.get("step") if isinstance(train_state, dict) else obj.get("train_state.step")
        if step is not None:
            n = _counter_value(step)
            if n is None:
                raise BadInput(checkpoint, "train_state.step", f"not an integer >= 0 ({step!r})")
            out.append(("train_state.step", n, "one"))
        for key, numbering in (("iter_num", "zero"), ("iteration", "one")):
            if key in obj and _counter_value(obj[key]) is not None:
                out.append((key, _counter_value(obj[key]), numbering))
    return out


def check_first(args, counters, adam_step):
    """FIRST against the checkpoint's counters and the optimizer's step count: each says how many
    updates the parameters have seen, so FIRST is that count (log numbered from 0) or one more (from 1).
    Returns the numbering used; a conflict is bad input naming both sides."""
    numbering = args.log_numbering or (counters[0][2] if counters else "zero")
    base = 1 if numbering == "one" else 0
    how = (f"--log-numbering {numbering}" if args.log_numbering else
           f"{counters[0][0]}'s convention" if counters else "the docs' convention, steps counted from 0")
    for name, n, _ in counters:
        if args.first != n + base:
            raise BadInput("command line", "--steps", f"FIRST is {args.first}, but the checkpoint's {name} is {n}: it "
                           f"holds the parameters after {n} updates, so with the log numbered from {base} ({how}) "
                           f"FIRST is {n + base}" + ("" if args.log_numbering else
                                                     "; pass --log-numbering if your log counts otherwise"))
    if adam_step is not None:
        fp16 = args.precision == "fp16"  # the scaler's skipped steps do not count in AdamW's step
        updates = counters[0][1] if counters else args.first - base
        if adam_step != updates and not (fp16 and adam_step < updates):
            raise BadInput("command line", "--steps", f"FIRST is {args.first}, but the optimizer's step count is "
                           f"{adam_step}: with the log numbered from {base} ({how}) FIRST is {adam_step + base}"
                           + (f", and {counters[0][0]} says {counters[0][1]} updates" if counters else "")
                           + ("" if args.log_numbering or counters else
                              "; pass --log-numbering one if your log numbers a step after its update"))
    return numbering


def check_incident_window(args, first, last, has_optimizer):
    """A non-finite logged loss (not a step the fp16 scaler skipped) outside FIRST..LAST: the bundle
    would lose the incident, so it is bad input naming the step."""
    for _, line in _log_lines(args.log):
        try:
            obj = json.loads(line) if line.strip() else None
        except ValueError:
            continue  # read_log names a bad line inside the window
        if not isinstance(obj, dict) or not isinstance(obj.get("step"), int) or first <= obj["step"] <= last:
            continue
        loss = obj.get("loss")
        try:
            value = _number(loss, args.log, "loss") if loss is not None else 0.0
        except BadInput:
            continue
        if not math.isfinite(value) and obj.get("skipped") is not True:
            where = "before the checkpoint" if obj["step"] < first else "after the last imported step"
            fix = ("import a checkpoint from before it" if obj["step"] < first else
                   f"extend --steps to {first}:{obj['step']}" if has_optimizer else
                   "give the optimizer state (--optimizer) so that the replay can roll forward to it, and extend --steps")
            raise BadInput(args.log, f"step {obj['step']}.loss", f"{loss} is the logged incident, {where} (--steps "
                                                                  f"{first}:{last}): the bundle would lose it; {fix}")


# ---------------------------------------------------------------------------
# The command.

def _parser(kind=argparse.ArgumentParser):
    ap = kind(prog="nanreplay import", description=__doc__.split("\n\n")[0],
              add_help=kind is argparse.ArgumentParser)
    ap.add_argument("--checkpoint", required=True, help="the checkpoint: HF directory or safetensors file, "
                                                        "torch.save file, or torch.distributed.checkpoint directory")
    ap.add_argument("--optimizer", help="AdamW state: a torch.save file or DCP directory (default: the checkpoint's own, "
                                        "when it holds one, or HF Trainer's optimizer.pt beside the weights)")
    ap.add_argument("--format", default="auto", choices=FORMATS)
    ap.add_argument("--naming", default="auto", choices=NAMINGS)
    ap.add_argument("--config", help="model config JSON (HF config.json, Meta params.json, nanoGPT/llama2.c model_args, "
                                     "Megatron args, or manifest model keys)")
    ap.add_argument("--num-heads", type=int, help="attention heads (before any config)")
    ap.add_argument("--num-kv-heads", type=int, help="key/value heads (checked against the k projection's rows)")
    ap.add_argument("--norm-eps", type=float, help="the norms' epsilon (before any config)")
    ap.add_argument("--rope-theta", type=float, help="the rotary base (before any config)")
    ap.add_argument("--rope-style", choices=("rotate_half", "interleaved"), help="the rotary convention (default: the "
                                                                                 "naming's, or the config's)")
    ap.add_argument("--tie-embeddings", choices=("true", "false"), help="whether the output head is the embedding")
    ap.add_argument("--activation", help="the MLP's activation, checked: silu (llama's SwiGLU) or gelu_tanh (gpt2)")
    ap.add_argument("--log-numbering", choices=("zero", "one"), help="zero: the log's step s is the update applied "
                    "after s updates (nanoGPT, llama2.c, a range() loop); one: the s-th update (torchtitan, HF Trainer); "
                    "default: the checkpoint's own counter's convention, else zero")
    ap.add_argument("--data", nargs="+", action="extend", required=True, metavar="SHARD",
                    help="token shards, in order; repeating the flag appends")
    ap.add_argument("--token-dtype", action="append", choices=tuple(_TOKEN_WIDTH),
                    help="uint16 (default) or uint32: once for every shard, or once per --data shard, in order")
    ap.add_argument("--seq-len", type=int, required=True)
    ap.add_argument("--micro-batch-size", type=int, required=True)
    ap.add_argument("--grad-accum", type=int, default=1)
    ap.add_argument("--world-size", type=int, default=1)
    ap.add_argument("--sampler-seed", type=int)
    ap.add_argument("--epoch", type=int, default=0)
    ap.add_argument("--epoch-start-step", type=int, default=0)
    ap.add_argument("--samples", help="JSON object: step -> per-rank sample lists")
    ap.add_argument("--log", required=True, help="JSON lines: step, lr, loss, optionally grad_norm, loss_scale, skipped")
    ap.add_argument("--steps", required=True, metavar="FIRST:LAST")
    ap.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "fp16", "fp8"))
    ap.add_argument("--grad-clip", type=float)
    ap.add_argument("--betas", help="B1,B2 when the optimizer state does not say (default 0.9,0.999)")
    ap.add_argument("--eps", type=float, help="when the optimizer state does not say (default 1e-8)")
    ap.add_argument("--weight-decay", type=float, help="when the optimizer state does not say (default 0.01)")
    ap.add_argument("--trust-pickle", action="store_true",
                    help="load pickles (torch.save files, DCP) with Python's full unpickler: only for files you trust, "
                         "since a crafted pickle runs code (recorded in the manifest)")
    ap.add_argument("--out", required=True)
    return ap


class _ArgError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise _ArgError(message)


def _check_flags(ap, argv):
    """A mistyped flag is named, with the nearest real one, before argparse asks for required ones."""
    import difflib
    known = list(ap._option_string_actions)
    for token in argv:
        flag = token.split("=", 1)[0]
        if flag.startswith("--") and not any(k.startswith(flag) for k in known):  # argparse takes prefixes
            near = difflib.get_close_matches(flag, known, n=1)
            raise BadInput("command line", flag, f"unknown option '{flag}'" + (f"; did you mean '{near[0]}'?" if near else ""))


def parse_args(argv):
    ap = _parser(_Parser)
    _check_flags(ap, argv)
    try:
        args = ap.parse_args(argv)
    except _ArgError as e:
        m = re.search(r"(--[a-z-]+)", str(e))
        raise BadInput("command line", m.group(1) if m else "arguments", str(e))
    m = re.fullmatch(r"(\d+)[:-](\d+)", args.steps)  # FIRST:LAST, or FIRST-LAST as run takes it
    if not m or int(m.group(1)) > int(m.group(2)):
        raise BadInput("command line", "--steps", f"{args.steps!r} is not FIRST:LAST with FIRST <= LAST")
    args.first, args.last = int(m.group(1)), int(m.group(2))
    dtypes = args.token_dtype or ["uint16"]
    if len(dtypes) not in (1, len(args.data)):
        raise BadInput("command line", "--token-dtype", f"given {len(dtypes)} times for {len(args.data)} --data shards: "
                                                        "give it once for all of them, or once per shard")
    args.token_dtypes = dtypes * len(args.data) if len(dtypes) == 1 else dtypes
    for flag, value in (("--checkpoint", args.checkpoint), ("--optimizer", args.optimizer), ("--config", args.config),
                        ("--log", args.log), ("--samples", args.samples), *(("--data", d) for d in args.data)):
        if value is not None and os.path.exists(value):  # missing ones are named where they are read
            _check_regular(value, flag)
    for flag, value, low in (("--seq-len", args.seq_len, 1), ("--micro-batch-size", args.micro_batch_size, 1),
                             ("--grad-accum", args.grad_accum, 1), ("--world-size", args.world_size, 1),
                             ("--epoch", args.epoch, 0), ("--epoch-start-step", args.epoch_start_step, 0)):
        if value < low:
            raise BadInput("command line", flag, f"must be >= {low}, got {value}")
    if (args.sampler_seed is None) == (args.samples is None):
        raise BadInput("command line", "--sampler-seed", "give exactly one of --sampler-seed (randperm) and --samples")
    if args.sampler_seed is not None and not 0 <= args.sampler_seed < 2**64:
        raise BadInput("command line", "--sampler-seed", "must be in [0, 2^64)")
    if args.grad_clip is not None and not (math.isfinite(args.grad_clip) and args.grad_clip > 0):
        raise BadInput("command line", "--grad-clip", "must be a finite number > 0")
    if args.betas is not None:
        try:
            b = [float(x) for x in args.betas.split(",")]
            assert len(b) == 2 and all(0 <= x < 1 for x in b)
            args.betas = b
        except (ValueError, AssertionError):
            raise BadInput("command line", "--betas", f"{args.betas!r} is not B1,B2 with each in [0, 1)")
    if args.eps is not None and not (math.isfinite(args.eps) and args.eps > 0):
        raise BadInput("command line", "--eps", "must be a finite number > 0")
    if args.weight_decay is not None and not (math.isfinite(args.weight_decay) and args.weight_decay >= 0):
        raise BadInput("command line", "--weight-decay", "must be a finite number >= 0")
    for flag, value, low in (("--num-heads", args.num_heads, 1), ("--num-kv-heads", args.num_kv_heads, 1)):
        if value is not None and value < low:
            raise BadInput("command line", flag, f"must be >= {low}, got {value}")
    if args.norm_eps is not None and not (math.isfinite(args.norm_eps) and args.norm_eps >= 0):
        raise BadInput("command line", "--norm-eps", "must be a finite number >= 0")
    if args.rope_theta is not None and not (math.isfinite(args.rope_theta) and args.rope_theta > 0):
        raise BadInput("command line", "--rope-theta", "must be a finite number > 0")
    if args.tie_embeddings is not None:
        args.tie_embeddings = args.tie_embeddings == "true"
    return args


def load_checkpoint(args):
    """(source state dict, whole loaded object, format, why, configs [(dict, where)], label)."""
    fmt, why = args.format, "--format"
    if fmt == "auto":
        fmt, why = detect_format(args.checkpoint)
        why = f"detected: {why}"
    path = Path(args.checkpoint)
    if not path.exists():
        raise BadInput(path, "--checkpoint", "does not exist")
    configs = []
    if args.config:
        configs.append((_read_json(args.config), args.config))
    reader = None
    if fmt == "hf":
        sd, config, files = read_hf(path)
        obj = None
        if config is not None:
            configs.append((config, str(path / "config.json")))
        reader = f"{len(files)} file(s)"
    elif fmt == "torch":
        if path.is_dir():
            raise BadInput(path, "--format", "torch needs a torch.save file, not a directory")
        obj = _torch_load(path, path)
        sd, where = find_model_state(obj, path)
        config, key = _meta_config(obj)
        if config is not None:
            configs.append((config, f"{path}: {key}"))
        reader = f"state dict at {where or 'the top level'}"
    else:
        if not (path / ".metadata").is_file():
            raise BadInput(path, ".metadata", "missing: not a torch.distributed.checkpoint directory")
        obj, reader = read_dcp(path)
        sd, where = find_model_state(obj, path)
        reader += f", state dict at {where or 'the top level'}"
    return sd, obj, fmt, why, configs, reader


def settle_model_section(args, arch, naming, sd, configs):
    """The manifest's model section from the renamed tensors, flags and configs, each value with its
    source, printed (defaults loudly). Returns (mapper, model, parameters, provenance entries)."""
    # num_heads etc. come from flags and configs; the tensors settle every shape.
    flags = flag_config(args)
    if flags:
        configs.insert(0, (flags, FLAGS_WHERE))
    required_values(arch, configs, naming, args.config or next((w for _, w in configs if w != FLAGS_WHERE),
                                                                str(args.checkpoint)))
    heads_cfg = {}
    for raw, where in configs:
        for k, (v, _) in normalize_config(raw, where).items():
            heads_cfg.setdefault(k, v)
    if naming == "megatron":
        sd = unstack_megatron_layers(sd, heads_cfg.get("num_layers"))
    if naming == "megatron" and "num_heads" in heads_cfg:
        C = next((t.shape[1] for k, t in sd.items() if k.endswith("word_embeddings.weight")), None)
        if C is not None:
            H = heads_cfg["num_heads"]
            qkv = next((t for k, t in sd.items() if k.endswith("linear_qkv.weight")), None)
            G = heads_cfg.get("num_kv_heads")
            if G is None and qkv is not None:
                G = (qkv.shape[0] // (C // H) - H) // 2  # rows = (H + 2G) * D
            heads_cfg["num_kv_heads"] = G
            heads_cfg["hidden_size"] = C
    mapper = Mapper(naming, {"num_heads": heads_cfg["num_heads"], "num_kv_heads": heads_cfg.get("num_kv_heads", heads_cfg["num_heads"]),
                             "hidden_size": heads_cfg.get("hidden_size", 0) or 1})
    mapped = mapper.map(sd, args.checkpoint)
    model, notes = settle_model(arch, mapped, naming, configs, args)
    opts, opt_notes = model_options(naming, configs, model, args)
    model.update(opts)
    notes.update(opt_notes)
    activation, notes["activation"] = settle_activation(arch, naming, configs, args)
    for raw, where in configs:
        moe = _moe_config(raw, where, model["num_layers"], len(mapped)) if arch == "llama" else None
        if moe:
            model["moe"] = moe
            notes["moe"] = (_kind_of(where, args), f"{where}: num_experts")
            break
    if model["tie_embeddings"]:
        mapped.pop("lm_head.weight", None)
    params = check_parameters(mapped, model, args.checkpoint)

    say("model: " + ", ".join(f"{k} {v}" for k, v in model.items() if k != "arch") + f" ({model['arch']})")
    for key in dict.fromkeys(("num_heads", "num_kv_heads", "norm_eps", "rope_theta", "rope_style", "tie_embeddings",
                              "activation", "moe", *_capture.LLAMA_OPTION_DEFAULTS)):
        if key in notes and (key in model or key in ("rope_style", "activation")):
            kind, detail = notes[key]
            if kind == "default":  # a value no checkpoint or config gave: the user should confirm it
                warn(f"{key}: DEFAULTED, {detail}")
            else:
                say(f"  {key}: {detail}")
    provenance = {f"model.{k}": _provenance_entry(kind, detail, activation if k == "activation" else
                                                  model.get(k, "rotate_half" if k == "rope_style" else None))
                  for k, (kind, detail) in notes.items()}
    return mapper, model, params, provenance


def build(args):
    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise BadInput(out, "--out", "exists and is not an empty directory")

    global _trust_pickle
    _trust_pickle = args.trust_pickle
    if _trust_pickle:
        warn("--trust-pickle: pickles are loaded with Python's full unpickler, which runs any code a crafted file "
             "names; recorded in the manifest")
    source_sd, obj, fmt, why, configs, reader = load_checkpoint(args)
    say(f"format: {fmt} ({why}; {reader})")
    naming = args.naming
    if naming == "auto":
        naming, key = detect_naming(list(source_sd))
        say(f"naming: {naming} (detected: {key})")
    else:
        say(f"naming: {naming} (--naming)")
    arch = "gpt2" if naming == "nanogpt" else "llama"
    sd = strip_prefix(source_sd, naming)

    mapper, model, params, provenance = settle_model_section(args, arch, naming, sd, configs)

    # The optimizer state: --optimizer, else HF Trainer's optimizer.pt beside the weights, else the
    # checkpoint's own when it has one.
    opt, opt_where = None, None
    optimizer_path = args.optimizer or hf_trainer_file(args.checkpoint, fmt, "optimizer.pt")
    if optimizer_path:
        p = Path(optimizer_path)
        if not p.exists():
            raise BadInput(p, "--optimizer", "does not exist")
        if p.is_dir():
            if not (p / ".metadata").is_file():
                raise BadInput(p, ".metadata", "missing: --optimizer directory is not a torch.distributed.checkpoint")
            loaded = obj if Path(args.checkpoint).resolve() == p.resolve() and fmt == "dcp" else read_dcp(p)[0]
        else:
            loaded = obj if Path(args.checkpoint).resolve() == p.resolve() and fmt == "torch" else _torch_load(p, p)
        opt, key = find_optimizer_state(loaded)
        if opt is None:
            raise BadInput(p, "optimizer", "no AdamW state ('state' and 'param_groups') in it")
        opt_where = f"{p}" + (f" ({key})" if key else "")
    elif obj is not None:
        opt, key = find_optimizer_state(obj)
        if opt is not None:
            opt_where = f"{args.checkpoint} ({key or 'top level'})"
    first, last = args.first, args.last
    if opt is not None:
        moments, adam_step, hyper, opt_notes = read_optimizer(opt, optimizer_path or args.checkpoint, source_sd,
                                                              mapper, model, args)
        say(f"optimizer: AdamW state of {len(moments or params)} parameters from {opt_where}, {opt_notes[0]}; "
            f"step count {adam_step}; " + "; ".join(opt_notes[1:]))
        provenance.update(_hyper_provenance(opt_notes, hyper))
    else:
        moments, adam_step = None, None
        hyper = {"betas": args.betas or [0.9, 0.999], "eps": args.eps or 1e-8,
                 "weight_decay": args.weight_decay if args.weight_decay is not None else 0.01}
        if last > first:
            say(f"optimizer: none given (--optimizer) and none in the checkpoint: only step {first} is replayed "
                f"(steps {first + 1}..{last} need AdamW state to roll forward)")
            last = first
    counters = checkpoint_counters(obj, args.checkpoint, fmt)
    numbering = check_first(args, counters, adam_step)
    say(f"first step: {first} (" + ("; ".join(f"{name} {n}" for name, n, _ in counters) or "no step counter in the "
        "checkpoint") + (f"; AdamW step count {adam_step}" if adam_step is not None else "")
        + f"; log numbered from {0 if numbering == 'zero' else 1})")

    log = read_log(args.log, first, last)
    check_incident_window(args, first, last, opt is not None)
    world, per_rank = args.world_size, args.micro_batch_size * args.grad_accum
    samples, sample_kind = read_samples(args.samples, first, last, world, per_rank) if args.samples else (None, None)

    out.mkdir(parents=True, exist_ok=True)
    (out / "data").mkdir()
    extra = {}
    if sample_kind == "offsets":
        shards, total, samples, extra = copy_windows(args, samples, out)
    else:
        shards, total = copy_shards(args.data, args.token_dtypes, out)
    num_samples = (total - 1) // args.seq_len
    if num_samples < 1:
        raise BadInput(args.data[0], "--data", f"{total} tokens hold no sample of seq_len {args.seq_len} + 1")
    sampler = {"kind": "explicit"}
    if args.sampler_seed is not None:
        sampler = {"kind": "randperm", "seed": args.sampler_seed, "epoch": args.epoch,
                   "epoch_start_step": args.epoch_start_step}
        per_rank_samples = num_samples // world
        steps_in_epoch = per_rank_samples // per_rank
        if first < args.epoch_start_step:
            raise BadInput("command line", "--epoch-start-step", f"{args.epoch_start_step} is after step {first}")
        if last - args.epoch_start_step >= steps_in_epoch:
            raise BadInput("command line", "--steps", f"step {last} lies past the epoch: {num_samples} samples make "
                                                      f"{steps_in_epoch} steps of {per_rank} per rank from step "
                                                      f"{args.epoch_start_step}")
    else:
        for step, rows in samples.items():
            bad = [i for r in rows for i in r if i >= num_samples]
            if bad:
                raise BadInput(args.samples, str(step), f"sample {bad[0]} is past the data's {num_samples} samples")

    steps = []
    for step in range(first, last + 1):
        rel = f"steps/{step}"
        d = out / rel
        d.mkdir(parents=True)
        if step == first:
            _capture.write_safetensors(d / "model.safetensors", params)
            if opt is not None:
                tensors = []
                for key, p in params:
                    m, v = moments[key] if moments is not None else (torch.zeros_like(p), torch.zeros_like(p))
                    for which, t in (("exp_avg", m), ("exp_avg_sq", v)):
                        if tuple(t.shape) != tuple(p.shape):
                            raise BadInput(optimizer_path or args.checkpoint, f"state.{key}.{which}",
                                           f"shape {list(t.shape)} differs from the parameter's {list(p.shape)}")
                        t = t.float() if t.dtype == torch.float64 else t
                        if t.dtype not in _FLOAT_TYPES:
                            raise BadInput(optimizer_path or args.checkpoint, f"state.{key}.{which}", f"is {t.dtype}")
                        tensors.append((f"{key}.{which}", t.contiguous()))
                tensors.append(("step", torch.tensor(adam_step, dtype=torch.int64)))
                _capture.write_safetensors(d / "optimizer.safetensors", tensors)
        e = log[step]
        state = {"step": step}
        if "lr" in e:
            state["lr"] = e["lr"]
        if "loss_scale" in e:
            state["loss_scale"] = _capture._json_number(e["loss_scale"])
        if "skipped" in e:
            state["skipped"] = e["skipped"]
        state["logged"] = {k: _capture._json_number(e[k]) for k in ("loss", "grad_norm") if k in e}
        _capture._write_json(d / "state.json", state)
        entry = {"step": step, "dir": rel}
        if samples is not None:
            entry["samples"] = samples[step]
        if step in extra:
            entry["original_offsets"] = extra[step]
        steps.append(entry)

    optimizer = dict({"kind": "adamw"}, **hyper)
    if args.grad_clip is not None:
        optimizer["grad_clip"] = args.grad_clip
    manifest = {
        "format": "nanreplay.bundle",
        "version": 1,
        "model": model,
        "precision": {"compute": args.precision},
        "optimizer": optimizer,
        "data": {"shards": shards, "seq_len": args.seq_len, "micro_batch_size": args.micro_batch_size,
                 "grad_accum_steps": args.grad_accum, "world_size": world, "sampler": sampler},
        "steps": steps,
    }
    bad = next((s for s in range(first, last + 1) if not math.isfinite(log[s]["loss"])), None)
    if bad is not None:
        manifest["incident"] = {"step": bad, "symptom": f"loss={_capture._json_number(log[bad]['loss'])}"}
    manifest["import"] = {"writer": "nanreplay_import", "version": IMPORT_VERSION, "torch": torch.__version__,
                          "checkpoint": str(args.checkpoint), "format": fmt, "naming": naming,
                          "optimizer": opt_where, "config_sources": {k[len("model."):]: e["detail"] for k, e in provenance.items()
                                                                 if k.startswith("model.")}}
    manifest["provenance"] = provenance
    if args.trust_pickle:
        manifest["import"]["trust_pickle"] = True
    _capture._write_json(out / "manifest.json", manifest)
    derived = last - first
    say(f"steps: {first} to {last} (checkpoint at {first}" + (f", {derived} derived by the replay's own update)" if derived else ")"))
    say(f"data: {len(shards)} shard(s), {total} tokens, {num_samples} samples; sampler "
        + (f"randperm seed {args.sampler_seed} epoch {args.epoch} epoch_start_step {args.epoch_start_step}"
           if args.sampler_seed is not None else f"explicit ({args.samples})"))
    say("bundle written (manifest.json last)")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        _parser().print_help()
        return 0
    created = None
    try:
        args = parse_args(argv)
        out = Path(args.out)
        created = None if out.exists() else out  # run standalone: a failure removes what it made
        build(args)
        created = None
    except BadInput as e:
        return fail(2, "bad_input", e.what, e.file, e.key)
    except _capture.CaptureError as e:
        return fail(2, "bad_input", str(e), getattr(e, "file", "checkpoint"), "model")
    except Exception as e:  # a bug here, not bad input: the traceback, then one summary line
        import traceback
        traceback.print_exc()
        return fail(3, "internal", f"import: {type(e).__name__}: {e}")
    finally:
        if created is not None:
            shutil.rmtree(created, ignore_errors=True)
    _write_outcome()
    return 0


if __name__ == "__main__":
    sys.exit(main())
