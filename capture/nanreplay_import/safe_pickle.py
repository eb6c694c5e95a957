"""Reading pickles without running them (torch.save zip and legacy files, DCP's .metadata and
items): _SafeUnpickler's table, torch.load through it, and --trust-pickle, the user's opt-out."""

import io
import pickle

import torch

from .inputs import _check_regular
from .outcome import BadInput


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
