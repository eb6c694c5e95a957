"""Megatron-LM's optimizer files: the layout that names every parameter read by name, the layouts that
do not refused by the Megatron file and key (docs/import.md, "Megatron's optimizer files").

Read from NVIDIA/Megatron-LM at commit d98e8a64ddf34856e74b24714e3bedb2f5a39553 (2026-08-22):
- torch_dist (DCP) checkpoints, the distributed optimizer's default `fully_sharded_model_space` and the
  plain optimizers (megatron/core/optimizer/distrib_optimizer.py sharded_param_state_fs_model_space,
  megatron/core/dist_checkpointing/optimizer.py optim_state_to_sharding_state): one tensor per state
  entry and parameter, `optimizer.state.<entry>.<model key>` (`fp32_param` the fp32 main parameter;
  `step` left out), `chained_<i>.` before it for a ChainedOptimizer's i-th optimizer (Muon + AdamW).
  The model keys are the model's own (its layers stacked on one axis), so the megatron naming maps them.
  They are DCP's keys as they are: Megatron saves with MCoreSavePlanner(flatten_state_dict=False) after
  replacing each entry's key by its ShardedTensor key (dist_checkpointing/strategies/torch.py).
- `distrib_optim.pt` (legacy torch format, DistributedOptimizer.save_parameter_state ->
  get_parameter_state_dp_zero): {"buckets_coalesced": True, <buffer index>: {<dtype>: {"param",
  "exp_avg", "exp_avg_sq": one flat fp32 tensor per gradient buffer, "numel_unpadded"}}}. Offsets into
  those buffers follow the run's bucket layout (param_and_grad_buffer), which the file does not record.
- `layer_wise_optimizer_<dp rank>.pt` (megatron/training/checkpointing.py, torch format with
  --use-layer-wise-distributed-optimizer; LayerWiseDistributedOptimizer.save_state_dict_to_file):
  ChainedOptimizer.state_dict(), a list of (or one) optimizer state dicts with integer ids over the
  parameters this data-parallel rank updates, which the optimizer assigns at run time (LPT bin-packing by
  Newton-Schulz cost in _compute_per_buffer_param_layout); the file does not name them.
- torch_dist with the `dp_reshardable` / `fully_sharded_bucket_space` / `dp_zero_gather_scatter` sharding
  types: `optimizer.distributed.dp_group_idx_<n>.param_state` and per-bucket objects, the buffers above.
"""

import re

import torch

from .outcome import BadInput

# State entries Megatron's torch_dist writes per parameter, by the wrapped torch optimizer's names.
_ENTRIES = ("exp_avg_sq_row", "exp_avg_sq_col", "exp_avg_sq", "exp_avg", "max_exp_avg_sq", "momentum_buffer",
            "row_var", "col_var", "variance", "fp32_param")
_TORCH_DIST = re.compile(r"(?:chained_(\d+)\.)?optimizer\.state\.(" + "|".join(_ENTRIES) + r")\.(.+)")
_DP_BUFFERS = re.compile(r"(?:chained_\d+\.)?optimizer\.distributed\.dp_group_idx_\d+\..*")


# param_groups keys of emerging_optimizers' OrthogonalizedOptimizer (NVIDIA-NeMo/Emerging-Optimizers,
# orthogonalized_optimizers/orthogonalized_optimizer.py), which Megatron's Muon (TensorParallelMuon in
# megatron/core/optimizer/emerging_optimizers.py) is: not torch.optim.Muon's math (weight decay before the
# momentum, L2 or "independent" decay, a "spectral" scale by default), and its scale mode, Newton-Schulz
# steps and coefficients live in the constructor's closure, not in the checkpoint.
_ORTHOGONALIZED_KEYS = ("momentum_beta", "use_nesterov", "use_decoupled_wd", "use_independent_wd")


def refuse_orthogonalized(groups, where):
    """BadInput for the param groups of emerging_optimizers' Muon family (Megatron's Muon), by the first
    such key: the replay's "muon" is torch.optim.Muon."""
    for i, g in enumerate(groups):
        key = next((k for k in _ORTHOGONALIZED_KEYS if isinstance(g, dict) and k in g), None)
        if key is not None:
            raise BadInput(where, f"param_groups.{i}.{key}",
                           "emerging_optimizers' orthogonalized optimizer (Megatron's Muon, TensorParallelMuon), not "
                           "torch.optim.Muon: it decays before the momentum and scales the update by its scale_mode "
                           "(\"spectral\" by default), which the checkpoint does not record; the replay follows "
                           "torch.optim.Muon only")


def _distrib_optim_buffers(obj):
    """Whether `obj` is get_parameter_state_dp_zero's dict (distrib_optim.pt)."""
    if not isinstance(obj, dict):
        return False
    if "buckets_coalesced" in obj:
        return True
    for k, v in obj.items():
        if isinstance(k, int) and isinstance(v, dict) and any(
                isinstance(d, torch.dtype) and isinstance(s, dict) and ("numel_unpadded" in s or "param" in s)
                for d, s in v.items()):
            return True
    return False


def _integer_id_states(obj):
    """The optimizer state dicts with integer parameter ids in a layer-wise file: a list of them
    (ChainedOptimizer.state_dict() of several), or one; each a torch optimizer's state_dict or
    Float16OptimizerWithFloat16Params' {"optimizer": ..., "fp32_from_fp16_params": ...}."""
    items = obj if isinstance(obj, list) else [obj]
    out = []
    for item in items:
        if isinstance(item, dict) and isinstance(item.get("optimizer"), dict) and "fp32_from_fp16_params" in item:
            item = item["optimizer"]
        if isinstance(item, dict) and isinstance(item.get("state"), dict) and isinstance(item.get("param_groups"), list):
            out.append(item)
    return out


def refuse_unmappable(obj, where):
    """BadInput, naming the Megatron file and key, for an optimizer layout that cannot be mapped back to
    parameters by name; nothing for any other object."""
    name = getattr(where, "name", str(where).rsplit("/", 1)[-1])
    if _distrib_optim_buffers(obj):
        key = "buckets_coalesced" if "buckets_coalesced" in obj else str(next(k for k in obj if isinstance(k, int)))
        raise BadInput(where, key, "Megatron's distributed optimizer state flattened per gradient buffer "
                                   "(distrib_optim.pt, get_parameter_state_dp_zero): its offsets follow the run's "
                                   "bucket layout, which the file does not record, so no tensor maps back to a "
                                   "parameter; save with --ckpt-format torch_dist (per-parameter "
                                   "optimizer.state.exp_avg.<param> tensors), which nanreplay import reads")
    if isinstance(obj, dict):
        key = next((k for k in obj if isinstance(k, str) and _DP_BUFFERS.fullmatch(k)), None)
        if key is not None:
            raise BadInput(where, key, "Megatron's distributed optimizer state saved per data-parallel buffer "
                                       "(the dp_reshardable / fully_sharded_bucket_space sharding types): its "
                                       "offsets follow the run's bucket layout, not parameter names; save with "
                                       "the default fully_sharded_model_space (optimizer.state.<entry>.<param>)")
    states = _integer_id_states(obj)
    layer_wise = re.fullmatch(r"layer_wise_optimizer_\d+\.pt", name) is not None
    if states and (layer_wise or isinstance(obj, list)):
        raise BadInput(where, "state" if not isinstance(obj, list) else "0.state",
                       f"Megatron's layer-wise distributed optimizer file ({len(states)} chained optimizer state "
                       "dict(s), LayerWiseDistributedOptimizer.save_state_dict_to_file): integer ids over the "
                       "parameters this data-parallel rank updates, which the optimizer assigns at run time and "
                       "the file does not name; save with --ckpt-format torch_dist (per-parameter "
                       "optimizer.state.<entry>.<param> tensors), which nanreplay import reads")


def _common_optimizer(where):
    """The optimizer's part of a torch_dist checkpoint's common.pt (its param_groups, with the update
    count as each group's `step` or the state's `common_step`), or None when there is no common.pt."""
    from .safe_pickle import _torch_load
    from pathlib import Path
    path = (Path(where) if Path(where).is_dir() else Path(where).parent) / "common.pt"
    if not path.is_file():
        return None, path
    node = _torch_load(path, path)
    node = node.get("optimizer") if isinstance(node, dict) else None
    for _ in range(3):  # Float16Optimizer / DistributedOptimizer nest the torch optimizer's dict one level down
        if not isinstance(node, dict) or "param_groups" in node:
            break
        node = node.get("optimizer", node.get(0))  # a ChainedOptimizer of one: {0: ...}
    return (node if isinstance(node, dict) and isinstance(node.get("param_groups"), list) else None), path


def _step_of(common, path):
    steps = {int(float(g["step"].item() if isinstance(g["step"], torch.Tensor) else g["step"]))
             for g in common["param_groups"] if isinstance(g, dict) and g.get("step") is not None}
    state = common.get("state")
    if isinstance(state, dict) and state.get("common_step") is not None:
        step = state["common_step"]
        steps.add(int(float(step.item() if isinstance(step, torch.Tensor) else step)))
    if len(steps) > 1:
        raise BadInput(path, "optimizer.param_groups.step", f"differs between groups ({sorted(steps)})")
    return steps.pop() if steps else None


def torch_dist_state(flat, where):
    """Megatron's torch_dist optimizer tensors in a flat (DCP) state dict as one optimizer state dict keyed
    by the model's names ({"state": {key: {entry: tensor, "step": n}}, "param_groups": [...]}), or None
    when there are none. The update count and the hyper-parameters come from the checkpoint's common.pt
    (in `where`, the checkpoint's directory, or beside `where`, a file holding the same keys); a state that needs a count it does not give is refused by name, as is a
    fp32 main parameter that differs from the model's weight (the bundle replays the model's weights)."""
    per = {}
    for key, value in flat.items():
        m = _TORCH_DIST.fullmatch(key) if isinstance(key, str) else None
        if m:
            per.setdefault(int(m.group(1) or 0), {}).setdefault(m.group(3), {})[m.group(2)] = value
    if not per:
        return None
    if len(per) > 1:
        raise BadInput(where, "chained_1.optimizer.state",
                       f"Megatron's ChainedOptimizer with {len(per)} optimizers in one torch_dist checkpoint (a Muon "
                       "run: emerging_optimizers' Muon, which is not torch.optim.Muon, and an AdamW; or separate "
                       "expert-parallel optimizers): not read; nanreplay import takes a second optimizer from a file "
                       "of its own (--aux-optimizer)")
    state = per.popitem()[1]
    for key, entries in state.items():
        main = entries.pop("fp32_param", None)
        weight = flat.get(key)
        if main is not None and not (isinstance(weight, torch.Tensor) and weight.shape == main.shape
                                     and torch.equal(weight.float(), main.float())):
            raise BadInput(where, f"optimizer.state.fp32_param.{key}",
                           "the fp32 main parameter differs from the model's weight " + (
                               "(mixed-precision training): the bundle replays the model's weights, so this would "
                               "replay another run" if isinstance(weight, torch.Tensor) else
                               f"{key!r}, which is not beside it to compare (give the whole torch_dist checkpoint)"))
    common, path = _common_optimizer(where)
    step = _step_of(common, path) if common is not None else None
    adam_like = any(e in entries for entries in state.values() for e in ("exp_avg", "exp_avg_sq", "row_var",
                                                                           "exp_avg_sq_row", "variance"))
    if common is None:
        raise BadInput(path, "optimizer.param_groups", "missing: Megatron's torch_dist checkpoint keeps the "
                                                       "optimizer's hyper-parameters and update count in common.pt "
                                                       "beside the tensors")
    if step is None and adam_like:
        raise BadInput(path, "optimizer.param_groups.step", "missing: the update count (bias correction) is "
                                                            "neither a group's step nor the state's common_step")
    refuse_orthogonalized(common["param_groups"], path)  # Megatron's own Muon: not torch.optim.Muon
    groups = [{k: v for k, v in g.items() if k not in ("params", "step")} for g in common["param_groups"]
              if isinstance(g, dict)]
    from .optimizer import KIND_HYPER
    hyper = sorted({k for keys in KIND_HYPER.values() for k in keys})
    for k in hyper:
        values = {repr(g.get(k)) for g in groups}
        if len(values) > 1:
            raise BadInput(path, f"optimizer.param_groups.{k}",
                           f"differs between groups ({sorted(values)}) but common.pt does not say which parameters "
                           "each group holds (Megatron saves their ids as non-persistent)")
    if step is not None:
        for entries in state.values():
            entries["step"] = step
    return {"state": state, "param_groups": [dict(groups[0] if groups else {}, params=sorted(state))]}
