"""Naming presets: the user's framework's parameter names onto bundle v1's (HF llama, Meta/torchtitan/
llama2.c, Megatron-core, nanoGPT gpt2), and detecting which one a checkpoint uses."""

import re

import torch

import nanreplay_capture as _capture

from .outcome import BadInput

NAMINGS = ("auto", "hf", "meta", "torchtitan", "megatron", "nanogpt")


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
]

# Hugging Face families whose checkpoints fuse or rename llama's parameters, by config model_type (Phi-3's
# qkv_proj and gate_up_proj, GLM's gate_up_proj, GLM-4-0414's sandwich norms): the capture helper's table,
# which splits a live model's the same way.
HF_FUSED = _capture.HF_FUSED_NAMES

_HF_MOE = re.compile(r"model\.layers\.\d+\.mlp\.(gate\.weight|experts\.\d+\.(gate|up|down)_proj\.weight)")


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
    raise BadInput("--checkpoint", "naming", "no known parameter naming (hf, meta, torchtitan, megatron, nanogpt) "
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
        table = {"meta": _META, "torchtitan": _META, "megatron": _MEGATRON}.get(naming)
        self.table = [(re.compile(p), t) for p, t in table] if table else None
        # hf: llama's names, but for the fused and renamed ones of the config's model_type (HF_FUSED)
        fused = HF_FUSED.get(cfg.get("model_type")) if naming == "hf" else None
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
            if target.startswith("qkv:"):
                for part, piece in zip("qkv", self.split_qkv(t, key, where)):
                    out[target[4:].format(part)] = piece
            elif target.startswith(("hfqkv:", "fc1:")):
                out.update(self.split_rows(t, key, where, target))
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
