"""The optimizer: AdamW state keyed by name, or a plain state_dict() with integer ids, onto bundle
v1's parameters; its hyper-parameters from the param groups, flags or PyTorch's defaults."""

import json
import math
import re
from pathlib import Path

import torch

import nanreplay_capture as _capture

from . import megatron_optim
from .model_settle import expected_parameters
from .naming import _IGNORED, strip_prefix, unstack_megatron_layers
from .outcome import BadInput


def _unflatten_optimizer(flat):
    """torch.distributed.checkpoint.state_dict's flatten_optimizer_state_dict layout
    ({"state.<fqn>.exp_avg": t, "param_groups.<fqn>.lr": x}) as the nested one."""
    state, groups = {}, {}
    for key, value in flat.items():
        if not isinstance(key, str):
            continue
        m = re.fullmatch(r"state\.(.+)\.(exp_avg|exp_avg_sq|step|max_exp_avg_sq|row_var|col_var|variance|"
                         r"exp_avg_sq_row|exp_avg_sq_col|RMS|momentum_buffer)", key)
        if m:
            state.setdefault(m.group(1), {})[m.group(2)] = value
            continue
        m = re.fullmatch(r"param_groups\.(.+)\.([a-z_][a-z_0-9]*)", key)
        if m:
            groups.setdefault(m.group(1), {})[m.group(2)] = value
    by_settings = {}
    if groups and all(k.isdigit() and isinstance(v.get("params"), list) for k, v in groups.items()):
        return {"state": state, "param_groups": [groups[k] for k in sorted(groups, key=int)]}  # DCP-flattened list
    for fqn, settings in groups.items():
        sig = json.dumps({k: v for k, v in settings.items() if k != "params"}, sort_keys=True, default=str)
        by_settings.setdefault(sig, dict(settings, params=[]))["params"].append(fqn)
    return {"state": state, "param_groups": list(by_settings.values())}


def _state_fits(s, shape):
    """Whether a parameter's state entries have the shapes its class gives a parameter of `shape`:
    the elementwise ones its shape, Adafactor's row and column factors its rows and columns."""
    rows = math.prod(shape[:-1]) if len(shape) > 1 else None
    cols = math.prod(shape[:-2]) * shape[-1] if len(shape) > 1 else None
    for k, t in s.items():
        if not isinstance(t, torch.Tensor) or k == "step":
            continue
        if k in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "variance"):
            if tuple(t.shape) != tuple(shape):
                return False
        elif k in ("row_var", "exp_avg_sq_row"):
            if t.numel() != rows:
                return False
        elif k in ("col_var", "exp_avg_sq_col"):
            if t.numel() != cols:
                return False
    return True


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
        ok = all(_state_fits(s, tuple(shapes[mapping[i]]))
                 for i, s in opt["state"].items() if i in mapping and isinstance(s, dict))
        if ok and set(opt["state"]) <= set(mapping):
            return mapping, label
    raise BadInput(where, "param_groups", f"integer parameter ids in groups of sizes {sizes} match neither a single "
                                          f"group in model order ({len(source_names)} parameters) nor nanoGPT's two "
                                          f"groups ({len(decay)} of >= 2 dimensions, {len(nodecay)} others); save the "
                                          "optimizer keyed by name (get_optimizer_state_dict)")


def _source_parameters(source_sd):
    """Source names of the floating-point parameters in model order, aliases (tied weights) dropped, and their shapes."""
    seen, source_names = {}, []
    for name, t in source_sd.items():
        if _IGNORED.fullmatch(name) or not t.is_floating_point():
            continue
        key = (t.data_ptr(), tuple(t.shape), t.dtype)
        if t.numel() and key in seen:
            continue
        seen[key] = name
        source_names.append(name)
    return source_names, {n: tuple(source_sd[n].shape) for n in source_names}

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
    source_names, shapes = _source_parameters(source_sd)
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
        if s.get("step") is None:  # the update count AdamW's bias correction reads: never taken as 0
            raise BadInput(where, f"state.{name}.step", "missing: AdamW's update count (its bias correction) is "
                                                       "not guessed")
        step = s["step"]
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
        if mapper.naming == "megatron":
            m = re.fullmatch(r"decoder\.layers\.([a-z_]+\..*)", p)
            if m:  # layer-stacked: every layer
                keys += [k for i in range(model["num_layers"])
                         for k in _group_param_keys({"params": [f"decoder.layers.{i}.{m.group(1)}"]}, mapper, model)]
                continue
        keys += mapper.bundle_keys(p, model)
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


# ---- Optimizers beyond AdamW: read by the names of their state entries and param_groups' keys. ----

# The classes the importer reads, by module + qualified name (and the public alias), onto the manifest's kind.
OPTIMIZER_CLASSES = {
    "torch.optim.AdamW": "adamw", "torch.optim.adamw.AdamW": "adamw",
    "torch.optim.Adam": "adam", "torch.optim.adam.Adam": "adam",
    "torch.optim.Adafactor": "adafactor", "torch.optim._adafactor.Adafactor": "adafactor",
    "transformers.Adafactor": "adafactor_hf", "transformers.optimization.Adafactor": "adafactor_hf",
    "torch.optim.Muon": "muon", "torch.optim._muon.Muon": "muon",
}
# Per kind: the state entries written to optimizer.safetensors (under these names), and the
# param_groups' hyper-parameters written to the manifest (under these names).
KIND_STATE = {
    "adamw": ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"),
    "adam": ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"),
    "adafactor": ("row_var", "col_var", "variance"),
    "adafactor_hf": ("exp_avg_sq_row", "exp_avg_sq_col", "exp_avg_sq", "exp_avg"),
    "muon": ("momentum_buffer",),
}
KIND_HYPER = {
    "adamw": ("betas", "eps", "weight_decay", "amsgrad", "maximize"),
    "adam": ("betas", "eps", "weight_decay", "amsgrad", "maximize", "decoupled_weight_decay"),
    "adafactor": ("beta2_decay", "eps", "d", "weight_decay", "maximize"),
    "adafactor_hf": ("eps", "clip_threshold", "decay_rate", "beta1", "weight_decay", "scale_parameter",
                     "relative_step", "warmup_init"),
    "muon": ("weight_decay", "momentum", "nesterov", "ns_coefficients", "eps", "ns_steps", "adjust_lr_fn",
             "use_addmm"),
}
# State entries a class keeps that the replay recomputes (Hugging Face's Adafactor's RMS of the parameter).
_RECOMPUTED = {"adafactor_hf": ("RMS",)}
# Elementwise state splits with a fused parameter (Megatron's linear_qkv, linear_fc1); the others do not.
_ELEMENTWISE = {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"}


def optimizer_kind(cls, where, flag="--optimizer-class"):
    """The manifest's kind for --optimizer-class CLASS; an unknown class is refused by name."""
    if cls not in OPTIMIZER_CLASSES:
        raise BadInput("command line", flag,
                       f"{cls!r} is not an optimizer the importer reads (it reads "
                       f"{', '.join(k for k in OPTIMIZER_CLASSES if k.count('.') == 2 or k.startswith('transformers.A'))})")
    return OPTIMIZER_CLASSES[cls]


def infer_kind(state, groups, where):
    """The class from its state entries' and param_groups' names, where they say it; else bad input."""
    megatron_optim.refuse_orthogonalized(groups, where)
    names = set()
    for s in state.values():
        if isinstance(s, dict):
            names |= {k for k in s if isinstance(k, str)}
    names.discard("step")
    gkeys = {k for g in groups for k in g if isinstance(k, str)}
    if gkeys & {"ns_steps", "ns_coefficients"}:
        return "muon", "Muon (param_groups' ns_steps)"
    if "beta2_decay" in gkeys or names & {"row_var", "col_var", "variance"}:
        return "adafactor", "torch.optim.Adafactor (row_var/col_var/variance, beta2_decay)"
    if gkeys & {"relative_step", "decay_rate", "clip_threshold"} or names & {"exp_avg_sq_row", "exp_avg_sq_col", "RMS"}:
        return "adafactor_hf", "transformers' Adafactor (exp_avg_sq_row/col, relative_step)"
    if names & {"exp_avg", "exp_avg_sq"} or (not names and "betas" in gkeys):
        dwd = {bool(g["decoupled_weight_decay"]) for g in groups if "decoupled_weight_decay" in g}
        if dwd == {False}:
            return "adam", "torch.optim.Adam (param_groups' decoupled_weight_decay false)"
        return "adamw", "AdamW (the importer's default for exp_avg/exp_avg_sq; --optimizer-class torch.optim.Adam for Adam)"
    if "momentum_buffer" in names:
        raise BadInput(where, "state.*.momentum_buffer", "momentum_buffer without Muon's ns_steps in the param_groups "
                                                         "(SGD's state?): name the class with --optimizer-class")
    return "adamw", "AdamW (the importer's default; its reader names what the state lacks)"


def _json_value(v):
    if isinstance(v, torch.Tensor):
        v = v.item()
    if isinstance(v, (tuple, list)):
        return [_json_value(x) for x in v]
    if isinstance(v, bool) or v is None or isinstance(v, str):
        return v
    if isinstance(v, int):
        return v
    return float(v)


def read_optimizer_general(opt, kind, where, source_sd, mapper, model, args):
    """An optimizer state dict of `kind`: (state tensors [(bundle name, tensor)], {bundle key: step},
    the manifest's optimizer section without grad_clip, [(bundle keys, settings)] per group, notes). Entries and hyper-parameters by name."""
    if not isinstance(opt, dict):
        raise BadInput(where, "optimizer", f"a {type(opt).__name__}, not an optimizer state dict")
    if "state" not in opt and any(isinstance(k, str) and k.startswith("state.") for k in opt):
        opt = _unflatten_optimizer(opt)
    state, groups = opt.get("state"), opt.get("param_groups")
    if not isinstance(state, dict) or not isinstance(groups, list) or not groups:
        raise BadInput(where, "state", "an optimizer state dict needs 'state' and 'param_groups'")
    megatron_optim.refuse_orthogonalized(groups, where)
    for flag, value in (("--betas", args.betas), ("--eps", args.eps), ("--weight-decay", args.weight_decay)):
        if value is not None:
            raise BadInput("command line", flag, f"applies to AdamW's state only; the {kind} state's param_groups say it")
    notes = []
    source_sd = strip_prefix(source_sd, mapper.naming)
    source_names, shapes = _source_parameters(source_sd)
    if all(isinstance(k, int) for k in state) and all(isinstance(i, int) for g in groups for i in g.get("params", [])):
        mapping, label = _recover_ids(opt, source_names, shapes, where)
        notes.append(f"integer ids, {label}")
        state = {mapping[i]: s for i, s in state.items() if i in mapping}
        groups = [dict(g, params=[mapping[i] for i in g.get("params", [])]) for g in groups]
    else:
        notes.append("keyed by parameter name")
        state = {strip_prefix({k: None}, mapper.naming).popitem()[0] if isinstance(k, str) else k: v
                 for k, v in state.items()}
        groups = [dict(g, params=[strip_prefix({p: None}, mapper.naming).popitem()[0] if isinstance(p, str) else p
                                  for p in g.get("params", [])]) for g in groups]
    allowed = set(KIND_STATE[kind]) | {"step"} | set(_RECOMPUTED.get(kind, ()))
    per_entry, steps = {}, {}
    for name, s in state.items():
        if not isinstance(s, dict):
            raise BadInput(where, f"state.{name}", f"a {type(s).__name__}, not a parameter's state")
        for entry, t in s.items():
            if entry not in allowed:
                raise BadInput(where, f"state.{name}.{entry}", f"not a state entry of {kind} "
                                                               f"({', '.join(KIND_STATE[kind])}, step)")
            if entry == "step":
                steps[name] = int(float(t.item() if isinstance(t, torch.Tensor) else t))
            elif entry in KIND_STATE[kind] and t is not None:
                if not isinstance(t, torch.Tensor):
                    raise BadInput(where, f"state.{name}.{entry}", f"a {type(t).__name__}, not a tensor")
                target = mapper.target(name) or ""
                if entry not in _ELEMENTWISE and mapper.is_split(target):
                    raise BadInput(where, f"state.{name}.{entry}", f"{kind}'s {entry} of a fused parameter does not "
                                                                   "split into the bundle's separate ones")
                per_entry.setdefault(entry, {})[name] = t
    tensors, step_values = [], {}
    for entry, d in per_entry.items():
        if model["arch"] == "llama" and mapper.naming == "megatron":
            d = unstack_megatron_layers(d, model["num_layers"])
        mapped = mapper.map(d, where, strict=False)
        if model.get("tie_embeddings"):
            embed = "model.embed_tokens.weight" if model["arch"] == "llama" else "transformer.wte.weight"
            if "lm_head.weight" in mapped and embed not in mapped:
                mapped[embed] = mapped["lm_head.weight"]
            mapped.pop("lm_head.weight", None)
        for key, t in mapped.items():
            tensors.append((f"{key}.{entry}", t))
    expected = dict(expected_parameters(model))
    for name, n in steps.items():
        for key in mapper.map({name: torch.zeros(shapes.get(name, (1,)))}, where, strict=False):
            if key in expected or key == "lm_head.weight":
                step_values["model.embed_tokens.weight" if key == "lm_head.weight" and model.get("tie_embeddings")
                            and model["arch"] == "llama" else key] = n
    # Hyper-parameters: each group's, under the class's own names; the first group's at the top level,
    # a group whose settings differ listed in `groups` with one glob per parameter.
    settings = []
    for i, g in enumerate(groups):
        for k in g:
            if kind == "adamw" and k == "decoupled_weight_decay" and g[k]:
                continue  # PyTorch 2.7's AdamW is Adam with decoupled_weight_decay true
            if isinstance(k, str) and k not in KIND_HYPER[kind] and any(k in h for h in KIND_HYPER.values()):
                raise BadInput(where, f"param_groups.{i}.{k}", f"belongs to another optimizer than {kind}")
        settings.append({k: _json_value(g[k]) for k in KIND_HYPER[kind] if k in g})
    section = dict({"kind": kind}, **settings[0])
    extra, every = [], []
    for i, (g, st) in enumerate(zip(groups, settings)):
        keys = [k for k in _group_param_keys(g, mapper, model) if k in expected]
        every.append((keys, st))
        if i == 0 or st == settings[0]:
            continue
        if keys:
            extra.append(dict({"name": f"{kind}{i}", "params": keys}, **st))
    if extra:
        section["groups"] = extra
        notes.append(f"{len(extra) + 1} param groups with different settings")
    notes.append("hyper-parameters " + ", ".join(f"{k} {v}" for k, v in settings[0].items()) + " (param_groups)")
    return tensors, step_values, section, every, notes


def step_entries(step_values):
    """(the scalar step, per-parameter `<key>.step` tensors where the counts differ); the scalar is
    None when no parameter has a step entry (Muon keeps none)."""
    distinct = set(step_values.values())
    if len(distinct) <= 1:
        return (distinct.pop() if distinct else None), []
    return None, [(f"{k}.step", torch.tensor(n, dtype=torch.int64)) for k, n in sorted(step_values.items())]


def merge_aux(section, every, aux_kind, aux_every, where):
    """A second optimizer of the same run (torch.optim.Muon's runs give the embeddings, norms and head
    to an AdamW): each of its param groups joins `groups` with its kind and its parameters' names (the
    capture helper's join_optimizer_groups, which the recorder uses for a run's several optimizers)."""
    try:
        return _capture.join_optimizer_groups(section, {k for keys, _ in every for k in keys}, aux_kind, aux_every,
                                              "aux_")
    except _capture.CaptureError as e:
        raise BadInput(where, "param_groups", str(e)) from None


def aux_optimizer_state(opt, where, args):
    """The run's second optimizer and where it came from: --aux-optimizer's file, or the second class of a
    Megatron ChainedOptimizer in a torch_dist checkpoint (megatron_optim.torch_dist_state); (None, None)
    when there is none. Both at once is bad input: the run had one second optimizer."""
    from .checkpoint_state import find_optimizer_state
    from .safe_pickle import _torch_load
    chained = opt.get(megatron_optim.CHAINED_AUX) if isinstance(opt, dict) else None
    if args.aux_optimizer is None:
        return chained, (where if chained is not None else None)
    aux_path = Path(args.aux_optimizer)
    if chained is not None:
        raise BadInput("command line", "--aux-optimizer", f"{where} holds a ChainedOptimizer whose second optimizer "
                                                          "is read from it already")
    if not aux_path.is_file():
        raise BadInput(aux_path, "--aux-optimizer", "is not a torch.save file")
    aux, _ = find_optimizer_state(_torch_load(aux_path, aux_path), aux_path)
    if aux is None:
        raise BadInput(aux_path, "optimizer", "no optimizer state ('state' and 'param_groups') in it")
    return aux, aux_path
