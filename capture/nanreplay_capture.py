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
        H, D = cfg["num_heads"], C // cfg["num_heads"]
        kv = cfg["num_kv_heads"] * D
        ffn = cfg["intermediate_size"]
        bias = bool(cfg.get("attention_bias", False))
        qk_norm = cfg.get("qk_norm")
        if qk_norm not in (None, "head", "full"):
            raise CaptureError(f"qk_norm must be None, 'head' or 'full', got {qk_norm!r}")
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
            out.append((p + "input_layernorm.weight", (C,)))
            # Hugging Face's module order, which the replay's parameter table follows: a bias right
            # after its weight, q_norm and k_norm after o_proj.
            for proj, rows in (("q", C), ("k", kv), ("v", kv)):
                out.append((f"{p}self_attn.{proj}_proj.weight", (rows, C)))
                if bias:
                    out.append((f"{p}self_attn.{proj}_proj.bias", (rows,)))
            out.append((p + "self_attn.o_proj.weight", (C, C)))
            if qk_norm is not None:
                out += [(p + "self_attn.q_norm.weight", norm_shapes["q"]),
                        (p + "self_attn.k_norm.weight", norm_shapes["k"])]
            out.append((p + "post_attention_layernorm.weight", (C,)))
            out += [(p + name, shape) for name, shape in mlp]
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
                value = value.get("rope_theta")
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


def _infer_model_config(arch, model, named, given, seq_len, defaulted=None):
    """The manifest's model section: shapes read off the parameters, the rest from `given`
    (or from the modules where they carry it, e.g. LayerNorm.eps). A given value that
    contradicts the parameters is an error, never silently overridden. llama's model options
    (_model_options) are settled after the shapes. `defaulted` (a dict) receives the keys taken
    from bundle v1's defaults because neither the model nor model_config says them."""
    defaulted = {} if defaulted is None else defaulted

    def spec_default(key):
        if key in given:
            return given[key]
        defaulted[key] = _SPEC_DEFAULTS[key]
        return _SPEC_DEFAULTS[key]
    cfg = {k: v for k, v in given.items() if k not in LLAMA_OPTION_DEFAULTS and k != "moe"}

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
        while f"model.layers.{layers}.input_layernorm.weight" in named:
            layers += 1
        settle("vocab_size", V)
        settle("hidden_size", C)
        settle("num_layers", layers)
        moe = _model_moe(model, named, given, layers, C)
        if moe is None:
            settle("intermediate_size", shape("model.layers.0.mlp.gate_proj.weight")[0] if layers else None)
        else:  # no dense MLP to read it off: model.config's (Qwen3-MoE keeps one), else the experts' width
            width = _config_attr(getattr(model, "config", None) or {}, "intermediate_size")
            cfg.setdefault("intermediate_size", width if _is_number(width) and width >= 1 else moe["intermediate_size"])
        head_dim = C // cfg["num_heads"]
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
    if cfg["hidden_size"] % cfg["num_heads"] or cfg["num_heads"] % cfg["num_kv_heads"]:
        raise CaptureError("num_heads must divide hidden_size and num_kv_heads must divide num_heads")
    if seq_len > cfg["max_seq_len"]:
        raise CaptureError(f"data seq_len {seq_len} exceeds model max_seq_len {cfg['max_seq_len']}")
    if arch != "llama" and given.get("moe") is not None:
        raise CaptureError("model_config['moe'] applies to arch 'llama' only")
    options = _model_options(arch, model, named, given, cfg)
    if arch == "llama" and moe is not None:
        options["moe"] = moe
    return dict({"arch": arch}, **{k: v for k, v in cfg.items() if k != "arch"}, **options)


# ---------------------------------------------------------------------------
# llama's model options (docs/bundle-format.md, "Model options"): what the model computes beyond
# plain llama. Read off a Hugging Face style `model.config` where it says, or given in model_config;
# a parameter only an option explains, with that option off, is an error: never a guess.

LLAMA_OPTION_DEFAULTS = {"rope_style": "rotate_half", "rope_scaling": None, "attention_bias": False,
                         "qk_norm": None, "attn_logit_softcap": None, "final_logit_softcap": None,
                         "sliding_window": None}
_QK_NORM_BY_MODEL_TYPE = {"qwen3": "head", "qwen3_moe": "head", "olmo2": "full"}
# Qwen2Config has no attention_bias: Qwen2's q, k and v projections always carry one.
_BIAS_BY_MODEL_TYPE = {"qwen2": True}
# Models whose window applies to every other layer only, which bundle v1 cannot express.
_ALTERNATING_WINDOW_TYPES = ("gemma2", "gemma3", "gemma3_text", "cohere2")
_LLAMA3_SCALING_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
_BIAS_PARAM = re.compile(r"model\.layers\.\d+\.self_attn\.[qkv]_proj\.bias")
_QK_NORM_PARAM = re.compile(r"model\.layers\.\d+\.self_attn\.[qk]_(?:norm|layernorm)\.weight")
_O_BIAS_PARAM = re.compile(r"model\.layers\.\d+\.self_attn\.o_proj\.bias")
_MISSING = object()


def _is_number(x):
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _rope_scaling(value, where):
    """A rope_scaling dict (Hugging Face's, or model_config's) in the manifest's form: None, or
    Llama 3.1's llama3 scaling. Any other scaling would be replayed wrong, so it is refused."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise CaptureError(f"{where} must be None or a dict, got {value!r}")
    kind = value.get("rope_type", value.get("type"))
    if kind == "default":  # transformers' spelling of "no scaling"
        return None
    if kind != "llama3":
        raise CaptureError(f"{where} has rope_type {kind!r}; bundle v1 replays only 'llama3' "
                           "(Llama 3.1) frequency scaling")
    out = {"rope_type": "llama3"}
    for key in _LLAMA3_SCALING_KEYS:
        v = value.get(key)
        if not _is_number(v) or v <= 0:
            raise CaptureError(f"{where}[{key!r}] must be a number > 0, got {v!r}")
        out[key] = float(v)
    if out["original_max_position_embeddings"] != int(out["original_max_position_embeddings"]):
        raise CaptureError(f"{where}['original_max_position_embeddings'] must be an integer")
    out["original_max_position_embeddings"] = int(out["original_max_position_embeddings"])
    if out["high_freq_factor"] <= out["low_freq_factor"]:
        raise CaptureError(f"{where}: high_freq_factor must exceed low_freq_factor "
                           "(llama3 divides by their difference)")
    return out


def _option_value(key, value, where):
    """`value` of option `key` in the manifest's form, or CaptureError naming `where` it came from."""
    if key == "rope_scaling":
        return _rope_scaling(value, where)
    if key == "rope_style" and value in ("rotate_half", "interleaved"):
        return value
    if key == "attention_bias" and isinstance(value, bool):
        return value
    if key == "qk_norm" and (value is None or value in ("head", "full")):
        return value
    if key.endswith("_softcap") and (value is None or (_is_number(value) and value > 0)):
        return None if value is None else float(value)
    if key == "sliding_window" and (value is None or (isinstance(value, int) and not isinstance(value, bool)
                                                      and value >= 1)):
        return value
    allowed = {"rope_style": "'rotate_half' or 'interleaved'", "attention_bias": "True or False",
               "qk_norm": "None, 'head' or 'full'", "attn_logit_softcap": "None or a number > 0",
               "final_logit_softcap": "None or a number > 0", "sliding_window": "None or an integer >= 1"}
    raise CaptureError(f"{where} must be {allowed[key]}, got {value!r}")


def _config_attr(config, name):
    if isinstance(config, dict):
        return config.get(name, _MISSING)
    return getattr(config, name, _MISSING)


def _config_window(config, model_type, num_layers):
    """The sliding window every layer of a Hugging Face style config uses (None: none, _MISSING:
    the config does not say). A window on only some layers cannot be replayed: CaptureError."""
    window = _config_attr(config, "sliding_window")
    if window is _MISSING:
        return _MISSING
    mixed = ("model.config gives a sliding window to only some layers ({}); bundle v1's sliding_window "
             "applies to every layer (alternating window layers, as Gemma 2's, are not supported)")
    layer_types = _config_attr(config, "layer_types")  # newer transformers spell it out per layer
    if isinstance(layer_types, (list, tuple)) and layer_types:
        kinds = set(layer_types)
        if kinds == {"full_attention"}:
            return None
        if kinds == {"sliding_attention"}:
            return window
        raise CaptureError(mixed.format(f"layer_types {sorted(kinds)}"))
    if model_type in _ALTERNATING_WINDOW_TYPES and window is not None:
        raise CaptureError(mixed.format(f"{model_type} alternates, sliding_window={window}"))
    use = _config_attr(config, "use_sliding_window")  # Qwen2: sliding_window is inert unless this is set
    if use is not _MISSING:
        if not use:
            return None
        first = _config_attr(config, "max_window_layers")  # Qwen2: layers from this index on slide
        if isinstance(first, int) and first >= num_layers:
            return None
        if isinstance(first, int) and first > 0:
            raise CaptureError(mixed.format(f"max_window_layers={first} of {num_layers}"))
    return window


def _options_from_config(config, num_layers):
    """{option: (value, where it was read)} for what a Hugging Face style config object says;
    options it is silent on are left out (model_config, or the default, then decides)."""
    said = {}
    model_type = _config_attr(config, "model_type")
    if isinstance(model_type, str):  # every transformers PretrainedConfig has one
        said["rope_style"] = ("rotate_half", f"model.config (Hugging Face {model_type or 'model'}, "
                                             "whose rotary embeddings rotate halves)")
    for attr in ("rope_scaling", "rope_parameters"):  # transformers >= 5 names it rope_parameters
        value = _config_attr(config, attr)
        if value is not _MISSING:
            said["rope_scaling"] = (_rope_scaling(value, f"model.config.{attr}"), f"model.config.{attr}")
            break
    if model_type in _BIAS_BY_MODEL_TYPE:
        said["attention_bias"] = (_BIAS_BY_MODEL_TYPE[model_type], f"model.config.model_type {model_type!r}")
    elif _config_attr(config, "attention_bias") is not _MISSING:
        said["attention_bias"] = (bool(_config_attr(config, "attention_bias")), "model.config.attention_bias")
    if model_type in _QK_NORM_BY_MODEL_TYPE:
        said["qk_norm"] = (_QK_NORM_BY_MODEL_TYPE[model_type], f"model.config.model_type {model_type!r}")
    for key, attr in (("attn_logit_softcap", "attn_logit_softcapping"),
                      ("final_logit_softcap", "final_logit_softcapping")):  # Gemma 2's names
        value = _config_attr(config, attr)
        if value is not _MISSING:
            said[key] = (_option_value(key, value, f"model.config.{attr}"), f"model.config.{attr}")
    window = _config_window(config, model_type, num_layers)
    if window is not _MISSING:
        said["sliding_window"] = (_option_value("sliding_window", window, "model.config.sliding_window"),
                                  "model.config.sliding_window")
    return said


def _model_options(arch, model, named, given, cfg):
    """The model options that differ from their defaults, for the manifest's model section:
    model.config's word where it has one, model_config's otherwise; the two must agree."""
    given = {k: given[k] for k in LLAMA_OPTION_DEFAULTS if k in given}
    if arch != "llama":
        on = [k for k, v in given.items() if _option_value(k, v, f"model_config[{k!r}]") != LLAMA_OPTION_DEFAULTS[k]]
        if on:
            raise CaptureError(f"model options {on} apply to arch 'llama' only")
        return {}
    config = getattr(model, "config", None)
    said = {}
    if config is not None:
        head_dim = _config_attr(config, "head_dim")
        if isinstance(head_dim, int) and head_dim != cfg["hidden_size"] // cfg["num_heads"]:
            raise CaptureError(f"model.config.head_dim = {head_dim}, but bundle v1's head_dim is hidden_size / "
                               f"num_heads = {cfg['hidden_size'] // cfg['num_heads']}")
        said = _options_from_config(config, cfg["num_layers"])
    out = {}
    for key, default in LLAMA_OPTION_DEFAULTS.items():
        value, where = said.get(key, (default, None))
        if key in given:
            mine = _option_value(key, given[key], f"model_config[{key!r}]")
            if where is not None and mine != value:
                raise CaptureError(f"model_config[{key!r}] = {mine!r} contradicts {where}, which says {value!r}")
            value = mine
        if value != default:
            out[key] = value
    _check_option_parameters(named, out)
    return out


def _check_option_parameters(named, options):
    """Parameters that only an option explains must not be there with that option off: the replay
    would not read them, and the bundle would describe a different model."""
    for name in named:
        if _BIAS_PARAM.fullmatch(name) and not options.get("attention_bias"):
            raise CaptureError(f"the model has {name}, but attention_bias is off: if q, k and v carry biases "
                               "(Qwen2's layout), pass model_config=dict(attention_bias=True, ...)")
        if _QK_NORM_PARAM.fullmatch(name) and not options.get("qk_norm"):
            raise CaptureError(f"the model has {name}, but qk_norm is not set: pass model_config=dict(qk_norm="
                               "'head', ...) for a norm over each head (Qwen3) or qk_norm='full' for one over "
                               "the whole projection (OLMo 2)")
        if _O_BIAS_PARAM.fullmatch(name):
            raise CaptureError(f"the model has {name}: bundle v1's attention_bias puts biases on q, k and v only, "
                               "as Qwen2 does (Hugging Face Llama's attention_bias=True also biases o_proj, "
                               "which bundle v1 does not replay)")


# ---------------------------------------------------------------------------
# llama's model.moe (docs/bundle-format.md): Hugging Face Qwen3-MoE's sparse MLP in every layer. Read off
# a Hugging Face MoE config (the same reading `nanreplay import` uses), or given as model_config["moe"];
# the experts' count and width are read off the parameters. What bundle v1's moe cannot express (shared
# experts, dense layers among the MoE ones) is refused.

MOE_KEYS = ("num_experts", "top_k", "intermediate_size", "norm_topk_prob", "router_aux_loss_coef",
            "router_z_loss_coef")
_EXPERT_PARAM = re.compile(r"model\.layers\.\d+\.mlp\.(?:gate\.weight|experts\.\d+\.(?:gate|up|down)_proj\.weight)")
_DENSE_MLP_PARAM = re.compile(r"model\.layers\.\d+\.mlp\.(?:gate|up|down)_proj\.weight")
_SHARED_EXPERT_PARAM = re.compile(r"model\.layers\.\d+\.mlp\.shared_expert(?:_gate)?\.")


class MoeConfigRefusal(CaptureError):
    """A Hugging Face MoE config that bundle v1's moe cannot express: `key` is the config entry."""

    def __init__(self, key, what):
        super().__init__(f"{key}: {what}")
        self.key, self.what = key, what


def moe_from_config(config):
    """model.moe from a Hugging Face MoE config (a dict or a config object; Qwen3-MoE / Qwen2-MoE /
    Mixtral names), with only the keys the config gives; None when it is dense (no expert count).
    MoeConfigRefusal for what bundle v1's moe cannot express."""
    def get(name, default=None):
        value = _config_attr(config, name)
        return default if value is _MISSING else value

    experts = get("num_experts", get("num_local_experts"))
    if not experts:
        return None
    top_k = get("num_experts_per_tok", get("moe_router_topk"))
    if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1:
        raise MoeConfigRefusal("num_experts_per_tok", f"an MoE config needs an integer top_k, got {top_k!r}")
    if get("mlp_only_layers"):
        raise MoeConfigRefusal("mlp_only_layers", "some layers dense: bundle v1's moe replaces every layer's MLP")
    if get("decoder_sparse_step", 1) != 1:
        raise MoeConfigRefusal("decoder_sparse_step", "MoE on only some layers: bundle v1's moe replaces every layer's MLP")
    if get("shared_expert_intermediate_size"):
        raise MoeConfigRefusal("shared_expert_intermediate_size", "shared experts are not part of bundle v1's moe")
    moe = {"num_experts": int(experts), "top_k": int(top_k)}
    if get("moe_intermediate_size"):
        moe["intermediate_size"] = int(get("moe_intermediate_size"))
    if _config_attr(config, "norm_topk_prob") is not _MISSING:
        moe["norm_topk_prob"] = bool(get("norm_topk_prob"))
    elif get("model_type") == "mixtral":
        moe["norm_topk_prob"] = True  # Mixtral always renormalises its top-k
    if get("output_router_logits") and get("router_aux_loss_coef"):
        moe["router_aux_loss_coef"] = float(get("router_aux_loss_coef"))
    return moe


def _moe_value(value, where):
    """A given moe (model_config["moe"]): None, or a dict of MOE_KEYS with valid values (the keys given)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise CaptureError(f"{where} must be None or a dict of {list(MOE_KEYS)}, got {value!r}")
    unknown = sorted(set(value) - set(MOE_KEYS))
    if unknown:
        raise CaptureError(f"{where} has {unknown}: bundle v1's moe knows {list(MOE_KEYS)} only (shared experts "
                           "and other routers are not part of it)")
    out = {}
    for key, v in value.items():
        if key in ("num_experts", "top_k", "intermediate_size"):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise CaptureError(f"{where}[{key!r}] must be an integer >= 1, got {v!r}")
            out[key] = v
        elif key == "norm_topk_prob":
            if not isinstance(v, bool):
                raise CaptureError(f"{where}['norm_topk_prob'] must be True or False, got {v!r}")
            out[key] = v
        else:
            if not _is_number(v) or v < 0:
                raise CaptureError(f"{where}[{key!r}] must be a number >= 0, got {v!r}")
            out[key] = float(v)
    return out


def _model_moe(model, named, given, num_layers, hidden):
    """The manifest's model.moe (every key written) or None for a dense model: model.config's word
    where it says, model_config["moe"]'s otherwise (keys both give must agree), the experts' count and
    width from the parameters."""
    shared = sorted(n for n in named if _SHARED_EXPERT_PARAM.match(n))
    if shared:
        raise CaptureError(f"the model has {shared[0]}: shared experts (Qwen2-MoE's) are not part of bundle v1's "
                           "moe, which routes every token to its top_k experts only")
    experts = sorted(n for n in named if _EXPERT_PARAM.fullmatch(n))
    config = getattr(model, "config", None)
    said = None
    if config is not None:
        try:
            said = moe_from_config(config)
        except MoeConfigRefusal as e:
            raise CaptureError(f"model.config.{e.key}: {e.what}") from None
    if "moe" in given:
        mine = _moe_value(given["moe"], "model_config['moe']")
        if mine is None and said is not None:
            raise CaptureError(f"model_config['moe'] = None contradicts model.config, which says {said!r}")
        for key in (mine or {}):
            if said is not None and key in said and said[key] != mine[key]:
                raise CaptureError(f"model_config['moe'][{key!r}] = {mine[key]!r} contradicts model.config, which "
                                   f"says {said[key]!r}")
        moe = None if mine is None else dict(said or {}, **mine)
    else:
        moe = said
    if moe is None:
        if experts:
            raise CaptureError(f"the model has {experts[0]} (a mixture of experts), but moe is not set: pass "
                               "model_config=dict(moe=dict(num_experts=..., top_k=..., norm_topk_prob=..., "
                               "router_aux_loss_coef=..., router_z_loss_coef=...)), or a Hugging Face MoE "
                               "model.config")
        return None
    router = named.get("model.layers.0.mlp.gate.weight")
    if router is None or router.dim() != 2:
        raise CaptureError("moe is set, but the model has no router model.layers.0.mlp.gate.weight (bundle v1's moe "
                           "is Hugging Face Qwen3-MoE's layout: mlp.gate, mlp.experts.{e}.gate_proj/up_proj/down_proj)")
    E = int(router.shape[0])
    if moe.get("num_experts", E) != E:
        raise CaptureError(f"moe num_experts = {moe['num_experts']} but model.layers.0.mlp.gate.weight has {E} rows")
    if "top_k" not in moe:
        raise CaptureError("moe needs 'top_k' (the experts each token is routed to): pass model_config=dict("
                           "moe=dict(top_k=..., ...))")
    if moe["top_k"] > E:
        raise CaptureError(f"moe top_k = {moe['top_k']} exceeds num_experts = {E}")
    first = named.get("model.layers.0.mlp.experts.0.gate_proj.weight")
    if first is None:
        raise CaptureError("moe is set, but the model has no model.layers.0.mlp.experts.0.gate_proj.weight")
    width = int(first.shape[0])
    if moe.get("intermediate_size", width) != width:
        raise CaptureError(f"moe intermediate_size = {moe['intermediate_size']} but the experts' gate_proj has "
                           f"{width} rows")
    for i in range(num_layers):
        dense = [n for n in named if _DENSE_MLP_PARAM.fullmatch(n) and n.startswith(f"model.layers.{i}.")]
        if dense or f"model.layers.{i}.mlp.gate.weight" not in named:
            raise CaptureError(f"layer {i} has a dense MLP ({dense[0] if dense else 'no mlp.gate.weight'}) among MoE "
                               "layers: bundle v1's moe replaces every layer's MLP (dense layers mixed in, as "
                               "mlp_only_layers or decoder_sparse_step make them, are not supported)")
    return {"num_experts": E, "top_k": moe["top_k"], "intermediate_size": width,
            "norm_topk_prob": bool(moe.get("norm_topk_prob", False)),
            "router_aux_loss_coef": float(moe.get("router_aux_loss_coef", 0.0)),
            "router_z_loss_coef": float(moe.get("router_z_loss_coef", 0.0))}


def _option_needing(name, cfg):
    """For error messages: the option that asks for parameter `name`, when one does."""
    if _EXPERT_PARAM.fullmatch(name):
        return f", with moe={cfg.get('moe')!r}"
    if _BIAS_PARAM.fullmatch(name):
        return ", with attention_bias=True"
    if _QK_NORM_PARAM.fullmatch(name):
        return f", with qk_norm={cfg.get('qk_norm')!r}"
    return ""


# ---------------------------------------------------------------------------
# The capture self-check. On the first captured step whose logged loss is finite, the bundle's model
# (a small fp32 reference of docs/bundle-format.md's model, torch only, run on the live parameters
# under no_grad) computes that step's loss on the step's real batch and compares it with the loss
# the user's model logged. A gap means the bundle would describe another model than the run's: a
# CaptureError says so, and names the likely cause (the rotary convention, norm_eps, rope_theta, the
# GELU variant, an option) when changing that one setting closes the gap, before any incident
# depends on the bundle. Recorder.self_check = False turns it off.

_SELF_CHECK_TOLERANCE = {"fp32": 1e-4, "bf16": 1e-2, "fp16": 1e-2, "fp8": 1e-2}  # the replay's own (README)
# A gap this small is the same model up to fp32 rounding. A near match within the tolerance loses to a
# variant that matches to rounding: the wrong convention can sit under 1e-4 at step 0 and drift later.
_SELF_CHECK_ROUNDING = {"fp32": 1e-6}


def _ref_inv_freq(D, theta, scaling, device):
    inv = 1.0 / (theta ** (torch.arange(0, D, 2, device=device).float() / D))
    if not scaling:
        return inv
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old / low, inv / factor, inv)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old / high) * ~(wavelen > old / low)
    return torch.where(medium, smoothed, scaled)


def _ref_rope(x, inv_freq, style):
    """x: (B, heads, T, D); rotate_half pairs (j, j + D/2), interleaved (2j, 2j + 1)."""
    T, D = x.shape[-2], x.shape[-1]
    ang = torch.outer(torch.arange(T, device=x.device).float(), inv_freq)
    if style == "interleaved":
        x1, x2, cos, sin = x[..., 0::2], x[..., 1::2], ang.cos(), ang.sin()
        return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1).flatten(-2)
    ang = torch.cat([ang, ang], -1)
    x1, x2 = x[..., :D // 2], x[..., D // 2:]
    return x * ang.cos() + torch.cat([-x2, x1], -1) * ang.sin()


def _ref_attention(q, k, v, H, G, softcap=None, window=None):
    B, T, _ = q.shape
    D = q.shape[-1] // H
    q = q.view(B, T, H, D).transpose(1, 2)
    k = k.reshape(B, T, G, D).transpose(1, 2).repeat_interleave(H // G, dim=1)
    v = v.reshape(B, T, G, D).transpose(1, 2).repeat_interleave(H // G, dim=1)
    s = (q @ k.transpose(-2, -1)) / math.sqrt(D)
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    mask = torch.triu(torch.ones(T, T, dtype=torch.bool, device=q.device), 1)
    if window is not None:
        mask |= torch.tril(torch.ones(T, T, dtype=torch.bool, device=q.device), -window)
    p = torch.softmax(s.masked_fill(mask, float("-inf")), -1)
    return (p @ v).transpose(1, 2).reshape(B, T, H * D)


def reference_loss(cfg, p, inputs, targets, gelu="tanh"):
    """The mean next-token cross-entropy bundle v1's model (manifest model section `cfg`, parameters
    `p` by bundle key) computes on inputs/targets (B, T), in fp32, with the llama options."""
    F = torch.nn.functional
    w = {k: v.detach().float() for k, v in p.items()}
    B, T = inputs.shape
    H, eps = cfg["num_heads"], cfg.get("norm_eps", 1e-5)
    if cfg["arch"] == "gpt2":
        C = cfg["hidden_size"]

        def ln(x, pre):
            return F.layer_norm(x, (C,), w[pre + ".weight"], w[pre + ".bias"], eps)

        def lin(x, pre):
            return F.linear(x, w[pre + ".weight"], w[pre + ".bias"])

        x = w["transformer.wte.weight"][inputs] + w["transformer.wpe.weight"][torch.arange(T, device=inputs.device)]
        for i in range(cfg["num_layers"]):
            pre = f"transformer.h.{i}."
            q, k, v = lin(ln(x, pre + "ln_1"), pre + "attn.c_attn").split(C, -1)
            x = x + lin(_ref_attention(q, k, v, H, H), pre + "attn.c_proj")
            x = x + lin(F.gelu(lin(ln(x, pre + "ln_2"), pre + "mlp.c_fc"), approximate=gelu), pre + "mlp.c_proj")
        logits = F.linear(ln(x, "transformer.ln_f"), w["transformer.wte.weight"])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    G, D = cfg.get("num_kv_heads", H), cfg["hidden_size"] // H
    style, qk_norm = cfg.get("rope_style") or "rotate_half", cfg.get("qk_norm")
    bias = bool(cfg.get("attention_bias"))
    inv = _ref_inv_freq(D, cfg.get("rope_theta", 10000.0), cfg.get("rope_scaling"), inputs.device)
    moe, router = cfg.get("moe"), []

    def norm(x, weight):
        return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight

    def q_or_k(h, pre, name, heads):
        t = F.linear(h, w[pre + f"self_attn.{name}_proj.weight"], w[pre + f"self_attn.{name}_proj.bias"] if bias else None)
        if qk_norm == "head":
            t = norm(t.view(B, T, heads, D), w[pre + f"self_attn.{name}_norm.weight"]).reshape(B, T, heads * D)
        elif qk_norm == "full":
            t = norm(t, w[pre + f"self_attn.{name}_norm.weight"])
        return _ref_rope(t.view(B, T, heads, D).transpose(1, 2), inv, style).transpose(1, 2).reshape(B, T, heads * D)

    x = w["model.embed_tokens.weight"][inputs]
    for i in range(cfg["num_layers"]):
        pre = f"model.layers.{i}."
        h = norm(x, w[pre + "input_layernorm.weight"])
        v = F.linear(h, w[pre + "self_attn.v_proj.weight"], w[pre + "self_attn.v_proj.bias"] if bias else None)
        att = _ref_attention(q_or_k(h, pre, "q", H), q_or_k(h, pre, "k", G), v, H, G,
                             cfg.get("attn_logit_softcap"), cfg.get("sliding_window"))
        x = x + F.linear(att, w[pre + "self_attn.o_proj.weight"])
        h = norm(x, w[pre + "post_attention_layernorm.weight"])
        if moe:
            mixed, logits = _ref_moe(moe, w, pre, h)
            router.append(logits)
            x = x + mixed
            continue
        x = x + F.linear(F.silu(F.linear(h, w[pre + "mlp.gate_proj.weight"])) * F.linear(h, w[pre + "mlp.up_proj.weight"]),
                         w[pre + "mlp.down_proj.weight"])
    x = norm(x, w["model.norm.weight"])
    logits = F.linear(x, w["model.embed_tokens.weight"] if cfg.get("tie_embeddings") else w["lm_head.weight"])
    if cfg.get("final_logit_softcap") is not None:
        logits = torch.tanh(logits / cfg["final_logit_softcap"]) * cfg["final_logit_softcap"]
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    if moe and moe.get("router_aux_loss_coef"):
        loss = loss + moe["router_aux_loss_coef"] * _ref_load_balancing(router, moe["num_experts"], moe["top_k"])
    if moe and moe.get("router_z_loss_coef"):
        loss = loss + moe["router_z_loss_coef"] * torch.logsumexp(torch.cat(router), -1).pow(2).mean()
    return loss


def _ref_top_k(probs, k):
    """Top k per row, ties to the lower expert index (a stable descending sort)."""
    values, experts = torch.sort(probs, dim=-1, descending=True, stable=True)
    return values[:, :k], experts[:, :k]


def _ref_moe(moe, w, pre, h):
    """Hugging Face Qwen3MoeSparseMoeBlock.forward (modeling_qwen3_moe.py): (output, router logits)."""
    F = torch.nn.functional
    C = h.shape[-1]
    x = h.reshape(-1, C)
    logits = F.linear(x, w[pre + "mlp.gate.weight"])
    weights, experts = _ref_top_k(torch.softmax(logits, -1), moe["top_k"])
    if moe.get("norm_topk_prob"):
        weights = weights / weights.sum(-1, keepdim=True)
    out = torch.zeros_like(x)
    for e in range(moe["num_experts"]):
        token, slot = torch.where(experts == e)
        if token.numel():
            ex, xe = pre + f"mlp.experts.{e}.", x[token]
            y = F.linear(F.silu(F.linear(xe, w[ex + "gate_proj.weight"])) * F.linear(xe, w[ex + "up_proj.weight"]),
                         w[ex + "down_proj.weight"])
            out.index_add_(0, token, y * weights[token, slot, None])
    return out.view(h.shape), logits


def _ref_load_balancing(router, num_experts, top_k):
    """Hugging Face's load_balancing_loss_func (modeling_qwen3_moe.py), no attention mask."""
    probs = torch.softmax(torch.cat(router), -1)
    mask = torch.nn.functional.one_hot(_ref_top_k(probs, top_k)[1], num_experts).float()
    return torch.sum(mask.mean(0) * probs.mean(0).unsqueeze(0)) * num_experts


def _self_check_variants(cfg):
    """(label, manifest change or gelu, what it would mean): single changes tried when the check fails."""
    out = []
    if cfg["arch"] == "llama":
        other = "interleaved" if (cfg.get("rope_style") or "rotate_half") == "rotate_half" else "rotate_half"
        out.append((f"rope_style={other!r}", {"rope_style": other},
                    "the rotary convention (Meta's reference llama, torchtitan and llama2.c rotate adjacent pairs: "
                    "'interleaved'; Hugging Face rotates halves: 'rotate_half')"))
        for theta in (10000.0, 500000.0, 1000000.0, 100000.0, 5000000.0):
            if theta != cfg.get("rope_theta"):
                out.append((f"rope_theta={theta!r}", {"rope_theta": theta}, "rope_theta"))
    else:
        out.append(("GELU's erf form", "none", "the GELU variant: bundle v1's gpt2 uses GELU's tanh approximation "
                    "(F.gelu(x, approximate='tanh')), nanoGPT's nn.GELU() is the erf form"))
    for eps in (1e-5, 1e-6, 1e-8, 1e-12, 0.0):
        if eps != cfg.get("norm_eps"):
            out.append((f"norm_eps={eps!r}", {"norm_eps": eps}, "norm_eps"))
    for heads in _head_count_variants(cfg):
        label = f"num_heads={heads['num_heads']}" + (f", num_kv_heads={heads['num_kv_heads']}"
                                                       if cfg["arch"] == "llama" else "")
        out.append((label, heads, "the head count (num_heads"
                    + (", and num_kv_heads with it: the k projection's rows stay the same)" if cfg["arch"] == "llama"
                       else ")")))
    return out


def _head_count_variants(cfg):
    """Other head counts the same tensors allow: half, double, and head_dim 64 or 128 (llama keeps the
    k projection's rows, num_kv_heads * head_dim, so num_kv_heads follows)."""
    C, H = cfg["hidden_size"], cfg["num_heads"]
    G = cfg.get("num_kv_heads") or H
    kv_rows = G * (C // H)
    out = []
    for h in (H // 2, H * 2, C // 64, C // 128):
        if h < 1 or h == H or C % h or any(v["num_heads"] == h for v in out):
            continue
        if cfg["arch"] != "llama":
            out.append({"num_heads": h, "num_kv_heads": h})
            continue
        g, rest = divmod(kv_rows, C // h)
        if rest == 0 and g >= 1 and h % g == 0:
            out.append({"num_heads": h, "num_kv_heads": g})
    return out


def _self_check_params(recorder, slot):
    """The parameters the check computes with: the live ones (on their device, fast) when they are
    plain tensors, else (sharded or wrapped tensors) the slot's host copies, which the bundle writes."""
    live = list(recorder.params)
    if all(type(p) in (torch.Tensor, torch.nn.Parameter) for p in live):
        return dict(zip(recorder.names, live))
    if slot.event is not None:
        slot.event.synchronize()
    return dict(zip(recorder.names, slot.params))


def _self_check_batches(recorder, slot, device):
    """Per rank, the step's micro-batches as (inputs, targets) on `device`."""
    L, mbs = recorder.data["seq_len"], recorder.data["micro_batch_size"]
    dtype = recorder.source.shards[0]["dtype"]
    ranks = []
    for rows in slot.rows:
        windows = []
        for start in rows:
            raw = bytearray(recorder.source.read(start, L + 1))
            t = torch.frombuffer(raw, dtype=torch.int16 if dtype == "uint16" else torch.int32).to(torch.int64)
            windows.append(t & (0xFFFF if dtype == "uint16" else 0xFFFFFFFF))
        w = torch.stack(windows).to(device)
        ranks.append([(w[m:m + mbs, :-1], w[m:m + mbs, 1:]) for m in range(0, len(rows), mbs)])
    return ranks


def run_self_check(recorder, slot):
    """The check itself (see the section's comment). Returns {step, logged, reference, relative};
    raises CaptureError on a gap beyond the replay's tolerance."""
    cfg = recorder.model_config
    params = _self_check_params(recorder, slot)
    ranks = _self_check_batches(recorder, slot, next(iter(params.values())).device)
    logged = slot.logged["loss"]
    rank_losses = slot.logged.get("rank_losses")
    tol = _SELF_CHECK_TOLERANCE[recorder.precision]

    def losses(c, gelu="tanh"):
        with torch.no_grad():
            per_rank = [sum(float(reference_loss(c, params, x, y, gelu)) for x, y in mbs) / len(mbs) for mbs in ranks]
        return per_rank

    def gap(per_rank):
        """The smallest relative gap among the readings of the logged loss: the mean over ranks, rank 0's
        own (a job that logs its local loss), or rank 0 against rank_losses[0]."""
        cands = [(sum(per_rank) / len(per_rank), logged), (per_rank[0], logged)]
        if rank_losses:
            cands.append((per_rank[0], rank_losses[0]))
        return min((abs(a - b) / max(abs(b), 1e-12), a, b) for a, b in cands)

    def best_variant(accept):
        """The single change whose gap is smallest, if it is at most `accept`: (label, change, what, value, gap)."""
        best = None
        for label, change, what in _self_check_variants(cfg):
            per_rank_trial = losses(cfg, gelu="none") if change == "none" else losses(dict(cfg, **change))
            r, value, _ = gap(per_rank_trial)
            if r <= accept and (best is None or r < best[4]):
                best = (label, change, what, value, r)
        return best

    def blame(head, found):
        label, change, what, value, r = found
        fix = (f"pass model_config=dict({label}, ...)" if change != "none" else
               "make the model use F.gelu(x, approximate='tanh') (bundle v1 has no erf-GELU option)")
        return CaptureError(head + f"With {label} it computes {value:.7g} (gap {r:.1e}): the likely cause is {what}"
                                   f" (the recorder used {_self_check_used(cfg, label)}); {fix}")

    per_rank = losses(cfg)
    relative, reference, against = gap(per_rank)
    result = {"step": slot.step, "logged": against, "reference": reference, "relative": relative, "tolerance": tol}
    rounding = _SELF_CHECK_ROUNDING.get(recorder.precision)
    if relative <= tol:
        exact = best_variant(rounding) if rounding is not None and relative > rounding else None
        if exact is None or exact[4] * 10 > relative:
            return result
        raise blame(f"capture self-check, step {slot.step}: bundle v1's {cfg['arch']} model, as this recorder would "
                    f"write it, computes loss {reference:.7g} on the step's batch, within the replay's tolerance {tol:g} "
                    f"of the {against:.7g} your model logged but not to rounding (relative gap {relative:.2e}); a "
                    "near match drifts as the replay rolls forward. ", exact)
    head = (f"capture self-check, step {slot.step}: bundle v1's {cfg['arch']} model, as this recorder would write it, "
            f"computes loss {reference:.7g} on the step's batch, but your model logged {against:.7g} (relative gap "
            f"{relative:.2e}, the replay tolerates {tol:g}); a bundle of this run would not reproduce it. ")
    found = best_variant(tol)
    if found is not None:
        raise blame(head, found)
    raise CaptureError(head + "No single change of " + ("the rotary convention, rope_theta, norm_eps or the head count"
                       if cfg["arch"] == "llama" else "the GELU variant, norm_eps or the head count") + " explains it. Check the options your forward "
                       "applies (rope_scaling, attention_bias, qk_norm, softcaps, sliding_window: pass them in "
                       "model_config), that param_names maps every parameter to the one bundle v1 means, and that "
                       "end_step(loss=) is the step's mean over its micro-batches (and ranks). "
                       "recorder.self_check = False captures anyway.")


def _self_check_used(cfg, label):
    key = label.split("=")[0]
    if key == "num_heads":
        return f"num_heads={cfg['num_heads']}, num_kv_heads={cfg.get('num_kv_heads') or cfg['num_heads']}"
    if key in cfg or key in ("rope_style",):
        return f"{key}={cfg.get(key, 'rotate_half')!r}"
    return "GELU's tanh form"


# ---------------------------------------------------------------------------
# Files: safetensors, JSON with the bundle format's non-finite strings, atomic directories.

def _tensor_bytes(t):
    """A zero-copy view of a contiguous CPU tensor's bytes (kept alive by the caller)."""
    if t.numel() == 0:
        return b""
    nbytes = t.numel() * t.element_size()
    return memoryview((ctypes.c_char * nbytes).from_address(t.data_ptr())).cast("B")


def write_safetensors(path, tensors):
    """Writes [(name, tensor)] in the safetensors layout: 8-byte LE header length, JSON header
    padded with spaces to a multiple of 8, raw little-endian data in list order. An entry may be
    (name, ("zeros", dtype, shape)) to write zeros without allocating them."""
    if sys.byteorder != "little":
        raise CaptureError("safetensors data is little-endian; this host is not")
    header, parts, offset = {"__metadata__": {"format": "pt", "writer": "nanreplay_capture"}}, [], 0
    for name, t in tensors:
        if isinstance(t, tuple):
            _, dtype, shape = t
            nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        else:
            if t.device.type != "cpu" or not t.is_contiguous():
                t = t.detach().to("cpu").contiguous()
            dtype, shape, nbytes = t.dtype, tuple(t.shape), t.numel() * t.element_size()
        if dtype not in _SAFETENSORS_DTYPE:
            raise CaptureError(f"{name}: dtype {dtype} is not one bundle v1 stores (F32, BF16, F16, I64)")
        header[name] = {"dtype": _SAFETENSORS_DTYPE[dtype], "shape": list(shape),
                        "data_offsets": [offset, offset + nbytes]}
        parts.append((t, nbytes))
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for t, nbytes in parts:
            if isinstance(t, tuple):
                zeros = bytes(min(nbytes, _COPY_CHUNK))
                left = nbytes
                while left:
                    f.write(zeros[:min(left, len(zeros))])
                    left -= min(left, len(zeros))
            else:
                f.write(_tensor_bytes(t))


def _json_number(x):
    """JSON has no NaN: bundle v1 writes non-finite numbers as "nan", "inf", "-inf"."""
    if x is None:
        return None
    x = float(x)
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return x


_NUMBER_LIST = re.compile(r"\[\s+((?:-?[\d.eE+-]+,\s+)*-?[\d.eE+-]+)\s+\]")


def _write_json(path, obj):
    """Indented JSON, with lists of numbers (sample indices) kept on one line."""
    text = json.dumps(obj, indent=2, allow_nan=False)
    text = _NUMBER_LIST.sub(lambda m: "[" + re.sub(r",\s+", ", ", m.group(1)) + "]", text)
    Path(path).write_text(text + "\n")


def _as_float(x):
    """float() of a Python number or a one-element tensor (a CUDA tensor synchronises here)."""
    if x is None:
        return None
    if isinstance(x, torch.Tensor):
        return float(x.detach().reshape(()).item())
    return float(x)


# ---------------------------------------------------------------------------
# Token data: the run's shards as one stream, as bundle v1 defines it
# (docs/bundle-format.md, "Data: samples and samplers").

class _TokenSource:
    """The run's shards concatenated into one token stream (raw LE uint16/uint32, an
    optional fixed-size header per file skipped), read with plain file I/O."""

    def __init__(self, data):
        default_dtype = data.get("token_dtype", "uint16")
        default_header = int(data.get("header_bytes", 0))
        self.shards = []
        start = 0
        for i, entry in enumerate(data["shards"]):
            spec = dict(entry) if isinstance(entry, dict) else {"path": entry}
            path = Path(spec["path"])
            dtype = spec.get("dtype", default_dtype)
            header = int(spec.get("header_bytes", default_header))
            if dtype not in _TOKEN_WIDTH:
                raise CaptureError(f"data.shards[{i}]: dtype must be uint16 or uint32, got {dtype!r}")
            width = _TOKEN_WIDTH[dtype]
            size = path.stat().st_size - header
            if size <= 0 or size % width:
                raise CaptureError(f"{path}: {size} data bytes after a {header}-byte header is not a "
                                   f"whole number of {dtype} tokens")
            tokens = size // width
            self.shards.append({"path": path, "dtype": dtype, "width": width, "header": header,
                                "tokens": tokens, "start": start})
            start += tokens
        if not self.shards:
            raise CaptureError("data.shards is empty")
        self.total_tokens = start
        self.total_bytes = sum(s["tokens"] * s["width"] for s in self.shards)
        self.one_dtype = len({s["dtype"] for s in self.shards}) == 1

    def num_samples(self, seq_len):
        return max(0, (self.total_tokens - 1) // seq_len)

    def read(self, begin, count):
        """Raw bytes of tokens [begin, begin + count) of the stream (one dtype assumed)."""
        out = bytearray()
        for s in self.shards:
            lo, hi = max(begin, s["start"]), min(begin + count, s["start"] + s["tokens"])
            if lo >= hi:
                continue
            with open(s["path"], "rb") as f:
                f.seek(s["header"] + (lo - s["start"]) * s["width"])
                out += f.read((hi - lo) * s["width"])
        return bytes(out)


def _randperm_samples(sampler, num_samples, world, per_rank_step, step):
    """PyTorch's DistributedSampler (shuffle, drop_last) as bundle v1 defines `randperm` (docs/bundle-format.md)."""
    g = torch.Generator()
    g.manual_seed(int(sampler["seed"]) + int(sampler.get("epoch", 0)))
    perm = torch.randperm(num_samples, generator=g).tolist()
    total = (num_samples // world) * world
    start = (step - int(sampler.get("epoch_start_step", 0))) * per_rank_step
    if start < 0 or start + per_rank_step > total // world:
        raise CaptureError(f"step {step} lies outside the randperm sampler's epoch; pass samples= explicitly")
    return [perm[r:total:world][start:start + per_rank_step] for r in range(world)]


# ---------------------------------------------------------------------------
# Distributed jobs (DDP, FSDP, torch.compile): unwrapping, the collectives every rank calls, the
# per-rank gradient norms before the all-reduce, and gathering sharded state onto the recording rank.

def _is_fsdp1(module):
    """FullyShardedDataParallel (FSDP1), found by class name so that no FSDP import is needed
    (torch 1.13's FSDP package does not even import on Python 3.11)."""
    return any(c.__name__ == "FullyShardedDataParallel" for c in type(module).__mro__)


def _is_sharded(module):
    """FSDP1, or FSDP2's fully_shard (its parameters are DTensors)."""
    if _is_fsdp1(module):
        return True
    return any(type(p).__name__ == "DTensor" for p in module.parameters())


def unwrap_model(model):
    """The module a training wrapper holds: DistributedDataParallel's / DataParallel's `.module`
    (or any wrapper whose only child is `module` and that owns no parameters, e.g. DeepSpeed's
    engine), torch.compile's `_orig_mod`, repeatedly. FSDP is returned as it is: its parameters
    are shards, which the recorder gathers instead."""
    for _ in range(16):
        inner = getattr(model, "_orig_mod", None)
        if isinstance(inner, torch.nn.Module):
            model = inner
            continue
        inner = getattr(model, "module", None)
        if isinstance(inner, torch.nn.Module) and not _is_fsdp1(model) and (
                isinstance(model, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel))
                or (not any(p is not None for p in model._parameters.values())
                    and [n for n, _ in model.named_children()] == ["module"])):
            model = inner
            continue
        return model
    return model


# Prefixes wrappers put into parameter names; a sharded model's full state is keyed without them.
_WRAPPER_PREFIX = re.compile(r"(?:_fsdp_wrapped_module|_fpw_module|_checkpoint_wrapped_module|_orig_mod|module)\.")


def _clean_name(name):
    return _WRAPPER_PREFIX.sub("", name) if _WRAPPER_PREFIX.search(name) else name


class _Collective:
    """The few collectives the recorder makes when torch.distributed runs with more than one rank.
    Every rank calls each one in the same order (begin_step, end_step, dump are called by every rank)."""

    def __init__(self, record_rank, group=None):
        import torch.distributed as dist
        self.dist, self.group = dist, group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        if not 0 <= int(record_rank) < self.world:
            raise CaptureError(f"record_rank {record_rank} is not a rank of this {self.world}-rank job")
        self.record_rank = int(record_rank)
        nccl = str(dist.get_backend(group)).lower() == "nccl"
        self.device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")

    @property
    def recording(self):
        return self.rank == self.record_rank

    def gather_objects(self, obj):
        out = [None] * self.world
        self.dist.all_gather_object(out, obj, group=self.group)
        return out

    def gather_floats(self, values):
        """[values of rank 0, values of rank 1, ...]: one all_gather of a few float64."""
        mine = torch.tensor([math.nan if v is None else float(v) for v in values], dtype=torch.float64,
                            device=self.device)
        out = [torch.empty_like(mine) for _ in range(self.world)]
        self.dist.all_gather(out, mine, group=self.group)
        return [t.tolist() for t in out]

    def broadcast(self, obj):
        box = [obj]
        self.dist.broadcast_object_list(box, src=self.record_rank, group=self.group)
        return box[0]

    def agree(self, fn):
        """Runs fn() on the recording rank and hands its result, or its error, to every rank: a
        failure there raises on every rank instead of leaving the others waiting."""
        outcome, error = None, None
        if self.recording:
            try:
                outcome = ("ok", fn())
            except Exception as e:  # noqa: BLE001 (re-raised below, on every rank)
                outcome, error = ("error", f"{type(e).__name__}: {e}"), e
        kind, value = self.broadcast(outcome)
        if kind == "error":
            if error is not None:
                raise error
            raise CaptureError(f"the recording rank {self.record_rank} failed: {value}")
        return value


class _RankGradNorm:
    """This rank's own gradient norm before the all-reduce, from the gradients a comm hook sees: the
    2-norm over every DDP bucket (or FSDP flat parameter) of one step. Each bucket must be reduced
    once per step, which is what DDP's no_sync() does with gradient accumulation; a bucket reduced
    twice in a step (accumulation without no_sync) leaves the step without rank norms."""

    def __init__(self):
        self.limit = None  # FSDP: at most this many reductions (one per FSDP unit) in a step
        self.reset()

    def reset(self):
        self.sq, self.fires = None, collections.Counter()

    def record(self, key, grad):
        sq = torch.linalg.vector_norm(grad.detach(), 2, dtype=torch.float64).square()
        self.sq = sq if self.sq is None else self.sq + sq
        self.fires[key] += 1

    def value(self, loss_scale=None):
        """(norm, valid): the norm divided by the loss scale (GradScaler scales the gradients)."""
        if self.sq is None:
            return math.nan, False
        norm = math.sqrt(float(self.sq))
        if loss_scale:
            norm /= float(loss_scale)
        calls = sum(self.fires.values())
        return norm, max(self.fires.values()) == 1 and (self.limit is None or calls <= self.limit)


def _ddp_norm_hook(norms, inner):
    def nanreplay_rank_norm_hook(state, bucket):
        norms.record(bucket.index(), bucket.buffer())  # before the hook divides and all-reduces it in place
        return inner(state, bucket)
    return nanreplay_rank_norm_hook


def _fsdp_norm_hook(norms, inner):
    def nanreplay_rank_norm_hook(state, grad, output=None):
        norms.record(len(norms.fires), grad)  # the unsharded gradient of one flat parameter, before reducing
        return inner(state, grad) if output is None else inner(state, grad, output)
    return nanreplay_rank_norm_hook


def _registered_ddp_comm_hook(ddp):
    """The name of the comm hook a DDP model already has, or None. DDP takes one hook per model and
    a second registration fails inside its reducer, so this is asked first: torch >= 2.1 lists the
    hooks in `_comm_hooks`; torch 1.13 keeps them in C++ and only gives its logger the hook's name."""
    hooks = getattr(ddp, "_comm_hooks", None)
    if hooks:
        hook = hooks[0][0] if isinstance(hooks[0], tuple) else hooks[0]
        return getattr(hook, "__qualname__", repr(hook))
    try:
        name = ddp._get_ddp_logging_data().get("comm_hook")
    except (AttributeError, RuntimeError):
        return None
    return str(name) if name else None


def _install_norm_hook(wrapper, norms, comm_hook, comm_hook_state):
    """Registers the comm hook that measures this rank's norm (wrapping `comm_hook`, default: the
    plain all-reduce / reduce-scatter the wrapper does without one). Returns a word for what it did."""
    if isinstance(wrapper, torch.nn.parallel.DistributedDataParallel):
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        existing = _registered_ddp_comm_hook(wrapper)
        if existing is not None:
            raise CaptureError(
                f"the DistributedDataParallel model already has a comm hook ({existing}), and DDP takes one "
                "hook per model, so the recorder cannot add the one that measures each rank's gradient norm. "
                "Give your hook to the recorder instead of registering it: drop "
                "ddp.register_comm_hook(state, hook) and pass Recorder(..., comm_hook=hook, "
                "comm_hook_state=state), which wraps it (your hook still reduces the gradients); a built-in "
                "hook (register_builtin_comm_hook) has a Python equivalent in "
                "torch.distributed.algorithms.ddp_comm_hooks.default_hooks to pass the same way. Or pass "
                "comm_hook=False to record no per-rank gradient norms")
        inner = default_hooks.allreduce_hook if comm_hook in (None, True) else comm_hook
        wrapper.register_comm_hook(comm_hook_state, _ddp_norm_hook(norms, inner))
        return "ddp"
    if _is_fsdp1(wrapper) and hasattr(wrapper, "register_comm_hook"):  # FSDP1, torch >= 2.0
        from torch.distributed.algorithms._comm_hooks import default_hooks
        state = comm_hook_state if comm_hook_state is not None else default_hooks.DefaultState(
            wrapper.process_group)

        def default(state, grad, output=None):
            if output is None:
                return default_hooks.allreduce_hook(state, grad)
            return default_hooks.reduce_scatter_hook(state, grad, output)
        wrapper.register_comm_hook(state, _fsdp_norm_hook(norms, default if comm_hook in (None, True) else comm_hook))
        norms.limit = sum(1 for m in wrapper.modules() if _is_fsdp1(m))  # a unit reduced twice: no no_sync()
        return "fsdp"
    return None


class _ShardedGather:
    """Full parameters and AdamW state of a sharded model (FSDP1 FullyShardedDataParallel, FSDP2
    fully_shard), gathered onto the recording rank. Every rank calls gather() (it is collective);
    the recording rank gets ({name: CPU tensor}, {name: {"exp_avg", "exp_avg_sq", "step"}}), the
    others None. Names are the model's own, without wrapper prefixes."""

    def __init__(self, wrapper, optimizer, collective):
        self.wrapper, self.optimizer, self.coll = wrapper, optimizer, collective
        self.buffers = {_clean_name(n) for n, _ in wrapper.named_buffers()}

    @property
    def recording(self):
        return self.coll is None or self.coll.recording

    def gather(self, optimizer=True):
        if _is_fsdp1(self.wrapper):
            params, state = self._gather_fsdp1(optimizer)
        else:
            params, state = self._gather_dtensors(optimizer)
        if not self.recording:
            return None
        params = {_clean_name(k): v for k, v in params.items() if _clean_name(k) not in self.buffers}
        state = {_clean_name(str(k)): v for k, v in (state or {}).items()}
        return params, state

    def _gather_fsdp1(self, optimizer):
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp import FullStateDictConfig, StateDictType
        # rank0_only hands the state to rank 0 alone; any other recording rank needs it on every rank.
        rank0_only = self.coll is None or self.coll.record_rank == 0
        # offload_to_cpu moves the gathered state off the compute device. On a CPU device it frees the very
        # storage it "moved" (torch 2.6: "setStorage: ... out of bounds for storage of size 0"): no offload there.
        device = getattr(self.wrapper, "compute_device", None)
        offload = device is None or torch.device(device).type != "cpu"
        cfg = FullStateDictConfig(offload_to_cpu=offload, rank0_only=rank0_only)
        with FSDP.state_dict_type(self.wrapper, StateDictType.FULL_STATE_DICT, cfg):
            params = self.wrapper.state_dict()
        if not optimizer:
            return params, None
        if hasattr(FSDP, "optim_state_dict"):  # torch >= 2.0: keyed by parameter names
            from torch.distributed.fsdp import FullOptimStateDictConfig
            with FSDP.state_dict_type(self.wrapper, StateDictType.FULL_STATE_DICT, cfg,
                                      FullOptimStateDictConfig(offload_to_cpu=offload, rank0_only=rank0_only)):
                osd = FSDP.optim_state_dict(self.wrapper, self.optimizer)
        else:  # torch 1.13: keyed by ids, rekeyed to names
            from torch.distributed.fsdp import OptimStateKeyType
            osd = FSDP.full_optim_state_dict(self.wrapper, self.optimizer, rank0_only=rank0_only)
            if osd:
                osd = FSDP.rekey_optim_state_dict(osd, OptimStateKeyType.PARAM_NAME, self.wrapper)
        return params, (osd or {}).get("state", {})

    def _gather_dtensors(self, optimizer):
        """fully_shard: every parameter and moment is a DTensor; full_tensor() all-gathers it."""
        def full(t):
            t = t.full_tensor() if hasattr(t, "full_tensor") else t
            return t.detach().to("cpu") if self.recording else None
        params, state = {}, {}
        for name, p in self.wrapper.named_parameters():
            params[name] = full(p)
            st = self.optimizer.state.get(p) if optimizer else None
            if st and "exp_avg" in st:
                step = st.get("step", 0)
                step = step.full_tensor() if hasattr(step, "full_tensor") else step
                state[name] = {"exp_avg": full(st["exp_avg"]), "exp_avg_sq": full(st["exp_avg_sq"]),
                               "step": float(step)}
        return params, state


class _MetaTemplate(torch.Tensor):
    """A full parameter's shape and dtype (a meta tensor: no memory); not a live parameter, so the
    recorder's checks read the snapshot's host copies instead."""


class _GatheredModel:
    """What the constructor reads names, shapes and dtypes from for a sharded model: the full
    parameters as meta tensors (no memory), with the original module's config and norm modules."""

    def __init__(self, module, shapes):
        self._module = module
        self._parameters = {}
        for name, (shape, dtype, alias) in shapes.items():
            self._parameters[name] = (self._parameters[alias] if alias else
                                      torch.empty(shape, dtype=dtype, device="meta").as_subclass(_MetaTemplate))
        for attr in ("config", "rope_theta"):
            if getattr(module, attr, None) is not None:
                setattr(self, attr, getattr(module, attr))

    def named_modules(self, remove_duplicate=True):
        yield "", self

    def get_submodule(self, name):
        module = self._module
        for part in name.split("."):
            for _ in range(4):  # wrapper modules FSDP and activation checkpointing insert
                if hasattr(module, part) or not hasattr(module, "_fsdp_wrapped_module") and \
                        not hasattr(module, "_checkpoint_wrapped_module") and not hasattr(module, "_fpw_module"):
                    break
                module = getattr(module, "_fsdp_wrapped_module", None) or getattr(
                    module, "_fpw_module", None) or getattr(module, "_checkpoint_wrapped_module")
            module = getattr(module, part, None)
            if module is None:
                raise AttributeError(name)
        return module


def _gathered_shapes(params):
    """{name: (shape, dtype, alias)}: a tensor equal to an earlier one of the same shape is taken as
    tied to it (a full state dict returns tied weights as two entries)."""
    out, seen = {}, []
    for name, t in params.items():
        alias = next((n for n, u in seen if u.shape == t.shape and u.dtype == t.dtype and
                      (u.data_ptr() == t.data_ptr() or torch.equal(u, t))), None)
        out[name] = (tuple(t.shape), t.dtype, alias)
        if alias is None:
            seen.append((name, t))
    return out


# ---------------------------------------------------------------------------
# The ring buffer.

class _StepSlot:
    """One recorded step: host copies made at begin_step (none for a light record, whose
    parameters nanreplay derives), scalars added at end_step."""

    def __init__(self, params, pin, full=True):
        self.full = full
        self.params = [torch.empty(p.shape, dtype=p.dtype, device="cpu", pin_memory=pin) for p in params] if full else []
        self.exp_avg = [None] * len(self.params)      # host buffers, allocated on first AdamW state
        self.exp_avg_sq = [None] * len(self.params)
        self.pin = pin
        self._steps = None
        self.reset()

    def reset(self):
        self.step = None
        self.has_moments = [False] * len(self.params)
        self.adam_steps = []       # AdamW's per-parameter "step" values held on the host
        self.device_steps = None   # ... and those copied from CUDA tensors (capturable/fused AdamW)
        self.lr = None
        self.loss_scale = None
        self.sampler = None
        self.rows = None       # per rank: token offset of each row's window, in read order
        self.rows_are_samples = True
        self.logged = {}
        self.skipped = None
        self.ended = False
        self.event = None

    def step_buffer(self, n):
        if self._steps is None or self._steps.numel() < n:
            self._steps = torch.empty(n, dtype=torch.float64, pin_memory=self.pin)
        return self._steps[:n]

    def moment_buffer(self, which, i, like):
        bufs = self.exp_avg if which == "exp_avg" else self.exp_avg_sq
        if bufs[i] is None or bufs[i].dtype != like.dtype or bufs[i].shape != like.shape:
            bufs[i] = torch.empty(like.shape, dtype=like.dtype, device="cpu", pin_memory=self.pin)
        return bufs[i]


class Recorder:
    """Keeps the last `window` training steps and writes them as a nanreplay bundle.

    On the first step it captures with a finite loss, end_step() proves the bundle: the bundle's
    model computes that step's loss on its batch and must match the logged loss (CaptureError
    naming the likely cause otherwise; `recorder.self_check = False` skips it; the outcome is
    `recorder.self_check_result`).

    Per step, in the training loop:
        recorder.begin_step(step, samples=batch_indices)   # before forward: snapshots params + AdamW
        ... forward, backward, clip_grad_norm_ ...
        recorder.end_step(loss=loss, grad_norm=norm)       # dumps the window when loss is non-finite
        optimizer.step(); scheduler.step()

    Arguments:
      model, optimizer: the module being trained and its torch.optim.AdamW. A DDP / DataParallel /
        torch.compile wrapper is unwrapped; an FSDP model is gathered onto the recording rank at each
        full snapshot (needs snapshot_every).
      out_dir: where automatic dumps go (`<out_dir>/incident-step<step>`).
      arch: "llama" or "gpt2" (bundle v1 architectures).
      model_config: manifest model keys; shapes are read off the parameters; `num_heads`, `norm_eps`
        and `rope_theta` are read off the model (its norm modules, model.config, model.params, ...)
        where it says them, else `num_heads` is required and the others take bundle v1's defaults
        (1e-5, 10000), which the self-check on the first captured step then proves. llama's
        options (rope_style, rope_scaling, attention_bias, qk_norm, attn_logit_softcap,
        final_logit_softcap, sliding_window) are read off a Hugging Face style `model.config`
        where it says them, else taken from here (default: off); the two must agree. So is llama's
        `moe` (Hugging Face Qwen3-MoE's mlp.gate + mlp.experts.{e}.{gate,up,down}_proj in every layer):
        model_config=dict(moe=dict(num_experts, top_k, norm_topk_prob=False, router_aux_loss_coef=0,
        router_z_loss_coef=0)), or read off an HF MoE config (num_experts / num_local_experts,
        num_experts_per_tok, moe_intermediate_size, norm_topk_prob, router_aux_loss_coef when
        output_router_logits); the experts' count and width are read off the parameters.
      data: dict(shards=[paths or dicts(path, dtype, header_bytes)], token_dtype="uint16",
        header_bytes=0, seq_len, micro_batch_size, grad_accum_steps=1, world_size=1,
        sampler=None or dict(kind="randperm", seed, epoch=0, epoch_start_step=0)).
      window: steps kept (the bundle holds at most this many).
      snapshot_every: instead of a ring of `window` full steps, a full snapshot every K steps (the
        last two kept) and a light record of every step since the older one; the bundle then rolls
        forward from that snapshot (K + 1 to 2K steps). Host memory: two snapshots.
      precision: "fp32", "bf16" (autocast), "fp16" (autocast + GradScaler) or "fp8".
      grad_clip: the max_norm given to clip_grad_norm_, or None.
      param_names: dict or callable mapping the model's parameter names to the bundle's keys
        (docs/bundle-format.md), or a preset: "hf", "meta" / "torchtitan" (implies rope_style
        "interleaved"), "nanogpt" (docs/import.md); wrapper prefixes (_orig_mod., module.) are dropped.
      data_copy: "auto", "whole" or "window" (see dump()).
      whole_copy_limit: bytes of shard data up to which "auto" copies shards whole.
      pin_memory: host buffers pinned for asynchronous copies (default: when params are on CUDA).
      distributed: None (default): collective when torch.distributed runs more than one rank; then
        every rank creates the recorder and calls begin_step / end_step / dump, rank `record_rank`
        keeps the window and writes, and the recorder gathers samples, per-rank losses and norms.
        False: this process alone (a rank-0-only recorder fed every rank's values).
      record_rank: the rank that records and writes (default 0).
      comm_hook, comm_hook_state: True (default) installs a DDP / FSDP comm hook measuring each rank's
        gradient norm before the all-reduce, around the default all-reduce; a hook of yours to wrap
        instead; False for none.
    """

    self_check = True          # end_step() proves the bundle's model on the first finite step
    self_check_result = None   # {step, logged, reference, relative, tolerance} once it passed

    def __init__(self, model, optimizer, out_dir, *, arch, data, model_config=None, window=DEFAULT_WINDOW,
                 precision="fp32", grad_clip=None, param_names=None, data_copy="auto",
                 whole_copy_limit=DEFAULT_WHOLE_COPY_LIMIT, pin_memory=None, snapshot_every=None,
                 distributed=None, record_rank=0, comm_hook=True, comm_hook_state=None):
        if window < 1:
            raise CaptureError("window must be at least 1")
        if snapshot_every is not None and int(snapshot_every) < 1:
            raise CaptureError("snapshot_every must be at least 1 (or None for the ring of full steps)")
        self.snapshot_every = None if snapshot_every is None else int(snapshot_every)
        if precision not in _PRECISIONS:
            raise CaptureError(f"precision must be one of {_PRECISIONS}, got {precision!r}")
        if data_copy not in ("auto", "whole", "window"):
            raise CaptureError(f"data_copy must be 'auto', 'whole' or 'window', got {data_copy!r}")
        model = self._setup_distributed(model, optimizer, distributed, record_rank)  # unwraps DDP, compile, FSDP
        self.model, self.optimizer = model, optimizer
        self.out_dir = Path(out_dir)
        self.window, self.precision, self.grad_clip = int(window), precision, grad_clip
        self.data_copy, self.whole_copy_limit = data_copy, int(whole_copy_limit)
        self.data = self._check_data(data)
        if self._coll is not None:  # data.world_size is the job's
            if dict(data).get("world_size") is None:
                self.data["world_size"] = self._coll.world
            elif int(self.data["world_size"]) != self._coll.world:
                raise CaptureError(f"data world_size {self.data['world_size']} but torch.distributed runs "
                                   f"{self._coll.world} ranks")
        self.source = _TokenSource(self.data)
        self.sampler = dict(self.data["sampler"]) if self.data.get("sampler") else None

        rename, model_config = _renamer(param_names, arch, model_config)
        named = {}
        for name, p in _all_named_parameters(model):
            named.setdefault(rename(name), p)
        self.defaulted = {}  # what bundle v1's defaults filled in: the manifest's provenance says so
        self.model_config = _infer_model_config(arch, model, named, model_config or {}, self.data["seq_len"],
                                                self.defaulted)
        spec = expected_parameters(arch, self.model_config)
        self.names = [name for name, _ in spec]
        self.params = []
        for name, shape in spec:
            p = named.get(name)
            if p is None:
                raise CaptureError(f"the model has no parameter {name!r} (bundle v1, {arch}"
                                   f"{_option_needing(name, self.model_config)})")
            if tuple(p.shape) != tuple(shape):
                raise CaptureError(f"{name} has shape {tuple(p.shape)}, bundle v1 expects {tuple(shape)}"
                                   f"{_option_needing(name, self.model_config)}")
            if p.dtype not in (torch.float32, torch.bfloat16, torch.float16):
                raise CaptureError(f"{name} is {p.dtype}; bundle v1 stores F32, BF16 or F16")
            self.params.append(p)
        wanted = {id(p) for p in self.params}
        extra = sorted({n for n, p in named.items() if id(p) not in wanted})
        if extra:
            raise CaptureError(f"parameters outside bundle v1's {arch} model: {extra[:6]}"
                               + (f" and {len(extra) - 6} more" if len(extra) > 6 else ""))
        self._check_optimizer()
        self._optimizer_manifest()  # what the manifest cannot say is refused now, not while an incident is written

        self._async = any(p.is_cuda for p in self.params)
        self._pin = (self._async and torch.cuda.is_available()) if pin_memory is None else bool(pin_memory)
        self._free = []                                  # full slots evicted from the ring, reused
        self._ring = collections.deque()                 # slots in step order, oldest first
        self._copying = None                             # the full slot whose copies may be in flight
        self._copy_stream = None
        if self._async and hasattr(optimizer, "register_step_pre_hook"):
            optimizer.register_step_pre_hook(self._order_update_after_copies)
        self.incident_path = None
        self.param_bytes = sum(p.numel() * p.element_size() for p in self.params)
        self._norms, self._norms_from, self._norms_warned = None, None, False
        if self._coll is not None and comm_hook is not False:
            self._norms = _RankGradNorm()
            self._norms_from = _install_norm_hook(self.wrapper, self._norms, comm_hook, comm_hook_state)
            if self._norms_from is None:
                self._norms = None

    # -- distributed setup ----------------------------------------------------

    def _setup_distributed(self, model, optimizer, distributed, record_rank):
        """Unwraps `model` (DDP, DataParallel, torch.compile); decides whether this recorder runs
        collectively (torch.distributed initialised with more than one rank, unless distributed=False);
        for a sharded model gathers the full parameters once to learn their names and shapes. Returns
        what the constructor reads names, shapes and config from."""
        self._loss_scale, self._shadow, self._gathered, self._sharded = None, (None, None), None, None
        import torch.distributed as dist
        running = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        if distributed is None:
            distributed = running
        elif distributed and not running:
            raise CaptureError("distributed=True needs torch.distributed initialised with more than one rank")
        self._coll = _Collective(record_rank) if distributed else None
        inner = unwrap_model(model)
        ddp = model
        while not isinstance(ddp, torch.nn.parallel.DistributedDataParallel) and ddp is not inner:
            ddp = getattr(ddp, "_orig_mod", None) or getattr(ddp, "module", None)
            if not isinstance(ddp, torch.nn.Module):
                break
        self.wrapper = ddp if isinstance(ddp, torch.nn.parallel.DistributedDataParallel) else inner
        if not _is_sharded(inner):
            return inner
        if self.snapshot_every is None:
            raise CaptureError("a sharded (FSDP) model is gathered onto the recording rank at each full snapshot: "
                               "pass snapshot_every=K so that happens once every K steps, not every step")
        self._sharded = _ShardedGather(inner, optimizer, self._coll)
        full = self._sharded.gather(optimizer=False)
        shapes = _gathered_shapes(full[0]) if full is not None else None
        if self._coll is not None:
            shapes = self._coll.broadcast(shapes)
        self._sharded_names = {id(p): _clean_name(n) for n, p in inner.named_parameters()}
        return _GatheredModel(inner, shapes)

    @property
    def is_recording(self):
        """Whether this process keeps the window and writes bundles (rank record_rank; always, in one process)."""
        return self._coll is None or self._coll.recording

    @property
    def rank(self):
        return 0 if self._coll is None else self._coll.rank

    # -- setup checks -------------------------------------------------------

    @staticmethod
    def _check_data(data):
        data = dict(data)
        for key in ("shards", "seq_len", "micro_batch_size"):
            if key not in data:
                raise CaptureError(f"data needs {key!r}")
        data.setdefault("grad_accum_steps", 1)
        data.setdefault("world_size", 1)
        sampler = data.get("sampler")
        if sampler is not None:
            if sampler.get("kind", "randperm") != "randperm" or "seed" not in sampler:
                raise CaptureError("data.sampler must be dict(kind='randperm', seed=..., epoch=0, "
                                   "epoch_start_step=0) or None (explicit samples per step)")
            data["sampler"] = {"kind": "randperm", "seed": int(sampler["seed"]),
                               "epoch": int(sampler.get("epoch", 0)),
                               "epoch_start_step": int(sampler.get("epoch_start_step", 0))}
        return data

    def _check_optimizer(self):
        opt = self.optimizer
        if not isinstance(opt, torch.optim.AdamW):
            raise CaptureError(f"bundle v1 replays torch.optim.AdamW; got {type(opt).__name__}")
        if self._sharded is not None:  # it holds shards (or flat parameters): names are checked at each gather
            if any(g.get("amsgrad") or g.get("maximize") for g in opt.param_groups):
                raise CaptureError("AdamW with amsgrad or maximize is not what bundle v1 replays")
            return
        wanted = {id(p): i for i, p in enumerate(self.params)}
        seen = set()
        for g, group in enumerate(opt.param_groups):
            if group.get("amsgrad") or group.get("maximize"):
                raise CaptureError("AdamW with amsgrad or maximize is not what bundle v1 replays")
            for p in group["params"]:
                if id(p) not in wanted:
                    raise CaptureError(f"optimizer param_groups[{g}] holds a tensor that is not one of the "
                                       "model's bundle parameters")
                seen.add(id(p))
        missing = [self.names[i] for pid, i in wanted.items() if pid not in seen]
        if missing:
            raise CaptureError(f"parameters the optimizer does not update: {missing[:6]}")

    def _optimizer_manifest(self):
        groups = self.optimizer.param_groups
        betas = {tuple(float(b) for b in g["betas"]) for g in groups}
        eps = {float(g["eps"]) for g in groups}
        if len(betas) != 1 or len(eps) != 1:
            raise CaptureError("bundle v1 has one AdamW betas/eps for all parameters; the param groups differ")
        decays = {float(g["weight_decay"]) for g in groups}
        nonzero = decays - {0.0}
        if len(nonzero) > 1:
            raise CaptureError(f"bundle v1 expresses one weight decay plus no_decay globs; groups use {sorted(decays)}")
        decay = nonzero.pop() if nonzero else 0.0
        index = {id(p): i for i, p in enumerate(self.params)}
        if self._sharded is not None:  # the optimizer holds the sharded tensors: map them by name
            index = {pid: self.names.index(n) for pid, n in self._sharded_names.items() if n in self.names}
            if decay and any(id(p) not in index for g in groups if float(g["weight_decay"]) == 0.0
                             for p in g["params"]):
                raise CaptureError("under FSDP with flat parameters (use_orig_params=False) the recorder cannot "
                                   "tell which parameters a weight_decay=0 group holds; use one weight decay")
        no_decay = sorted(self.names[index[id(p)]] for g in groups if float(g["weight_decay"]) == 0.0 and decay
                          for p in g["params"])
        out = {"kind": "adamw", "betas": list(betas.pop()), "eps": eps.pop(), "weight_decay": decay}
        if no_decay:
            out["no_decay"] = no_decay  # exact keys are globs that match only themselves
        if self.grad_clip is not None:
            out["grad_clip"] = float(self.grad_clip)
        return out

    # -- the per-step hot path ------------------------------------------------

    @property
    def host_bytes_bound(self):
        """The most host memory the recorder can hold: window (or, with snapshot_every, two) times
        params + two AdamW moments."""
        moments = sum(2 * p.numel() * p.element_size() for p in self.params)  # AdamW keeps the param dtype
        full_steps = self.window if self.snapshot_every is None else 2
        return full_steps * (self.param_bytes + moments)

    def set_epoch(self, epoch, epoch_start_step):
        """Tell the recorder the randperm sampler moved to a new epoch (as DistributedSampler.set_epoch)."""
        if self.sampler is None:
            raise CaptureError("no randperm sampler was given in data.sampler")
        self.sampler = dict(self.sampler, epoch=int(epoch), epoch_start_step=int(epoch_start_step))

    def begin_step(self, step, *, samples=None, offsets=None, lr=None, loss_scale=None):
        """Snapshot the parameters and AdamW state at the start of `step` (call before forward).

        samples: dataset indices the step reads, per rank in read order ([[...], ...]; a flat list when
          world_size is 1); sample i is tokens [i*seq_len, i*seq_len + seq_len + 1) of the stream.
          Distributed (every rank calls begin_step): this rank's own indices, a flat list; the
          recorder gathers every rank's onto the recording rank.
        offsets: instead of samples, the first token (in the concatenated stream) of each row's
          seq_len + 1 window, for loaders that read at arbitrary offsets (e.g. nanoGPT's get_batch).
        Neither: derived from data.sampler (randperm).
        lr: the step's learning rate (default: the optimizer's param_groups lr).
        loss_scale: GradScaler.get_scale() for fp16.
        """
        step = int(step)
        full = self._shadow_step(step)
        if self._coll is not None:
            samples, offsets = self._gather_local(samples), self._gather_local(offsets)
        if self._norms is not None:
            self._norms.reset()
        self._loss_scale = None if loss_scale is None else _as_float(loss_scale)
        if self._sharded is not None:
            self._gathered = self._sharded.gather() if full else None  # collective: every rank gathers
        if not self.is_recording:
            return
        self._begin_step_local(step, samples=samples, offsets=offsets, lr=lr, loss_scale=loss_scale)

    def _shadow_step(self, step):
        """Whether `step` takes a full snapshot: the decision _take_slot makes from the ring, made from
        step numbers alone so that every rank (only one keeps a ring) knows when a sharded model is gathered."""
        last, last_full = self._shadow
        if last is not None and (step <= last or (self.snapshot_every and step != last + 1)):
            last_full = None
        full = self.snapshot_every is None or last_full is None or step - last_full >= self.snapshot_every
        self._shadow = (step, step if full else last_full)
        return full

    def _gather_local(self, rows):
        """This rank's rows (a flat list or 1-D tensor) -> every rank's, gathered; a list of per-rank
        lists is taken as already gathered (no collective)."""
        if rows is None:
            return None
        if isinstance(rows, torch.Tensor):
            rows = rows.tolist()
        rows = list(rows)
        if rows and isinstance(rows[0], (list, tuple, torch.Tensor)):
            return rows
        return self._coll.gather_objects([int(v) for v in rows])

    def _snapshot_gathered(self, slot):
        """A sharded model's snapshot: the full tensors gathered at begin_step, copied into the slot."""
        if self._gathered is None:
            raise CaptureError(f"step {slot.step}: a full snapshot without a gather (every rank must call begin_step "
                               "with the same step numbers)")
        params, state = self._gathered
        self._gathered = None
        for i, name in enumerate(self.names):
            if name not in params:
                raise CaptureError(f"the gathered full state dict has no {name!r} (it has {sorted(params)[:6]} ...)")
            with torch.no_grad():
                slot.params[i].copy_(params[name])
            st = state.get(name)
            if st and st.get("exp_avg") is not None:
                for which in ("exp_avg", "exp_avg_sq"):
                    with torch.no_grad():
                        slot.moment_buffer(which, i, st[which]).copy_(st[which])
                slot.has_moments[i] = True
                step = st.get("step", 0)
                slot.adam_steps.append(float(step.item() if isinstance(step, torch.Tensor) else step))

    def end_step(self, *, loss=None, local_loss=None, grad_norm=None, rank_losses=None, rank_grad_norms=None,
                 skipped=None):
        """Record what the job logged for the step begun last; dump the window on a non-finite loss
        (or a non-finite grad_norm outside fp16 loss scaling). Returns the bundle path when it dumped
        (distributed: on every rank).

        loss: the step's loss as the job logs it (mean over micro-batches and ranks).
        local_loss: distributed: this rank's own loss (mean over its micro-batches). The recorder
          gathers every rank's into rank_losses and, without loss=, logs their mean as the loss.
        grad_norm: what clip_grad_norm_ returned (the global norm, before clipping).
        rank_grad_norms: default, distributed: each rank's norm before the all-reduce, measured by
          the comm hook the recorder installed.
        """
        if loss is None and local_loss is None:
            raise CaptureError("end_step needs loss= (the step's loss) or local_loss= (this rank's own)")
        if self._coll is None:
            return self._end_step_local(loss=loss if loss is not None else local_loss, grad_norm=grad_norm,
                                        rank_losses=rank_losses, rank_grad_norms=rank_grad_norms, skipped=skipped)
        # clip_grad_norm_ under fully_shard returns a DTensor holding each rank's partial norm, whose item()
        # is this rank's part alone: make it whole here, on every rank (full_tensor() is collective).
        loss, local_loss, grad_norm = (x.full_tensor() if isinstance(x, torch.Tensor) and hasattr(x, "full_tensor")
                                       else x for x in (loss, local_loss, grad_norm))
        own, valid = self._norms.value(self._loss_scale) if self._norms is not None else (math.nan, False)
        gathered = self._coll.gather_floats([_as_float(local_loss) if local_loss is not None else None, own,
                                             1.0 if valid else 0.0])
        if rank_losses is None and local_loss is not None:
            rank_losses = [v[0] for v in gathered]
        if loss is None:
            loss = sum(rank_losses) / len(rank_losses)
        if rank_grad_norms is None and self._norms is not None:
            if all(v[2] == 1.0 for v in gathered):
                rank_grad_norms = [v[1] for v in gathered]
            elif not self._norms_warned and self.is_recording:
                self._norms_warned = True
                import warnings
                warnings.warn("nanreplay_capture: a gradient bucket was all-reduced more than once in a step (or "
                              "not at all), so the step's per-rank gradient norms are not recorded; with gradient "
                              "accumulation, run every micro-batch but the last under model.no_sync()")

        def record():
            return self._end_step_local(loss=loss, grad_norm=grad_norm, rank_losses=rank_losses,
                                        rank_grad_norms=rank_grad_norms, skipped=skipped)
        path = self._coll.agree(record)  # the recording rank's outcome (a bundle path or None), on every rank
        if path is not None:
            self.incident_path = path
        return path

    def dump(self, path=None, *, symptom="captured on demand", incident_step=None, data_copy=None):
        """Write the recorded window as a bundle at `path` (default `<out_dir>/capture-step<last>`);
        see _dump_local. Distributed: every rank calls it; the recording rank writes, and every rank
        gets the path."""
        def write():
            return self._dump_local(path, symptom=symptom, incident_step=incident_step, data_copy=data_copy)
        return write() if self._coll is None else self._coll.agree(write)

    def _begin_step_local(self, step, *, samples=None, offsets=None, lr=None, loss_scale=None):
        """Snapshot the parameters and AdamW state at the start of `step` (call before forward).

        samples: dataset indices the step reads, per rank in read order ([[...], ...]; a flat list when
          world_size is 1); sample i is tokens [i*seq_len, i*seq_len + seq_len + 1) of the stream.
        offsets: instead of samples, the first token (in the concatenated stream) of each row's
          seq_len + 1 window, for loaders that read at arbitrary offsets (e.g. nanoGPT's get_batch).
        Neither: derived from data.sampler (randperm).
        lr: the step's learning rate (default: the optimizer's param_groups lr).
        loss_scale: GradScaler.get_scale() for fp16.
        """
        step = int(step)
        # The run went back (a restart) or, when rolling forward, skipped steps: the old window is not its past.
        if self._ring and (step <= self._ring[-1].step or (self.snapshot_every and step != self._ring[-1].step + 1)):
            self._free.extend(s for s in self._ring if s.full)
            self._ring.clear()
        slot = self._take_slot(step)
        slot.step = step
        slot.sampler = self.sampler
        slot.rows, slot.rows_are_samples = self._rows(step, samples, offsets)
        slot.lr = _as_float(lr) if lr is not None else self._optimizer_lr()
        slot.loss_scale = _as_float(loss_scale)
        if slot.full:
            self._snapshot(slot)
            self._copying = slot
        self._ring.append(slot)

    def _snapshot(self, slot):
        """Copies the parameters and AdamW state into the slot's host buffers. On CUDA the copies
        run on a side stream, after the work already queued (the previous update) and overlapping
        this step's forward and backward; end_step() (and, on torch >= 2.0, a pre-hook on
        optimizer.step) makes the next update wait for them, since it changes those tensors in place."""
        if self._sharded is not None:
            return self._snapshot_gathered(slot)
        pairs = list(zip(slot.params, self.params))
        device_steps = []
        for i, p in enumerate(self.params):
            st = self.optimizer.state.get(p)
            if not st or "exp_avg" not in st:
                continue
            pairs.append((slot.moment_buffer("exp_avg", i, st["exp_avg"]), st["exp_avg"]))
            pairs.append((slot.moment_buffer("exp_avg_sq", i, st["exp_avg_sq"]), st["exp_avg_sq"]))
            slot.has_moments[i] = True
            step = st.get("step", 0)  # AdamW bumps it in place: keep its value, not the tensor
            if isinstance(step, torch.Tensor) and step.is_cuda:
                device_steps.append(step.detach().reshape(()).double())
            else:
                slot.adam_steps.append(float(step))
        if not self._async:
            with torch.no_grad():
                for dst, src in pairs:
                    dst.copy_(src)
            return
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(device=self.params[0].device)
        self._copy_stream.wait_stream(torch.cuda.current_stream(self.params[0].device))
        with torch.no_grad(), torch.cuda.stream(self._copy_stream):
            for dst, src in pairs:
                dst.copy_(src.detach(), non_blocking=True)
            if device_steps:
                slot.device_steps = slot.step_buffer(len(device_steps))
                slot.device_steps.copy_(torch.stack(device_steps), non_blocking=True)
            slot.event = torch.cuda.Event()
            slot.event.record(self._copy_stream)

    def _order_update_after_copies(self, *_):
        """The update about to run rewrites what the newest full slot is still copying: make it wait."""
        if self._copying is not None and self._copying.event is not None:
            torch.cuda.current_stream(self.params[0].device).wait_event(self._copying.event)
            self._copying = None

    def _end_step_local(self, *, loss, grad_norm=None, rank_losses=None, rank_grad_norms=None, skipped=None):
        """Record what the job logged for the step begun last; dump the window on a non-finite loss
        (or a non-finite grad_norm outside fp16 loss scaling). Returns the bundle path when it dumped."""
        if not self._ring or self._ring[-1].ended:
            raise CaptureError("end_step() without a matching begin_step()")
        slot = self._ring[-1]
        slot.logged = {"loss": _as_float(loss), "grad_norm": _as_float(grad_norm)}
        if rank_losses is not None:
            slot.logged["rank_losses"] = [_as_float(v) for v in rank_losses]
        if rank_grad_norms is not None:
            slot.logged["rank_grad_norms"] = [_as_float(v) for v in rank_grad_norms]
        slot.skipped = None if skipped is None else bool(skipped)
        slot.ended = True
        self._order_update_after_copies()
        if self.self_check and self.self_check_result is None and slot.logged["loss"] is not None \
                and math.isfinite(slot.logged["loss"]) and self.source.one_dtype:
            self.self_check_result = run_self_check(self, slot)  # CaptureError on a gap
        symptom = self._symptom(slot)
        if symptom and self.incident_path is None:
            self.incident_path = self._dump_local(self._unique_dir(f"incident-step{slot.step}"), symptom=symptom,
                                           incident_step=slot.step)
            return self.incident_path
        return None

    def _symptom(self, slot):
        loss, norm = slot.logged["loss"], slot.logged["grad_norm"]
        if loss is not None and not math.isfinite(loss):
            return f"loss={_json_number(loss)}"
        scaler_overflow = self.precision == "fp16" or slot.skipped
        if norm is not None and not math.isfinite(norm) and not scaler_overflow:
            return f"grad_norm={_json_number(norm)}"
        return None

    def _take_slot(self, step):
        if self.snapshot_every is not None:
            return self._take_snapshot_slot(step)
        if len(self._ring) >= self.window:
            slot = self._ring.popleft()
        elif self._free:
            slot = self._free.pop()
        else:
            return _StepSlot(self.params, self._pin)
        return self._reused(slot)

    def _take_snapshot_slot(self, step):
        """A full slot every snapshot_every steps, a light one otherwise. A third snapshot evicts
        the oldest with the light records before the second: the ring then starts at a snapshot."""
        fulls = [s for s in self._ring if s.full]
        if fulls and step - fulls[-1].step < self.snapshot_every:
            return _StepSlot(self.params, self._pin, full=False)
        if len(fulls) >= 2:
            while self._ring[0] is not fulls[1]:
                evicted = self._ring.popleft()
                if evicted.full:
                    self._free.append(evicted)
        return self._reused(self._free.pop()) if self._free else _StepSlot(self.params, self._pin)

    def _reused(self, slot):
        if slot.event is not None:
            slot.event.synchronize()  # its previous copies must land before they are overwritten
        slot.reset()
        return slot

    def _optimizer_lr(self):
        lrs = {_as_float(g["lr"]) for g in self.optimizer.param_groups}
        if len(lrs) != 1:
            raise CaptureError(f"param groups use different learning rates {sorted(lrs)}; bundle v1 has one "
                               "lr per step: pass lr= to begin_step if one of them is the real one")
        return lrs.pop()

    def _rows(self, step, samples, offsets):
        d = self.data
        world, per_rank = d["world_size"], d["micro_batch_size"] * d["grad_accum_steps"]
        if samples is not None and offsets is not None:
            raise CaptureError("give samples= or offsets=, not both")
        given = samples if samples is not None else offsets
        if given is None:
            if self.sampler is None:
                raise CaptureError("begin_step needs samples= (or offsets=) when data.sampler is None")
            given = _randperm_samples(self.sampler, self.source.num_samples(d["seq_len"]), world, per_rank, step)
            samples = given
        if isinstance(given, torch.Tensor):
            given = given.tolist()
        if world == 1 and len(given) and not isinstance(given[0], (list, tuple, torch.Tensor)):
            given = [given]
        rows = [[int(v) for v in (r.tolist() if isinstance(r, torch.Tensor) else r)] for r in given]
        if len(rows) != world or any(len(r) != per_rank for r in rows):
            raise CaptureError(f"step {step}: expected {world} rank list(s) of micro_batch_size * grad_accum_steps "
                               f"= {per_rank} entries, got {[len(r) for r in rows]}")
        if samples is not None:
            rows = [[i * d["seq_len"] for i in r] for r in rows]
        return rows, samples is not None

    # -- writing a bundle -----------------------------------------------------

    def _unique_dir(self, name):
        path = self.out_dir / name
        n = 1
        while path.exists():
            n += 1
            path = self.out_dir / f"{name}-{n}"
        return path

    def _dump_local(self, path=None, *, symptom="captured on demand", incident_step=None, data_copy=None):
        """Write the recorded window as a bundle at `path` (default `<out_dir>/capture-step<last>`),
        atomically: everything goes to a temporary sibling directory renamed at the end.

        data_copy: "whole" copies every shard; "window" writes one compact shard holding only the
        token windows the captured steps read and rewrites the samples as explicit indices into it;
        "auto" (default) copies whole when the shards total at most `whole_copy_limit` bytes and
        every row starts at a sample boundary. Returns the bundle path.
        """
        slots = list(self._ring)
        if not slots:
            raise CaptureError("nothing recorded yet: call begin_step() first")
        assert slots[0].full, "a window starts at a full step"
        for slot in slots:
            if slot.event is not None:
                slot.event.synchronize()
        path = Path(path) if path is not None else self._unique_dir(f"capture-step{slots[-1].step}")
        if path.exists() and any(path.iterdir()):
            raise CaptureError(f"{path} exists and is not empty")
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.parent / f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            (tmp / "data").mkdir(parents=True)
            data_manifest, step_samples, step_extra = self._write_data(tmp, slots, data_copy or self.data_copy)
            steps = []
            for slot, samples, extra in zip(slots, step_samples, step_extra):
                rel = f"steps/{slot.step}"
                self._write_step(tmp / rel, slot)
                steps.append(dict({"step": slot.step, "dir": rel, "samples": samples}, **extra))
            manifest = {
                "format": "nanreplay.bundle",
                "version": 1,
                "model": self.model_config,
                "precision": {"compute": self.precision},
                "optimizer": self._optimizer_manifest(),
                "data": data_manifest,
                "steps": steps,
                "incident": {"step": slots[-1].step if incident_step is None else incident_step,
                             "symptom": symptom},
                "capture": {"writer": "nanreplay_capture", "version": CAPTURE_VERSION,
                            "torch": torch.__version__, "host": socket.gethostname(),
                            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                            "window": self.window,
                            **({"snapshot_every": self.snapshot_every} if self.snapshot_every else {})},
            }
            if self.defaulted:  # docs/bundle-format.md, "Provenance": the report names them beside a gap
                manifest["provenance"] = {
                    f"model.{k}": {"from": "default", "value": v, "detail": "bundle v1's default: neither the model nor "
                                   "model_config says it (the capture self-check compared the loss with it)"}
                    for k, v in self.defaulted.items()}
            _write_json(tmp / "manifest.json", manifest)  # last: its presence marks a complete bundle
            if path.exists():
                path.rmdir()
            os.rename(tmp, path)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return path

    def _write_step(self, step_dir, slot):
        step_dir.mkdir(parents=True)
        if slot.full:
            self._write_checkpoint(step_dir, slot)
        _write_json(step_dir / "state.json", self._step_state(slot))

    def _write_checkpoint(self, step_dir, slot):
        write_safetensors(step_dir / "model.safetensors", list(zip(self.names, slot.params)))
        tensors = []
        for i, name in enumerate(self.names):
            for which, bufs in (("exp_avg", slot.exp_avg), ("exp_avg_sq", slot.exp_avg_sq)):
                if slot.has_moments[i]:
                    tensors.append((f"{name}.{which}", bufs[i]))
                else:  # no AdamW state yet (before the first update): zeros, as AdamW starts
                    tensors.append((f"{name}.{which}", ("zeros", slot.params[i].dtype, tuple(slot.params[i].shape))))
        adam_steps = [int(s) for s in slot.adam_steps]
        if slot.device_steps is not None:
            adam_steps += [int(s) for s in slot.device_steps.tolist()]
        if len(set(adam_steps)) > 1:
            raise CaptureError(f"step {slot.step}: AdamW step counts differ across parameters "
                               f"({sorted(set(adam_steps))}); bundle v1 has one")
        tensors.append(("step", torch.tensor(adam_steps[0] if adam_steps else 0, dtype=torch.int64)))
        write_safetensors(step_dir / "optimizer.safetensors", tensors)

    @staticmethod
    def _step_state(slot):
        state = {"step": slot.step, "lr": _json_number(slot.lr)}
        if slot.loss_scale is not None:
            state["loss_scale"] = _json_number(slot.loss_scale)
        if slot.skipped is not None:
            state["skipped"] = slot.skipped
        logged = {}
        for key, value in slot.logged.items():
            if value is None:
                continue
            logged[key] = [_json_number(v) for v in value] if isinstance(value, list) else _json_number(value)
        state["logged"] = logged
        return state

    def _write_data(self, root, slots, mode):
        """Writes the token data the slots read; returns (manifest "data", samples per slot, extra
        keys per step entry)."""
        d, src = self.data, self.source
        L = d["seq_len"]
        for slot in slots:
            for rank, rows in enumerate(slot.rows):
                for row, start in enumerate(rows):
                    if start < 0 or start + L + 1 > src.total_tokens:
                        raise CaptureError(f"step {slot.step} rank {rank} row {row}: tokens [{start}, {start + L + 1}) "
                                           f"lie outside the {src.total_tokens}-token stream")
        aligned = all(start % L == 0 for slot in slots for rows in slot.rows for start in rows)
        if mode == "auto":
            mode = "whole" if aligned and src.total_bytes <= self.whole_copy_limit else "window"
        if mode == "whole" and not aligned:
            raise CaptureError("data_copy='whole' needs every row to start at a sample boundary (offset % seq_len == 0)")
        base = {"seq_len": L, "micro_batch_size": d["micro_batch_size"],
                "grad_accum_steps": d["grad_accum_steps"], "world_size": d["world_size"]}
        if mode == "whole":
            shards = self._copy_whole_shards(root)
            samplers = {tuple(sorted(s.sampler.items())) if s.sampler else None for s in slots}
            sampler = slots[0].sampler if len(samplers) == 1 and slots[0].sampler else {"kind": "explicit"}
            if sampler["kind"] == "explicit" and self.sampler is not None:
                base["original_samplers"] = {str(s.step): s.sampler for s in slots}
            samples = [[[start // L for start in rows] for rows in slot.rows] for slot in slots]
            data = dict({"shards": shards, "sampler": sampler}, **base)
            data["capture"] = {"mode": "whole"}
            return data, samples, [{} for _ in slots]
        if not src.one_dtype:
            raise CaptureError("data_copy='window' needs all shards in one dtype")
        shard, runs, index = self._copy_windows(root, slots)
        samples = [[[index[start] for start in rows] for rows in slot.rows] for slot in slots]
        data = dict({"shards": [shard], "sampler": {"kind": "explicit"}}, **base)
        data["capture"] = {"mode": "window", "runs": runs,
                           "source_shards": [{"path": str(s["path"]), "dtype": s["dtype"], "tokens": s["tokens"],
                                              "header_bytes": s["header"]} for s in src.shards]}
        if self.sampler is not None:
            data["capture"]["original_sampler"] = slots[-1].sampler
        # What the run read, in its own terms, beside the rewritten indices.
        if all(slot.rows_are_samples for slot in slots):
            extra = [{"original_samples": [[start // L for start in rows] for rows in slot.rows]} for slot in slots]
        else:
            extra = [{"original_offsets": [list(rows) for rows in slot.rows]} for slot in slots]
        return data, samples, extra

    def _copy_whole_shards(self, root):
        shards, used = [], set()
        for i, s in enumerate(self.source.shards):
            name = s["path"].name if s["path"].name not in used else f"{i:03d}_{s['path'].name}"
            used.add(name)
            rel = f"data/{name}"
            digest = hashlib.sha256()
            with open(s["path"], "rb") as f, open(root / rel, "wb") as out:
                f.seek(s["header"])
                left = s["tokens"] * s["width"]
                while left:
                    chunk = f.read(min(left, _COPY_CHUNK))
                    if not chunk:
                        raise CaptureError(f"{s['path']} shrank while it was being copied")
                    digest.update(chunk)
                    out.write(chunk)
                    left -= len(chunk)
            shards.append({"path": rel, "dtype": s["dtype"], "tokens": s["tokens"], "sha256": digest.hexdigest()})
        return shards

    def _copy_windows(self, root, slots):
        """One compact shard holding every window the slots read. Rows whose windows follow each
        other at stride seq_len in the source share tokens there, so they are kept together as a
        run; each run starts at a sample boundary of the new stream and is followed by the rest of
        the source's next sample (real tokens, not filler, so data checks see real data)."""
        L, src = self.data["seq_len"], self.source
        starts = sorted({start for slot in slots for rows in slot.rows for start in rows})
        runs_src = []
        for start in starts:
            if runs_src and start == runs_src[-1][0] + L * runs_src[-1][1]:
                runs_src[-1][1] += 1
            else:
                runs_src.append([start, 1])
        index, runs = {}, []
        digest, written = hashlib.sha256(), 0
        rel = "data/window.bin"
        width = src.shards[0]["width"]
        with open(root / rel, "wb") as out:
            for start, count in runs_src:
                assert written % L == 0
                copied = min((count + 1) * L, src.total_tokens - start)  # count windows + one sample of context
                raw = src.read(start, copied)
                length = copied
                if length % L and start != runs_src[-1][0]:
                    # Cut short by the end of the stream with runs still to come (rows at arbitrary
                    # offsets): fill up to the next sample boundary with the run's own tokens,
                    # which no sample reads.
                    pad = L - length % L
                    raw += (raw * (pad // length + 1))[:pad * width]
                    length += pad
                out.write(raw)
                digest.update(raw)
                for k in range(count):
                    index[start + k * L] = written // L + k
                runs.append({"bundle_offset": written, "source_offset": start, "tokens": copied})
                written += length
        shard = {"path": rel, "dtype": src.shards[0]["dtype"], "tokens": written, "sha256": digest.hexdigest()}
        assert written * width == (root / rel).stat().st_size
        return shard, runs, index
