"""torch.distributed.checkpoint directories: detected by their .metadata, read with PyTorch's own
reader under --trust-pickle, otherwise parsed here from the file format, every pickle restricted."""

import io
import math
import os
import pickle
from pathlib import Path

import torch

from .. import safe_pickle
from ..inputs import _MAX_DCP_METADATA_BYTES, _MAX_JSON_DEPTH, _check_regular, _check_shape
from ..checkpoint_state import find_model_state
from ..outcome import BadInput
from ..safe_pickle import PickleRefused, _SafeUnpickler, _refusal, _torch_load


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
    if safe_pickle._trust_pickle and _dcp_reader_available():
        try:
            return read_dcp_with_torch(path), "PyTorch's torch.distributed.checkpoint reader (--trust-pickle)"
        except Exception:
            pass  # fall back to the format itself (e.g. a planner this torch does not know)
    return read_dcp_from_format(path), "parsed from the DCP file format"


def detect(path):
    return ".metadata" if path.is_dir() and (path / ".metadata").is_file() else None


def read(path):
    if not (path / ".metadata").is_file():
        raise BadInput(path, ".metadata", "missing: not a torch.distributed.checkpoint directory")
    obj, reader = read_dcp(path)
    sd, where = find_model_state(obj, path)
    return sd, obj, [], reader + f", state dict at {where or 'the top level'}"
