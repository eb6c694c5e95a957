"""Hugging Face checkpoints: a directory (config.json, model.safetensors[.index.json], shards, or
pytorch_model.bin) or one .safetensors file."""

import math
from pathlib import Path

import torch

from ..inputs import _check_regular, _check_shape, _parse_json, _read_json
from ..outcome import BadInput
from ..safe_pickle import _torch_load


_ST_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool}


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


def detect(path):
    if not path.is_dir():
        return "*.safetensors file" if path.suffix == ".safetensors" else None
    for name in ("model.safetensors.index.json", "model.safetensors", "config.json", "pytorch_model.bin"):
        if (path / name).is_file():
            return name
    if any(path.glob("*.safetensors")):
        return "*.safetensors"
    return None


def text_model_config(config, where):
    """(config, where) of the text model a config.json describes: a multimodal model's (Gemma 3, Llama 4)
    nests it as "text_config", whose model_type ("gemma3_text") and dimensions are the ones replayed; the
    outer config's own keys (its vision tower's) would only mislead."""
    text = config.get("text_config") if isinstance(config, dict) else None
    if text is None:
        return config, where
    if not isinstance(text, dict):
        raise BadInput(where, "text_config", f"not a JSON object, got {type(text).__name__}")
    return text, f"{where}: text_config"


def read(path):
    sd, config, files = read_hf(path)
    configs = [] if config is None else [text_model_config(config, str(path / "config.json"))]
    return sd, None, configs, f"{len(files)} file(s)"
