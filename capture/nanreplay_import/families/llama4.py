"""Llama 4 (Llama4ForCausalLM, and Llama4ForConditionalGeneration's language model, in transformers'
modeling_llama4.py; Llama4TextConfig's defaults from configuration_llama4.py): its MoE layers and its
attention options."""

from ..outcome import BadInput
from .common import config_of

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
    return config_of(configs, LLAMA4_TYPES)


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
