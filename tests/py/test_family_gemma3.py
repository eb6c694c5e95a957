"""Gemma 3's text model (layer_types, the local rotary, sandwich norms, rms_norm_offset, scale_embeddings,
query_pre_attn_scalar, hidden_act gelu_pytorch_tanh) against eager PyTorch written from transformers'
modeling_gemma3.py.

The reference transcribes Gemma3RMSNorm (x * rsqrt(mean(x^2) + eps) * (1 + weight) in fp32, cast back),
Gemma3TextScaledWordEmbedding (times hidden_size**0.5 in the weight's type), Gemma3RotaryEmbedding per layer
type (full_attention: rope_theta with linear scaling, inv_freq / factor; sliding_attention: the local base,
unscaled), Gemma3Attention (per-head q_norm / k_norm before rotary, eager attention with scores *
query_pre_attn_scalar**-0.5 plus a finfo.min mask, the sliding window on sliding layers), Gemma3MLP
(down(gelu_tanh(gate(x)) * up(x))) and Gemma3DecoderLayer's four norms.

1. `nanreplay synth clean-gemma3`: each step's replayed loss and gradient norm against the reference on the
   bundle's own weights and batches, within 1e-5 relative (fp32).
2. `nanreplay import` of a save_pretrained-style directory as transformers 4 writes it (config.json with
   model_type gemma3_text, rope_theta, rope_local_base_freq, rope_scaling, layer_types), and of one as
   transformers 5 writes Gemma 3's multimodal model (model_type gemma3, the text model under text_config,
   rope_parameters per layer type, the language model under model.language_model, a vision tower left out):
   the manifest says every option, and the replay gives the reference's loss and gradient norm.
4. `nanreplay import` of Gemma 2 (model_type gemma2) as save_pretrained writes it, Gemma2Config's defaults
   left out and filled by the import, against Gemma2ForCausalLM (soft caps, one rotary for every layer); and
   of Gemma 1 (model_type gemma: llama's pre-norm block with Gemma's norms, embeddings and GeGLU).
3. A sliding layer given a scaled rotary (rope_parameters['sliding_attention'] linear) is refused by name (by
   the config reading the import and the capture helper share).
5. A model of 2.'s config from a one-step bf16 bundle (precision.compute "bf16"): the reference rounds where
   the bundle format does (docs/bundle-format.md, "Precision as replayed": every linear's input, weight and
   bias, q k^T and the scaled scores, every probe site as it is produced, the QK-norm's input; Gemma's offset
   norms compute in fp32, the embedding scale is held in the weight's fp32); loss and gradient norm within
   1e-4 relative, and that loss departs from the fp32 one.

    /usr/bin/python3 tests/py/test_family_gemma3.py --cli build/nanreplay --work DIR
"""
import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import family_support as fs  # noqa: E402
import reference_model  # noqa: E402  (a bundle's batches and safetensors only)
import synth_cache  # noqa: E402


class Gemma3RMSNorm(fs.Rounding, torch.nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.zeros(dim))

    def _norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        output = self._norm(x.float())
        output = output * (1.0 + self.weight.float())
        return self.rnd(output.type_as(x))  # every norm's output is a site (or, q_norm / k_norm, rounded as one)


class Gemma3TextScaledWordEmbedding(fs.Rounding, torch.nn.Embedding):
    def __init__(self, num_embeddings, embedding_dim, embed_scale):
        super().__init__(num_embeddings, embedding_dim)
        self.register_buffer("embed_scale", torch.tensor(embed_scale), persistent=False)

    def forward(self, input_ids):
        return self.rnd(super().forward(input_ids) * self.embed_scale.to(self.weight.dtype))  # the embed site


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def default_inv_freq(base, dim):
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


class Gemma3Attention(fs.Rounding, torch.nn.Module):
    def __init__(self, cfg, layer_idx):
        super().__init__()
        C, H, G, D = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
        self.layer_type = cfg["layer_types"][layer_idx]
        self.head_dim, self.num_key_value_groups = D, H // G
        self.scaling = cfg["query_pre_attn_scalar"] ** -0.5
        self.q_proj = fs.Linear(C, H * D, bias=False)
        self.k_proj = fs.Linear(C, G * D, bias=False)
        self.v_proj = fs.Linear(C, G * D, bias=False)
        self.o_proj = fs.Linear(H * D, C, bias=False)
        self.q_norm = Gemma3RMSNorm(D, cfg["rms_norm_eps"])
        self.k_norm = Gemma3RMSNorm(D, cfg["rms_norm_eps"])

    def forward(self, hidden_states, position_embeddings, attention_mask):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        value_states = self.rnd(self.v_proj(hidden_states)).view(hidden_shape).transpose(1, 2)  # attn.v
        query_states = self.q_norm(self.rnd(query_states))  # the QK-norm reads the rounded projection
        key_states = self.k_norm(self.rnd(key_states))
        cos, sin = position_embeddings
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        query_states = self.rnd((query_states * cos) + (rotate_half(query_states) * sin))  # attn.q
        key_states = self.rnd((key_states * cos) + (rotate_half(key_states) * sin))  # attn.k
        key_states = key_states.repeat_interleave(self.num_key_value_groups, 1)  # repeat_kv
        value_states = value_states.repeat_interleave(self.num_key_value_groups, 1)
        # q k^T rounded, then the scaled scores (the attn.scores site)
        attn_weights = self.rnd(self.rnd(torch.matmul(query_states, key_states.transpose(2, 3))) * self.scaling)
        attn_weights = attn_weights + attention_mask
        attn_weights = self.rnd(F.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query_states.dtype))
        attn_output = self.rnd(torch.matmul(attn_weights, value_states)).transpose(1, 2).contiguous()  # context
        return self.rnd(self.o_proj(attn_output.reshape(*input_shape, -1).contiguous()))  # attn.out


class Gemma3MLP(fs.Rounding, torch.nn.Module):
    def __init__(self, cfg):
        super().__init__()
        C, FF = cfg["hidden_size"], cfg["intermediate_size"]
        self.gate_proj = fs.Linear(C, FF, bias=False)
        self.up_proj = fs.Linear(C, FF, bias=False)
        self.down_proj = fs.Linear(FF, C, bias=False)

    def forward(self, x):
        gate, up = self.rnd(self.gate_proj(x)), self.rnd(self.up_proj(x))  # mlp.gate, mlp.up
        return self.rnd(self.down_proj(self.rnd(F.gelu(gate, approximate="tanh") * up)))  # mlp.act, mlp.down


class Gemma2Attention(Gemma3Attention):
    """Gemma2Attention and its eager_attention_forward: Gemma 3's without q_norm / k_norm, the scaled
    scores soft-capped (c * tanh(x / c)) before the mask is added (in bf16: from the rounded scores, in
    fp32, not rounded again, as the bundle format rounds)."""

    def __init__(self, cfg, layer_idx):
        super().__init__(cfg, layer_idx)
        del self.q_norm, self.k_norm
        self.attn_logit_softcapping = cfg["attn_logit_softcapping"]

    def forward(self, hidden_states, position_embeddings, attention_mask):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        value_states = self.rnd(self.v_proj(hidden_states)).view(hidden_shape).transpose(1, 2)  # attn.v
        cos, sin = position_embeddings
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        query_states = self.rnd((query_states * cos) + (rotate_half(query_states) * sin))  # attn.q
        key_states = self.rnd((key_states * cos) + (rotate_half(key_states) * sin))  # attn.k
        key_states = key_states.repeat_interleave(self.num_key_value_groups, 1)  # repeat_kv
        value_states = value_states.repeat_interleave(self.num_key_value_groups, 1)
        attn_weights = self.rnd(self.rnd(torch.matmul(query_states, key_states.transpose(2, 3))) * self.scaling)
        if self.attn_logit_softcapping is not None:
            attn_weights = attn_weights / self.attn_logit_softcapping
            attn_weights = torch.tanh(attn_weights)
            attn_weights = attn_weights * self.attn_logit_softcapping
        attn_weights = attn_weights + attention_mask
        attn_weights = self.rnd(F.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query_states.dtype))
        attn_output = self.rnd(torch.matmul(attn_weights, value_states)).transpose(1, 2).contiguous()  # context
        return self.rnd(self.o_proj(attn_output.reshape(*input_shape, -1).contiguous()))  # attn.out


class Gemma3DecoderLayer(fs.Rounding, torch.nn.Module):
    """Gemma2DecoderLayer too (the same four norms), with Gemma2Attention."""

    def __init__(self, cfg, layer_idx, attention=Gemma3Attention):
        super().__init__()
        C, eps = cfg["hidden_size"], cfg["rms_norm_eps"]
        self.attention_type = cfg["layer_types"][layer_idx]
        self.self_attn = attention(cfg, layer_idx)
        self.mlp = Gemma3MLP(cfg)
        self.input_layernorm = Gemma3RMSNorm(C, eps)
        self.post_attention_layernorm = Gemma3RMSNorm(C, eps)
        self.pre_feedforward_layernorm = Gemma3RMSNorm(C, eps)
        self.post_feedforward_layernorm = Gemma3RMSNorm(C, eps)

    def forward(self, hidden_states, position_embeddings, attention_mask):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states = self.self_attn(hidden_states, position_embeddings, attention_mask)
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = self.rnd(residual + hidden_states)  # attn_residual
        residual = hidden_states
        hidden_states = self.pre_feedforward_layernorm(hidden_states)
        hidden_states = self.mlp(hidden_states)
        hidden_states = self.post_feedforward_layernorm(hidden_states)
        return self.rnd(residual + hidden_states)  # output


class GemmaDecoderLayer(fs.Rounding, torch.nn.Module):
    """Gemma 1's GemmaDecoderLayer: llama's pre-norm block (input_layernorm, post_attention_layernorm)
    with Gemma's norms and GeGLU MLP."""

    def __init__(self, cfg, layer_idx, attention):
        super().__init__()
        C, eps = cfg["hidden_size"], cfg["rms_norm_eps"]
        self.attention_type = cfg["layer_types"][layer_idx]
        self.self_attn = attention(cfg, layer_idx)
        self.mlp = Gemma3MLP(cfg)
        self.input_layernorm = Gemma3RMSNorm(C, eps)
        self.post_attention_layernorm = Gemma3RMSNorm(C, eps)

    def forward(self, hidden_states, position_embeddings, attention_mask):
        hidden_states = self.rnd(hidden_states + self.self_attn(self.input_layernorm(hidden_states),
                                                                position_embeddings, attention_mask))
        return self.rnd(hidden_states + self.mlp(self.post_attention_layernorm(hidden_states)))


class Gemma3ForCausalLM(fs.Rounding, torch.nn.Module):
    """Tied head (Gemma's), so the parameters are the text model's only. Gemma2ForCausalLM with
    `attention` Gemma2Attention: one rotary for every layer (no rope_local_base_freq) and the logits
    soft-capped by final_logit_softcapping before the loss."""

    def __init__(self, cfg, attention=Gemma3Attention, layer=Gemma3DecoderLayer):
        super().__init__()
        self.cfg = cfg
        C, D = cfg["hidden_size"], cfg["head_dim"]
        self.embed_tokens = Gemma3TextScaledWordEmbedding(cfg["vocab_size"], C, C ** 0.5)
        self.layers = torch.nn.ModuleList([layer(cfg, i, attention) for i in range(cfg["num_hidden_layers"])])
        self.norm = Gemma3RMSNorm(C, cfg["rms_norm_eps"])
        scaling = cfg.get("rope_scaling") or {}
        full = default_inv_freq(cfg["rope_theta"], D)
        if scaling.get("rope_type") == "linear":  # _compute_linear_scaling_rope_parameters
            full = full / scaling["factor"]
        local = cfg.get("rope_local_base_freq")
        self.inv_freq = {"full_attention": full,
                         "sliding_attention": full if local is None else default_inv_freq(local, D)}

    def forward(self, input_ids, labels):
        seq = input_ids.shape[1]
        position_ids = torch.arange(seq)[None, :].float()
        position_embeddings = {}
        for kind, inv_freq in self.inv_freq.items():
            freqs = (inv_freq[None, :, None].float() @ position_ids[:, None, :]).transpose(1, 2)
            emb = torch.cat((freqs, freqs), dim=-1)
            position_embeddings[kind] = (emb.cos(), emb.sin())
        q = torch.arange(seq)[:, None]
        k = torch.arange(seq)[None, :]
        lowest = torch.finfo(torch.float32).min
        window = self.cfg["sliding_window"] or seq  # Gemma 1: no window
        masks = {"full_attention": torch.zeros(seq, seq).masked_fill(k > q, lowest)[None, None],
                 "sliding_attention": torch.zeros(seq, seq).masked_fill((k > q) | (q - k >= window),
                                                                        lowest)[None, None]}
        hidden_states = self.embed_tokens(input_ids)
        for layer in self.layers:
            hidden_states = layer(hidden_states, position_embeddings[layer.attention_type], masks[layer.attention_type])
        logits = self.rnd(F.linear(self.rnd(self.norm(hidden_states)), self.rnd(self.embed_tokens.weight)))
        cap = self.cfg.get("final_logit_softcapping")
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return fs.cross_entropy(logits, labels)


def named_as_hf(model, prefix="model."):
    """(key, tensor) under Gemma3ForCausalLM's names (the head tied, so absent), in its module order."""
    return [(prefix + k, v) for k, v in model.named_parameters()]


def load(model, weights):
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(weights["model." + name])


def config_of_manifest(m):
    """The HF-style config of a bundle's model section (the reference's inputs; nanreplay never reads it)."""
    return {"vocab_size": m["vocab_size"], "hidden_size": m["hidden_size"], "intermediate_size": m["intermediate_size"],
            "num_hidden_layers": m["num_layers"], "num_attention_heads": m["num_heads"],
            "num_key_value_heads": m.get("num_kv_heads", m["num_heads"]), "head_dim": m["head_dim"],
            "rms_norm_eps": m["norm_eps"], "rope_theta": m["rope_theta"], "rope_scaling": m.get("rope_scaling"),
            "rope_local_base_freq": m["rope_local_base_freq"], "query_pre_attn_scalar": m["query_pre_attn_scalar"],
            "sliding_window": m["sliding_window"], "layer_types": m["layer_types"]}


def check_preset(cli, work):
    """1. every step of clean-gemma3 against the reference on the bundle's weights and batches."""
    bundle_dir = work / "clean-gemma3"
    synth_cache.synth(cli, "clean-gemma3", bundle_dir)
    rc, report, err = fs.replay(cli, bundle_dir, work / "out-clean-gemma3")
    if not fs.check(report is not None and rc == 0, f"clean-gemma3 replays (exit {rc}; {err.strip()[-300:]})"):
        return
    bundle = reference_model.Bundle(bundle_dir)
    m = bundle.manifest["model"]
    fs.check(m.get("layer_types") == ["sliding_attention", "full_attention"] and m.get("norm_layout") == "sandwich",
             f"clean-gemma3's manifest has both attention kinds and sandwich norms ({m})")
    dirs = {e["step"]: e["dir"] for e in bundle.manifest["steps"]}
    for row in report["steps"][:2]:
        model = Gemma3ForCausalLM(config_of_manifest(m))
        load(model, reference_model.read_safetensors(bundle.root / dirs[row["step"]] / "model.safetensors"))
        fs.compare_bundle_step(bundle, row, model, f"clean-gemma3 step {row['step']}")


CONFIG = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 40, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-6,
          "rope_theta": 1e6, "rope_scaling": {"rope_type": "linear", "factor": 2.0}, "rope_local_base_freq": 10000.0,
          "query_pre_attn_scalar": 24, "sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"],
          "max_position_embeddings": 64, "tie_word_embeddings": True}
T = 12


def transformers4(cfg):
    """config.json as transformers 4.5x writes Gemma3ForCausalLM's."""
    return {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", **cfg,
            "hidden_activation": "gelu_pytorch_tanh", "sliding_window_pattern": 2, "torch_dtype": "float32"}


def transformers5(cfg):
    """config.json as transformers 5 writes Gemma3ForConditionalGeneration's: the text model's under
    text_config, its rotary per layer type in rope_parameters."""
    text = {k: v for k, v in cfg.items() if k not in ("rope_theta", "rope_scaling", "rope_local_base_freq")}
    text.update({"model_type": "gemma3_text", "hidden_activation": "gelu_pytorch_tanh",
                 "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": cfg["rope_scaling"]["factor"],
                                                        "rope_theta": cfg["rope_theta"]},
                                     "sliding_attention": {"rope_type": "default",
                                                           "rope_theta": cfg["rope_local_base_freq"]}}})
    return {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "text_config": text,
            "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 8}, "mm_tokens_per_image": 4,
            "dtype": "float32"}


def manifest_model(cfg):
    """Bundle v1's model section for Gemma 3's text config `cfg` (the options `nanreplay import` sets)."""
    return {"arch": "llama", "vocab_size": cfg["vocab_size"], "hidden_size": cfg["hidden_size"],
            "num_layers": cfg["num_hidden_layers"], "num_heads": cfg["num_attention_heads"],
            "num_kv_heads": cfg["num_key_value_heads"], "head_dim": cfg["head_dim"],
            "intermediate_size": cfg["intermediate_size"], "max_seq_len": cfg["max_position_embeddings"],
            "norm_eps": cfg["rms_norm_eps"], "rope_theta": cfg["rope_theta"], "rope_scaling": cfg["rope_scaling"],
            "rope_local_base_freq": cfg["rope_local_base_freq"], "query_pre_attn_scalar": cfg["query_pre_attn_scalar"],
            "sliding_window": cfg["sliding_window"], "layer_types": cfg["layer_types"], "tie_embeddings": True,
            "norm_layout": "sandwich", "qk_norm": "head", "rms_norm_offset": True, "scale_embeddings": True,
            "hidden_act": "gelu_pytorch_tanh", "attention_mask": "additive_finfo_min"}


def check_bf16(cli, work):
    """5. CONFIG's model from a one-step bf16 bundle, against the reference with its rounding points on."""
    torch.manual_seed(5)
    model = Gemma3ForCausalLM(CONFIG)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(0.3 * torch.randn(p.shape) if "norm" in name else 0.4 * torch.randn(p.shape))
    stream = fs.token_stream(CONFIG["vocab_size"], 2, T, seed=5)
    fs.check_bf16_step(cli, work, "gemma3-bf16", manifest_model(CONFIG), model, named_as_hf, stream, 2, T,
                       "Gemma 3 in bf16 (offset norms in fp32, scaled embeddings, query_pre_attn_scalar, sliding)")


def import_case(cli, work, data, model, label, config, tensors, loss0, norm0, log):
    directory = work / label
    directory.mkdir(parents=True, exist_ok=True)
    fs.nanreplay_capture.write_safetensors(directory / "model.safetensors", tensors)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    imported = work / (label + "-imported")
    proc = import_support.run_import(cli, ["--checkpoint", directory, *data.flags(), "--log", log, "--steps", "0:0"],
                                     imported)
    if not fs.check(proc.returncode == 0, f"import of {label}: exit {proc.returncode} {proc.stderr.strip()[-400:]}"):
        return
    m = json.loads((imported / "manifest.json").read_text())["model"]
    want = {"norm_layout": "sandwich", "qk_norm": "head", "rms_norm_offset": True, "scale_embeddings": True,
            "hidden_act": "gelu_pytorch_tanh", "query_pre_attn_scalar": 24.0, "rope_local_base_freq": 10000.0,
            "rope_theta": 1e6, "layer_types": CONFIG["layer_types"], "sliding_window": 4, "head_dim": 16,
            "rope_scaling": {"rope_type": "linear", "factor": 2.0}, "tie_embeddings": True, "num_layers": 2}
    wrong = {k: m.get(k) for k, v in want.items() if m.get(k) != v}
    fs.check(not wrong, f"import of {label}: the manifest says Gemma 3's options (differing: {wrong})")
    rc, report, err = fs.replay(cli, imported, work / (label + "-out"))
    if fs.check(report is not None, f"imported {label} replays (exit {rc}; {err.strip()[-300:]})"):
        fs.compare_step(report, loss0, norm0, f"imported {label}")


# Gemma 2 as save_pretrained writes it: the values equal to Gemma2Config's defaults left out
# (query_pre_attn_scalar 256, the soft caps 50 and 30, layer_types alternating from a sliding layer 0).
GEMMA2_CONFIG = {"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "vocab_size": 64, "hidden_size": 32,
                 "intermediate_size": 40, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                 "head_dim": 16, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "sliding_window": 4,
                 "max_position_embeddings": 64, "tie_word_embeddings": True, "torch_dtype": "float32"}
GEMMA2_DEFAULTS = {"query_pre_attn_scalar": 256, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
                   "layer_types": ["sliding_attention", "full_attention"]}


def imported_against(cli, work, data, log_for, label, model, written, want):
    """`model` (a reference) saved as save_pretrained would with config.json `written`, imported: the
    manifest's model section holds `want` and the replay gives the reference's loss and gradient norm."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(0.3 * torch.randn(p.shape) if "norm" in name else 0.4 * torch.randn(p.shape))
    loss0, norm0 = fs.loss_and_grad_norm(model(*data.batch(data.rows(0))), list(model.parameters()))
    directory = work / label
    directory.mkdir(parents=True, exist_ok=True)
    fs.nanreplay_capture.write_safetensors(directory / "model.safetensors",
                                           [(k, v.detach()) for k, v in named_as_hf(model)])
    (directory / "config.json").write_text(json.dumps(written, indent=2))
    imported = work / (label + "-imported")
    proc = import_support.run_import(cli, ["--checkpoint", directory, *data.flags(), "--log", log_for(loss0),
                                           "--steps", "0:0"], imported)
    if not fs.check(proc.returncode == 0, f"import of {label}: exit {proc.returncode} {proc.stderr.strip()[-400:]}"):
        return
    m = json.loads((imported / "manifest.json").read_text())["model"]
    wrong = {k: m.get(k) for k, v in want.items() if m.get(k) != v}
    fs.check(not wrong, f"import of {label}: the manifest says its options, defaults filled (differing: {wrong})")
    rc, report, err = fs.replay(cli, imported, work / (label + "-out"))
    if fs.check(report is not None, f"imported {label} replays (exit {rc}; {err.strip()[-300:]})"):
        fs.compare_step(report, loss0, norm0, f"imported {label}")


def check_gemma2_import(cli, work, data, log_for):
    """4. Gemma 2 from its config.json (Gemma2Config's defaults filled where it leaves them out) against
    Gemma2ForCausalLM; soft caps small enough to bend this toy model's scores and logits. Then Gemma 1
    (GemmaForCausalLM: llama's pre-norm block with Gemma's norms, embeddings and GeGLU)."""
    torch.manual_seed(1)
    cfg = dict(GEMMA2_CONFIG, **GEMMA2_DEFAULTS)
    cfg["attn_logit_softcapping"], cfg["final_logit_softcapping"] = 2.0, 3.0  # said in config.json below
    imported_against(cli, work, data, log_for, "gemma2", Gemma3ForCausalLM(cfg, Gemma2Attention),
                     dict(GEMMA2_CONFIG, attn_logit_softcapping=2.0, final_logit_softcapping=3.0),
                     {"norm_layout": "sandwich", "qk_norm": None, "rms_norm_offset": True, "scale_embeddings": True,
                      "hidden_act": "gelu_pytorch_tanh", "query_pre_attn_scalar": 256.0, "rope_local_base_freq": None,
                      "attn_logit_softcap": 2.0, "final_logit_softcap": 3.0,
                      "layer_types": GEMMA2_DEFAULTS["layer_types"], "sliding_window": 4, "head_dim": 16})
    gemma1 = {k: v for k, v in GEMMA2_CONFIG.items() if k != "sliding_window"}
    gemma1.update(architectures=["GemmaForCausalLM"], model_type="gemma")
    cfg = dict(gemma1, attn_logit_softcapping=None, query_pre_attn_scalar=gemma1["head_dim"],
               layer_types=["full_attention"] * gemma1["num_hidden_layers"], sliding_window=None)
    imported_against(cli, work, data, log_for, "gemma1", Gemma3ForCausalLM(cfg, Gemma2Attention, GemmaDecoderLayer),
                     gemma1, {"norm_layout": None, "qk_norm": None, "rms_norm_offset": True, "scale_embeddings": True,
                              "hidden_act": "gelu_pytorch_tanh", "query_pre_attn_scalar": None, "layer_types": None,
                              "sliding_window": None, "attn_logit_softcap": None, "head_dim": 16})
    said = fs.nanreplay_capture._options_from_config(dict(GEMMA2_CONFIG), 2)  # the caps left out: the class's
    fs.check(said.get("attn_logit_softcap", (None,))[0] == 50.0 and said.get("final_logit_softcap", (None,))[0] == 30.0,
             f"gemma2 without soft caps in config.json takes Gemma2Config's 50 and 30 ({said})")


def check_imports(cli, work):
    """2. and 3.: the two config forms, and a refusal."""
    torch.manual_seed(0)
    model = Gemma3ForCausalLM(CONFIG)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(0.3 * torch.randn(p.shape) if "norm" in name else 0.4 * torch.randn(p.shape))
    data = import_support.Data(work, CONFIG["vocab_size"], T, 2, 1, num_samples=16, seed=3)
    loss = model(*data.batch(data.rows(0)))
    loss0, norm0 = fs.loss_and_grad_norm(loss, list(model.parameters()))
    log = work / "log.jsonl"
    log.write_text(json.dumps({"step": 0, "loss": loss0, "lr": 1e-3}) + "\n")
    text = [(k, v.detach()) for k, v in named_as_hf(model)]
    import_case(cli, work, data, model, "gemma3-text-t4", transformers4(CONFIG), text, loss0, norm0, log)
    nested = [(k, v.detach()) for k, v in named_as_hf(model, "model.language_model.")]
    nested += [("model.vision_tower.vision_model.embeddings.patch_embedding.weight", torch.randn(8, 3, 2, 2)),
               ("model.multi_modal_projector.mm_input_projection_weight", torch.randn(8, CONFIG["hidden_size"]))]
    import_case(cli, work, data, model, "gemma3-multimodal-t5", transformers5(CONFIG), nested, loss0, norm0, log)

    def log_for(loss):
        path = work / "log-gemma2.jsonl"
        path.write_text(json.dumps({"step": 0, "loss": loss, "lr": 1e-3}) + "\n")
        return path
    check_gemma2_import(cli, work, data, log_for)
    # 3. through the capture helper's reading of configs, which the import runs (no third import: CI's time)
    bad = transformers5(CONFIG)["text_config"]
    bad["rope_parameters"]["sliding_attention"] = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
    try:
        fs.nanreplay_capture._options_from_config(bad, CONFIG["num_hidden_layers"])
        said = "accepted"
    except fs.nanreplay_capture.CaptureError as e:
        said = str(e)
    fs.check("rope_parameters['sliding_attention']" in said, f"a scaled rotary on sliding layers is refused by name ({said})")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cli", required=True)
    ap.add_argument("--work", required=True)
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    check_preset(args.cli, work)
    check_bf16(args.cli, work)
    check_imports(args.cli, work)
    fs.finish()


import import_support  # noqa: E402  (its token data and import runner)

if __name__ == "__main__":
    main()
