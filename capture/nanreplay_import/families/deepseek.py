"""DeepSeek-V3 and Kimi K2 (DeepseekV3ForCausalLM in transformers' modeling_deepseek_v3.py): latent
attention, the sigmoid grouped router and its correction bias, carried to state.json."""

import math
import re

import torch

from ..outcome import BadInput
from .common import config_of

LATENT_TYPES = ("deepseek_v3", "kimi_k2")  # Kimi K2 runs DeepseekV3ForCausalLM's code
LATENT_KEYS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
# DeepseekV3Attention builds q_a_layernorm and kv_a_layernorm as DeepseekV3RMSNorm(width): its default eps.
LATENT_NORM_EPS = 1e-6
# DeepseekV3Config's defaults for the keys that decide which layers are MoE.
_DEEPSEEK_MOE_DEFAULTS = {"first_k_dense_replace": 3, "n_routed_experts": 256}


def latent_config(configs):
    """(config, where) of a DeepSeek-V3 / Kimi K2 config, or (None, None)."""
    return config_of(configs, LATENT_TYPES)


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


# DeepseekV3Config's defaults (configuration_deepseek_v3.py) for the keys DeepseekV3MoE and
# DeepseekV3TopkRouter read.
_DEEPSEEK_ROUTER_DEFAULTS = {"num_experts_per_tok": 8, "moe_intermediate_size": 2048, "n_shared_experts": 1,
                             "n_group": 8, "topk_group": 4, "norm_topk_prob": True, "routed_scaling_factor": 2.5}
SCORE_BIAS = re.compile(r"model\.layers\.(\d+)\.mlp\.gate\.e_score_correction_bias")


def _deepseek_value(raw, where, key, check):
    """(value, kind, detail): the config's `key`, else DeepseekV3Config's default (said as one), checked by
    `check` (a refusal's words, or None when fine)."""
    defaults = dict(_DEEPSEEK_MOE_DEFAULTS, **_DEEPSEEK_ROUTER_DEFAULTS)
    if key in raw and raw[key] is not None:
        bad = check(raw[key])
        if bad:
            raise BadInput(where, key, f"{bad}, got {raw[key]!r}")
        return raw[key], "checkpoint", f"{where}: {key}"
    bad = check(defaults[key])  # a default is checked as the config's own value would be
    if bad:
        raise BadInput(where, key, f"{bad}, got DeepseekV3Config's default {defaults[key]!r} (the config leaves it out)")
    return defaults[key], "default", f"DeepseekV3Config's default {key} ({defaults[key]}), which the config leaves out"


def _int_check(low):
    return lambda v: None if isinstance(v, int) and not isinstance(v, bool) and v >= low else \
        f"must be an integer >= {low}"


def deepseek_moe(configs, num_layers):
    """model.moe of a DeepSeek-V3 / Kimi K2 config (DeepseekV3MoE: DeepseekV3TopkRouter's sigmoid scores,
    grouped choice with e_score_correction_bias, routed_scaling_factor; shared_experts one DeepseekV3MLP of
    moe_intermediate_size * n_shared_experts) and {provenance key: (kind, detail, value)}; (None, {}) for
    another model type or a config whose layers are all dense (first_k_dense_replace >= num_hidden_layers, or
    n_routed_experts 0 or null). Hugging Face's rule: layer_idx >= first_k_dense_replace is MoE."""
    raw, where = latent_config(configs)
    if raw is None or ("n_routed_experts" in raw and raw["n_routed_experts"] in (0, None)):
        return None, {}  # n_routed_experts 0 or null: every layer dense
    dense, dense_kind, dense_detail = _deepseek_value(raw, where, "first_k_dense_replace", _int_check(0))
    routed, e_kind, e_detail = _deepseek_value(raw, where, "n_routed_experts", _int_check(1))
    if dense >= num_layers:
        return None, {}
    freq = raw.get("moe_layer_freq", 1)
    if freq != 1:
        raise BadInput(where, "moe_layer_freq", f"{freq!r}: Hugging Face's DeepseekV3DecoderLayer puts experts on "
                                                "every layer from first_k_dense_replace (it ignores moe_layer_freq), "
                                                "DeepSeek's own modeling_deepseek.py only on layer_idx % "
                                                "moe_layer_freq == 0; which one the run used is not guessed")
    for key, ok in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
        if raw.get(key) not in (None, ok):
            raise BadInput(where, key, f"{raw[key]!r}: DeepseekV3TopkRouter always routes by {ok!r} "
                                       "(sigmoid scores, grouped choice with e_score_correction_bias)")
    top_k, k_kind, k_detail = _deepseek_value(raw, where, "num_experts_per_tok", _int_check(1))
    width, w_kind, w_detail = _deepseek_value(raw, where, "moe_intermediate_size", _int_check(1))
    shared_n, s_kind, s_detail = _deepseek_value(raw, where, "n_shared_experts", _int_check(1))
    n_group, g_kind, g_detail = _deepseek_value(
        raw, where, "n_group", lambda v: _int_check(1)(v) or (None if routed % v == 0 and routed // v >= 2 else
                                                               f"must divide n_routed_experts {routed} into groups of "
                                                               "at least 2 (each group is scored by its top 2)"))
    topk_group, t_kind, t_detail = _deepseek_value(
        raw, where, "topk_group", lambda v: _int_check(1)(v) or (None if v <= n_group else
                                                                  f"must be at most n_group {n_group}"))
    if top_k > topk_group * (routed // n_group):
        raise BadInput(where, "num_experts_per_tok", f"{top_k} exceeds the {topk_group * (routed // n_group)} experts "
                                                     f"of the topk_group {topk_group} groups it chooses among")
    norm, n_kind, n_detail = _deepseek_value(raw, where, "norm_topk_prob",
                                             lambda v: None if isinstance(v, bool) else "must be true or false")
    scale, f_kind, f_detail = _deepseek_value(
        raw, where, "routed_scaling_factor", lambda v: None if isinstance(v, (int, float)) and not isinstance(v, bool)
        and math.isfinite(v) and v > 0 else "must be a finite number > 0")
    layers = list(range(dense, num_layers))
    moe = {"num_experts": routed, "top_k": top_k, "intermediate_size": width, "router": "sigmoid_grouped",
           "n_group": n_group, "topk_group": topk_group, "norm_topk_prob": norm,
           "routed_scaling_factor": float(scale), "router_score_bias": True,
           "shared_expert_intermediate_size": width * shared_n, "layers": layers, "router_aux_loss_coef": 0.0}
    notes = {"moe.layers": (dense_kind, f"{dense_detail}: DeepseekV3DecoderLayer's layer_idx >= "
                                        "first_k_dense_replace hold DeepseekV3MoE", layers),
             "moe.num_experts": (e_kind, e_detail, routed), "moe.top_k": (k_kind, k_detail, top_k),
             "moe.intermediate_size": (w_kind, w_detail + " (the experts' width; dense layers: intermediate_size)",
                                       width),
             "moe.shared_expert_intermediate_size": (s_kind, f"{s_detail}: DeepseekV3MoE's shared_experts is one "
                                                             "DeepseekV3MLP of moe_intermediate_size * "
                                                             "n_shared_experts", width * shared_n),
             "moe.n_group": (g_kind, g_detail, n_group), "moe.topk_group": (t_kind, t_detail, topk_group),
             "moe.norm_topk_prob": (n_kind, n_detail, norm),
             "moe.routed_scaling_factor": (f_kind, f_detail, float(scale)),
             "moe.router": ("naming", "modeling_deepseek_v3.py: DeepseekV3TopkRouter, sigmoid scores, experts chosen "
                                      "within the topk_group best of n_group groups by the scores plus "
                                      "e_score_correction_bias (each step's state.json router_score_bias)",
                            "sigmoid_grouped"),
             "moe.router_aux_loss_coef": ("naming", "DeepseekV3ForCausalLM adds no router loss (" + where +
                                                    f": aux_loss_alpha {raw.get('aux_loss_alpha')!r} unused)", 0.0)}
    return moe, notes


def take_score_bias(sd, moe, where):
    """(state dict without them, {state.json router_score_bias key: [E numbers]}): each MoE layer's
    mlp.gate.e_score_correction_bias, a buffer DeepseekV3TopkRouter reads and no optimizer updates, taken
    out of the parameters for the imported step's state.json. A missing one, one on a dense layer or one
    of another length than num_experts is refused by its name."""
    if not moe or moe.get("router") != "sigmoid_grouped":
        return sd, {}
    biases, kept = {}, {}
    for key, t in sd.items():
        m = SCORE_BIAS.fullmatch(key)
        if m is None:
            kept[key] = t
            continue
        if int(m.group(1)) not in moe["layers"]:
            raise BadInput(where, key, f"layer {m.group(1)} is dense (first_k_dense_replace): it has no router")
        if tuple(t.shape) != (moe["num_experts"],) or not t.is_floating_point():
            raise BadInput(where, key, f"is {list(t.shape)} {t.dtype}: the router's correction bias holds one number "
                                       f"per routed expert ({moe['num_experts']}, n_routed_experts)")
        values = t.double()
        if not bool(torch.isfinite(values).all()):
            raise BadInput(where, key, "holds a value that is not finite")
        biases[key] = values.tolist()
    for i in moe["layers"]:
        key = f"model.layers.{i}.mlp.gate.e_score_correction_bias"
        if key not in biases:
            raise BadInput(where, key, "missing: DeepseekV3TopkRouter's correction bias chooses the experts; the "
                                       "checkpoint must carry it (save_pretrained writes the buffer)")
    return kept, biases
