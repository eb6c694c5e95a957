"""Hugging Face model types whose checkpoints need more than llama's reading: GPT-OSS's experts and
attention, DeepSeek-V3's (and Kimi K2's) latent attention and MoE layers (its router's correction bias
carried to state.json), and the multi-token prediction layers a DeepSeek-V3 checkpoint carries past its
decoder. Each value settled here comes with where it came from: the config's key, or the modeling code
that fixes it."""

import math
import re

import torch

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
    if _config_of(configs, LLAMA4_TYPES)[0] is not None:
        return llama4_moe(configs, moe)
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


MTP_FLAG = "--mtp-loss-scale"
# Megatron-LM's MultiTokenPredictionLayer parameters beside its block, by DeepSeek-V3's Hugging Face names
# (param_table.h's MtpPart, in the bundle's order: enorm, hnorm, eh_proj, the block, shared_head.norm).
_MTP_OWN_BEFORE = ("enorm.weight", "hnorm.weight", "eh_proj.weight")
_MTP_OWN_AFTER = ("shared_head.norm.weight",)
# The checkpoint's per-depth copies of what Megatron-LM shares with the model (GPTModel hands the MTP block
# its embedding and output layer): checked equal to the model's own, then left out of the bundle.
_MTP_SHARED = {"embed_tokens.weight": "model.embed_tokens.weight", "shared_head.head.weight": "lm_head.weight"}


def split_mtp_layers(sd, configs, loss_scale):
    """(decoder's state dict, MTP layers' {key: tensor}, MTP layer indices, a line to print or None): DeepSeek-V3's
    multi-token prediction layers (model.layers.{num_hidden_layers + k - 1} with eh_proj, enorm, hnorm, shared_head
    beside a decoder block) taken out. Whether the run's loss included them is the user's to say (--mtp-loss-scale):
    Hugging Face's DeepseekV3ForCausalLM never computes them, Megatron-LM adds them when mtp_num_layers is set."""
    layers = sorted({int(m.group(1)) for k in sd for m in [_MTP_PARAM.fullmatch(k)] if m})
    if not layers:
        if loss_scale:
            raise BadInput("command line", MTP_FLAG, f"{loss_scale} given, but the checkpoint holds no multi-token "
                                                     "prediction layers (model.layers.N.eh_proj/enorm/hnorm)")
        return sd, {}, [], None
    raw, where = next(((raw, w) for raw, w in configs if "num_hidden_layers" in raw), ({}, "config"))
    decoder = raw.get("num_hidden_layers")
    if not isinstance(decoder, int) or min(layers) < decoder:
        raise BadInput(where, "num_hidden_layers", f"{decoder!r}, but model.layers.{min(layers)} holds a multi-token "
                                                   "prediction layer's eh_proj/enorm/hnorm: it must come after the "
                                                   "decoder's layers")
    named = f"model.layers.{{{','.join(map(str, layers))}}}"
    said = raw.get("num_nextn_predict_layers")
    if loss_scale is None:
        raise BadInput("command line", MTP_FLAG, f"required: the checkpoint holds multi-token prediction layers {named} "
                                                 f"({where}: num_nextn_predict_layers {said}); say whether the run's loss "
                                                 f"included them: {MTP_FLAG} F replays them with the run's "
                                                 f"mtp_loss_scaling_factor F (Megatron-LM's default is 0.1), "
                                                 f"{MTP_FLAG} 0 leaves them out")
    if layers != list(range(decoder, decoder + len(layers))):
        raise BadInput(where, "num_hidden_layers", f"{decoder}: the multi-token prediction layers {named} must follow "
                                                   "it one after another")
    prefixes = tuple(f"model.layers.{i}." for i in layers)
    kept = {k: v for k, v in sd.items() if not k.startswith(prefixes)}
    mtp = {k: v for k, v in sd.items() if k.startswith(prefixes)}
    if loss_scale == 0:
        return kept, mtp, layers, (f"multi-token prediction: {named} ({len(mtp)} tensors; {where}: "
                                   f"num_nextn_predict_layers {said}) left out of the replayed loss ({MTP_FLAG} 0)")
    return kept, mtp, layers, (f"multi-token prediction: {named} ({len(mtp)} tensors; {where}: num_nextn_predict_layers "
                               f"{said}) replayed in the loss, mtp_loss_scaling_factor {loss_scale} ({MTP_FLAG})")


def mtp_experts(mtp, layers, model, where):
    """(the MTP tensors without their correction biases, {state.json router_score_bias key: [E numbers]}, the MTP
    layers with experts): DeepSeek-V3's released MTP layer is a mixture of experts like its decoder layers past
    first_k_dense_replace (mlp.gate, mlp.experts.*, mlp.shared_experts). Those the checkpoint holds experts for
    join model.moe.layers, so the bundle's parameter list and the replay give their blocks the decoder's experts,
    and their e_score_correction_bias goes to state.json as the decoder layers' does (take_score_bias)."""
    with_experts = [layer for layer in layers
                    if any(k.startswith((f"model.layers.{layer}.mlp.gate.", f"model.layers.{layer}.mlp.experts."))
                           for k in mtp)]
    if not with_experts:
        return mtp, {}, []
    moe = model.get("moe")
    if not moe:
        first = next(k for k in sorted(mtp) if ".mlp.gate." in k or ".mlp.experts." in k)
        raise BadInput(where, first, "a multi-token prediction block with experts in a model whose decoder has none: "
                                     "its routing (n_routed_experts, num_experts_per_tok ...) is not known")
    moe["layers"] = sorted(set(moe.get("layers", range(model["num_layers"]))) | set(with_experts))
    kept, biases = take_score_bias(mtp, dict(moe, layers=with_experts), where)
    return kept, biases, with_experts


def mtp_section(mtp, layers, loss_scale, model, decoder_sd, block_spec, where):
    """(model.mtp or None, the MTP parameters [(key, tensor)] in the bundle's order, (kind, detail, value) for the
    provenance). `block_spec`: expected_parameters of the model counting the MTP blocks as layers; `decoder_sd`
    the decoder's tensors, for the shared copies' check. With loss_scale 0 nothing is kept: the provenance says
    the layers were left out, which the report repeats beside a replay that does not reproduce the run."""
    named = f"model.layers.{{{','.join(map(str, layers))}}}"
    if not loss_scale:
        return None, [], ("flag", f"{MTP_FLAG} 0: the checkpoint's multi-token prediction layers {named} were left "
                                  "out of the replayed loss", layers[:16])
    if model["arch"] != "llama":
        raise BadInput(where, named, "multi-token prediction is replayed for llama-family models only")
    shared_head = decoder_sd.get("lm_head.weight", decoder_sd.get("model.embed_tokens.weight"))
    params = []
    for layer in layers:
        prefix = f"model.layers.{layer}."
        for suffix, main_key in _MTP_SHARED.items():
            copy, main = mtp.get(prefix + suffix), (shared_head if suffix.startswith("shared_head")
                                                    else decoder_sd.get(main_key))
            if copy is not None and (main is None or copy.shape != main.shape or not torch.equal(copy, main)):
                raise BadInput(where, prefix + suffix, f"differs from the model's {main_key}: Megatron-LM shares the "
                                                       "embedding and output head with every MTP depth, and a depth "
                                                       "with its own is not replayed")
        own = [prefix + n for n in _MTP_OWN_BEFORE] + [k for k, _ in block_spec if k.startswith(prefix)] + \
              [prefix + n for n in _MTP_OWN_AFTER]
        for key in own:
            if key not in mtp:
                raise BadInput(where, key, "missing: a multi-token prediction layer holds enorm, hnorm, eh_proj, "
                                           "shared_head.norm and a decoder block")
        extra = sorted(k for k in mtp if k.startswith(prefix) and k not in own and k[len(prefix):] not in _MTP_SHARED)
        if extra:
            raise BadInput(where, extra[0], "not a parameter of a multi-token prediction layer as replayed")
        for key in own:
            t = mtp[key]
            want = [k_s for k_s in block_spec if k_s[0] == key]
            shape = tuple(want[0][1]) if want else ((model["hidden_size"], 2 * model["hidden_size"])
                                                    if key.endswith("eh_proj.weight") else (model["hidden_size"],))
            if tuple(t.shape) != shape:
                raise BadInput(where, key, f"is {list(t.shape)}, expected {list(shape)}")
            params.append((key, (t.float() if t.dtype == torch.float64 else t).contiguous()))
    mtp_model = {"num_layers": len(layers), "loss_scale": loss_scale}
    return mtp_model, params, ("flag", f"{MTP_FLAG} {loss_scale}: the checkpoint's multi-token prediction layers "
                                       f"{named} replayed in the loss (Megatron-LM's mtp_loss_scaling_factor)",
                               loss_scale)


# ---------------------------------------------------------------------------
# Llama 4 (Llama4ForCausalLM, and Llama4ForConditionalGeneration's language model, in transformers'
# modeling_llama4.py; Llama4TextConfig's defaults from configuration_llama4.py)

LLAMA4_TYPES = ("llama4_text", "llama4")
_LLAMA4_DEFAULTS = {"interleave_moe_layer_step": 1, "no_rope_layer_interval": 4, "use_qk_norm": True,
                    "attn_temperature_tuning": True, "floor_scale": 8192, "attn_scale": 0.1,
                    "attention_chunk_size": 8192}
# Llama4TextMoe as model.moe: Llama4Router's top-k of the logits, sigmoid over them (the others -inf, so 0),
# each expert's INPUT scaled by its score, gate_up_proj one matmul, the shared expert a Llama4TextMLP of
# intermediate_size (the experts' width) beside them; Llama4ForCausalLM adds no router loss.
_LLAMA4_MOE = {"router": "sigmoid_top_k", "scale_expert_input": True, "fused_gate_up": True}


def llama4_config(configs):
    """(config, where) of a Llama 4 text config (llama4_text, or the text_config of llama4), or (None, None)."""
    return _config_of(configs, LLAMA4_TYPES)


def _llama4_value(raw, where, key, why_default):
    """(value, kind, detail): the config's `key`, else Llama4TextConfig's default (said as one)."""
    if key in raw and raw[key] is not None:
        return raw[key], "checkpoint", f"{where}: {key}"
    value = _LLAMA4_DEFAULTS[key]
    return value, "default", f"Llama4TextConfig's default {key} ({value}), which the config leaves out{why_default}"


def _int_at_least(raw, where, key, value, low):
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise BadInput(where, key, f"must be an integer >= {low}, got {value!r}")
    return value


def llama4_moe_layers(raw, where):
    """(the layers holding experts, kind, detail): moe_layers, else Llama4TextConfig's
    range(interleave_moe_layer_step - 1, num_hidden_layers, interleave_moe_layer_step)."""
    layers_n = raw.get("num_hidden_layers")
    _int_at_least(raw, where, "num_hidden_layers", layers_n, 1)
    listed = raw.get("moe_layers")
    if listed is not None:
        if not isinstance(listed, list) or not listed:
            raise BadInput(where, "moe_layers", f"must be a non-empty list of layer indices, got {listed!r}")
        for i, layer in enumerate(listed):
            if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < layers_n or layer in listed[:i]:
                raise BadInput(where, f"moe_layers[{i}]", f"{layer!r}: must be a distinct layer index in "
                                                          f"[0, {layers_n}) (num_hidden_layers)")
        return sorted(listed), "checkpoint", f"{where}: moe_layers"
    step, kind, detail = _llama4_value(raw, where, "interleave_moe_layer_step", "")
    step = _int_at_least(raw, where, "interleave_moe_layer_step", step, 1)
    return (list(range(step - 1, layers_n, step)), kind,
            f"{detail} (Llama4TextConfig: every {step}th layer from layer {step - 1}, as moe_layers leaves unsaid)")


def llama4_moe(configs, moe):
    """model.moe of a Llama 4 config over the Hugging Face MoE reading `moe` (num_local_experts,
    num_experts_per_tok) and {provenance key: (kind, detail, value)}."""
    raw, where = llama4_config(configs)
    if moe is None:
        raise BadInput(where, "num_local_experts", f"{raw.get('num_local_experts')!r}: Llama 4's MoE layers need "
                                                   "their expert count")
    width = _int_at_least(raw, where, "intermediate_size", raw.get("intermediate_size"), 1)
    layers, kind, detail = llama4_moe_layers(raw, where)
    moe = {k: v for k, v in moe.items() if k not in ("router_aux_loss_coef", "norm_topk_prob")}
    moe.update(_LLAMA4_MOE, intermediate_size=width, shared_expert_intermediate_size=width, layers=layers)
    notes = {"moe.layers": (kind, detail, layers),
             "moe.intermediate_size": ("checkpoint", f"{where}: intermediate_size (the experts' and the shared "
                                                     "expert's width; dense layers: intermediate_size_mlp)", width),
             "moe.shared_expert_intermediate_size": ("naming", "modeling_llama4.py: Llama4TextMoe's shared_expert is "
                                                               "Llama4TextMLP(config), of intermediate_size", width),
             "moe.router": ("naming", "modeling_llama4.py: Llama4Router, sigmoid of the top-k logits, each expert's "
                                      "input scaled by its score (Llama4TextMoe)", "sigmoid_top_k"),
             "moe.router_aux_loss_coef": ("naming", f"Llama4ForCausalLM adds no router loss ({where}: "
                                                    f"router_aux_loss_coef {raw.get('router_aux_loss_coef')!r} "
                                                    "unused)", 0.0)}
    return moe, notes


def llama4_options(configs, num_layers):
    """Llama 4's attention options (Llama4TextAttention) from its config, where a Llama4TextConfig's
    defaults fill what the config leaves out: {option: (value, kind, detail)}; {} for another model type.
    A layer_types list other than Llama4TextConfig's own (chunked exactly where the layer is rotary) is
    written as model.layer_types; a kind other than chunked or full is refused."""
    raw, where = llama4_config(configs)
    if raw is None:
        return {}
    said = {"rope_style": ("interleaved", "naming", "modeling_llama4.py: apply_rotary_emb turns adjacent pairs "
                                                    "(q and k as complex numbers)")}
    if raw.get("attention_bias"):
        raise BadInput(where, "attention_bias", "true: Llama 4's attention has no biases in the replay")
    rope = raw.get("no_rope_layers")
    if rope:
        if not isinstance(rope, list) or len(rope) != num_layers or any(r not in (0, 1) or isinstance(r, bool)
                                                                        for r in rope):
            raise BadInput(where, "no_rope_layers", f"must be a list of {num_layers} entries 1 (rotary) or 0 (NoPE), "
                                                    f"got {rope!r}")
        said["no_rope_layers"] = (list(rope), "checkpoint", f"{where}: no_rope_layers (1: rotary, 0: NoPE)")
    else:
        every, kind, detail = _llama4_value(raw, where, "no_rope_layer_interval", "")
        every = _int_at_least(raw, where, "no_rope_layer_interval", every, 1)
        said["no_rope_layers"] = ([int((i + 1) % every != 0) for i in range(num_layers)], kind,
                                  f"{detail}: every {every}th layer NoPE (Llama4TextConfig's no_rope_layers)")
    norm, kind, detail = _llama4_value(raw, where, "use_qk_norm", "")
    if norm:
        said["qk_norm"] = ("l2", kind, f"{detail}: Llama4TextL2Norm on q and k of the rotary layers")
    tuning, kind, detail = _llama4_value(raw, where, "attn_temperature_tuning", "")
    if tuning and 0 in said["no_rope_layers"][0]:
        floor, floor_kind, floor_detail = _llama4_value(raw, where, "floor_scale", "")
        scale, scale_kind, scale_detail = _llama4_value(raw, where, "attn_scale", "")
        kinds = {kind, floor_kind, scale_kind}
        said["attn_temperature_tuning"] = ({"floor_scale": floor, "attn_scale": scale},
                                           "default" if "default" in kinds else "checkpoint",
                                           f"{detail}; {floor_detail}; {scale_detail}")
    chunk, kind, detail = _llama4_value(raw, where, "attention_chunk_size", "")
    if "attention_chunk_size" in raw and raw["attention_chunk_size"] is None:
        chunk, kind, detail = None, "checkpoint", f"{where}: attention_chunk_size (null: no chunks)"
    if chunk is not None:
        said["attention_chunk_size"] = (chunk, kind, f"{detail} (the rotary layers' chunks, Llama4TextConfig's "
                                                     "layer_types)")
    types = raw.get("layer_types")
    if types is not None:
        kinds = ("chunked_attention", "full_attention")
        if not isinstance(types, list) or len(types) != num_layers or any(t not in kinds for t in types):
            raise BadInput(where, "layer_types", f"{types!r}: Llama 4's layers are {' or '.join(kinds)}, one per "
                                                 f"layer ({num_layers})")
        default = ["chunked_attention" if r else "full_attention" for r in said["no_rope_layers"][0]]
        if "chunked_attention" in types and chunk is None:
            raise BadInput(where, "attention_chunk_size", "null, but layer_types has chunked_attention layers")
        if types != default and chunk is not None:  # the bundle's default chunks exactly the rotary layers
            said["layer_types"] = (list(types), "checkpoint", f"{where}: layer_types (not the rotary layers' "
                                                              "chunks Llama4TextConfig derives)")
    return said


def llama4_config_without_layer_types(raw):
    """A Llama 4 config for the generic reading (nanreplay_capture's), its layer_types (chunked_attention,
    which llama4_options checks) left out."""
    return {k: v for k, v in raw.items() if k != "layer_types"}


# ---------------------------------------------------------------------------
# The parameters these options add, in docs/bundle-format.md's order

_PROJ = re.compile(r"(model\.layers\.\d+\.)(?:self_attn\.([qkvo])_proj|mlp\.(gate)|mlp\.experts\.\d+\.\w+_proj)\.weight")


def adjust_parameters(spec, model):
    """[(key, shape)] of the capture helper's list with model.moe's router and expert biases and
    model.latent_attention's projections in place of q, k and v."""
    moe, latent = model.get("moe") or {}, model.get("latent_attention")
    spec = _expert_layers(spec, model, moe)
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


_LAYER_MLP = re.compile(r"model\.layers\.(\d+)\.mlp\.(?:gate\.weight|experts\.\d+\.\w+_proj\.weight)")


def _expert_layers(spec, model, moe):
    """The capture helper's list (every layer's MLP the experts) with model.moe.layers' dense layers given
    back their gate/up/down_proj (model.intermediate_size) and the shared expert
    (moe.shared_expert_intermediate_size) after each expert layer's experts (Llama 4)."""
    layers, shared = moe.get("layers"), moe.get("shared_expert_intermediate_size")
    if not layers and not shared:
        return spec
    C, ffn = model["hidden_size"], model["intermediate_size"]
    out = []
    for key, shape in spec:
        m = _LAYER_MLP.fullmatch(key)
        if m is None:
            out.append((key, shape))
            continue
        i, prefix = int(m.group(1)), f"model.layers.{m.group(1)}.mlp."
        if layers and i not in layers:
            if key == prefix + "gate.weight":
                out += [(prefix + "gate_proj.weight", (ffn, C)), (prefix + "up_proj.weight", (ffn, C)),
                        (prefix + "down_proj.weight", (C, ffn))]
            continue
        out.append((key, shape))
        if shared and key == f"{prefix}experts.{moe['num_experts'] - 1}.down_proj.weight":
            out += [(prefix + "shared_expert.gate_proj.weight", (shared, C)),
                    (prefix + "shared_expert.up_proj.weight", (shared, C)),
                    (prefix + "shared_expert.down_proj.weight", (C, shared))]
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
