## Part of capture/nanreplay_capture.py: the module's docstring, imports and constants; the parameter table; naming presets and the model config read off a model.
## scripts/gen_capture.py joins capture/capture_src/*.py in name order into that one file (these '##'
## lines dropped); edit here, then run it. Names used here may be defined in the other parts.
"""Capture nanreplay incident bundles (format v1, docs/bundle-format.md) from a plain PyTorch training loop.

Copy this one file next to your training script; it needs torch and the standard
library only. A `Recorder` keeps the last `window` steps (parameters at the start
of each step, AdamW moments, lr, loss scale, the samples each step read and what
the job logged) in preallocated host buffers, and writes a complete bundle when a
step's loss is non-finite, or whenever `dump()` is called.

Key constraint: a healthy step pays for one copy of the parameters and the two
AdamW moments into host memory and nothing else (no allocation, no disk I/O, no
device synchronisation on CUDA: copies go to pinned buffers asynchronously).
Host memory is bounded by `window * (P * param_bytes + 2 * P * moment_bytes)`;
with fp32 masters and moments that is `12 * P * window` bytes.

With `snapshot_every=K` it keeps two full snapshots instead (one every K steps,
the last two) plus each step's light record (samples, lr, loss scale, what the
job logged), so host memory is `2 * 12 * P` bytes whatever K; the bundle starts
at the older snapshot and nanreplay rolls the steps after it forward.

Distributed jobs (DDP, FSDP): every rank creates the recorder and makes the same calls; see
docs/capture.md, "Distributed jobs". Full API and the on-disk choices: docs/capture.md in the nanreplay repository.
"""

import collections
import ctypes
import datetime
import hashlib
import json
import math
import os
import re
import shutil
import socket
import sys
import uuid
from pathlib import Path

import torch

__all__ = ["Recorder", "CaptureError", "expected_parameters", "write_safetensors"]

CAPTURE_VERSION = 1
DEFAULT_WINDOW = 10
# Shards whose total size is at most this are copied whole (the bundle then keeps
# the run's randperm sampler, which nanreplay re-derives and checks); bigger data
# is cut down to the token windows the captured steps read.
DEFAULT_WHOLE_COPY_LIMIT = 256 * 2**20
_COPY_CHUNK = 8 * 2**20

_SAFETENSORS_DTYPE = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.int64: "I64"}
_TOKEN_WIDTH = {"uint16": 2, "uint32": 4}
_PRECISIONS = ("fp32", "bf16", "fp16", "fp8")


class CaptureError(RuntimeError):
    """The recorder was set up or called in a way that cannot yield a valid bundle."""


# ---------------------------------------------------------------------------
# The model contract of bundle v1: parameter keys and shapes, in docs/bundle-format.md's order.

def expected_parameters(arch, cfg):
    """[(safetensors key, shape)] that bundle v1 requires for `arch` and the model config `cfg`
    (docs/bundle-format.md, "Parameter names and shapes"), including the parameters llama's
    `attention_bias` and `qk_norm` options add (absent keys: the defaults, no extra parameters).
    With llama's `moe` (model.moe), each layer's dense gate/up/down_proj give way to Hugging Face
    Qwen3-MoE's module order: the router mlp.gate.weight [E, hidden], then expert 0's gate_proj,
    up_proj, down_proj, expert 1's, ... (experts' width: moe.intermediate_size, else the model's).
    The one list of keys: `nanreplay import` reads it too."""
    C, V, L = cfg["hidden_size"], cfg["vocab_size"], cfg["num_layers"]
    out = []
    if arch == "llama":
        H, D = cfg["num_heads"], cfg.get("head_dim") or C // cfg["num_heads"]  # Qwen3: a head_dim of its own
        kv = cfg["num_kv_heads"] * D
        ffn = cfg["intermediate_size"]
        bias = bool(cfg.get("attention_bias", False))
        qk_norm = cfg.get("qk_norm")
        if qk_norm not in (None, "head", "full", "l2"):
            raise CaptureError(f"qk_norm must be None, 'head', 'full' or 'l2', got {qk_norm!r}")
        if qk_norm == "l2":  # Llama 4's L2 norm has no weight
            qk_norm = None
        # Qwen3 normalises each head (head_dim weights), OLMo 2 the whole projection.
        norm_shapes = {"q": (D,) if qk_norm == "head" else (H * D,), "k": (D,) if qk_norm == "head" else (kv,)}
        moe = cfg.get("moe")
        if moe:
            E, width = moe["num_experts"], moe.get("intermediate_size") or ffn
            mlp = [("mlp.gate.weight", (E, C))]
            for e in range(E):
                mlp += [(f"mlp.experts.{e}.gate_proj.weight", (width, C)),
                        (f"mlp.experts.{e}.up_proj.weight", (width, C)),
                        (f"mlp.experts.{e}.down_proj.weight", (C, width))]
        else:
            mlp = [("mlp.gate_proj.weight", (ffn, C)), ("mlp.up_proj.weight", (ffn, C)),
                   ("mlp.down_proj.weight", (C, ffn))]
        out.append(("model.embed_tokens.weight", (V, C)))
        for i in range(L):
            p = f"model.layers.{i}."
            post = cfg.get("norm_layout") == "post"  # OLMo 2: norms of the sublayers' outputs, after the MLP
            sandwich = cfg.get("norm_layout") == "sandwich"  # Gemma 3: both, after the MLP in Gemma3DecoderLayer's order
            if not post:
                out.append((p + "input_layernorm.weight", (C,)))
            # Hugging Face's module order, which the replay's parameter table follows: a bias right
            # after its weight, q_norm and k_norm after o_proj; GPT-OSS's sinks before the projections.
            if cfg.get("attention_sinks"):
                out.append((p + "self_attn.sinks", (H,)))
            for proj, rows in (("q", H * D), ("k", kv), ("v", kv)):
                out.append((f"{p}self_attn.{proj}_proj.weight", (rows, C)))
                if bias:
                    out.append((f"{p}self_attn.{proj}_proj.bias", (rows,)))
            out.append((p + "self_attn.o_proj.weight", (C, H * D)))
            if cfg.get("o_proj_bias"):
                out.append((p + "self_attn.o_proj.bias", (C,)))
            if qk_norm is not None:
                out += [(p + "self_attn.q_norm.weight", norm_shapes["q"]),
                        (p + "self_attn.k_norm.weight", norm_shapes["k"])]
            if not post and not sandwich:
                out.append((p + "post_attention_layernorm.weight", (C,)))
            out += [(p + name, shape) for name, shape in mlp]
            if sandwich:
                out += [(p + name + "_layernorm.weight", (C,)) for name in ("post_attention", "pre_feedforward",
                                                                           "post_feedforward")]
            if post:
                out += [(p + "post_attention_layernorm.weight", (C,)), (p + "post_feedforward_layernorm.weight", (C,))]
        out.append(("model.norm.weight", (C,)))
        if not cfg["tie_embeddings"]:
            out.append(("lm_head.weight", (V, C)))
        return out
    if arch == "gpt2":
        out += [("transformer.wte.weight", (V, C)), ("transformer.wpe.weight", (cfg["max_seq_len"], C))]
        for i in range(L):
            p = f"transformer.h.{i}."
            out += [(p + "ln_1.weight", (C,)), (p + "ln_1.bias", (C,)),
                    (p + "attn.c_attn.weight", (3 * C, C)), (p + "attn.c_attn.bias", (3 * C,)),
                    (p + "attn.c_proj.weight", (C, C)), (p + "attn.c_proj.bias", (C,)),
                    (p + "ln_2.weight", (C,)), (p + "ln_2.bias", (C,)),
                    (p + "mlp.c_fc.weight", (4 * C, C)), (p + "mlp.c_fc.bias", (4 * C,)),
                    (p + "mlp.c_proj.weight", (C, 4 * C)), (p + "mlp.c_proj.bias", (C,))]
        out += [("transformer.ln_f.weight", (C,)), ("transformer.ln_f.bias", (C,))]
        return out
    raise CaptureError(f"arch must be 'llama' or 'gpt2', got {arch!r}")


def _all_named_parameters(model):
    """Every (name, parameter) including tied aliases (named_parameters() drops them)."""
    for prefix, module in model.named_modules(remove_duplicate=False):
        for name, p in module._parameters.items():
            if p is not None:
                yield (f"{prefix}.{name}" if prefix else name), p


def _module_eps(model, names, params=()):
    """The eps of the norm module named `names` (bundle names) or, with param_names renaming the
    model, of the module that owns one of `params` (its weight). nn.RMSNorm's eps=None is finfo's eps."""
    modules = []
    for name in names:
        try:
            modules.append(model.get_submodule(name))
        except AttributeError:
            continue
    wanted = [id(p) for p in params if p is not None]
    if wanted:
        owners = {id(p): m for _, m in model.named_modules() for p in m._parameters.values() if p is not None}
        modules += [owners[i] for i in wanted if i in owners]
    for module in modules:
        for attr in ("eps", "variance_epsilon", "norm_eps", "epsilon"):
            if not hasattr(module, attr):
                continue
            value = getattr(module, attr)
            if value is None and isinstance(module, getattr(torch.nn, "RMSNorm", ())):
                return float(torch.finfo(module.weight.dtype).eps)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                return float(value)
    return None


# Where models keep their config: Hugging Face's config, Meta's llama params, torchtitan's model_args,
# llama2.c's params; attribute names of the options bundle v1 reads from them.
_CONFIG_HOLDERS = ("config", "params", "model_args", "args", "cfg")


def _model_attr(model, names):
    """The first number found under `names` on the model, its config holders, or any submodule
    (e.g. a rotary module's rope_theta). None when the model does not say."""
    objects = [model] + [getattr(model, h, None) for h in _CONFIG_HOLDERS]
    objects += [m for _, m in model.named_modules()][1:]
    for obj in objects:
        if obj is None:
            continue
        for name in names:
            value = obj.get(name) if isinstance(obj, dict) else getattr(obj, name, None)
            if name == "rope_parameters" and isinstance(value, dict):
                full = value.get("full_attention")  # per layer type (transformers 5): the full layers' base
                value = full.get("rope_theta") if isinstance(full, dict) else value.get("rope_theta")
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                return value
    return None


# Bundle v1's defaults for what a model may not say (docs/bundle-format.md); the capture self-check
# (Recorder.self_check) proves them on the first captured step.
_SPEC_DEFAULTS = {"norm_eps": 1e-5, "rope_theta": 10000.0}


# ---------------------------------------------------------------------------
# Naming presets (param_names="hf", "meta", "torchtitan", "nanogpt"): a framework's parameter names
# onto bundle v1's, the same tables `nanreplay import` uses (capture/nanreplay_import.py).

META_NAMES = [  # Meta's reference llama, torchtitan (incl. its attention.qkv_linear.wq and lm_head), llama2.c
    (r"tok_embeddings\.weight", "model.embed_tokens.weight"),
    (r"layers\.(\d+)\.attention\.(?:qkv_linear\.)?wq\.weight", "model.layers.{0}.self_attn.q_proj.weight"),
    (r"layers\.(\d+)\.attention\.(?:qkv_linear\.)?wk\.weight", "model.layers.{0}.self_attn.k_proj.weight"),
    (r"layers\.(\d+)\.attention\.(?:qkv_linear\.)?wv\.weight", "model.layers.{0}.self_attn.v_proj.weight"),
    (r"layers\.(\d+)\.attention\.wo\.weight", "model.layers.{0}.self_attn.o_proj.weight"),
    (r"layers\.(\d+)\.attention\.(?:qkv_linear\.)?wq\.bias", "model.layers.{0}.self_attn.q_proj.bias"),
    (r"layers\.(\d+)\.attention\.(?:qkv_linear\.)?wk\.bias", "model.layers.{0}.self_attn.k_proj.bias"),
    (r"layers\.(\d+)\.attention\.(?:qkv_linear\.)?wv\.bias", "model.layers.{0}.self_attn.v_proj.bias"),
    (r"layers\.(\d+)\.attention\.q_norm\.weight", "model.layers.{0}.self_attn.q_norm.weight"),
    (r"layers\.(\d+)\.attention\.k_norm\.weight", "model.layers.{0}.self_attn.k_norm.weight"),
    (r"layers\.(\d+)\.attention_norm\.weight", "model.layers.{0}.input_layernorm.weight"),
    (r"layers\.(\d+)\.ffn_norm\.weight", "model.layers.{0}.post_attention_layernorm.weight"),
    (r"layers\.(\d+)\.feed_forward\.w1\.weight", "model.layers.{0}.mlp.gate_proj.weight"),
    (r"layers\.(\d+)\.feed_forward\.w2\.weight", "model.layers.{0}.mlp.down_proj.weight"),
    (r"layers\.(\d+)\.feed_forward\.w3\.weight", "model.layers.{0}.mlp.up_proj.weight"),
    (r"norm\.weight", "model.norm.weight"),
    (r"output\.weight", "lm_head.weight"),
    (r"lm_head\.weight", "lm_head.weight"),
]
NAMING_PRESETS = ("hf", "meta", "torchtitan", "megatron", "nanogpt")
_WRAPPER_PREFIXES = ("_orig_mod.", "module.", "_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")

# Hugging Face families whose parameters fuse or rename llama's, by config model_type: a fused tensor is
# split into row blocks (fused_row_blocks), a renamed one mapped (GLM-4-0414's sandwich norms onto the
# sandwich layout's names). One table for the recorder (views of the live tensors) and `nanreplay import`
# (nanreplay_import/naming.py, which also maps optimizer moments through it).
_HF_FUSED_QKV = (r"model\.layers\.(\d+)\.self_attn\.qkv_proj\.(weight|bias)", "hfqkv:model.layers.{0}.self_attn.{{}}_proj.{1}")
_HF_FUSED_FC1 = (r"model\.layers\.(\d+)\.mlp\.gate_up_proj\.weight", "fc1:model.layers.{0}.mlp.{{}}_proj.weight")
_HF_GLM4_NORMS = [
    (r"model\.layers\.(\d+)\.post_self_attn_layernorm\.weight", "model.layers.{0}.post_attention_layernorm.weight"),
    (r"model\.layers\.(\d+)\.post_attention_layernorm\.weight", "model.layers.{0}.pre_feedforward_layernorm.weight"),
    (r"model\.layers\.(\d+)\.post_mlp_layernorm\.weight", "model.layers.{0}.post_feedforward_layernorm.weight"),
]
HF_FUSED_NAMES = {"phi3": [_HF_FUSED_QKV, _HF_FUSED_FC1], "glm": [_HF_FUSED_FC1],
                  "glm4": [_HF_FUSED_FC1, *_HF_GLM4_NORMS]}


def fused_row_blocks(kind, rows, heads=None):
    """[(part, first row, row count)] of a fused tensor of `rows` rows. 'hfqkv': Phi-3's qkv_proj, every
    query head's rows, then the key heads', then the value heads' (Phi3Attention slices qkv[..., :H*D],
    then G*D, then the rest); `heads` is (H, G, D). 'fc1': gate then up, halves of the rows (Phi3MLP:
    `gate, up = gate_up_proj(x).chunk(2, dim=-1)`; Megatron's linear_fc1 alike). CaptureError when the
    rows do not fit."""
    if kind == "fc1":
        if rows % 2:
            raise CaptureError(f"has {rows} rows: gate and up stacked need an even count")
        return [("gate", 0, rows // 2), ("up", rows // 2, rows // 2)]
    H, G, D = heads
    if rows != (H + 2 * G) * D:
        raise CaptureError(f"has {rows} rows; {H} query heads and {G} key/value heads of head_dim {D} need "
                           f"(H + 2G) * D = {(H + 2 * G) * D}")
    return [("q", 0, H * D), ("k", H * D, G * D), ("v", (H + G) * D, G * D)]


def _unwrapped(name):
    """A parameter name without torch.compile's, DDP's and FSDP's wrapper components."""
    parts = [p for p in name.split(".") if p + "." not in _WRAPPER_PREFIXES]
    return ".".join(parts)


def _renamer(param_names, arch, model_config):
    """(rename function, model_config) for param_names: a preset name, a dict, a callable or None.
    meta and torchtitan rotate adjacent pairs: they imply rope_style="interleaved" (given otherwise:
    CaptureError)."""
    if callable(param_names):
        return param_names, model_config
    if param_names is None or isinstance(param_names, dict):
        mapping = dict(param_names or {})
        return (lambda name: mapping.get(name, name)), model_config
    if param_names not in NAMING_PRESETS:
        raise CaptureError(f"param_names must be a dict, a callable or one of {NAMING_PRESETS}, got {param_names!r}")
    want = "gpt2" if param_names == "nanogpt" else "llama"
    if arch != want:
        raise CaptureError(f"param_names={param_names!r} names a {want} model, but arch is {arch!r}")
    if param_names == "megatron":
        raise CaptureError("param_names='megatron': Megatron's fused linear_qkv and linear_fc1 hold q, k, v and "
                           "gate, up in one tensor, which the recorder cannot split by renaming; save a checkpoint "
                           "and run `nanreplay import --naming megatron` on it (docs/import.md)")
    if param_names in ("hf", "nanogpt"):
        return _unwrapped, model_config
    table = [(re.compile(p), t) for p, t in META_NAMES]

    def rename(name):
        name = _unwrapped(name)
        for rx, target in table:
            m = rx.fullmatch(name)
            if m:
                return target.format(*m.groups())
        return name

    model_config = dict(model_config or {})
    if model_config.setdefault("rope_style", "interleaved") != "interleaved":
        raise CaptureError(f"param_names={param_names!r} is Meta's layout, whose rotary rotates adjacent pairs; "
                           f"model_config says rope_style={model_config['rope_style']!r}")
    return rename, model_config


def _config_head_dim(model):
    """model.config's head_dim (an integer > 0), GlmConfig's default where a GLM config leaves it out, else None."""
    config = getattr(model, "config", None) or {}
    said = _config_attr(config, "head_dim")
    if said is _MISSING and glm_default(_config_attr(config, "model_type"), "head_dim"):
        said = glm_default(_config_attr(config, "model_type"), "head_dim")[0]
    return said if isinstance(said, int) and not isinstance(said, bool) and said > 0 else None


def _fused_heads(model, given, named):
    """(H, G, D) a fused qkv_proj is split by: model_config's, else model.config's (num_key_value_heads
    None meaning H, and head_dim hidden_size // H where it has none, as Phi3Config reads them)."""
    config = getattr(model, "config", None) or {}

    def said(key, attr):
        value = given.get(key, _config_attr(config, attr))
        return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None
    H = said("num_heads", "num_attention_heads")
    if H is None:
        raise CaptureError("model_config needs 'num_heads' to split the fused qkv_proj (model.config does not say it)")
    G = said("num_kv_heads", "num_key_value_heads") or H
    embed = named.get("model.embed_tokens.weight")
    D = said("head_dim", "head_dim") or _config_head_dim(model) or (embed.shape[1] // H if embed is not None else None)
    if D is None:
        raise CaptureError("model_config needs 'head_dim' to split the fused qkv_proj (no model.embed_tokens.weight)")
    return H, G, D


def _split_fused(named, model, given):
    """`named` with model.config.model_type's fused parameters (HF_FUSED_NAMES) as views of their row
    blocks under llama's names, and its renamed ones renamed. Returns (named, {bundle name: (the model's
    name, the fused parameter, first row, row count)}): the optimizer holds the fused parameter, whose
    state is split the same way."""
    kind = _config_attr(getattr(model, "config", None) or {}, "model_type")
    table = [(re.compile(p), t) for p, t in HF_FUSED_NAMES.get(kind, [])] if isinstance(kind, str) else []
    if not table:
        return named, {}
    out, fused = {}, {}
    for name, p in named.items():
        target = next((t.format(*m.groups()) for rx, t in table for m in [rx.fullmatch(name)] if m), name)
        split, _, template = target.rpartition(":")
        if not split:
            out.setdefault(target, p)
            continue
        try:
            blocks = fused_row_blocks(split, p.shape[0], _fused_heads(model, given, named) if split == "hfqkv" else None)
        except CaptureError as e:
            raise CaptureError(f"{name} (model.config.model_type {kind!r}) {e}") from None
        for part, first, count in blocks:
            out[template.format(part)] = p.detach().narrow(0, first, count)
            fused[template.format(part)] = (name, p, first, count)
    return out, fused


def _infer_model_config(arch, model, named, given, seq_len, defaulted=None):
    """The manifest's model section: shapes read off the parameters, the rest from `given`
    (or from the modules where they carry it, e.g. LayerNorm.eps). A given value that
    contradicts the parameters is an error, never silently overridden. llama's model options
    (_model_options) are settled after the shapes. `defaulted` (a dict) receives the keys taken
    from bundle v1's defaults because neither the model nor model_config says them."""
    defaulted = {} if defaulted is None else defaulted
    _refuse_model_type(getattr(model, "config", None))

    def spec_default(key):
        if key in given:
            return given[key]
        defaulted[key] = _SPEC_DEFAULTS[key]
        return _SPEC_DEFAULTS[key]
    cfg = {k: v for k, v in given.items() if k not in LLAMA_OPTION_KEYS}

    def settle(key, inferred):
        if key in cfg and inferred is not None and cfg[key] != inferred:
            raise CaptureError(f"model_config[{key!r}] = {cfg[key]!r} but the model says {inferred!r}")
        if key not in cfg:
            if inferred is None:
                raise CaptureError(f"model_config needs {key!r} (it cannot be read off the model)")
            cfg[key] = inferred

    def shape(name):
        if name not in named:
            raise CaptureError(f"the model has no parameter {name!r}, which bundle v1 requires for {arch} "
                               "(pass param_names= to map your names onto the spec's)")
        return tuple(named[name].shape)

    if "num_heads" not in cfg:
        heads = _model_attr(model, ("num_attention_heads", "n_heads", "n_head", "num_heads"))
        if heads is None:
            raise CaptureError("model_config needs 'num_heads' (the model does not say it)")
        cfg["num_heads"] = int(heads)
    moe = None
    if arch == "llama":
        V, C = shape("model.embed_tokens.weight")
        layers = 0
        while f"model.layers.{layers}.self_attn.q_proj.weight" in named:  # every layout has it (OLMo 2: no input_layernorm)
            layers += 1
        settle("vocab_size", V)
        settle("hidden_size", C)
        settle("num_layers", layers)
        family = fused_family(getattr(model, "config", None))  # GPT-OSS, Llama 4: fused experts (25_fused_experts)
        moe = family_model_moe(model, named, given, layers) if family else _model_moe(model, named, given, layers, C)
        if family:
            settle("intermediate_size", family_intermediate_size(model, named, moe, layers))
        elif moe is None:
            settle("intermediate_size", shape("model.layers.0.mlp.gate_proj.weight")[0] if layers else None)
        else:  # no dense MLP to read it off: model.config's (Qwen3-MoE keeps one), else the experts' width
            width = _config_attr(getattr(model, "config", None) or {}, "intermediate_size")
            cfg.setdefault("intermediate_size", width if _is_number(width) and width >= 1 else moe["intermediate_size"])
        head_dim = (given.get("head_dim") or _config_head_dim(model)
                    or C // cfg["num_heads"])
        settle("num_kv_heads", shape("model.layers.0.self_attn.k_proj.weight")[0] // head_dim if layers else None)
        head = named.get("lm_head.weight")
        settle("tie_embeddings", head is None or head is named["model.embed_tokens.weight"])
        cfg.setdefault("max_seq_len", seq_len)  # llama's math does not depend on it
        eps = _module_eps(model, ["model.norm", "model.layers.0.input_layernorm"],
                          [named.get("model.norm.weight"), named.get("model.layers.0.input_layernorm.weight")])
        if eps is None:
            eps = _model_attr(model, ("rms_norm_eps", "norm_eps", "layer_norm_eps", "norm_epsilon"))
        settle("norm_eps", float(eps) if eps is not None else spec_default("norm_eps"))
        theta = _model_attr(model, ("rope_theta", "rope_parameters", "rotary_base", "rope_base"))
        settle("rope_theta", float(theta) if theta is not None else spec_default("rope_theta"))
    else:
        V, C = shape("transformer.wte.weight")
        T, _ = shape("transformer.wpe.weight")
        layers = 0
        while f"transformer.h.{layers}.ln_1.weight" in named:
            layers += 1
        settle("vocab_size", V)
        settle("hidden_size", C)
        settle("num_layers", layers)
        settle("max_seq_len", T)
        settle("num_kv_heads", cfg["num_heads"])  # c_attn stacks full-width q, k and v
        settle("tie_embeddings", True)
        eps = _module_eps(model, ["transformer.ln_f", "transformer.h.0.ln_1"],
                          [named.get("transformer.ln_f.weight"), named.get("transformer.h.0.ln_1.weight")])
        settle("norm_eps", eps if eps is not None else spec_default("norm_eps"))
        head = named.get("lm_head.weight")
        if head is not None and head is not named["transformer.wte.weight"]:
            raise CaptureError("gpt2 in bundle v1 ties the output head to transformer.wte.weight, "
                               "but lm_head.weight is a separate tensor")
    own_head_dim = given.get("head_dim") or _config_head_dim(model)
    if (cfg["hidden_size"] % cfg["num_heads"] and not isinstance(own_head_dim, int)) or cfg["num_heads"] % cfg["num_kv_heads"]:
        raise CaptureError("num_heads must divide hidden_size (unless the model has a head_dim of its own) and "
                           "num_kv_heads must divide num_heads")
    if seq_len > cfg["max_seq_len"]:
        raise CaptureError(f"data seq_len {seq_len} exceeds model max_seq_len {cfg['max_seq_len']}")
    if arch != "llama" and given.get("moe") is not None:
        raise CaptureError("model_config['moe'] applies to arch 'llama' only")
    options = _model_options(arch, model, named, given, cfg)
    if arch == "llama" and moe is not None:
        options["moe"] = moe
    return dict({"arch": arch}, **{k: v for k, v in cfg.items() if k != "arch"}, **options)


