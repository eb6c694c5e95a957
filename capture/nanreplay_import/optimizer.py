"""The optimizer: AdamW state keyed by name, or a plain state_dict() with integer ids, onto bundle
v1's parameters; its hyper-parameters from the param groups, flags or PyTorch's defaults."""

import json
import re

import torch

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
