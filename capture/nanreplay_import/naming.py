"""Naming presets: the user's framework's parameter names onto bundle v1's (HF llama, Meta/torchtitan/
llama2.c, Megatron-core, DeepSeek's own, nanoGPT gpt2), and detecting which one a checkpoint uses."""

import re

import torch

import nanreplay_capture as _capture

from .outcome import BadInput

NAMINGS = ("auto", "hf", "meta", "torchtitan", "megatron", "deepseek", "nanogpt")


# Known non-parameter buffers, skipped by name: rotary caches (inv_freq, freqs_cis, HF's cos/sin caches),
# attention masks (llama2.c's attention.mask, nanoGPT's attn.bias, HF's causal_mask) and TE's _extra_state.
_IGNORED = re.compile(r"(.*\._extra_state|.*rotary_emb\.inv_freq|.*\.inv_freq|(?:.*\.)?freqs_cis|(?:.*\.)?freqs_cos|"
                      r"(?:.*\.)?freqs_sin|.*rotary_emb\.(?:cos|sin)_cached|(?:.*\.)?causal_mask|"
                      r".*\.attention\.mask|.*\.attn\.mask|"
                      r"rope\.freqs|.*\.attn\.bias|.*\.attn\.masked_bias|"
                      # a flat DCP state dict's other entries (no planner_data to nest them)
                      r"(?:optimizer|optim|rng_state|rerun_state_machine_state|lr_scheduler|train_state|dataloader)\..*)$")

_DETECT = [  # (naming, key regex): the first that matches any key of the state dict
    ("torchtitan", r"layers\.0\.attention\.qkv_linear\.wq\.weight"),
    ("meta", r"layers\.0\.attention\.wq\.weight"),
    ("megatron", r"decoder\.layers\.(0\.)?self_attention\.linear_qkv\.weight"),
    ("megatron", r"embedding\.word_embeddings\.weight"),
    ("deepseek", r"layers\.0\.attn\.wkv_a\.weight"),
    ("nanogpt", r"transformer\.wte\.weight"),
    ("hf", r"model\.embed_tokens\.weight"),
    ("meta", r"tok_embeddings\.weight"),
]

_META = _capture.META_NAMES  # meta / torchtitan / llama2.c: the capture helper's preset table

_MEGATRON = [  # Megatron-core (GPTModel with TransformerEngine's fused LayerNormLinear, or the plain layer spec)
    (r"embedding\.word_embeddings\.weight", "model.embed_tokens.weight"),
    (r"decoder\.layers\.(\d+)\.self_attention\.linear_qkv\.layer_norm_weight", "model.layers.{0}.input_layernorm.weight"),
    (r"decoder\.layers\.(\d+)\.input_layernorm\.weight", "model.layers.{0}.input_layernorm.weight"),
    (r"decoder\.layers\.(\d+)\.self_attention\.linear_qkv\.weight", "qkv:model.layers.{0}.self_attn.{{}}_proj.weight"),
    (r"decoder\.layers\.(\d+)\.self_attention\.linear_qkv\.bias", "qkv:model.layers.{0}.self_attn.{{}}_proj.bias"),
    (r"decoder\.layers\.(\d+)\.self_attention\.linear_proj\.weight", "model.layers.{0}.self_attn.o_proj.weight"),
    (r"decoder\.layers\.(\d+)\.self_attention\.q_layernorm\.weight", "model.layers.{0}.self_attn.q_norm.weight"),
    (r"decoder\.layers\.(\d+)\.self_attention\.k_layernorm\.weight", "model.layers.{0}.self_attn.k_norm.weight"),
    (r"decoder\.layers\.(\d+)\.mlp\.linear_fc1\.layer_norm_weight", "model.layers.{0}.post_attention_layernorm.weight"),
    (r"decoder\.layers\.(\d+)\.pre_mlp_layernorm\.weight", "model.layers.{0}.post_attention_layernorm.weight"),
    (r"decoder\.layers\.(\d+)\.mlp\.linear_fc1\.weight", "fc1:model.layers.{0}.mlp.{{}}_proj.weight"),
    (r"decoder\.layers\.(\d+)\.mlp\.linear_fc2\.weight", "model.layers.{0}.mlp.down_proj.weight"),
    (r"decoder\.final_layernorm\.weight", "model.norm.weight"),
    (r"output_layer\.weight", "lm_head.weight"),
    # Megatron's multi-latent attention and MoE (MLASelfAttention, MoELayer): refused by name ("!why").
    (r"decoder\.layers\.\d+\.self_attention\.(?:linear_q_down_proj|linear_q_up_proj|linear_kv_down_proj|"
     r"linear_kv_up_proj|linear_q_proj|kv_layernorm)\..*",
     "!Megatron's multi-latent attention: its args' latent widths and rotary (qk_head_dim, qk_pos_emb_head_dim, "
     "rotary_scaling_factor, mscale) are not read by this import; convert the checkpoint to Hugging Face's "
     "DeepSeek-V3 names (q_a_proj, kv_a_proj_with_mqa, ...) with its config.json"),
    (r"decoder\.layers\.\d+\.mlp\.(?:router|experts|shared_experts)\..*",
     "!Megatron's MoE layer (router, grouped experts): not imported; bundle v1's moe is read from Hugging Face's "
     "names and config only"),
    # Megatron's MultiTokenPredictionBlock (mtp.layers.{k}.enorm, .hnorm, .eh_proj, .transformer_layer.*,
    # .final_layernorm): its block's names are not mapped; Hugging Face's DeepSeek-V3 layout is.
    (r"mtp\.layers\.\d+\..*",
     "!Megatron's multi-token prediction layers: not imported under Megatron's names; convert the checkpoint to "
     "Hugging Face's DeepSeek-V3 names (model.layers.{{num_hidden_layers + k}}.enorm, eh_proj, ...) and import it "
     "with --mtp-loss-scale"),
]

# DeepSeek's own checkpoint names (deepseek-ai/DeepSeek-V3 inference/convert.py's mapping, applied backwards).
# Its MoE names go to Hugging Face's (the correction bias to mlp.gate.e_score_correction_bias, which the
# import moves into state.json: families.take_score_bias), its shared experts to the bundle's shared_expert.
_DEEPSEEK = [
    (r"embed\.weight", "model.embed_tokens.weight"),
    (r"layers\.(\d+)\.attn_norm\.weight", "model.layers.{0}.input_layernorm.weight"),
    (r"layers\.(\d+)\.ffn_norm\.weight", "model.layers.{0}.post_attention_layernorm.weight"),
    (r"layers\.(\d+)\.attn\.wq\.weight", "model.layers.{0}.self_attn.q_proj.weight"),
    (r"layers\.(\d+)\.attn\.wq_a\.weight", "model.layers.{0}.self_attn.q_a_proj.weight"),
    (r"layers\.(\d+)\.attn\.q_norm\.weight", "model.layers.{0}.self_attn.q_a_layernorm.weight"),
    (r"layers\.(\d+)\.attn\.wq_b\.weight", "model.layers.{0}.self_attn.q_b_proj.weight"),
    (r"layers\.(\d+)\.attn\.wkv_a\.weight", "model.layers.{0}.self_attn.kv_a_proj_with_mqa.weight"),
    (r"layers\.(\d+)\.attn\.kv_norm\.weight", "model.layers.{0}.self_attn.kv_a_layernorm.weight"),
    (r"layers\.(\d+)\.attn\.wkv_b\.weight", "model.layers.{0}.self_attn.kv_b_proj.weight"),
    (r"layers\.(\d+)\.attn\.wo\.weight", "model.layers.{0}.self_attn.o_proj.weight"),
    (r"layers\.(\d+)\.ffn\.w1\.weight", "model.layers.{0}.mlp.gate_proj.weight"),
    (r"layers\.(\d+)\.ffn\.w2\.weight", "model.layers.{0}.mlp.down_proj.weight"),
    (r"layers\.(\d+)\.ffn\.w3\.weight", "model.layers.{0}.mlp.up_proj.weight"),
    (r"layers\.(\d+)\.ffn\.gate\.weight", "model.layers.{0}.mlp.gate.weight"),
    (r"layers\.(\d+)\.ffn\.gate\.bias", "model.layers.{0}.mlp.gate.e_score_correction_bias"),
    (r"layers\.(\d+)\.ffn\.(experts\.\d+)\.w1\.weight", "model.layers.{0}.mlp.{1}.gate_proj.weight"),
    (r"layers\.(\d+)\.ffn\.(experts\.\d+)\.w2\.weight", "model.layers.{0}.mlp.{1}.down_proj.weight"),
    (r"layers\.(\d+)\.ffn\.(experts\.\d+)\.w3\.weight", "model.layers.{0}.mlp.{1}.up_proj.weight"),
    # DeepseekV3MoE's shared_experts (one MLP) is the bundle's mlp.shared_expert
    (r"layers\.(\d+)\.ffn\.shared_experts\.w1\.weight", "model.layers.{0}.mlp.shared_expert.gate_proj.weight"),
    (r"layers\.(\d+)\.ffn\.shared_experts\.w2\.weight", "model.layers.{0}.mlp.shared_expert.down_proj.weight"),
    (r"layers\.(\d+)\.ffn\.shared_experts\.w3\.weight", "model.layers.{0}.mlp.shared_expert.up_proj.weight"),
    (r"norm\.weight", "model.norm.weight"),
    (r"head\.weight", "lm_head.weight"),
]

# Hugging Face MoE families whose experts are stored fused, by config model_type (import only: the capture
# helper refuses them live). GPT-OSS: gate_up_proj [E, C, 2M] with gate in the even columns and up in the
# odd ones, down_proj [E, M, C], each multiplied from the right; split per expert and transposed
# (docs/bundle-format.md, "GPT-OSS's checkpoint in these keys"). "{{e}}" is the expert, "{{part}}" gate/up.
HF_EXPERT_NAMES = {"gpt_oss": [
    (r"model\.layers\.(\d+)\.mlp\.router\.(weight|bias)", "model.layers.{0}.mlp.gate.{1}"),
    (r"model\.layers\.(\d+)\.mlp\.experts\.gate_up_proj", "gate_up:model.layers.{0}.mlp.experts.{{e}}.{{part}}_proj.weight"),
    (r"model\.layers\.(\d+)\.mlp\.experts\.gate_up_proj_bias", "gate_up:model.layers.{0}.mlp.experts.{{e}}.{{part}}_proj.bias"),
    (r"model\.layers\.(\d+)\.mlp\.experts\.down_proj", "per_expert:model.layers.{0}.mlp.experts.{{e}}.down_proj.weight"),
    (r"model\.layers\.(\d+)\.mlp\.experts\.down_proj_bias", "per_expert:model.layers.{0}.mlp.experts.{{e}}.down_proj.bias"),
]}
# Llama 4 (Llama4ForCausalLM, and Llama4ForConditionalGeneration's language model once model_settle.text_model
# has renamed it): the MLP is `feed_forward`; on its MoE layers (moe_layers) Llama4TextMoe's router
# (nn.Linear, no bias), Llama4TextExperts' gate_up_proj [E, C, 2M] (gate the FIRST half of the last axis, up
# the second: gate_up.chunk(2, dim=-1)) and down_proj [E, M, C], both multiplied from the right (bmm), and a
# shared expert; its dense layers a Llama4TextMLP of intermediate_size_mlp (docs/import.md, "Llama 4").
_LLAMA4_NAMES = [
    (r"model\.layers\.(\d+)\.feed_forward\.router\.weight", "model.layers.{0}.mlp.gate.weight"),
    (r"model\.layers\.(\d+)\.feed_forward\.experts\.gate_up_proj",
     "gate_up_halves:model.layers.{0}.mlp.experts.{{e}}.{{part}}_proj.weight"),
    (r"model\.layers\.(\d+)\.feed_forward\.experts\.down_proj",
     "per_expert:model.layers.{0}.mlp.experts.{{e}}.down_proj.weight"),
    (r"model\.layers\.(\d+)\.feed_forward\.shared_expert\.(gate|up|down)_proj\.weight",
     "model.layers.{0}.mlp.shared_expert.{1}_proj.weight"),
    (r"model\.layers\.(\d+)\.feed_forward\.(gate|up|down)_proj\.weight", "model.layers.{0}.mlp.{1}_proj.weight"),
]
HF_EXPERT_NAMES["llama4_text"] = HF_EXPERT_NAMES["llama4"] = _LLAMA4_NAMES
# DeepSeek-V3 / Kimi K2 (DeepseekV3MoE): experts one nn.Module each under llama's MoE names already; its
# shared_experts (one DeepseekV3MLP) is the bundle's mlp.shared_expert, the same for the optimizer's moments.
HF_EXPERT_NAMES["deepseek_v3"] = HF_EXPERT_NAMES["kimi_k2"] = [
    (r"model\.layers\.(\d+)\.mlp\.shared_experts\.(gate|up|down)_proj\.weight",
     "model.layers.{0}.mlp.shared_expert.{1}_proj.weight"),
]
# What an expert-stacked tensor holds per expert: [(part, columns of its last axis)]; "gate_up_halves"
# (Llama 4): [(part, which half of the last axis)], the halves' width read off the tensor.
_EXPERT_PARTS = {"gate_up": [("gate", slice(0, None, 2)), ("up", slice(1, None, 2))], "per_expert": [(None, slice(None))],
                 "gate_up_halves": [("gate", 0), ("up", 1)]}
# How each family's stacked experts are split, for the import's own line (build.py).
HF_EXPERT_SPLITS = {
    "gpt_oss": "mlp.experts.gate_up_proj / down_proj and their biases split per expert (gate the even columns, up "
               "the odd ones, each transposed), mlp.router read as mlp.gate",
    "llama4": "feed_forward.experts.gate_up_proj / down_proj split per expert (gate the first half of the last axis, "
              "up the second, each transposed), feed_forward.router read as mlp.gate, feed_forward.* as mlp.*",
}
HF_EXPERT_SPLITS["llama4_text"] = HF_EXPERT_SPLITS["llama4"]
HF_EXPERT_SPLITS["deepseek_v3"] = HF_EXPERT_SPLITS["kimi_k2"] = (
    "experts one module each (no split), mlp.shared_experts read as mlp.shared_expert")

# Quantized weights a released checkpoint stores and a training run's does not: refused by key.
_QUANTIZED = [
    (re.compile(r".*_(?:blocks|scales)"), "MXFP4-quantized experts (GPT-OSS's released checkpoints: 4-bit blocks and "
                                          "their scales, quantization_config mxfp4); a training run's checkpoint holds "
                                          "bf16/fp32 experts, which the replay's update needs"),
    (re.compile(r".*\.weight_scale_inv|layers\.\d+\..*\.scale"),
     "FP8 block-quantized weights (DeepSeek-V3's released checkpoints, quantization_config fp8); a training run's "
     "checkpoint holds bf16/fp32 weights, which the replay's update needs"),
]

# Hugging Face families whose checkpoints fuse or rename llama's parameters, by config model_type (Phi-3's
# qkv_proj and gate_up_proj, GLM's gate_up_proj, GLM-4-0414's sandwich norms): the capture helper's table,
# which splits a live model's the same way.
HF_FUSED = _capture.HF_FUSED_NAMES

_HF_MOE = re.compile(r"model\.layers\.\d+\.mlp\.(gate\.weight|experts\.\d+\.(gate|up|down)_proj\.weight)")


def refuse_quantized(keys, where):
    """BadInput naming the first key of quantized weights (_QUANTIZED) the checkpoint holds."""
    for key in keys:
        for rx, why in _QUANTIZED:
            if isinstance(key, str) and rx.fullmatch(key):
                raise BadInput(where, key, f"{why}: not importable")


def group_names(names, limit=12):
    """Names in one short line: layer indices folded ("layers.{0-31}.attention.wq.weight"), in first-seen
    order, at most `limit` groups then how many more. So an error can list every name it means."""
    groups = {}
    for name in names:
        m = re.search(r"(?:^|\.)(\d+)(?=\.)", name)
        if m is None:
            groups.setdefault(name, [])
            continue
        template = name[:m.start(1)] + "{}" + name[m.end(1):]
        groups.setdefault(template, []).append(int(m.group(1)))
    shown = []
    for template, idx in groups.items():
        if not idx:
            shown.append(template)
            continue
        idx = sorted(set(idx))
        contiguous = len(idx) > 1 and idx == list(range(idx[0], idx[-1] + 1))
        span = f"{idx[0]}-{idx[-1]}" if contiguous else ",".join(map(str, idx))
        shown.append(template.replace("{}", "{" + span + "}" if len(idx) > 1 else str(idx[0])))
    more = len(shown) - limit
    return ", ".join(shown[:limit]) + (f" and {more} more" if more > 0 else "")


def detect_naming(keys):
    for naming, pattern in _DETECT:
        rx = re.compile(r"(?:.*\.)?" + pattern)
        for key in keys:
            if rx.fullmatch(key):
                return naming, key
    raise BadInput("--checkpoint", "naming", "no known parameter naming (hf, meta, torchtitan, megatron, deepseek, "
                                             "nanogpt) "
                                             f"matches keys such as {sorted(keys)[:3]}; pass --naming")


def strip_prefix(sd, naming):
    """Drop wrappers' prefixes (torch.compile's _orig_mod., DDP's module., a model. nesting of a
    non-HF naming) so the preset's names match."""
    out = {}
    for key, value in sd.items():
        k = key
        changed = True
        while changed:
            changed = False
            for prefix in ("_orig_mod.", "module.", "_fsdp_wrapped_module.", "_checkpoint_wrapped_module."):
                if k.startswith(prefix):
                    k, changed = k[len(prefix):], True
            k = k.replace("._orig_mod.", ".").replace("._fsdp_wrapped_module.", ".").replace(
                "._checkpoint_wrapped_module.", ".")
            if naming != "hf" and k.startswith("model.") and not k.startswith("model.embed_tokens"):
                k, changed = k[len("model."):], True
        if k in out:
            raise BadInput("--checkpoint", key, f"is {k} after removing wrapper prefixes, which another key also is")
        out[k] = value
    return out


def unstack_megatron_layers(sd, num_layers):
    """Megatron's torch_dist checkpoints store each layer parameter once for the whole decoder,
    `decoder.layers.<name>` with the layer as the leading axis; split it into decoder.layers.N.<name>."""
    out = {}
    for key, value in sd.items():
        m = re.fullmatch(r"decoder\.layers\.([a-z_]+\..*)", key)
        if m and not re.match(r"\d+\.", m.group(1)) and isinstance(value, torch.Tensor):
            if num_layers is None or value.dim() < 1 or value.shape[0] != num_layers:
                raise BadInput("--checkpoint", key, "a layer-stacked Megatron tensor needs num_layers in --config "
                                                    f"equal to its leading size {list(value.shape)[:1]}")
            for i in range(num_layers):
                out[f"decoder.layers.{i}.{m.group(1)}"] = value[i]
        else:
            out[key] = value
    return out


class Mapper:
    """Maps one framework's named tensors (parameters, or one AdamW moment of each) onto bundle v1's
    keys, the same way for both, so moments follow their parameters."""

    def __init__(self, naming, cfg):
        self.naming, self.cfg = naming, cfg
        table = {"meta": _META, "torchtitan": _META, "megatron": _MEGATRON, "deepseek": _DEEPSEEK}.get(naming)
        self.table = [(re.compile(p), t) for p, t in table] if table else None
        # hf: llama's names, but for the fused and renamed ones of the config's model_type (HF_FUSED,
        # HF_EXPERT_NAMES)
        kind = cfg.get("model_type")
        fused = (HF_FUSED.get(kind) or HF_EXPERT_NAMES.get(kind)) if naming == "hf" else None
        self.hf_table = [(re.compile(p), t) for p, t in fused] if fused else []

    def target(self, key):
        """Bundle key (or a 'qkv:'/'fc1:' split template) for a source key; None when ignored."""
        if _IGNORED.fullmatch(key):
            return None
        if self.table is None:  # hf and nanogpt names are the bundle's own, but for HF_FUSED's
            for rx, template in self.hf_table:
                m = rx.fullmatch(key)
                if m:
                    return template.format(*m.groups())
            return key
        for rx, template in self.table:
            m = rx.fullmatch(key)
            if m:
                return template.format(*m.groups())
        return "?" + key

    def map(self, tensors, where, strict=True):
        out, unknown = {}, []
        for key, t in tensors.items():
            target = self.target(key)
            if target is None:
                continue
            if target.startswith("?"):
                unknown.append(key)
                continue
            if target.startswith("!"):
                raise BadInput(where, key, target[1:])
            if target.startswith("qkv:"):
                for part, piece in zip("qkv", self.split_qkv(t, key, where)):
                    out[target[4:].format(part)] = piece
            elif target.startswith(("hfqkv:", "fc1:")):
                out.update(self.split_rows(t, key, where, target))
            elif target.partition(":")[0] in _EXPERT_PARTS:
                out.update(self.split_experts(t, key, where, target))
            else:
                if target in out:
                    raise BadInput(where, key, f"maps onto {target}, which another key also maps onto")
                out[target] = t
        if unknown and strict:
            unknown_set = set(unknown)
            known = [k for k in tensors if k not in unknown_set and self.target(k) is not None]
            raise BadInput(where, unknown[0], f"not a parameter of the {self.naming} naming's llama (bundle v1 has no "
                                              f"place for it); the checkpoint's names the preset does not know: "
                                              f"{group_names(unknown)}; those it maps: {group_names(known, 6)}")
        return out

    def split_qkv(self, t, key, where):
        """Megatron's linear_qkv: per query group g, [the group's H/G query heads, its key head, its
        value head] along the output rows."""
        H, G, C = self.cfg["num_heads"], self.cfg["num_kv_heads"], self.cfg["hidden_size"]
        D = C // H
        rows = (H + 2 * G) * D
        if t.shape[0] != rows:
            raise BadInput(where, key, f"has {t.shape[0]} rows; {H} query heads and {G} query groups of head_dim {D} "
                                       f"need (H + 2G) * D = {rows}")
        rest = tuple(t.shape[1:])
        per = t.reshape((G, (H // G + 2) * D) + rest)
        q = per[:, :H // G * D].reshape((H * D,) + rest)
        k = per[:, H // G * D:H // G * D + D].reshape((G * D,) + rest)
        v = per[:, H // G * D + D:].reshape((G * D,) + rest)
        return q.contiguous(), k.contiguous(), v.contiguous()

    def split_rows(self, t, key, where, target):
        """{bundle key: rows} of a tensor fused in row blocks ('hfqkv:' Phi-3's qkv_proj, 'fc1:' gate then
        up): the capture helper's split (nanreplay_capture.fused_row_blocks), so a live capture and an
        import take a fused parameter and its moments apart alike."""
        kind, _, template = target.partition(":")
        heads = None
        if kind == "hfqkv":
            H, G = self.cfg["num_heads"], self.cfg["num_kv_heads"]
            heads = (H, G, self.cfg.get("head_dim") or self.cfg["hidden_size"] // H)
        try:
            blocks = _capture.fused_row_blocks(kind, t.shape[0], heads)
        except _capture.CaptureError as e:
            raise BadInput(where, key, str(e)) from None
        return {template.format(part): t.narrow(0, first, count).contiguous() for part, first, count in blocks}

    def split_experts(self, t, key, where, target):
        """{bundle key: tensor} of a tensor stacked over experts (GPT-OSS's): per expert e, each part's
        columns of the last axis (_EXPERT_PARTS), a [in, out] matrix transposed to the bundle's [out, in]."""
        kind, _, template = target.partition(":")
        if t.dim() not in (2, 3) or t.shape[0] < 1:
            raise BadInput(where, key, f"is {list(t.shape)}: experts stacked as [E, in, out] or, for a bias, [E, out]")
        out = {}
        parts = _EXPERT_PARTS[kind]
        if kind == "gate_up_halves":  # Llama 4: gate_up.chunk(2, dim=-1)
            if t.dim() != 3 or t.shape[-1] % 2:
                raise BadInput(where, key, f"is {list(t.shape)}: Llama 4's gate_up_proj is [E, hidden, 2 * "
                                           "intermediate_size], gate then up along its last axis")
            half = t.shape[-1] // 2
            parts = [(part, slice(which * half, (which + 1) * half)) for part, which in parts]
        for e in range(t.shape[0]):
            for part, columns in parts:
                piece = t[e][..., columns]
                out[template.format(e=e, part=part)] = (piece.t() if piece.dim() == 2 else piece).contiguous()
        return out

    def bundle_keys(self, key, model):
        """Every bundle key a source key maps onto (its splits', for a fused tensor); [] when ignored."""
        target = self.target(key)
        kind, _, template = (target or "").partition(":")
        if target is None or target.startswith(("?", "!")):
            return []
        if kind in ("qkv", "hfqkv"):
            return [template.format(x) for x in "qkv"]
        if kind == "fc1":
            return [template.format(x) for x in ("gate", "up")]
        if kind in _EXPERT_PARTS:
            experts = (model.get("moe") or {}).get("num_experts", 0)
            return [template.format(e=e, part=part) for e in range(experts) for part, _ in _EXPERT_PARTS[kind]]
        return [target]

    @staticmethod
    def is_split(target):
        """Whether a target splits one source tensor into several bundle keys."""
        return (target or "").partition(":")[0] in ("qkv", "hfqkv", "fc1", *_EXPERT_PARTS)
