"""Megatron-LM's optimizer files: the layout that names every parameter read by name, the layouts that
do not refused by the Megatron file and key (docs/import.md, "Megatron's optimizer files").

Read from NVIDIA/Megatron-LM at commit d98e8a64ddf34856e74b24714e3bedb2f5a39553 (2026-08-22):
- torch_dist (DCP) checkpoints, the distributed optimizer's `fully_sharded_model_space` and
  `fully_reshardable` and the plain optimizers (megatron/core/optimizer/distrib_optimizer.py
  sharded_param_state_fs_model_space, sharded_param_state_fully_reshardable; megatron/core/dist_checkpointing/
  optimizer.py optim_state_to_sharding_state): one tensor per state entry and parameter,
  `optimizer.state.<entry>.<model key>` (`fp32_param`, or `param` in fully_reshardable, the fp32 main
  parameter; `step` left out). The model keys are the model's own (its layers stacked on one axis), so the
  megatron naming maps them. They are DCP's keys as they are: Megatron saves with
  MCoreSavePlanner(flatten_state_dict=False) after replacing each entry's key by its ShardedTensor key
  (dist_checkpointing/strategies/torch.py). The param groups go to common.pt without their params
  (LocalNonpersistentObject), each with `step` (DistributedOptimizer.state_dict) or the state's
  `common_step` (Float16OptimizerWithFloat16Params / FP32Optimizer.sharded_state_dict).
- A ChainedOptimizer of several (megatron/core/optimizer/optimizer.py ChainedOptimizer.sharded_state_dict;
  dense + expert-parallel optimizers, or an emerging optimizer + the AdamW of the rest): {i: the i-th
  optimizer's sharded state dict}, so common.pt's "optimizer" is {0: ..., 1: ...}, each with its own param
  groups, steps synchronised (_synchronize_steps). Its tensors carry `chained_<i>.` before `optimizer.` unless
  the metadata's chained_optim_avoid_prefix holds with a fully reshardable format, which
  megatron/training/checkpointing.py _build_sharded_state_dict_metadata always sets: a current checkpoint's
  chain shares the unprefixed keys, and only each tensor's entry names say which optimizer holds it.
- `distrib_optim.pt` (legacy torch format, DistributedOptimizer.save_parameter_state ->
  get_parameter_state_dp_zero): {"buckets_coalesced": True, <buffer index>: {<dtype>: {"param",
  "exp_avg", "exp_avg_sq": one flat fp32 tensor per gradient buffer, "numel_unpadded"}}}. Offsets into
  those buffers follow the run's bucket layout (param_and_grad_buffer), which the file does not record.
- `layer_wise_optimizer_<dp rank>.pt` (megatron/training/checkpointing.py, torch format with
  --use-layer-wise-distributed-optimizer; megatron/core/optimizer/layer_wise_optimizer.py
  LayerWiseDistributedOptimizer.save_state_dict_to_file = torch.save(ChainedOptimizer.state_dict())): a list
  of (or one) torch optimizer state dicts with integer ids over the param groups of this data-parallel rank,
  whose members shard_params picks at run time (LPT bin-packing by Newton-Schulz cost in
  _compute_per_buffer_param_layout) from groups _get_param_groups built; neither is saved, so the file does
  not name them. Its torch_dist form (LayerWiseDistributedOptimizer.sharded_state_dict, a ChainedOptimizer's)
  names every parameter and is read as above; its Muon is emerging_optimizers', refused by its group keys.
- torch_dist with the `dp_reshardable` (the training default with --use-distributed-optimizer) /
  `fully_sharded_bucket_space` / `dp_zero_gather_scatter` sharding types:
  `optimizer.distributed.dp_group_idx_<n>.param_state` and per-bucket objects, the buffers above.
"""

import re

import torch

from .outcome import BadInput

# State entries Megatron's torch_dist writes per parameter, by the wrapped torch optimizer's names.
_MAIN_PARAM = ("fp32_param", "param")  # the fp32 main parameter: fully_sharded_model_space's name, fully_reshardable's
_ENTRIES = ("exp_avg_sq_row", "exp_avg_sq_col", "exp_avg_sq", "exp_avg", "max_exp_avg_sq", "momentum_buffer",
            "row_var", "col_var", "variance") + _MAIN_PARAM
_TORCH_DIST = re.compile(r"(?:chained_(\d+)\.)?optimizer\.state\.(" + "|".join(_ENTRIES) + r")\.(.+)")
_DP_BUFFERS = re.compile(r"(?:chained_\d+\.)?optimizer\.distributed\.dp_group_idx_\d+\..*")
# The key of torch_dist_state's dict that holds a ChainedOptimizer's second optimizer class.
CHAINED_AUX = "chained_aux"


# param_groups keys of emerging_optimizers' OrthogonalizedOptimizer (NVIDIA-NeMo/Emerging-Optimizers,
# orthogonalized_optimizers/orthogonalized_optimizer.py), which Megatron's Muon (TensorParallelMuon in
# megatron/core/optimizer/emerging_optimizers.py) is: not torch.optim.Muon's math (weight decay before the
# momentum, L2 or "independent" decay, a "spectral" scale by default), and its scale mode, Newton-Schulz
# steps and coefficients live in the constructor's closure, not in the checkpoint.
_ORTHOGONALIZED_KEYS = ("momentum_beta", "use_nesterov", "use_decoupled_wd", "use_independent_wd")


def refuse_orthogonalized(groups, where, prefix=""):
    """BadInput for the param groups of emerging_optimizers' Muon family (Megatron's Muon), by the first
    such key (after `prefix`, a chained optimizer's place in common.pt): the replay's "muon" is torch.optim.Muon."""
    for i, g in enumerate(groups):
        key = next((k for k in _ORTHOGONALIZED_KEYS if isinstance(g, dict) and k in g), None)
        if key is not None:
            raise BadInput(where, f"{prefix}param_groups.{i}.{key}",
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
                                   "parameter; save with --ckpt-format torch_dist and "
                                   "--dist-ckpt-optim-fully-reshardable (per-parameter "
                                   "optimizer.state.exp_avg.<param> tensors), which nanreplay import reads")
    if isinstance(obj, dict):
        key = next((k for k in obj if isinstance(k, str) and _DP_BUFFERS.fullmatch(k)), None)
        if key is not None:
            raise BadInput(where, key, "Megatron's distributed optimizer state saved per data-parallel buffer "
                                       "(the dp_reshardable / fully_sharded_bucket_space sharding types): its "
                                       "offsets follow the run's bucket layout, not parameter names; save with "
                                       "--dist-ckpt-optim-fully-reshardable (optimizer.state.<entry>.<param>)")
    states = _integer_id_states(obj)
    layer_wise = re.fullmatch(r"layer_wise_optimizer_\d+\.pt", name) is not None
    if states and (layer_wise or isinstance(obj, list)):
        raise BadInput(where, "state" if not isinstance(obj, list) else "0.state",
                       f"Megatron's layer-wise distributed optimizer file ({len(states)} chained optimizer state "
                       "dict(s), LayerWiseDistributedOptimizer.save_state_dict_to_file): integer ids over the "
                       "parameters this data-parallel rank updates, which the optimizer assigns at run time and "
                       "the file does not name; save with --ckpt-format torch_dist (per-parameter "
                       "optimizer.state.<entry>.<param> tensors), which nanreplay import reads")


def _common_optimizers(where):
    """The optimizers' parts of a torch_dist checkpoint's common.pt in chain order, [(key prefix, {param_groups,
    state})] (a ChainedOptimizer of several saves {0: ..., 1: ...}), and the file; None when there is no
    common.pt or an optimizer's part has no param_groups."""
    from .safe_pickle import _torch_load
    from pathlib import Path
    path = (Path(where) if Path(where).is_dir() else Path(where).parent) / "common.pt"
    if not path.is_file():
        return None, path
    node = _torch_load(path, path)
    node = node.get("optimizer") if isinstance(node, dict) else None
    chain = isinstance(node, dict) and len(node) > 1 and all(isinstance(k, int) for k in node)
    parts = [(f"optimizer.{i}.", node[i]) for i in sorted(node)] if chain else [("optimizer.", node)]
    out = []
    for prefix, part in parts:
        for _ in range(3):  # Float16Optimizer / DistributedOptimizer nest the torch optimizer's dict one level down
            if not isinstance(part, dict) or "param_groups" in part:
                break
            part = part.get("optimizer", part.get(0))  # a ChainedOptimizer of one: {0: ...}
        if not (isinstance(part, dict) and isinstance(part.get("param_groups"), list)):
            return None, path
        out.append((prefix, part))
    return out, path


def _step_of(common, path, prefix):
    steps = {int(float(g["step"].item() if isinstance(g["step"], torch.Tensor) else g["step"]))
             for g in common["param_groups"] if isinstance(g, dict) and g.get("step") is not None}
    state = common.get("state")
    if isinstance(state, dict) and state.get("common_step") is not None:
        step = state["common_step"]
        steps.add(int(float(step.item() if isinstance(step, torch.Tensor) else step)))
    if len(steps) > 1:
        raise BadInput(path, prefix + "param_groups.step", f"differs between groups ({sorted(steps)})")
    return steps.pop() if steps else None


def _per_optimizer_tensors(flat):
    """{chained index, None without the prefix: {model key: {entry: tensor}}} of the optimizer.state tensors."""
    per = {}
    for key, value in flat.items():
        m = _TORCH_DIST.fullmatch(key) if isinstance(key, str) else None
        if m:
            index = None if m.group(1) is None else int(m.group(1))
            per.setdefault(index, {}).setdefault(m.group(3), {})[m.group(2)] = value
    return per


def _check_main_params(state, flat, where, prefix):
    """Drops the fp32 main parameters (`fp32_param`, fully_reshardable's `param`) after checking each equals
    the model's weight: the bundle replays the model's weights."""
    for key, entries in state.items():
        for entry in _MAIN_PARAM:
            main = entries.pop(entry, None)
            weight = flat.get(key)
            if main is not None and not (isinstance(weight, torch.Tensor) and weight.shape == main.shape
                                         and torch.equal(weight.float(), main.float())):
                raise BadInput(where, f"{prefix}optimizer.state.{entry}.{key}",
                               "the fp32 main parameter differs from the model's weight " + (
                                   "(mixed-precision training): the bundle replays the model's weights, so this "
                                   "would replay another run" if isinstance(weight, torch.Tensor) else
                                   f"{key!r}, which is not beside it to compare (give the whole torch_dist checkpoint)"))


def _settings(common, path, prefix):
    """One optimizer's hyper-parameters from its param groups (without params and step). Its groups must agree:
    Megatron saves their params as non-persistent, so which parameters a group holds is not in the files."""
    from .optimizer import KIND_HYPER
    groups = [{k: v for k, v in g.items() if k not in ("params", "step")} for g in common["param_groups"]
              if isinstance(g, dict)]
    for k in sorted({k for keys in KIND_HYPER.values() for k in keys}):
        values = {repr(g.get(k)) for g in groups}
        if len(values) > 1:
            raise BadInput(path, f"{prefix}param_groups.{k}",
                           f"differs between groups ({sorted(values)}) but common.pt does not say which parameters "
                           "each group holds (Megatron saves their ids as non-persistent)")
    return groups[0] if groups else {}


class _Member:
    """One optimizer of the chain: its common.pt part and the tensors it holds, by model key."""

    def __init__(self, prefix, common, path, state):
        from .optimizer import infer_kind
        self.prefix, self.state = prefix, state
        refuse_orthogonalized(common["param_groups"], path, "" if prefix == "optimizer." else prefix)
        self.settings, self.step = _settings(common, path, prefix), _step_of(common, path, prefix)
        self.kind = infer_kind(state, [self.settings], path)[0]
        self.signature = (self.kind, repr(sorted(self.settings.items(), key=lambda kv: kv[0])), self.step)


def _split_unprefixed(state, members, where):
    """A chain saved without the chained_<i>. prefix (Megatron's chained_optim_avoid_prefix, its default): every
    tensor under optimizer.state.<entry>.<key>. Which optimizer holds a parameter is then read from its state
    entries' names where only one optimizer of the chain keeps those entries; otherwise bad input."""
    from .optimizer import KIND_STATE
    if len({m.signature for m in members}) == 1:
        members[0].state = state  # one class and one setting: which of them held a parameter changes nothing
        return members
    for key, entries in state.items():
        names = set(entries)
        holders = {m.signature: m for m in members if names and names <= set(KIND_STATE[m.kind])}
        if len(holders) != 1:
            raise BadInput(where, f"optimizer.state.{sorted(names)[0] if names else '*'}.{key}",
                           f"{len(members)} chained optimizers saved without the chained_<i>. prefix, and "
                           f"{len(holders) or 'none'} of them could hold this state: the files do not say which "
                           "parameters each updates (common.pt's param_groups keep no params)")
        next(iter(holders.values())).state[key] = entries
    return members


def _members(per, commons, path, where):
    """Each optimizer of the chain with the tensors it holds."""
    prefixed = sorted(i for i in per if i is not None)
    if prefixed and prefixed[-1] >= len(commons):
        raise BadInput(where, f"chained_{prefixed[-1]}.optimizer.state",
                       f"{path} holds {len(commons)} optimizer(s)' param_groups, none for this chained optimizer")
    def held(i):  # with the prefix each its own; without it the only optimizer's, or split below
        return per.get(i, {}) if prefixed else (per[None] if len(commons) == 1 else {})
    members = [_Member(prefix, common, path, held(i)) for i, (prefix, common) in enumerate(commons)]
    if not prefixed and len(members) > 1:
        members = _split_unprefixed(per[None], members, where)
    return members


def _by_kind(members, path):
    """One name-keyed state dict per optimizer class, in chain order: its members' tensors (each with its
    update count) and one param group per member's settings, listing the parameters it holds."""
    out = {}
    for m in members:
        if not m.state:
            if len({x.signature for x in members}) > 1:
                raise BadInput(path, m.prefix + "param_groups", "a chained optimizer with no tensor in the checkpoint "
                                                                "(a stub, or saved before its first update): which "
                                                                "parameters it updates is not in the files")
            continue
        if m.step is None and m.kind != "muon":
            raise BadInput(path, m.prefix + "param_groups.step", "missing: the update count (bias correction) is "
                                                                 "neither a group's step nor the state's common_step")
        opt, groups = out.setdefault(m.kind, ({"state": {}, "param_groups": []}, {}))
        for entries in m.state.values():
            if m.step is not None:
                entries["step"] = m.step
        opt["state"].update(m.state)
        if m.signature not in groups:  # optimizers of one class and one setting share a group
            groups[m.signature] = dict(m.settings, params=[])
            opt["param_groups"].append(groups[m.signature])
        groups[m.signature]["params"] = sorted(set(groups[m.signature]["params"]) | set(m.state))
    return [opt for opt, _ in out.values()]


def torch_dist_state(flat, where):
    """Megatron's torch_dist optimizer tensors in a flat (DCP) state dict as one optimizer state dict keyed by
    the model's names ({"state": {key: {entry: tensor, "step": n}}, "param_groups": [{..., "params": [keys]}]}),
    or None when there are none. The update count and the hyper-parameters come from the checkpoint's
    common.pt (in `where`, the checkpoint's directory, or beside `where`, a file holding the same keys). A
    ChainedOptimizer's optimizers of one class become one state dict (a param group each); a second class
    (torch.optim.Muon beside an AdamW) is the returned dict's CHAINED_AUX, the run's second optimizer.
    Refused by name: a state that needs a count it does not give, a fp32 main parameter that differs from
    the model's weight, Megatron's own Muon, and whatever the files do not assign to one optimizer."""
    per = _per_optimizer_tensors(flat)
    if not per:
        return None
    prefixed = sorted(i for i in per if i is not None)
    if prefixed and None in per:
        raise BadInput(where, f"chained_{prefixed[0]}.optimizer.state", "tensors with and without the chained_<i>. "
                                                                        "prefix in one checkpoint")
    for index, state in per.items():
        _check_main_params(state, flat, where, "" if index is None else f"chained_{index}.")
    commons, path = _common_optimizers(where)
    if commons is None:
        raise BadInput(path, "optimizer.param_groups", "missing: Megatron's torch_dist checkpoint keeps the "
                                                       "optimizer's hyper-parameters and update count in common.pt "
                                                       "beside the tensors")
    per = {i: {k: e for k, e in state.items() if e} for i, state in per.items()}  # fp32_param alone: no state yet
    kinds = _by_kind(_members(per, commons, path, where), path)
    if len(kinds) > 2:
        raise BadInput(path, "optimizer", f"a ChainedOptimizer of {len(kinds)} optimizer classes: the replay "
                                          "takes two (a first and a second, as --aux-optimizer gives)")
    if not kinds:
        return {"state": {}, "param_groups": [dict(_settings(commons[0][1], path, commons[0][0]), params=[])]}
    return dict(kinds[0], **({CHAINED_AUX: kinds[1]} if len(kinds) == 2 else {}))
