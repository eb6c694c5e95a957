"""Finding the model's and the optimizer's state, and a saved model config, in what a reader loaded."""

import torch

from . import megatron_optim
from .outcome import BadInput


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


def find_optimizer_state(obj, where=None):
    """(optimizer state dict, key path) nested in a loaded checkpoint, or (None, None). With `where` (the
    file or directory it was loaded from), Megatron's optimizer files first: its torch_dist tensors read by
    name, its layouts that name no parameter refused (megatron_optim)."""
    if where is not None:
        megatron_optim.refuse_unmappable(obj, where)
        found = megatron_optim.torch_dist_state(obj, where) if isinstance(obj, dict) else None
        if found is not None:
            return found, "Megatron torch_dist optimizer.state.<entry>.<param>"
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
