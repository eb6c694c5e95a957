"""Hugging Face model types whose checkpoints need more than llama's reading: GPT-OSS's experts and
attention, DeepSeek-V3's (and Kimi K2's) latent attention with its dense layers, and the multi-token
prediction layers a DeepSeek-V3 checkpoint carries past its decoder. Each value settled here comes with
where it came from: the config's key, or the modeling code that fixes it."""

import math
import re

from .outcome import BadInput

LATENT_TYPES = ("deepseek_v3", "kimi_k2")  # Kimi K2 runs DeepseekV3ForCausalLM's code
LATENT_KEYS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
# DeepseekV3Attention builds q_a_layernorm and kv_a_layernorm as DeepseekV3RMSNorm(width): its default eps.
LATENT_NORM_EPS = 1e-6
# GptOssConfig's defaults, where a config leaves a key out; swiglu_alpha is modeling_gpt_oss.py's constant.
_GPT_OSS_DEFAULTS = {"attention_bias": True, "sliding_window": 128, "swiglu_limit": 7.0, "swiglu_alpha": 1.702}
_GPT_OSS_MOE = {"router": "top_k_softmax", "router_bias": True, "expert_bias": True, "fused_gate_up": True,
                "expert_activation": "gpt_oss"}
# DeepseekV3Config's defaults for the keys that decide which layers are MoE.
_DEEPSEEK_MOE_DEFAULTS = {"first_k_dense_replace": 3, "n_routed_experts": 256}
# A multi-token prediction layer's own parameters (DeepSeek-V3's MTP module beside its decoder block).
_MTP_PARAM = re.compile(r"model\.layers\.(\d+)\.(?:eh_proj|enorm|hnorm|shared_head|embed_tokens)\b.*")
_EXPERT_PARAM = re.compile(r"model\.layers\.\d+\.mlp\.(?:gate|experts|shared_experts)\..*")


def model_type_of(configs):
    return next((raw["model_type"] for raw, _ in configs if isinstance(raw.get("model_type"), str)), None)


def _config_of(configs, kinds):
    """(config dict, where) of the first config whose model_type is one of `kinds`, else (None, None)."""
    return next(((raw, w) for raw, w in configs if raw.get("model_type") in kinds), (None, None))


def _positive(raw, where, key, default, why):
    """(number > 0, provenance detail): the config's `key`, else `default` said to come from `why`."""
    value = raw.get(key)
    if value is None:
        return default, why
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise BadInput(where, key, f"must be a finite number > 0, got {value!r}")
    return float(value), f"{where}: {key}"


# ---------------------------------------------------------------------------
# GPT-OSS (GptOssForCausalLM in transformers' modeling_gpt_oss.py)

def gpt_oss_moe(configs, moe):
    """model.moe's GPT-OSS keys over the Hugging Face MoE reading `moe` (expert count, top_k, aux loss),
    and {provenance key: (kind, detail, value)}. None, {} for another model type."""
    raw, where = _config_of(configs, ("gpt_oss",))
    if raw is None or moe is None:
        return moe, {}
    limit, limit_why = _positive(raw, where, "swiglu_limit", _GPT_OSS_DEFAULTS["swiglu_limit"],
                                 "GptOssConfig's default swiglu_limit (7.0), which the config leaves out")
    alpha, alpha_why = _positive(raw, where, "swiglu_alpha", _GPT_OSS_DEFAULTS["swiglu_alpha"],
                                 "modeling_gpt_oss.py: GptOssExperts fixes alpha = 1.702 (no config key)")
    moe = dict(moe, **_GPT_OSS_MOE, swiglu_alpha=alpha, swiglu_limit=limit)
    notes = {"moe.swiglu_limit": ("checkpoint" if limit_why.startswith(where) else "default", limit_why, limit),
             "moe.swiglu_alpha": ("checkpoint" if alpha_why.startswith(where) else "naming", alpha_why, alpha),
             "moe.router_aux_loss_coef": _aux_loss_note(raw, where, moe)}
    return moe, notes


def _aux_loss_note(raw, where, moe):
    """Hugging Face adds the router's load-balancing loss only when output_router_logits is on."""
    coef = moe.get("router_aux_loss_coef", 0.0)
    if raw.get("output_router_logits"):
        return "checkpoint", f"{where}: router_aux_loss_coef, added because output_router_logits is true", coef
    return "checkpoint", (f"{where}: output_router_logits is {raw.get('output_router_logits', 'absent')!r}, so "
                          "Hugging Face adds no router aux loss (router_aux_loss_coef "
                          f"{raw.get('router_aux_loss_coef')!r} unused; a run that added it: set model.moe."
                          "router_aux_loss_coef in the manifest)"), coef


def gpt_oss_options(configs, layers):
    """GptOssAttention's options a config.json does not spell as llama's: sinks (always), o_proj's bias
    (the one attention_bias), layer_types and sliding_window where the config leaves them out. Returns
    {option: (value, kind, detail)}."""
    raw, where = _config_of(configs, ("gpt_oss",))
    if raw is None:
        return {}
    said = {"attention_sinks": (True, "naming", "model_type gpt_oss: GptOssAttention always has sinks")}
    for key in ("attention_bias", "sliding_window"):
        if key not in raw:
            said[key] = (_GPT_OSS_DEFAULTS[key], "default", f"GptOssConfig's default {key}, which the config leaves out")
    bias = raw.get("attention_bias", _GPT_OSS_DEFAULTS["attention_bias"])
    said["o_proj_bias"] = (bool(bias), "checkpoint" if "attention_bias" in raw else "default",
                           f"{where}: attention_bias (GptOssAttention biases o_proj with it too)")
    if "layer_types" not in raw:
        said["layer_types"] = (["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)],
                               "default", "GptOssConfig's default layer_types (sliding, full, alternating)")
    return said


# ---------------------------------------------------------------------------
# DeepSeek-V3 and Kimi K2 (DeepseekV3ForCausalLM in transformers' modeling_deepseek_v3.py)

def latent_config(configs):
    """(config, where) of a DeepSeek-V3 / Kimi K2 config, or (None, None)."""
    return _config_of(configs, LATENT_TYPES)


def latent_attention(configs, num_heads):
    """model.latent_attention from a DeepSeek-V3 config and {provenance key: (kind, detail, value)};
    (None, {}) for another model type. What DeepseekV3Attention has and the replay does not is refused
    by the config's key."""
    raw, where = latent_config(configs)
    if raw is None:
        return None, {}
    if raw.get("attention_bias"):
        raise BadInput(where, "attention_bias", "true: the replay's latent attention has no biases")
    kv = raw.get("num_key_value_heads")
    if kv is not None and kv != num_heads:
        raise BadInput(where, "num_key_value_heads", f"{kv} differs from num_attention_heads {num_heads}: latent "
                                                     "attention gives every head its own k and v")
    section, notes = {}, {}
    for key in LATENT_KEYS:
        value = raw.get(key, "missing")
        if key == "q_lora_rank" and value is None:  # a plain q_proj (DeepSeek-V2-Lite's layout)
            section[key] = None
        elif isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise BadInput(where, key, f"must be an integer >= 1{' or null' if key == 'q_lora_rank' else ''}, "
                                       f"got {value!r}")
        else:
            section[key] = value
        notes[f"latent_attention.{key}"] = ("checkpoint", f"{where}: {key}", section[key])
    section["norm_eps"] = LATENT_NORM_EPS
    notes["latent_attention.norm_eps"] = ("naming", "DeepseekV3Attention builds q_a_layernorm and kv_a_layernorm "
                                                    "with DeepseekV3RMSNorm's default eps 1e-6, whatever rms_norm_eps "
                                                    "says", LATENT_NORM_EPS)
    return section, notes


def latent_rope_style(configs):
    """(rope_style, detail): rope_interleave (DeepseekV3Config's default true) turns adjacent pairs."""
    raw, where = latent_config(configs)
    interleave = raw.get("rope_interleave", True)
    detail = f"{where}: rope_interleave" if "rope_interleave" in raw else \
        "DeepseekV3Config's default rope_interleave (true), which the config leaves out"
    return ("interleaved" if interleave else "rotate_half"), detail


def refuse_deepseek_moe(configs, sd, num_layers):
    """A DeepSeek-V3 checkpoint with MoE layers, refused by its config key and its first expert tensor:
    the sigmoid router grouped by n_group with e_score_correction_bias, the shared experts and
    routed_scaling_factor are not replayed yet (only its dense layers are)."""
    raw, where = latent_config(configs)
    if raw is None:
        return
    experts = sorted(k for k in sd if _EXPERT_PARAM.fullmatch(k))
    dense = raw.get("first_k_dense_replace", _DEEPSEEK_MOE_DEFAULTS["first_k_dense_replace"])
    routed = raw.get("n_routed_experts", _DEEPSEEK_MOE_DEFAULTS["n_routed_experts"])
    moe_layers = bool(routed) and isinstance(dense, int) and dense < num_layers
    if not moe_layers and not experts:
        return
    key = "first_k_dense_replace" if moe_layers else "n_routed_experts"
    said = f"first_k_dense_replace {dense} of num_hidden_layers {num_layers}, n_routed_experts {routed}"
    raise BadInput(where, key, f"{said}: DeepSeek-V3's MoE layers (a sigmoid router grouped by n_group with "
                               "e_score_correction_bias, shared experts, routed_scaling_factor) are not replayed "
                               "yet, only its dense layers; the checkpoint's first expert tensor: "
                               + (experts[0] if experts else "none"))


def drop_mtp_layers(sd, configs):
    """(state dict, a line to print or None): multi-token prediction layers (DeepSeek-V3's
    model.layers.{num_hidden_layers}... with eh_proj, enorm, hnorm, shared_head) left out: Hugging Face's
    DeepseekV3ForCausalLM neither builds nor computes them, so they take no part in the loss."""
    layers = {int(m.group(1)) for k in sd for m in [_MTP_PARAM.fullmatch(k)] if m}
    if not layers:
        return sd, None
    raw, where = next(((raw, w) for raw, w in configs if "num_hidden_layers" in raw), ({}, "config"))
    decoder = raw.get("num_hidden_layers")
    if not isinstance(decoder, int) or min(layers) < decoder:
        raise BadInput(where, "num_hidden_layers", f"{decoder!r}, but model.layers.{min(layers)} holds a multi-token "
                                                   "prediction layer's eh_proj/enorm/hnorm: it must come after the "
                                                   "decoder's layers")
    prefixes = tuple(f"model.layers.{i}." for i in sorted(layers))
    kept = {k: v for k, v in sd.items() if not k.startswith(prefixes)}
    said = raw.get("num_nextn_predict_layers")
    return kept, (f"multi-token prediction: model.layers.{{{','.join(map(str, sorted(layers)))}}} ({len(sd) - len(kept)} "
                  f"tensors; {where}: num_nextn_predict_layers {said}) left out of the replay: Hugging Face's "
                  "DeepseekV3ForCausalLM does not compute them in its loss")


# ---------------------------------------------------------------------------
# The parameters these options add, in docs/bundle-format.md's order

_PROJ = re.compile(r"(model\.layers\.\d+\.)(?:self_attn\.([qkvo])_proj|mlp\.(gate)|mlp\.experts\.\d+\.\w+_proj)\.weight")


def adjust_parameters(spec, model):
    """[(key, shape)] of the capture helper's list with model.moe's router and expert biases and
    model.latent_attention's projections in place of q, k and v."""
    moe, latent = model.get("moe") or {}, model.get("latent_attention")
    listed = {key for key, _ in spec}  # what the capture helper's list already has is not added twice
    out = []
    for key, shape in spec:
        m = _PROJ.fullmatch(key)
        if m is None:
            out.append((key, shape))
        elif latent and m.group(2):
            out += _latent_parameters(m.group(1), m.group(2), model, latent)
        else:
            out.append((key, shape))
            biased = moe.get("router_bias") if m.group(3) else moe.get("expert_bias") and not m.group(2)
            if biased and key[:-len("weight")] + "bias" not in listed:  # right after its weight (HF's module order)
                out.append((key[:-len("weight")] + "bias", (shape[0],)))
    return out


def _latent_parameters(prefix, proj, model, latent):
    """DeepseekV3Attention's parameters in the place of llama's q/k/v/o_proj weight `proj`."""
    C, H = model["hidden_size"], model["num_heads"]
    Q, L, N, R, Dv = (latent[k] for k in LATENT_KEYS)
    a = prefix + "self_attn."
    if proj == "q":
        if Q is None:
            return [(a + "q_proj.weight", (H * (N + R), C))]
        return [(a + "q_a_proj.weight", (Q, C)), (a + "q_a_layernorm.weight", (Q,)), (a + "q_b_proj.weight", (H * (N + R), Q))]
    if proj == "k":
        return [(a + "kv_a_proj_with_mqa.weight", (L + R, C)), (a + "kv_a_layernorm.weight", (L,)),
                (a + "kv_b_proj.weight", (H * (N + Dv), L))]
    if proj == "o":
        return [(a + "o_proj.weight", (C, H * Dv))]
    return []  # v: kv_b_proj holds it
