"""torch.save files (zip or legacy pickle): nanoGPT's ckpt.pt, llama2.c's, Megatron's, a plain
{"model": ..., "optimizer": ...}; loaded through the restricted unpickler (safe_pickle.py)."""

from ..checkpoint_state import _meta_config, find_model_state
from ..outcome import BadInput
from ..safe_pickle import _torch_load


def detect(path):
    if path.is_dir():
        return None
    with open(path, "rb") as f:
        head = f.read(8)
    if head[:2] == b"PK" or head[:1] == b"\x80":
        return "torch.save file (zip)" if head[:2] == b"PK" else "torch.save file (legacy pickle)"
    return None


def read(path):
    if path.is_dir():
        raise BadInput(path, "--format", "torch needs a torch.save file, not a directory")
    obj = _torch_load(path, path)
    sd, where = find_model_state(obj, path)
    configs = []
    config, key = _meta_config(obj)
    if config is not None:
        configs.append((config, f"{path}: {key}"))
    return sd, obj, configs, f"state dict at {where or 'the top level'}"
