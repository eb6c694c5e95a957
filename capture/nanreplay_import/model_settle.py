"""The manifest's model section: shapes read off the tensors, the rest from flags and configs
(config.json, params.json, model_args, Megatron args, --config) or a recognised framework's own
default, each with where it came from; then the parameters bundle v1 needs, checked."""

import math
import re

import torch

import nanreplay_capture as _capture

from . import families
from .naming import _HF_MOE, HF_EXPERT_NAMES, group_names
from .outcome import BadInput

_FLOAT_TYPES = (torch.float32, torch.bfloat16, torch.float16)

_ALIASES = {  # manifest key: source keys in order of preference
    "vocab_size": ("vocab_size", "padded_vocab_size"),
    "hidden_size": ("hidden_size", "dim", "n_embd", "d_model"),
    "num_layers": ("num_layers", "num_hidden_layers", "n_layers", "n_layer"),
    "num_heads": ("num_heads", "num_attention_heads", "n_heads", "n_head"),
    "num_kv_heads": ("num_kv_heads", "num_key_value_heads", "n_kv_heads", "num_query_groups"),
    "intermediate_size": ("intermediate_size", "ffn_hidden_size"),
    "max_seq_len": ("max_seq_len", "max_position_embeddings", "block_size", "seq_length", "max_seq_length"),
    "norm_eps": ("norm_eps", "rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "norm_epsilon",
                 "layernorm_epsilon"),
    "rope_theta": ("rope_theta", "rotary_base", "rope_base"),
    "head_dim": ("head_dim",),  # Qwen3, Gemma 3: the shapes below read it; model.head_dim is an option
}


def normalize_config(raw, where):
    """Manifest model keys from a framework's config dict; keys it does not give are left out."""
    cfg = {}
    if not isinstance(raw, dict):
        raise BadInput(where, "config", "not a JSON object")
    for key, names in _ALIASES.items():
        for name in names:
            value = raw.get(name)
            if value is not None:
                cfg[key] = (value, name)
                break
    default = _capture.glm_default(raw.get("model_type"), "head_dim") if "head_dim" not in raw else None
    if default:  # GlmConfig's head_dim (128), not hidden_size / num_heads: the shapes below read it
        cfg["head_dim"] = default
    params = raw.get("rope_parameters")  # transformers >= 5 keeps rope_theta there
    if "rope_theta" not in cfg and isinstance(params, dict) and params.get("rope_theta") is not None:
        cfg["rope_theta"] = (params["rope_theta"], "rope_parameters.rope_theta")
    full = params.get("full_attention") if isinstance(params, dict) else None  # per layer type (Gemma 3)
    if "rope_theta" not in cfg and isinstance(full, dict) and full.get("rope_theta") is not None:
        cfg["rope_theta"] = (full["rope_theta"], "rope_parameters.full_attention.rope_theta")
    if raw.get("model_type") in families.LLAMA4_TYPES:  # its intermediate_size is the experts' width
        cfg.pop("intermediate_size", None)
        if raw.get("intermediate_size_mlp") is not None:  # Llama4TextMLP's of the dense layers
            cfg["intermediate_size"] = (raw["intermediate_size_mlp"], "intermediate_size_mlp")
    if raw.get("group_query_attention") is False and "num_kv_heads" in cfg and cfg["num_kv_heads"][1] == "num_query_groups":
        del cfg["num_kv_heads"]  # Megatron keeps num_query_groups even when GQA is off
    for key, (value, name) in list(cfg.items()):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if key in ("norm_eps", "rope_theta"):
            if not ok or value < 0 or (key == "rope_theta" and value <= 0):
                raise BadInput(where, name, f"must be a finite number{' > 0' if key == 'rope_theta' else ' >= 0'}, got {value!r}")
            cfg[key] = (float(value), name)
        elif not ok or value != int(value) or value <= 0:
            raise BadInput(where, name, f"must be an integer > 0, got {value!r}")
        else:
            cfg[key] = (int(value), name)
    for name in ("tie_word_embeddings", "tie_embeddings"):
        if isinstance(raw.get(name), bool):
            cfg["tie_embeddings"] = (raw[name], name)
    if isinstance(raw.get("untie_embeddings_and_output_weights"), bool):
        cfg["tie_embeddings"] = (not raw["untie_embeddings_and_output_weights"], "untie_embeddings_and_output_weights")
    return cfg


_MOE_BOUNDS = {"num_experts": 2**16, "num_local_experts": 2**16, "num_experts_per_tok": 2**16,
               "moe_intermediate_size": 2**24}


def _moe_config(raw, where, num_layers, tensor_count=None):
    """model.moe from a Hugging Face MoE config (Qwen3-MoE / Qwen2-MoE / Mixtral names); None when dense.
    The capture helper's reading (nanreplay_capture.moe_from_config), its refusals as bad input. Sizes
    are checked by name first: the parameter list is built per expert, so an absurd expert count would
    take gigabytes before any tensor is compared."""
    for name, bound in _MOE_BOUNDS.items():
        value = raw.get(name) if isinstance(raw, dict) else None
        if value is not None and value is not False and value != 0 and not (
                isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= bound):
            raise BadInput(where, name, f"must be an integer in [1, {bound}], got {value!r}")
    try:
        moe = _capture.moe_from_config(raw)
    except _capture.MoeConfigRefusal as e:
        raise BadInput(where, e.key, e.what) from None
    if moe and tensor_count is not None and moe["num_experts"] * num_layers > tensor_count:
        name = "num_experts" if isinstance(raw, dict) and raw.get("num_experts") else "num_local_experts"
        raise BadInput(where, name, f"{moe['num_experts']} experts in each of {num_layers} layers need at least "
                                    f"{moe['num_experts'] * num_layers} expert tensors; the checkpoint holds "
                                    f"{tensor_count} tensors in all")
    return moe


# Gemma 3's multimodal checkpoints (model_type "gemma3"): the language model's names onto the text
# model's (transformers >= 4.52 nest it under model.language_model, older ones under language_model.model).
_TEXT_MODEL_PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
                        ("language_model.lm_head.", "lm_head."))
# Llama 4's Llama4ForConditionalGeneration: language_model.model.*, language_model.lm_head, vision_model.*,
# multi_modal_projector.*.
_NOT_TEXT_MODEL = re.compile(r"(?:model\.)?(?:vision_tower|vision_model|multi_modal_projector)\.")


def text_model(sd, configs):
    """A multimodal checkpoint (Gemma 3's Gemma3ForConditionalGeneration) as its text model: the language
    model's tensors under the text model's names, the vision tower's and projector's left out (they take no
    part in the text loss); its config is already the text_config (formats/hf.py). Returns (state dict,
    configs, a line to print or None); other checkpoints unchanged."""
    if not any(isinstance(k, str) and k.startswith(old) for k in sd for old, _ in _TEXT_MODEL_PREFIXES[:2]):
        return sd, configs, None
    renamed, left = {}, 0
    for key, value in sd.items():
        if isinstance(key, str) and _NOT_TEXT_MODEL.match(key):
            left += 1
            continue
        for old, new in _TEXT_MODEL_PREFIXES:
            if key.startswith(old):
                key = new + key[len(old):]
                break
        renamed[key] = value
    kind = next((raw.get("model_type") for raw, _ in configs if isinstance(raw.get("model_type"), str)), None)
    family = "Llama 4" if kind in families.LLAMA4_TYPES else "Gemma 3"
    return renamed, configs, (f"text model: the checkpoint is a multimodal model's ({family}); its language model "
                              f"is imported, {left} vision tower and projector tensors left out (no part of the "
                              "text loss)")


FLAG_OF = {"num_heads": "--num-heads", "num_kv_heads": "--num-kv-heads", "norm_eps": "--norm-eps",
           "rope_theta": "--rope-theta", "tie_embeddings": "--tie-embeddings"}
FLAGS_WHERE = "command line"


def flag_config(args):
    """The model values given as flags, spelled as --config's manifest keys: the first config source."""
    raw = {k: getattr(args, k, None) for k in FLAG_OF}
    return {k: v for k, v in raw.items() if v is not None}


def _kind_of(where, args):
    """Provenance kind of a config source: a flag, the user's --config, or what the run saved."""
    if where == FLAGS_WHERE:
        return "flag"
    return "config" if args.config and where == args.config else "checkpoint"


def framework_defaults(configs, naming):
    """{key: (value, why)} a recognised framework fixes in its code but does not save: llama2.c's
    ModelArgs (norm_eps 1e-5, rotary theta 10000) and nanoGPT's LayerNorm (eps 1e-5). Only where its
    model_args are recognised by their own keys; these are recorded as defaulted, never silently."""
    for raw, where in configs:
        if not str(where).endswith(": model_args"):
            continue
        keys = set(raw)
        if naming == "meta" and {"dim", "n_layers", "n_heads", "multiple_of"} <= keys:
            why = "llama2.c's ModelArgs default, which its model_args do not save"
            return {"norm_eps": (1e-5, why), "rope_theta": (10000.0, why)}
        if naming == "nanogpt" and {"n_layer", "n_head", "n_embd", "block_size"} <= keys:
            return {"norm_eps": (1e-5, "nanoGPT's LayerNorm hard-codes eps 1e-5, which its model_args do not save")}
    return {}


def refuse_model_type(configs):
    """BadInput naming the config's model_type when bundle v1 cannot replay that family's checkpoints."""
    for raw, w in configs:
        kind = raw.get("model_type") if isinstance(raw, dict) else None
        if isinstance(kind, str) and kind in _capture.UNSUPPORTED_MODEL_TYPES and kind not in HF_EXPERT_NAMES:
            why, attention = _capture.UNSUPPORTED_MODEL_TYPES[kind]
            raise BadInput(w, "model_type", f"{kind!r} is not importable: {why}; its attention ({attention}) is, "
                                            "for a dense model given in --config")
        if isinstance(kind, str) and kind in _capture.REFUSED_MODEL_TYPES:
            raise BadInput(w, "model_type", f"{kind!r} is not importable: {_capture.REFUSED_MODEL_TYPES[kind]}")


def required_values(arch, configs, naming, where):
    """Every value that changes the math and cannot be read off the tensors, checked at once: the one
    line names all that no config, flag or known framework default gives, and what the configs hold."""
    refuse_model_type(configs)
    have = set()
    for raw, w in configs:
        have |= set(normalize_config(raw, w))
    have |= set(framework_defaults(configs, naming))
    needed = ["num_heads", "norm_eps"] + (["rope_theta"] if arch == "llama" else [])
    missing = [k for k in needed if k not in have]
    if not missing:
        return
    read = "; ".join(f"{w} ({', '.join(sorted(map(str, raw))[:12]) or 'empty'})" for raw, w in configs
                     if w != FLAGS_WHERE) or "none (no --config, and the checkpoint carries none)"
    raise BadInput(where, ", ".join(missing),
                   "missing: they change the math, the tensors cannot say them and no config gives them; pass "
                   + " ".join(f"{FLAG_OF[k]} X" for k in missing) + " (or give them in --config); configs read: "
                   + read)


def settle_model(arch, sd, naming, sources, args):
    """The manifest's model section: shapes read off the tensors, the rest from flags and configs
    (the first source that gives a key wins; a contradiction with the tensors is bad input), or a
    recognised framework's own default. Returns (model, provenance {key: (kind, detail)})."""
    cfg, origin, overridden = {}, {}, {}
    for raw, where in sources:
        for key, (value, name) in normalize_config(raw, where).items():
            if key not in cfg:
                cfg[key], origin[key] = value, (where, name)
            elif origin[key][0] == FLAGS_WHERE and value != cfg[key] and key not in overridden:
                overridden[key] = f" (overrides {where}: {name} {value!r})"  # the flag wins, and says so
    prov = {k: (_kind_of(w, args), FLAG_OF[k] + overridden.get(k, "") if w == FLAGS_WHERE else f"{w}: {n}")
            for k, (w, n) in origin.items()}
    for key, (value, why) in framework_defaults(sources, naming).items():
        if key not in cfg:
            cfg[key] = value
            prov[key] = ("default", why)
    model = {"arch": arch}
    src = "--checkpoint"

    def need(key):
        if key not in cfg:
            raise BadInput(sources[0][1] if sources else "--config", key,
                           f"missing: it cannot be read off the tensors; pass {FLAG_OF.get(key, 'it in --config')}"
                           + (" (or give it in --config)" if key in FLAG_OF else ""))
        return cfg[key]

    def settle(key, value, why):
        if key in cfg and cfg[key] != value:
            where, name = origin.get(key, ("--config", key))
            raise BadInput(FLAG_OF[key] if where == FLAGS_WHERE and key in FLAG_OF else where, name,
                           f"is {cfg[key]!r} but the checkpoint's tensors say {value!r} ({why})")
        model[key] = value
        prov.setdefault(key, ("tensors", why))

    H = need("num_heads")
    if arch == "llama":
        _settle_llama(sd, cfg, origin, prov, model, settle, need, H, args)
    else:
        wte, wpe = sd.get("transformer.wte.weight"), sd.get("transformer.wpe.weight")
        if wte is None or wpe is None:
            raise BadInput(src, "transformer.wte.weight" if wte is None else "transformer.wpe.weight", "missing")
        L = 0
        while f"transformer.h.{L}.ln_1.weight" in sd:
            L += 1
        settle("vocab_size", int(wte.shape[0]), "wte rows")
        settle("hidden_size", int(wte.shape[1]), "wte width")
        settle("num_layers", L, "layers")
        model["num_heads"] = H
        settle("max_seq_len", int(wpe.shape[0]), "wpe rows")
        model["num_kv_heads"] = H
        prov.setdefault("num_kv_heads", ("naming", "gpt2 has one key/value head per query head"))
        model["norm_eps"] = need("norm_eps")
        model["tie_embeddings"] = True
        prov["tie_embeddings"] = ("naming", "bundle v1's gpt2 ties the head to wte")
        head = sd.get("lm_head.weight")
        if head is not None and not (head.data_ptr() == wte.data_ptr() or torch.equal(head, wte)):
            raise BadInput(src, "lm_head.weight", "differs from transformer.wte.weight: bundle v1's gpt2 ties them")
        if cfg.get("tie_embeddings") is False:
            raise BadInput(*origin["tie_embeddings"], "false: bundle v1's gpt2 ties the head to wte")
    if model["max_seq_len"] < args.seq_len:
        raise BadInput("command line", "--seq-len", f"{args.seq_len} exceeds the model's max_seq_len {model['max_seq_len']}"
                       + (f" ({prov['max_seq_len'][1]})" if "max_seq_len" in prov else ""))
    return model, prov


def _settle_kv_heads(sd, cfg, origin, settle, C, H):
    """num_kv_heads from k_proj's rows over the head width (the config's head_dim, else C / H)."""
    head_dim = cfg.get("head_dim")  # a config's own head width (model_options() writes it as model.head_dim)
    if C % H and head_dim is None:
        where, name = origin["num_heads"]
        raise BadInput(FLAG_OF["num_heads"] if where == FLAGS_WHERE else where, name, f"{H} does not divide hidden_size {C}"
                       + " and no config gives head_dim")
    head_dim = head_dim or C // H
    k = sd.get("model.layers.0.self_attn.k_proj.weight")
    if k is None:
        raise BadInput("--checkpoint", "model.layers.0.self_attn.k_proj.weight", "missing (after the naming preset)")
    settle("num_kv_heads", int(k.shape[0]) // head_dim, "k_proj rows / head_dim")


def _settle_llama(sd, cfg, origin, prov, model, settle, need, H, args):
    src = "--checkpoint"
    embed = sd.get("model.embed_tokens.weight")
    if embed is None:
        raise BadInput(src, "model.embed_tokens.weight", "missing (after the naming preset)")
    V, C = embed.shape
    # Layers counted by their first norm: input_layernorm, or OLMo 2's post_feedforward_layernorm (post-norm).
    norm = "input_layernorm" if "model.layers.0.post_feedforward_layernorm.weight" not in sd else "post_feedforward_layernorm"
    L = 0
    while f"model.layers.{L}.{norm}.weight" in sd:
        L += 1
    if L == 0:
        raise BadInput(src, "model.layers.0.input_layernorm.weight", "missing (after the naming preset)")
    settle("vocab_size", int(V), "embedding rows")
    settle("hidden_size", int(C), "embedding width")
    settle("num_layers", L, "layers")
    model["num_heads"] = H
    if "model.layers.0.self_attn.kv_a_proj_with_mqa.weight" in sd:  # DeepSeek-V3's latent attention: no k_proj
        settle("num_kv_heads", H, "latent attention gives every head its own k and v")
    else:
        _settle_kv_heads(sd, cfg, origin, settle, C, H)
    gate = sd.get("model.layers.0.mlp.gate_proj.weight")
    if gate is not None:
        settle("intermediate_size", int(gate.shape[0]), "gate_proj rows")
    else:
        model["intermediate_size"] = need("intermediate_size")
    model["max_seq_len"] = cfg.get("max_seq_len", args.seq_len)  # llama's math does not depend on it
    prov.setdefault("max_seq_len", ("flag", "--seq-len (llama's math does not depend on it)"))
    model["norm_eps"] = need("norm_eps")
    model["rope_theta"] = need("rope_theta")
    head = sd.get("lm_head.weight")
    aliased = head is None or (head.shape == embed.shape and head.data_ptr() == embed.data_ptr())
    equal = head is not None and head.shape == embed.shape and torch.equal(head, embed)
    said = cfg.get("tie_embeddings")
    if said is False and head is None:
        raise BadInput(*origin["tie_embeddings"], "says the head is separate, but the checkpoint has no output head")
    if said is True and not (aliased or equal):
        raise BadInput(*origin["tie_embeddings"], "says the head is the embedding, but the checkpoint's output head "
                                                  "differs from it")
    if said is None and equal and not aliased:
        raise BadInput(src, "tie_embeddings", "the output head equals the embedding but is a separate tensor, so the "
                                              "checkpoint cannot say whether they are one parameter (tied) or two that "
                                              "AdamW updates apart; pass --tie-embeddings true or false")
    model["tie_embeddings"] = bool(said if said is not None else aliased)
    if said is None:
        prov["tie_embeddings"] = ("tensors", "the checkpoint's head " + ("is the embedding" if head is not None else
                                                                         "is absent: the embedding serves") if aliased
                                  else "the checkpoint's head is a separate tensor")


_ACTIVATION_KEYS = ("hidden_act", "hidden_activation", "activation", "activation_function", "act_fn")
_LLAMA_ACTIVATIONS = ("silu", "swish", "swiglu")
_GPT2_ACTIVATIONS = ("gelu_tanh", "gelu_new", "gelu_pytorch_tanh")


def settle_activation(arch, naming, configs, args):
    """(the activation bundle v1 computes, provenance): llama's SwiGLU (silu) and gpt2's tanh-GELU are
    its only ones, so a flag or config naming another is bad input, and where none says, the naming's
    convention is recorded (for nanoGPT as a default: its nn.GELU() is the erf form)."""
    ok = _LLAMA_ACTIVATIONS if arch == "llama" else _GPT2_ACTIVATIONS
    value = "silu" if arch == "llama" else "gelu_tanh"
    if args.activation is not None:
        if args.activation not in ok:
            raise BadInput("command line", "--activation", f"{args.activation!r}: bundle v1's {arch} computes {value} only")
        return value, ("flag", "--activation")
    for raw, where in configs:
        for key in _ACTIVATION_KEYS:
            said = raw.get(key)
            if isinstance(said, str):
                if arch == "llama" and said == "gelu_pytorch_tanh":  # model.hidden_act (Gemma's GeGLU)
                    return said, (_kind_of(where, args), f"{where}: {key}")
                if said.lower() not in ok:
                    raise BadInput(where, key, f"{said!r}: bundle v1's {arch} computes {value} only")
                return value, (_kind_of(where, args), f"{where}: {key}")
    if arch == "llama":
        return value, ("naming", f"{naming} naming: a llama's SwiGLU MLP (silu)")
    return value, ("default", "bundle v1's gpt2 computes GELU's tanh form; nanoGPT's nn.GELU() is the erf form, so "
                              "the replay differs a little (pass --activation gelu_tanh if the run used the tanh form)")


# The llama option keys this importer settles: model_options() those of the capture helper's
# LLAMA_OPTION_DEFAULTS, _moe_config() "moe". tests/test_arch_model_options.cpp checks them against
# nanreplay's option table (loaders/arch/llama_options.cpp).
# latent_attention: settled from a DeepSeek-V3 config (families.latent_attention); mtp: from --mtp-loss-scale and
# the checkpoint's multi-token prediction layers (families.mtp_section).
LLAMA_OPTION_KEYS = (*_capture.LLAMA_OPTION_DEFAULTS, "moe", "latent_attention", "mtp")


def model_options(naming, configs, model, args):
    """llama's model options: the rotary convention (--rope-style, else the config, else the naming's),
    and what a Hugging Face style config says (through the capture helper's own reading of transformers
    configs). Returns (options, provenance {key: (kind, detail)})."""
    if model["arch"] != "llama":
        return {}, {}
    opts, notes = {}, {}
    if naming in ("meta", "torchtitan"):
        opts["rope_style"], notes["rope_style"] = "interleaved", ("naming", f"{naming} naming: rotary over adjacent "
                                                                            "pairs, weights as stored")
    else:
        notes["rope_style"] = ("naming", f"{naming} naming: rotary over halves (rotate_half)")
    for raw, where in configs:
        kind = _kind_of(where, args)
        if isinstance(raw.get("rotary_interleaved"), bool) and naming not in ("meta", "torchtitan"):
            style = "interleaved" if raw["rotary_interleaved"] else "rotate_half"
            if style == "interleaved":
                opts["rope_style"] = style
            notes["rope_style"] = (kind, f"{where}: rotary_interleaved")
        for key, ok in (("normalization", "RMSNorm"), ("position_embedding_type", "rope")):
            if key in raw and raw[key] != ok:
                raise BadInput(where, key, f"{raw[key]!r}: bundle v1's llama needs {ok!r}")
        if raw.get("swiglu") is False:
            raise BadInput(where, "swiglu", "false: bundle v1's llama has a SwiGLU MLP")
        if raw.get("qk_layernorm") is True:
            raise BadInput(where, "qk_layernorm", "Megatron's QK layernorm: give qk_norm ('head' or 'full') in --config")
        if raw.get("add_qkv_bias") is True or raw.get("add_bias_linear") is True:
            if raw.get("add_bias_linear") is True:
                raise BadInput(where, "add_bias_linear", "biases on every linear are not bundle v1's llama")
            opts["attention_bias"], notes["attention_bias"] = True, (kind, f"{where}: add_qkv_bias")
        for key in _capture.LLAMA_OPTION_DEFAULTS if "model_type" not in raw else ():  # manifest-style --config
            if key in raw and raw[key] is not None and key not in opts:
                try:
                    value = _capture._option_value(key, raw[key], key)
                except _capture.CaptureError as e:
                    raise BadInput(where, key, str(e))
                if value != _capture.LLAMA_OPTION_DEFAULTS[key]:
                    opts[key], notes[key] = value, (kind, f"{where}: {key}")
        if "model_type" in raw:
            if raw.get("model_type") in families.LLAMA4_TYPES:  # chunked layer_types: families.llama4_options
                raw = families.llama4_config_without_layer_types(raw)
            try:
                said = _capture._options_from_config(raw, model["num_layers"])
            except _capture.CaptureError as e:
                raise BadInput(where, "config", str(e))
            for key, (value, why) in said.items():
                if key == "rope_style" and naming in ("meta", "torchtitan"):
                    continue  # a Meta-layout checkpoint next to an HF config: the weights decide
                if value != _capture.LLAMA_OPTION_DEFAULTS[key] and key not in opts:
                    opts[key], notes[key] = value, (kind, f"{where}: {why.replace('model.config', 'config')}")
    _family_options(configs, model, opts, notes, args)
    if "attention_mask" not in opts and not any("attention_mask" in raw for raw, _ in configs):
        mask, why = _mask_convention(naming)
        if mask != "exclude":  # exclude is the bundle's default: nothing to write or note
            opts["attention_mask"], notes["attention_mask"] = mask, ("naming", why)
    if args.rope_style is not None:
        if args.rope_style == "interleaved":
            opts["rope_style"] = "interleaved"
        else:
            opts.pop("rope_style", None)
        notes["rope_style"] = ("flag", "--rope-style" + (f" (overrides {notes['rope_style'][1]})"
                                                         if notes.get("rope_style") else ""))
    return opts, notes


def _family_options(configs, model, opts, notes, args):
    """GPT-OSS's attention options its config.json leaves implicit, Llama 4's (families.llama4_options),
    and DeepSeek-V3's rotary style; its
    head_dim (the rotary width, qk_rope_head_dim) is latent attention's, not a head width of llama's."""
    for key, (value, kind, detail) in families.gpt_oss_options(configs, model["num_layers"]).items():
        if value == _capture.LLAMA_OPTION_DEFAULTS[key]:
            opts.pop(key, None)  # the bundle's default: not written
        elif key not in opts or kind != "default":
            opts[key], notes[key] = value, (_kind_of(detail.split(": ")[0], args) if kind == "checkpoint" else kind,
                                            detail)
    for key, (value, kind, detail) in families.llama4_options(configs, model["num_layers"]).items():
        if notes.get(key, ("",))[0] in ("config", "flag"):
            continue  # the user's --config or flag said it
        if value == _capture.LLAMA_OPTION_DEFAULTS[key]:
            opts.pop(key, None)
        else:
            opts[key] = value
        notes[key] = (_kind_of(detail.split(": ")[0], args) if kind == "checkpoint" else kind, detail)
    if families.latent_config(configs)[0] is not None:
        opts.pop("head_dim", None)
        notes.pop("head_dim", None)
        style, detail = families.latent_rope_style(configs)
        if style == "interleaved":
            opts["rope_style"] = style
        else:
            opts.pop("rope_style", None)
        notes["rope_style"] = (_kind_of(detail.split(": ")[0], args) if detail.endswith("rope_interleave")
                               else "default", detail)


def _mask_convention(naming):
    """(model.attention_mask, why) a checkpoint's naming implies where no config says: how its framework's
    eager attention masks the scores. They differ only where a masked score is not finite (docs/import.md)."""
    if naming == "meta":
        return "additive_neg_inf", ("meta naming: llama2.c's and Meta's reference attention add a -inf mask to the "
                                    "scores (a run through a fused causal kernel excludes instead: give "
                                    "attention_mask 'exclude' in --config)")
    if naming == "hf":
        return "additive_finfo_min", ("hf naming: Hugging Face's eager attention adds finfo.min at masked keys (a run "
                                      "with sdpa or flash attention on a GPU excludes instead: give attention_mask "
                                      "'exclude' in --config)")
    return "exclude", f"{naming} naming: its fused causal attention leaves masked keys out"


def expected_parameters(model):
    """[(key, shape)] bundle v1 needs, with model.moe's expert parameters in place of the dense MLP
    (the capture helper's list: nanreplay_capture.expected_parameters), GPT-OSS's router and expert
    biases and DeepSeek-V3's latent attention added (families.adjust_parameters)."""
    return families.adjust_parameters(_capture.expected_parameters(model["arch"], model), model)


def check_parameters(sd, model, where):
    spec = expected_parameters(model)
    names = {k for k, _ in spec}
    missing, wrong = [], []
    for key, shape in spec:
        t = sd.get(key)
        if t is None:
            missing.append(key)
        elif tuple(t.shape) != tuple(shape):
            wrong.append(f"{key} is {list(t.shape)}, bundle v1 needs {list(shape)}")
    if missing:
        unused = [k for k in sd if k not in names and not (k == "lm_head.weight" and model.get("tie_embeddings"))]
        raise BadInput(where, missing[0], f"missing (bundle v1's {model['arch']} needs it{_why(missing[0])}); "
                                          f"all {len(missing)} missing: {group_names(missing)}; the checkpoint's own "
                                          f"names left over (after the naming preset): "
                                          + (group_names(unused) if unused else "none"))
    if wrong:
        raise BadInput(where, wrong[0].split(" ")[0], wrong[0].split(" ", 1)[1])
    extra = sorted(k for k in sd if k not in names and not (k == "lm_head.weight" and model.get("tie_embeddings")))
    if extra:
        raise BadInput(where, extra[0], "not a parameter of the bundle's model" + _extra_hint(extra[0])
                       + (f" ({len(extra) - 1} more)" if len(extra) > 1 else ""))
    for key, _ in spec:
        if sd[key].dtype not in _FLOAT_TYPES:
            if sd[key].dtype == torch.float64:
                sd[key] = sd[key].float()
            else:
                raise BadInput(where, key, f"is {sd[key].dtype}; bundle v1 stores F32, BF16 or F16")
    return [(k, sd[k].contiguous()) for k, _ in spec]


def _why(key):
    if key.endswith("_proj.bias"):
        return ", with attention_bias"
    if "_norm." in key:
        return ", with qk_norm"
    return ""


def _extra_hint(key):
    if key.endswith("_proj.bias") and "self_attn" in key:
        return ": q/k/v biases need attention_bias (config model_type qwen2, or attention_bias: true in --config)"
    if re.search(r"self_attn\.[qk]_norm", key):
        return ": QK-norm weights need qk_norm ('head' or 'full') in --config"
    if _HF_MOE.fullmatch(key):
        return ": expert weights need the config's num_experts / num_experts_per_tok"
    return ""
