"""The parameters the family options add to the capture helper's list, in docs/bundle-format.md's order:
routers' and experts' biases, dense layers between MoE ones, shared experts, latent attention's projections."""

import re

from .deepseek import LATENT_KEYS

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
