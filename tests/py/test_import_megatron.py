"""`nanreplay import` of a Megatron-core GPT checkpoint (torch format: {"model", "args", "iteration"},
the fused TransformerEngine layer spec), with its AdamW state keyed by parameter name in a separate
file, replayed by `nanreplay run` to the losses the original PyTorch model computed.

The model is Megatron-core's GPTModel with TE's fused modules, written here with their semantics
and names: embedding.word_embeddings; per layer self_attention.linear_qkv (a LayerNormLinear: its
layer_norm_weight is the input RMSNorm, its weight q, k and v laid out per query group: for each
group its H/G query heads, then its key head, then its value head), self_attention.linear_proj,
mlp.linear_fc1 (LayerNormLinear: the pre-MLP norm, and gate and up stacked), mlp.linear_fc2;
decoder.final_layernorm; output_layer (untied). Rotary rotate-half (Megatron's default), GQA,
TE's _extra_state entries in the state dict, norm_epsilon 0 in args. The embedding row of token 0 is
zero and first read at the last step, which divides 0 by 0 in layer 0's fused input norm: nanreplay
must name the site, sample and position PyTorch's forward hooks saw (the norm is a parameterless
child module here, so a hook sees its output as the bundle's layers.0.attn_norm).

Then the same AdamW state in Megatron's own optimizer files, written by hand with Megatron's key names
(megatron_optimizer_cases): torch_dist's optimizer.state.<entry>.<stacked key> tensors with their
common.pt import byte for byte as the name-keyed state does (as --optimizer, and as the whole
--checkpoint); a ChainedOptimizer's torch_dist state (ChainedOptimizer.sharded_state_dict in
megatron/core/optimizer/optimizer.py: chained_<i>. prefixes or none, common.pt's optimizer {i: ...}) of two
AdamW, of torch.optim.Muon + AdamW and of Megatron's Muon + AdamW (chained_cases); the layouts that name no
parameter, and what would be guessed, are one line each.
"""
import argparse
import json
import re
import shutil
import sys
from argparse import Namespace
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import import_support as s  # noqa: E402

C, H, G, L, V, FFN = 32, 4, 2, 2, 64, 48
D = C // H
SEQ, MBS, ACCUM, SEED = 16, 2, 2, 99
FIRST, LAST = 3, 6
SITES = [(r"embedding\.word_embeddings", "embed"),
         (r"decoder\.layers\.(\d+)\.self_attention\.linear_qkv\.norm", "layers.{}.attn_norm"),
         (r"decoder\.layers\.(\d+)\.self_attention\.linear_proj", "layers.{}.attn.out"),
         (r"decoder\.layers\.(\d+)\.mlp\.linear_fc1\.norm", "layers.{}.mlp_norm"),
         (r"decoder\.layers\.(\d+)\.mlp\.linear_fc2", "layers.{}.mlp.down"),
         (r"decoder\.final_layernorm", "final_norm"), (r"output_layer", "logits")]


class RMSNormFn(nn.Module):
    """TE's fused RMSNorm inside a LayerNormLinear (no parameters of its own)."""

    def __init__(self, eps):
        super().__init__()
        self.eps = eps

    def forward(self, x, weight):
        return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps) * weight


class TERMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.norm = RMSNormFn(eps)

    def forward(self, x):
        return self.norm(x, self.weight)


class LayerNormLinear(nn.Module):
    def __init__(self, cin, cout, eps):
        super().__init__()
        self.layer_norm_weight = nn.Parameter(torch.ones(cin))
        self.weight = nn.Parameter(torch.randn(cout, cin) * cin ** -0.5)
        self.norm = RMSNormFn(eps)

    def forward(self, x):
        return F.linear(self.norm(x, self.layer_norm_weight), self.weight)

    def get_extra_state(self):  # TE's fp8 metadata
        return torch.empty(0, dtype=torch.uint8)

    def set_extra_state(self, state):
        pass


class RowLinear(nn.Module):
    def __init__(self, cin, cout):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(cout, cin) * cin ** -0.5)

    def forward(self, x):
        return F.linear(x, self.weight)

    def get_extra_state(self):
        return torch.empty(0, dtype=torch.uint8)

    def set_extra_state(self, state):
        pass


def rotate_half(x):
    x1, x2 = torch.chunk(x, 2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class SelfAttention(nn.Module):
    def __init__(self, eps, base):
        super().__init__()
        self.linear_qkv = LayerNormLinear(C, (H + 2 * G) * D, eps)
        self.linear_proj = RowLinear(H * D, C)
        self.base = base

    def forward(self, x):
        b, t, _ = x.shape
        mixed = self.linear_qkv(x).view(b, t, G, (H // G + 2) * D)
        q, k, v = torch.split(mixed, [H // G * D, D, D], dim=3)
        q = q.reshape(b, t, H, D)
        inv_freq = 1.0 / (self.base ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
        freqs = torch.outer(torch.arange(t, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)[None, :, None, :]
        q = q * emb.cos() + rotate_half(q) * emb.sin()
        k = k * emb.cos() + rotate_half(k) * emb.sin()
        k, v = k.repeat_interleave(H // G, dim=2), v.repeat_interleave(H // G, dim=2)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        scores = q @ k.transpose(-2, -1) / D ** 0.5
        mask = torch.triu(torch.ones(t, t, dtype=torch.bool), 1)
        ctx = torch.softmax(scores.masked_fill(mask, float("-inf")).float(), -1) @ v
        return self.linear_proj(ctx.transpose(1, 2).reshape(b, t, H * D))


class MLP(nn.Module):
    def __init__(self, eps):
        super().__init__()
        self.linear_fc1 = LayerNormLinear(C, 2 * FFN, eps)
        self.linear_fc2 = RowLinear(FFN, C)

    def forward(self, x):
        gate, up = torch.chunk(self.linear_fc1(x), 2, dim=-1)
        return self.linear_fc2(F.silu(gate) * up)


class TransformerLayer(nn.Module):
    def __init__(self, eps, base):
        super().__init__()
        self.self_attention = SelfAttention(eps, base)
        self.mlp = MLP(eps)

    def forward(self, x):
        x = x + self.self_attention(x)
        return x + self.mlp(x)


class Decoder(nn.Module):
    def __init__(self, eps, base):
        super().__init__()
        self.layers = nn.ModuleList(TransformerLayer(eps, base) for _ in range(L))
        self.final_layernorm = TERMSNorm(C, eps)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.final_layernorm(x)


class Embedding(nn.Module):
    def __init__(self):
        super().__init__()
        self.word_embeddings = nn.Embedding(V, C)


class GPTModel(nn.Module):
    def __init__(self, eps=0.0, base=10000.0):
        super().__init__()
        self.embedding = Embedding()
        self.decoder = Decoder(eps, base)
        self.output_layer = RowLinear(C, V)

    def forward(self, tokens, targets):
        x = self.embedding.word_embeddings(tokens)
        logits = self.output_layer(self.decoder(x))
        return F.cross_entropy(logits.reshape(-1, V).float(), targets.reshape(-1))


# ---- Megatron's own optimizer files, written by hand with the key names of NVIDIA/Megatron-LM at
# d98e8a64ddf34856e74b24714e3bedb2f5a39553 (capture/nanreplay_import/megatron_optim.py cites the functions).

def _stacked(flat):
    """A torch_dist checkpoint's keys: the layers of decoder.layers.<i>.X stacked on a first axis as
    decoder.layers.X (TransformerLayer's sharded_state_dict, the layer a sharded axis)."""
    out, layers = {}, {}
    for k, t in flat.items():
        m = re.fullmatch(r"decoder\.layers\.(\d+)\.(.+)", k)
        if m:
            layers.setdefault(m.group(2), {})[int(m.group(1))] = t
        else:
            out[k] = t
    out.update({f"decoder.layers.{k}": torch.stack([v[i] for i in sorted(v)]) for k, v in layers.items()})
    return out


class Planted:
    """A class no checkpoint of Megatron's holds: its pickle must be refused, never instantiated."""

    def __setstate__(self, state):
        raise AssertionError("a planted common.pt was unpickled")


def write_megatron_optimizer_files(work, model, keyed):
    """dist/: a torch_dist checkpoint's tensors (as the DCP reader returns them, torch.save'd) and its
    common.pt; the layouts that name no parameter: distrib_optim.pt, layer_wise_optimizer_0.pt."""
    d = work / "dist"
    d.mkdir(exist_ok=True)
    weights = {k: v for k, v in model.state_dict().items() if "_extra_state" not in k}
    flat = dict(_stacked(weights))
    for entry in ("exp_avg", "exp_avg_sq"):  # fully_sharded_model_space: optimizer.state.<entry>.<model key>
        flat.update({f"optimizer.state.{entry}.{k}": t
                     for k, t in _stacked({n: st[entry] for n, st in keyed["state"].items()}).items()})
    flat.update({f"optimizer.state.fp32_param.{k}": t.float().clone() for k, t in _stacked(weights).items()})
    torch.save(flat, d / "optim_tensors.pt")
    step = int(next(iter(keyed["state"].values()))["step"])
    groups = [{k: v for k, v in g.items() if k != "params"} for g in keyed["param_groups"]]
    # DistributedOptimizer.state_dict(): {"optimizer": {"param_groups": [... "step"]}} under the checkpoint's "optimizer".
    torch.save({"optimizer": {"optimizer": {"param_groups": [dict(g, step=step) for g in groups]}},
                "iteration": FIRST, "checkpoint_version": 3.0}, d / "common.pt")
    bad = work / "dist-bad"
    bad.mkdir(exist_ok=True)
    torch.save({k: (t + 1 if k.startswith("optimizer.state.fp32_param.output_layer") else t) for k, t in flat.items()},
               bad / "optim_tensors.pt")  # fp32 main weights ahead of the bf16 model's: not the model's weights
    mixed = dict(flat, **{f"chained_1.optimizer.state.momentum_buffer.{k}": t for k, t in _stacked(weights).items()})
    torch.save(mixed, bad / "chained.pt")  # one optimizer's tensors with the chained_<i>. prefix, one's without
    write_chained_files(work, weights, keyed, groups, step)
    torch.save(flat, bad / "no_common.pt")  # the tensors without their common.pt: no update count, no hyper-parameters
    muon = work / "dist-muon"  # Megatron's Muon (emerging_optimizers' OrthogonalizedOptimizer's group keys)
    muon.mkdir(exist_ok=True)
    torch.save(dict(_stacked(weights), **{f"optimizer.state.momentum_buffer.{k}": torch.zeros_like(t)
                                          for k, t in _stacked(weights).items() if t.dim() == 3}),
               muon / "optim_tensors.pt")
    torch.save({"optimizer": {"param_groups": [{"lr": 2e-2, "momentum_beta": 0.95, "use_nesterov": True,
                                                "weight_decay": 0.1, "use_decoupled_wd": True,
                                                "use_independent_wd": False}]}}, muon / "common.pt")
    hostile = work / "dist-hostile"
    hostile.mkdir(exist_ok=True)
    torch.save(flat, hostile / "optim_tensors.pt")
    torch.save({"optimizer": Planted()}, hostile / "common.pt")  # goes through the restricted unpickler too
    n = sum(t.numel() for t in weights.values())
    # get_parameter_state_dp_zero: per gradient buffer, per dtype, flat fp32 buffers and no names.
    torch.save({"buckets_coalesced": True, 0: {torch.float32: {"param": torch.zeros(n), "exp_avg": torch.zeros(n),
                                                               "exp_avg_sq": torch.zeros(n), "numel_unpadded": n}}},
               bad / "distrib_optim.pt")
    # LayerWiseDistributedOptimizer.save_state_dict_to_file: ChainedOptimizer.state_dict(), integer ids.
    ids = {n_: i for i, n_ in enumerate(keyed["state"])}
    plain = {"state": {ids[k]: v for k, v in keyed["state"].items()},
             "param_groups": [dict(g, params=[ids[x] for x in keyed["param_groups"][0]["params"]]) for g in groups]}
    torch.save([plain, {"state": {}, "param_groups": []}], bad / "layer_wise_optimizer_0.pt")
    torch.save({"optimizer.distributed.dp_group_idx_0.param_state": {"buckets_coalesced": True}}, bad / "dp_reshardable.pt")


# ---- A ChainedOptimizer in a torch_dist checkpoint (megatron/core/optimizer/optimizer.py ChainedOptimizer.
# sharded_state_dict: each optimizer's sharded state under chained_<i>. unless metadata's chained_optim_avoid_prefix,
# which megatron/training/checkpointing.py sets; common.pt's "optimizer" then {i: that optimizer's param_groups}).

# The parameters a chained split gives the second optimizer (as an expert-parallel optimizer takes the experts).
SECOND = ("embedding.word_embeddings.weight", "output_layer.weight", "decoder.final_layernorm.weight")
# torch.optim.Muon's parameters in the Muon + AdamW chain: the unfused matrices (Muon of a fused linear_qkv
# is other math, refused by name).
MUON_KEYS = ("decoder.layers.self_attention.linear_proj.weight", "decoder.layers.mlp.linear_fc2.weight")
MEGATRON_GROUP_KEYS = {"wd_mult": 1.0, "lr_mult": 1.0, "is_expert_parallel": False, "is_decoupled_lr": False,
                       "max_lr": 1e-3, "min_lr": 0.0}
TORCH_MUON = {"weight_decay": 0.1, "momentum": 0.95, "nesterov": True, "ns_coefficients": (3.4445, -4.775, 2.0315),
              "eps": 1e-7, "ns_steps": 5, "adjust_lr_fn": None}


def _distopt_part(group, step):
    """DistributedOptimizer.sharded_state_dict's non-tensor part (fully_sharded_model_space), as common.pt keeps it."""
    return {"optimizer": {"param_groups": [dict(group, step=step, **MEGATRON_GROUP_KEYS)]},
            "param_state_sharding_type": "fully_sharded_model_space"}


def _write_chain(d, weights, parts, prefixed):
    """d/optim_tensors.pt and d/common.pt of a chain: parts = [(common.pt part, {stacked key: {entry: tensor}})]."""
    d.mkdir(exist_ok=True)
    flat = dict(_stacked(weights))
    for i, (_, state) in enumerate(parts):
        prefix = f"chained_{i}." if prefixed else ""
        for key, entries in state.items():
            for entry, t in dict(entries, fp32_param=flat[key].float().clone()).items():
                flat[f"{prefix}optimizer.state.{entry}.{key}"] = t
    torch.save(flat, d / "optim_tensors.pt")
    torch.save({"optimizer": {i: part for i, (part, _) in enumerate(parts)}, "iteration": FIRST,
                "checkpoint_version": 3.0}, d / "common.pt")


def write_chained_files(work, weights, keyed, groups, step):
    """Chains of the run's AdamW state: two AdamW (dense + the rest, with and without the chained_<i>. prefix;
    without it and with two weight decays, refused); torch.optim.Muon + AdamW, and the same two as files for
    --aux-optimizer; Megatron's own Muon + AdamW."""
    adam = {k: {e: t for e, t in st.items() if e != "step"} for k, st in _stacked_state(keyed).items()}
    first = {k: v for k, v in adam.items() if k not in SECOND}
    second = {k: v for k, v in adam.items() if k in SECOND}
    two = [(_distopt_part(groups[0], step), first), (_distopt_part(groups[0], step), second)]
    _write_chain(work / "dist-chained", weights, two, prefixed=True)
    _write_chain(work / "dist-chained-noprefix", weights, two, prefixed=False)
    decays = [two[0], (_distopt_part(dict(groups[0], weight_decay=0.0), step), second)]
    _write_chain(work / "dist-chained-ambiguous", weights, decays, prefixed=False)
    g = torch.Generator().manual_seed(4)
    stacked = _stacked(weights)
    muon = {k: {"momentum_buffer": torch.randn(stacked[k].shape, generator=g) * 1e-3} for k in MUON_KEYS}
    rest = {k: v for k, v in adam.items() if k not in MUON_KEYS}
    muon_group = dict(TORCH_MUON, lr=groups[0]["lr"], **MEGATRON_GROUP_KEYS)  # one scheduler: one lr for both
    _write_chain(work / "dist-chained-muon", weights, [({"param_groups": [muon_group]}, muon),
                                                       (_distopt_part(groups[0], step), rest)], prefixed=False)
    unstacked = {f"decoder.layers.{i}.{k[len('decoder.layers.'):]}": v["momentum_buffer"][i]
                 for k, v in muon.items() for i in range(L)}
    torch.save({"state": {k: {"momentum_buffer": t} for k, t in unstacked.items()},
                "param_groups": [dict(muon_group, params=list(unstacked))]}, work / "muon-files-muon.pt")
    names = [n for n in keyed["state"] if n not in unstacked]
    torch.save({"state": {n: keyed["state"][n] for n in names}, "param_groups": [dict(groups[0], params=names)]},
               work / "muon-files-adamw.pt")
    emerging = {"lr": groups[0]["lr"], "momentum_beta": 0.95, "use_nesterov": True, "weight_decay": 0.1,
                "use_decoupled_wd": True, "use_independent_wd": False}
    _write_chain(work / "dist-chained-emerging", weights, [({"param_groups": [emerging]}, muon),
                                                           (_distopt_part(groups[0], step), rest)], prefixed=True)


def _stacked_state(keyed):
    """The name-keyed AdamW state as torch_dist holds it: {stacked key: {entry: tensor}}."""
    entries = {e for st in keyed["state"].values() for e in st if e != "step"}
    per_entry = {e: _stacked({n: st[e] for n, st in keyed["state"].items()}) for e in entries}
    return {k: {e: per_entry[e][k] for e in entries} for k in next(iter(per_entry.values()))}


def import_in_process(argv, out):
    """The importer's main() in this process: (exit code, stderr)."""
    import contextlib
    import io
    import nanreplay_import as ni
    shutil.rmtree(out, ignore_errors=True)
    buf_out, buf_err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(buf_out), contextlib.redirect_stderr(buf_err):
        rc = ni.main([str(a) for a in argv] + ["--out", str(out)])
    return rc, buf_err.getvalue()


def megatron_optimizer_cases(cli, work, base, margs):
    """The torch_dist tensors import as the name-keyed state does; the other layouts are refused by name."""
    flags = ["--checkpoint", work / "model_optim_rng.pt", "--log-numbering", "zero", "--log", work / "log.jsonl",
             "--steps", f"{FIRST}:{LAST}", "--grad-clip", 1.0]
    data_flags = base
    rc, err = import_in_process(flags + data_flags + ["--optimizer", work / "dist" / "optim_tensors.pt"],
                                work / "bundle-dist")
    s.check(rc == 0, f"torch_dist optimizer.state.<entry>.<param>: import exits 0 ({err.strip()})")
    if rc == 0:
        a, b = (work / x / "steps" / str(FIRST) / "optimizer.safetensors" for x in ("bundle", "bundle-dist"))
        ma, mb = (json.loads((work / x / "manifest.json").read_text())["optimizer"]
                  for x in ("bundle", "bundle-dist"))
        s.check(a.read_bytes() == b.read_bytes() and ma == mb,
                f"torch_dist tensors + common.pt give the name-keyed state's bundle byte for byte ({ma} / {mb})")
    # The whole torch_dist checkpoint as --checkpoint (the stacked model weights beside the optimizer's tensors;
    # its args, which Megatron keeps in common.pt, as --config).
    (work / "dist" / "args.json").write_text(json.dumps(vars(margs)))
    rc, err = import_in_process(["--checkpoint", work / "dist" / "optim_tensors.pt", "--config", work / "dist" / "args.json",
                                 *flags[2:], *data_flags], work / "bundle-dist-whole")
    same = rc == 0 and all((work / "bundle" / "steps" / str(FIRST) / f).read_bytes()
                           == (work / "bundle-dist-whole" / "steps" / str(FIRST) / f).read_bytes()
                           for f in ("model.safetensors", "optimizer.safetensors"))
    s.check(same, f"the torch_dist dict as --checkpoint: the same model and optimizer files ({rc}: {err.strip()[-300:]})")
    for label, path, key in (("fp32 main params", work / "dist-bad" / "optim_tensors.pt",
                              "optimizer.state.fp32_param.output_layer.weight"),
                             ("chained_<i>. on some tensors only", work / "dist-bad" / "chained.pt", "chained_1.optimizer.state"),
                             ("distrib_optim.pt", work / "dist-bad" / "distrib_optim.pt", "buckets_coalesced"),
                             ("layer-wise", work / "dist-bad" / "layer_wise_optimizer_0.pt", "0.state"),
                             ("dp_reshardable", work / "dist-bad" / "dp_reshardable.pt",
                              "optimizer.distributed.dp_group_idx_0.param_state"),
                             ("without common.pt", work / "dist-bad" / "no_common.pt", "optimizer.param_groups"),
                             ("a planted common.pt", work / "dist-hostile" / "optim_tensors.pt", "pickle"),
                             ("Muon's common.pt", work / "dist-muon" / "optim_tensors.pt", "param_groups.0.momentum_beta")):
        if label == "distrib_optim.pt":  # through the CLI once; the others in process (no interpreter start each)
            proc = s.run_import(cli, flags + data_flags + ["--optimizer", path], work / "bundle-refused")
            rc, err = proc.returncode, proc.stderr.strip()
        else:
            rc, err = import_in_process(flags + data_flags + ["--optimizer", path], work / "bundle-refused")
            err = "\n".join(x for x in err.strip().splitlines() if not x.startswith("nanreplay: warning: "))
        where = path.parent / "common.pt" if "common.pt" in label else path
        s.check(rc == 2 and f"{where}: {key}" in err and len(err.splitlines()) == 1 and "Traceback" not in err
                and not (work / "bundle-refused").exists(), f"Megatron {label}: refused naming {key} ({err})")
    chained_cases(work, flags + data_flags)


def _optimizer_files(bundle):
    """(manifest's optimizer section with each group's params sorted, {name: tensor} of the first step's
    optimizer.safetensors)."""
    import reference_model
    section = json.loads((bundle / "manifest.json").read_text())["optimizer"]
    for g in section.get("groups", []):
        g["params"] = sorted(g["params"])
    return section, reference_model.read_safetensors(bundle / "steps" / str(FIRST) / "optimizer.safetensors")


def _same_optimizer(a, b):
    (sa, ta), (sb, tb) = _optimizer_files(a), _optimizer_files(b)
    return sa == sb and ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta), sa


def chained_cases(work, flags):
    """A ChainedOptimizer in torch_dist: two AdamW import as the unchained state does (the same manifest section
    and optimizer.safetensors, so the same replay), with or without the chained_<i>. prefix; torch.optim.Muon +
    AdamW as the first optimizer and the second (as --aux-optimizer gives them); Megatron's Muon, and a chain
    whose files do not say which optimizer holds a parameter, refused by name."""
    # In process: no interpreter and torch start each (the CLI reads Megatron's files in megatron_optimizer_cases).
    rc, err = import_in_process(flags + ["--optimizer", work / "dist-chained" / "optim_tensors.pt"],
                                work / "bundle-chained")
    s.check(rc == 0 and _same_optimizer(work / "bundle-chained", work / "bundle")[0]
            and (work / "bundle-chained" / "steps" / str(FIRST) / "model.safetensors").read_bytes()
            == (work / "bundle" / "steps" / str(FIRST) / "model.safetensors").read_bytes(),
            f"chained_0/chained_1 AdamW (dense + the rest): the unchained import's bundle ({err.strip()[-300:]})")
    rc, err = import_in_process(flags + ["--optimizer", work / "dist-chained-noprefix" / "optim_tensors.pt"],
                                work / "bundle-chained-noprefix")
    s.check(rc == 0 and _same_optimizer(work / "bundle-chained-noprefix", work / "bundle")[0],
            f"two AdamW of one setting without the chained_<i>. prefix: the same ({err.strip()[-300:]})")
    rc0, err0 = import_in_process(flags + ["--optimizer", work / "dist-chained-muon" / "optim_tensors.pt"],
                                  work / "bundle-chained-muon")
    rc, err = import_in_process(flags + ["--optimizer", work / "muon-files-muon.pt", "--aux-optimizer",
                                         work / "muon-files-adamw.pt"], work / "bundle-muon-files")
    same, section = (_same_optimizer(work / "bundle-chained-muon", work / "bundle-muon-files")
                     if rc0 == 0 and rc == 0 else (False, None))
    aux = [g for g in (section or {}).get("groups", []) if g["name"].startswith("aux_")]
    s.check(same and section["kind"] == "muon" and len(aux) == 1 and aux[0]["kind"] == "adamw"
            and len(aux[0]["params"]) == 3 + 7 * L, f"torch.optim.Muon + AdamW chained: Muon first, AdamW second, as "
            f"--aux-optimizer gives them ({section}; {err0.strip()[-200:]} {err.strip()[-200:]})")
    rc, err = import_in_process(flags + ["--optimizer", work / "dist-chained-muon" / "optim_tensors.pt",
                                         "--aux-optimizer", work / "muon-files-adamw.pt"], work / "bundle-refused")
    s.check(rc == 2 and "command line: --aux-optimizer" in err, f"--aux-optimizer beside a chain of two classes: "
                                                                f"refused by the flag ({err.strip()[-300:]})")
    common = work / "dist-chained-emerging" / "common.pt"
    rc, err = import_in_process(flags + ["--optimizer", work / "dist-chained-emerging" / "optim_tensors.pt"],
                                work / "bundle-refused")
    lines = [x for x in err.strip().splitlines() if not x.startswith("nanreplay: warning: ")]
    s.check(rc == 2 and len(lines) == 1 and f"{common}: optimizer.0.param_groups.0.momentum_beta" in lines[0],
            f"Megatron's Muon chained with an AdamW: refused by its param_groups key ({err.strip()})")
    tensors = work / "dist-chained-ambiguous" / "optim_tensors.pt"
    rc, err = import_in_process(flags + ["--optimizer", tensors], work / "bundle-refused")
    s.check(rc == 2 and f"{tensors}: optimizer.state.exp_avg." in err and len(err.strip().splitlines()) == 1,
            f"two AdamW with two weight decays, no prefix: which holds what is not in the files, refused ({err.strip()})")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cli", required=True)
    ap.add_argument("--work", required=True)
    args = ap.parse_args()
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    torch.set_num_threads(1)

    data = s.Data(work, V, SEQ, MBS, ACCUM, num_samples=64, seed=SEED, pad_at=(LAST, 1, 0, 4))
    torch.manual_seed(0)
    model = GPTModel(eps=0.0, base=500000.0)
    with torch.no_grad():
        model.embedding.word_embeddings.weight[s.PAD].zero_()
    opt = s.adamw(model.parameters())
    margs = Namespace(hidden_size=C, num_layers=L, num_attention_heads=H, num_query_groups=G, group_query_attention=True,
                      ffn_hidden_size=FFN, norm_epsilon=0.0, rotary_base=500000, seq_length=SEQ,
                      max_position_embeddings=SEQ, untie_embeddings_and_output_weights=True, normalization="RMSNorm",
                      swiglu=True, add_bias_linear=False, position_embedding_type="rope", padded_vocab_size=V)

    def save():
        torch.save({"model": model.state_dict(), "args": margs, "iteration": FIRST, "checkpoint_version": 3.0},
                   work / "model_optim_rng.pt")
        torch.save(s.name_keyed(model, opt), work / "optimizer.pt")
        write_megatron_optimizer_files(work, model, s.name_keyed(model, opt))

    proc, manifest = s.incident_case("megatron", args.cli, work, model, opt, data, SITES, save, FIRST, LAST,
                                     ["--checkpoint", work / "model_optim_rng.pt", "--optimizer", work / "optimizer.pt",
                                      # the loop logs from 0; Megatron's own log says "iteration 4" for this step
                                      "--log-numbering", "zero"])
    s.check("naming: megatron (detected: decoder.layers.0.self_attention.linear_qkv.weight)" in proc.stdout,
            "auto-detected Megatron naming")
    megatron_optimizer_cases(args.cli, work, data.flags(), margs)
    if manifest:
        m = manifest["model"]
        s.check(m["num_kv_heads"] == G and m["intermediate_size"] == FFN and m["rope_theta"] == 500000.0
                and m["norm_eps"] == 0.0 and not m["tie_embeddings"] and "rope_style" not in m,
                f"model from args and the fused tensors: GQA, fc1 halves, rotary_base, norm_epsilon, untied {m}")
    return s.finish()


if __name__ == "__main__":
    sys.exit(main())
