"""DeepSeek-V3's multi-token prediction layers past its decoder (Megatron-LM's MultiTokenPredictionLayer, by
DeepSeek-V3's Hugging Face names): taken out of the decoder's state dict, checked, and kept or left out as
--mtp-loss-scale says."""

import re

import torch

from ..outcome import BadInput
from .deepseek import take_score_bias

# A multi-token prediction layer's own parameters (DeepSeek-V3's MTP module beside its decoder block).
_MTP_PARAM = re.compile(r"model\.layers\.(\d+)\.(?:eh_proj|enorm|hnorm|shared_head|embed_tokens)\b.*")
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
