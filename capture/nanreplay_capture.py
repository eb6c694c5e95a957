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

Full API and the on-disk choices: docs/capture.md in the nanreplay repository.
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
    `attention_bias` and `qk_norm` options add (absent keys: the defaults, no extra parameters)."""
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
            out += [(p + "post_attention_layernorm.weight", (C,)),
                    (p + "mlp.gate_proj.weight", (ffn, C)),
                    (p + "mlp.up_proj.weight", (ffn, C)),
                    (p + "mlp.down_proj.weight", (C, ffn))]
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


def _module_eps(model, names):
    for name in names:
        try:
            module = model.get_submodule(name)
        except AttributeError:
            continue
        for attr in ("eps", "variance_epsilon", "norm_eps"):
            value = getattr(module, attr, None)
            if isinstance(value, (int, float)):
                return float(value)
    return None


def _infer_model_config(arch, model, named, given, seq_len):
    """The manifest's model section: shapes read off the parameters, the rest from `given`
    (or from the modules where they carry it, e.g. LayerNorm.eps). A given value that
    contradicts the parameters is an error, never silently overridden. llama's model options
    (_model_options) are settled after the shapes."""
    cfg = {k: v for k, v in given.items() if k not in LLAMA_OPTION_DEFAULTS}

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
        raise CaptureError("model_config needs 'num_heads'")
    if arch == "llama":
        V, C = shape("model.embed_tokens.weight")
        layers = 0
        while f"model.layers.{layers}.input_layernorm.weight" in named:
            layers += 1
        settle("vocab_size", V)
        settle("hidden_size", C)
        settle("num_layers", layers)
        settle("intermediate_size", shape("model.layers.0.mlp.gate_proj.weight")[0] if layers else None)
        head_dim = C // cfg["num_heads"]
        settle("num_kv_heads", shape("model.layers.0.self_attn.k_proj.weight")[0] // head_dim if layers else None)
        head = named.get("lm_head.weight")
        settle("tie_embeddings", head is None or head is named["model.embed_tokens.weight"])
        cfg.setdefault("max_seq_len", seq_len)  # llama's math does not depend on it
        settle("norm_eps", _module_eps(model, ["model.norm", "model.layers.0.input_layernorm"]))
        theta = getattr(model, "rope_theta", None) or getattr(getattr(model, "config", None), "rope_theta", None)
        settle("rope_theta", float(theta) if theta is not None else None)
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
        settle("norm_eps", _module_eps(model, ["transformer.ln_f", "transformer.h.0.ln_1"]))
        head = named.get("lm_head.weight")
        if head is not None and head is not named["transformer.wte.weight"]:
            raise CaptureError("gpt2 in bundle v1 ties the output head to transformer.wte.weight, "
                               "but lm_head.weight is a separate tensor")
    if cfg["hidden_size"] % cfg["num_heads"] or cfg["num_heads"] % cfg["num_kv_heads"]:
        raise CaptureError("num_heads must divide hidden_size and num_kv_heads must divide num_heads")
    if seq_len > cfg["max_seq_len"]:
        raise CaptureError(f"data seq_len {seq_len} exceeds model max_seq_len {cfg['max_seq_len']}")
    options = _model_options(arch, model, named, given, cfg)
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


def _option_needing(name, cfg):
    """For error messages: the option that asks for parameter `name`, when one does."""
    if _BIAS_PARAM.fullmatch(name):
        return ", with attention_bias=True"
    if _QK_NORM_PARAM.fullmatch(name):
        return f", with qk_norm={cfg.get('qk_norm')!r}"
    return ""


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

    Per step, in the training loop:
        recorder.begin_step(step, samples=batch_indices)   # before forward: snapshots params + AdamW
        ... forward, backward, clip_grad_norm_ ...
        recorder.end_step(loss=loss, grad_norm=norm)       # dumps the window when loss is non-finite
        optimizer.step(); scheduler.step()

    Arguments:
      model, optimizer: the module being trained and its torch.optim.AdamW.
      out_dir: where automatic dumps go (`<out_dir>/incident-step<step>`).
      arch: "llama" or "gpt2" (bundle v1 architectures).
      model_config: manifest model keys; shapes are read off the parameters, `num_heads` is
        required, `norm_eps` / `rope_theta` are required unless the modules carry them. llama's
        options (rope_style, rope_scaling, attention_bias, qk_norm, attn_logit_softcap,
        final_logit_softcap, sliding_window) are read off a Hugging Face style `model.config`
        where it says them, else taken from here (default: off); the two must agree.
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
        (docs/bundle-format.md).
      data_copy: "auto", "whole" or "window" (see dump()).
      whole_copy_limit: bytes of shard data up to which "auto" copies shards whole.
      pin_memory: host buffers pinned for asynchronous copies (default: when params are on CUDA).
    """

    def __init__(self, model, optimizer, out_dir, *, arch, data, model_config=None, window=DEFAULT_WINDOW,
                 precision="fp32", grad_clip=None, param_names=None, data_copy="auto",
                 whole_copy_limit=DEFAULT_WHOLE_COPY_LIMIT, pin_memory=None, snapshot_every=None):
        if window < 1:
            raise CaptureError("window must be at least 1")
        if snapshot_every is not None and int(snapshot_every) < 1:
            raise CaptureError("snapshot_every must be at least 1 (or None for the ring of full steps)")
        self.snapshot_every = None if snapshot_every is None else int(snapshot_every)
        if precision not in _PRECISIONS:
            raise CaptureError(f"precision must be one of {_PRECISIONS}, got {precision!r}")
        if data_copy not in ("auto", "whole", "window"):
            raise CaptureError(f"data_copy must be 'auto', 'whole' or 'window', got {data_copy!r}")
        self.model, self.optimizer = model, optimizer
        self.out_dir = Path(out_dir)
        self.window, self.precision, self.grad_clip = int(window), precision, grad_clip
        self.data_copy, self.whole_copy_limit = data_copy, int(whole_copy_limit)
        self.data = self._check_data(data)
        self.source = _TokenSource(self.data)
        self.sampler = dict(self.data["sampler"]) if self.data.get("sampler") else None

        if callable(param_names):
            rename = param_names
        else:
            mapping = dict(param_names or {})
            rename = lambda name: mapping.get(name, name)  # noqa: E731
        named = {}
        for name, p in _all_named_parameters(model):
            named.setdefault(rename(name), p)
        self.model_config = _infer_model_config(arch, model, named, model_config or {}, self.data["seq_len"])
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

    def end_step(self, *, loss, grad_norm=None, rank_losses=None, rank_grad_norms=None, skipped=None):
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
        symptom = self._symptom(slot)
        if symptom and self.incident_path is None:
            self.incident_path = self.dump(self._unique_dir(f"incident-step{slot.step}"), symptom=symptom,
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

    def dump(self, path=None, *, symptom="captured on demand", incident_step=None, data_copy=None):
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
