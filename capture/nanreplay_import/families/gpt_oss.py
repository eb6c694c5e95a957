"""GPT-OSS (GptOssForCausalLM in transformers' modeling_gpt_oss.py): its experts' clamped SwiGLU, its router,
and the attention options its config.json leaves implicit."""

from .common import config_of, positive_number
from .llama4 import LLAMA4_TYPES, llama4_moe

# GptOssConfig's defaults, where a config leaves a key out; swiglu_alpha is modeling_gpt_oss.py's constant.
_GPT_OSS_DEFAULTS = {"attention_bias": True, "sliding_window": 128, "swiglu_limit": 7.0, "swiglu_alpha": 1.702}
_GPT_OSS_MOE = {"router": "top_k_softmax", "router_bias": True, "expert_bias": True, "fused_gate_up": True,
                "expert_activation": "gpt_oss"}


def gpt_oss_moe(configs, moe):
    """model.moe's GPT-OSS keys over the Hugging Face MoE reading `moe` (expert count, top_k, aux loss),
    and {provenance key: (kind, detail, value)}. None, {} for another model type."""
    if config_of(configs, LLAMA4_TYPES)[0] is not None:
        return llama4_moe(configs, moe)
    raw, where = config_of(configs, ("gpt_oss",))
    if raw is None or moe is None:
        return moe, {}
    limit, limit_why = positive_number(raw, where, "swiglu_limit", _GPT_OSS_DEFAULTS["swiglu_limit"],
                                       "GptOssConfig's default swiglu_limit (7.0), which the config leaves out")
    alpha, alpha_why = positive_number(raw, where, "swiglu_alpha", _GPT_OSS_DEFAULTS["swiglu_alpha"],
                                       "modeling_gpt_oss.py: GptOssExperts fixes alpha = 1.702 (no config key)")
    moe = dict(moe, **_GPT_OSS_MOE, swiglu_alpha=alpha, swiglu_limit=limit)
    notes = {"moe.swiglu_limit": ("checkpoint" if limit_why.startswith(where) else "default", limit_why, limit),
             "moe.swiglu_alpha": ("checkpoint" if alpha_why.startswith(where) else "naming", alpha_why, alpha),
             "moe.router_aux_loss_coef": aux_loss_note(raw, where, moe)}
    return moe, notes


def aux_loss_note(raw, where, moe):
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
    raw, where = config_of(configs, ("gpt_oss",))
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
