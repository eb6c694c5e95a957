"""Phi-3 and GLM through `nanreplay import`, against eager PyTorch written from transformers'
modeling_phi3.py, modeling_glm.py and modeling_glm4.py.

- Phi3ForCausalLM: llama's pre-norm block with a fused `self_attn.qkv_proj` (rows: the H query heads,
  then the G key heads, then the G value heads; Phi3Attention slices qkv[..., :H*D] and so on) and a
  fused `mlp.gate_up_proj` (Phi3MLP: `gate, up = gate_up_proj(x).chunk(2, -1)`, `up * silu(gate)`);
  rotary over halves (rotate_half) on the first int(head_dim * partial_rotary_factor) dims (Phi-4-mini:
  0.75); `sliding_window` on every layer (create_sliding_window_causal_mask: q sees k when
  q - window < k <= q); eager attention adds finfo.min at masked keys.
- GlmForCausalLM (GLM-4): llama's block with q/k/v biases, Phi3MLP, and GLM's rotary: adjacent pairs
  (rotate_half over x[0::2], x[1::2]; cos/sin's first half repeat_interleave'd) on the first
  head_dim * 0.5 dims.
- Glm4ForCausalLM (GLM-4-0414): GLM's attention and MLP in a sandwich: input_layernorm, attention,
  post_self_attn_layernorm, add; post_attention_layernorm, MLP, post_mlp_layernorm, add.

1. Each model saved as save_pretrained writes it (config.json, model.safetensors with its own names, a
   tied head left out) is imported and replayed: loss and gradient norm within 1e-5 relative.
2. Controls: the imported bundle with k and v (split out of qkv_proj) or gate and up (out of
   gate_up_proj) swapped replays away from the reference, so the split is what the comparisons check.
4. `nanreplay synth clean-phi3` and `clean-glm4`: every step's replayed loss and gradient norm against
   the reference on the bundle's own weights (q/k/v and gate/up stacked back into qkv_proj and
   gate_up_proj, GLM-4's norms from the sandwich keys) and batches, within 1e-5 relative.
5. Phi-3 and GLM-4-0414 from one-step bf16 bundles: the reference rounds where the bundle format does
   (docs/bundle-format.md, "Precision as replayed": every linear's input, weight and bias, q k^T and the
   scaled scores, every probe site as it is produced; q and k rotated in fp32, the pass-through dims
   with them); loss and gradient norm within 1e-4 relative, and that loss departs from the fp32 one.
3. Refusals: `nanreplay import` of model_type phi exits 2 with one line naming it; the import's model_type
   check refuses phi and stablelm, the config reading it shares with the capture helper longrope / su
   and nonzero dropouts (resid_pdrop, embd_pdrop, attention_dropout), each by name; GlmConfig's defaults
   where a config leaves them out are recorded as such.

    /usr/bin/python3 tests/py/test_family_phi3_glm.py --cli build/nanreplay --work DIR
"""
import argparse
import collections
import json
import shutil
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import family_support as fs  # noqa: E402
import import_support  # noqa: E402  (its token data and import runner)
import reference_model  # noqa: E402  (a bundle's batches only)
import synth_cache  # noqa: E402
from reference_model import read_safetensors  # noqa: E402

V, C, H, G, D, FF, LAYERS, T, EPS, THETA = 64, 32, 4, 2, 8, 48, 2, 12, 1e-5, 10000.0


# ---- transcribed from modeling_phi3.py / modeling_glm.py / modeling_glm4.py -------------------------
# bf16 (set_compute): rounded where docs/bundle-format.md's "Precision as replayed" says, each site marked.

Dims = collections.namedtuple("Dims", "V C H G D FF LAYERS EPS THETA")
DIMS = Dims(V, C, H, G, D, FF, LAYERS, EPS, THETA)


class RMSNorm(fs.Rounding, nn.Module):  # Phi3RMSNorm, GlmRMSNorm, Glm4RMSNorm
    def __init__(self, hidden_size, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.rnd(self.weight * hidden_states.to(input_dtype))  # every norm's output is a site


class SplitLinear(fs.Linear):
    """A fused projection (qkv_proj, gate_up_proj) as the bundle replays it in bf16: the import splits it into
    llama's linears, and each of those rounds its own input (so the gradient reaching the input is rounded per
    block, then summed); fp32: F.linear by blocks of `rows`."""

    def __init__(self, in_features, rows):
        super().__init__(in_features, sum(rows), bias=False)
        self.rows = rows

    def forward(self, x):
        return torch.cat([F.linear(self.rnd(x), self.rnd(w)) for w in self.weight.split(self.rows)], dim=-1)


class MLP(fs.Rounding, nn.Module):  # Phi3MLP (GlmMLP, Glm4MLP are it)
    def __init__(self, dims=DIMS):
        super().__init__()
        self.gate_up_proj = SplitLinear(dims.C, [dims.FF, dims.FF])
        self.down_proj = fs.Linear(dims.FF, dims.C, bias=False)

    def forward(self, hidden_states):
        up_states = self.gate_up_proj(hidden_states)
        gate, up_states = up_states.chunk(2, dim=-1)
        gate, up_states = self.rnd(gate), self.rnd(up_states)  # mlp.gate, mlp.up
        up_states = self.rnd(up_states * F.silu(gate))  # mlp.act
        return self.rnd(self.down_proj(up_states))  # mlp.down


def rotate_half(x):  # modeling_phi3.py
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def phi3_apply_rotary_pos_emb(q, k, cos, sin):
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    rotary_dim = cos.shape[-1]
    q_rot, q_pass = q[..., :rotary_dim], q[..., rotary_dim:]
    k_rot, k_pass = k[..., :rotary_dim], k[..., rotary_dim:]
    q_embed = torch.cat([(q_rot * cos) + (rotate_half(q_rot) * sin), q_pass], dim=-1)
    k_embed = torch.cat([(k_rot * cos) + (rotate_half(k_rot) * sin), k_pass], dim=-1)
    return q_embed, k_embed


def glm_rotate_half(x):  # modeling_glm.py
    x1 = x[..., 0::2]
    x2 = x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def glm_apply_rotary_pos_emb(q, k, cos, sin):
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    cos = cos[..., : cos.shape[-1] // 2].repeat_interleave(2, dim=-1)
    sin = sin[..., : sin.shape[-1] // 2].repeat_interleave(2, dim=-1)
    rotary_dim = cos.shape[-1]
    q_rot, q_pass = q[..., :rotary_dim], q[..., rotary_dim:]
    k_rot, k_pass = k[..., :rotary_dim], k[..., rotary_dim:]
    q_embed = torch.cat([(q_rot * cos) + (glm_rotate_half(q_rot) * sin), q_pass], dim=-1)
    k_embed = torch.cat([(k_rot * cos) + (glm_rotate_half(k_rot) * sin), k_pass], dim=-1)
    return q_embed, k_embed


def eager_attention(q, k, v, mask, dims, rnd):
    """q, k (rotated in fp32) and v: rounded here as the attn.q, attn.k and attn.v sites."""
    q, k, v = rnd(q), rnd(k), rnd(v)
    k = k.repeat_interleave(dims.H // dims.G, dim=1)  # repeat_kv
    v = v.repeat_interleave(dims.H // dims.G, dim=1)
    w = rnd(rnd(torch.matmul(q, k.transpose(2, 3))) * dims.D ** -0.5) + mask  # q k^T, then the scaled scores
    w = rnd(F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype))  # attn.probs
    return rnd(torch.matmul(w, v)).transpose(1, 2).contiguous()  # the context


class Phi3Attention(fs.Rounding, nn.Module):
    def __init__(self, dims=DIMS):
        super().__init__()
        self.dims = dims
        self.o_proj = fs.Linear(dims.H * dims.D, dims.C, bias=False)
        self.qkv_proj = SplitLinear(dims.C, [dims.H * dims.D, dims.G * dims.D, dims.G * dims.D])

    def forward(self, x, mask, cos, sin):
        B, S, _ = x.shape
        H, G, D = self.dims.H, self.dims.G, self.dims.D
        qkv = self.qkv_proj(x)
        q = qkv[..., :H * D]
        k = qkv[..., H * D:H * D + G * D]
        v = qkv[..., H * D + G * D:]
        q, k, v = (t.view(B, S, -1, D).transpose(1, 2) for t in (q, k, v))
        q, k = phi3_apply_rotary_pos_emb(q, k, cos, sin)
        return self.rnd(self.o_proj(eager_attention(q, k, v, mask, self.dims, self.rnd).reshape(B, S, -1)))  # attn.out


class GlmAttention(fs.Rounding, nn.Module):  # LlamaAttention with config.attention_bias, GLM's rotary
    def __init__(self, dims=DIMS):
        super().__init__()
        self.dims = dims
        C, H, G, D = dims.C, dims.H, dims.G, dims.D
        self.q_proj = fs.Linear(C, H * D, bias=True)
        self.k_proj = fs.Linear(C, G * D, bias=True)
        self.v_proj = fs.Linear(C, G * D, bias=True)
        self.o_proj = fs.Linear(H * D, C, bias=False)

    def forward(self, x, mask, cos, sin):
        B, S, _ = x.shape
        D = self.dims.D
        q, k, v = (p(x).view(B, S, -1, D).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        q, k = glm_apply_rotary_pos_emb(q, k, cos, sin)
        return self.rnd(self.o_proj(eager_attention(q, k, v, mask, self.dims, self.rnd).reshape(B, S, -1)))  # attn.out


class DecoderLayer(fs.Rounding, nn.Module):
    def __init__(self, family, dims=DIMS):
        super().__init__()
        self.family = family
        C, EPS = dims.C, dims.EPS
        self.self_attn = Phi3Attention(dims) if family == "phi3" else GlmAttention(dims)
        self.mlp = MLP(dims)
        self.input_layernorm = RMSNorm(C, EPS)
        self.post_attention_layernorm = RMSNorm(C, EPS)
        if family == "glm4":
            self.post_self_attn_layernorm = RMSNorm(C, EPS)
            self.post_mlp_layernorm = RMSNorm(C, EPS)

    def forward(self, x, mask, cos, sin):
        if self.family == "glm4":  # Glm4DecoderLayer
            h = self.post_self_attn_layernorm(self.self_attn(self.input_layernorm(x), mask, cos, sin))
            x = self.rnd(x + h)  # attn_residual
            return self.rnd(x + self.post_mlp_layernorm(self.mlp(self.post_attention_layernorm(x))))  # output
        x = self.rnd(x + self.self_attn(self.input_layernorm(x), mask, cos, sin))  # resid_attn_dropout: p 0
        return self.rnd(x + self.mlp(self.post_attention_layernorm(x)))


class Inner(fs.Rounding, nn.Module):
    def __init__(self, family, dims=DIMS):
        super().__init__()
        self.embed_tokens = nn.Embedding(dims.V, dims.C)
        self.layers = nn.ModuleList([DecoderLayer(family, dims) for _ in range(dims.LAYERS)])
        self.norm = RMSNorm(dims.C, dims.EPS)


class ForCausalLM(fs.Rounding, nn.Module):
    def __init__(self, family, factor, window=None, tied=False, dims=DIMS):
        super().__init__()
        self.family, self.window, self.tied = family, window, tied
        self.model = Inner(family, dims)
        if not tied:
            self.lm_head = fs.Linear(dims.C, dims.V, bias=False)
        dim = int(dims.D * factor)  # compute_default_rope_parameters
        self.inv_freq = 1.0 / (dims.THETA ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))

    def forward(self, input_ids, labels):
        S = input_ids.shape[1]
        pos = torch.arange(S)[None, :].float()
        freqs = (self.inv_freq[None, :, None] @ pos[:, None, :]).transpose(1, 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        q, k = torch.arange(S)[:, None], torch.arange(S)[None, :]
        masked = k > q
        if self.window is not None:
            masked = masked | (k <= q - self.window)
        mask = torch.zeros(S, S).masked_fill(masked, torch.finfo(torch.float32).min)[None, None]
        x = self.rnd(self.model.embed_tokens(input_ids))  # embed
        for layer in self.model.layers:
            x = layer(x, mask, cos, sin)
        x = self.model.norm(x)
        head = self.model.embed_tokens.weight if self.tied else self.lm_head.weight
        return fs.cross_entropy(self.rnd(F.linear(self.rnd(x), self.rnd(head))), labels)  # logits


def init(model, seed):
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.3 * torch.randn(p.shape) if "norm" in name else 0.4 * torch.randn(p.shape))
    return model


# ---- config.json as save_pretrained writes them ------------------------------------------------------

def phi3_config(factor=None, window=None, tied=False):
    cfg = {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "vocab_size": V, "hidden_size": C,
           "intermediate_size": FF, "num_hidden_layers": LAYERS, "num_attention_heads": H, "num_key_value_heads": G,
           "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attention_dropout": 0.0, "hidden_act": "silu",
           "max_position_embeddings": 64, "original_max_position_embeddings": 64, "initializer_range": 0.02,
           "rms_norm_eps": EPS, "use_cache": True, "tie_word_embeddings": tied, "rope_theta": THETA,
           "rope_scaling": None, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
           "sliding_window": window, "torch_dtype": "float32", "transformers_version": "4.51.3"}
    if factor is not None:
        cfg["partial_rotary_factor"] = factor
    return cfg


def glm_config(model_type):
    return {"architectures": ["GlmForCausalLM" if model_type == "glm" else "Glm4ForCausalLM"],
            "model_type": model_type, "vocab_size": V, "hidden_size": C, "intermediate_size": FF,
            "num_hidden_layers": LAYERS, "num_attention_heads": H, "num_key_value_heads": G, "head_dim": D,
            "partial_rotary_factor": 0.5, "hidden_act": "silu", "attention_dropout": 0.0,
            "max_position_embeddings": 64, "initializer_range": 0.02, "rms_norm_eps": EPS, "use_cache": True,
            "tie_word_embeddings": False, "rope_theta": THETA, "pad_token_id": 0, "eos_token_id": [2, 3],
            "bos_token_id": None, "attention_bias": True, "torch_dtype": "float32", "transformers_version": "4.51.3"}


# ---- the bundle's names (nanreplay's parameter table: llama's, q/k/v and gate/up apart) -----------------

# Glm4DecoderLayer's norms under the sandwich layout's keys (Gemma's: post-attention, pre- and post-feedforward).
GLM4_NORMS = {"post_self_attn_layernorm": "post_attention_layernorm",
              "post_attention_layernorm": "pre_feedforward_layernorm",
              "post_mlp_layernorm": "post_feedforward_layernorm"}


def bundle_keys(name, family):
    """The bundle keys whose rows, stacked, make the reference's parameter `name`: qkv_proj is q, k and v
    (Phi3Attention's slices), gate_up_proj gate and up (Phi3MLP's chunk); GLM-4's norms are renamed."""
    if name.count(".") < 2:  # lm_head.weight
        return [name]
    prefix, leaf, kind = name.rsplit(".", 2)
    if leaf == "qkv_proj":
        return [f"{prefix}.{n}_proj.{kind}" for n in "qkv"]
    if leaf == "gate_up_proj":
        return [f"{prefix}.gate_proj.{kind}", f"{prefix}.up_proj.{kind}"]
    if family == "glm4" and leaf in GLM4_NORMS:
        return [f"{prefix}.{GLM4_NORMS[leaf]}.{kind}"]
    return [name]


def split_named(model, dims=DIMS):
    """[(bundle key, tensor)] of `model`, in its module order."""
    out = []
    for name, t in model.named_parameters():
        keys = bundle_keys(name, model.family)
        rows = {3: [dims.H * dims.D, dims.G * dims.D, dims.G * dims.D], 2: [t.shape[0] // 2] * 2, 1: [t.shape[0]]}
        out += list(zip(keys, t.split(rows[len(keys)])))
    return out


def load_bundle_weights(model, weights):
    """`model`'s parameters from a bundle checkpoint `weights` (split_named's inverse)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.cat([weights[k] for k in bundle_keys(name, model.family)]))


def save(directory, model, config_json, state=None):
    directory.mkdir(parents=True, exist_ok=True)
    state = state if state is not None else [(k, v.detach()) for k, v in model.named_parameters()]
    fs.nanreplay_capture.write_safetensors(directory / "model.safetensors", state)
    (directory / "config.json").write_text(json.dumps(config_json, indent=2))


def import_and_replay(cli, work, data, label, model, config_json, want):
    """`model` saved as save_pretrained would, imported and replayed: the manifest's options and the
    replayed step against the reference. Returns the imported bundle (None when the import failed)."""
    loss0, norm0 = fs.loss_and_grad_norm(model(*data.batch(data.rows(0))), list(model.parameters()))
    directory = work / label
    save(directory, model, config_json)
    log = work / (label + "-log.jsonl")
    log.write_text(json.dumps({"step": 0, "loss": loss0, "lr": 1e-3}) + "\n")
    imported = work / (label + "-imported")
    proc = import_support.run_import(cli, ["--checkpoint", directory, *data.flags(), "--log", log, "--steps", "0:0"],
                                     imported)
    if not fs.check(proc.returncode == 0, f"import of {label}: exit {proc.returncode} {proc.stderr.strip()[-400:]}"):
        return None
    m = json.loads((imported / "manifest.json").read_text())["model"]
    wrong = {k: m.get(k) for k, v in want.items() if m.get(k) != v}
    fs.check(not wrong, f"import of {label}: the manifest's options (differing: {wrong})")
    rc, report, err = fs.replay(cli, imported, work / (label + "-out"))
    if fs.check(report is not None, f"imported {label} replays (exit {rc}; {err.strip()[-300:]})"):
        fs.compare_step(report, loss0, norm0, f"imported {label}")
    return imported


def check_swapped(cli, work, imported, label, a, b, loss0):
    """2. A control: the imported bundle with layer 0's `a` and `b` swapped replays away from the reference."""
    if imported is None:
        return
    bundle = work / (label + "-control")
    shutil.rmtree(bundle, ignore_errors=True)
    shutil.copytree(imported, bundle)
    path = bundle / "steps" / "0" / "model.safetensors"
    state = read_safetensors(path)
    state[a], state[b] = state[b], state[a]
    fs.nanreplay_capture.write_safetensors(path, list(state.items()))
    rc, report, err = fs.replay(cli, bundle, work / (label + "-control-out"))
    loss = report["steps"][0]["loss"] if report and report.get("steps") else None
    fs.check(loss is not None and fs.rel_err(loss, loss0) > 1e-3,
             f"control {label}: {a.split('.')[-2]} and {b.split('.')[-2]} swapped, the replay departs from the "
             f"reference ({loss} vs {loss0}; exit {rc} {err.strip()[-200:]})")


def refusal(cli, work, data, label, model, config_json, key):
    """3. `nanreplay import` of `model` saved with `config_json`: exit 2, one line naming `key`."""
    directory = work / label
    save(directory, model, config_json)
    log = work / (label + "-log.jsonl")
    log.write_text(json.dumps({"step": 0, "loss": 1.0, "lr": 1e-3}) + "\n")
    proc = import_support.run_import(cli, ["--checkpoint", directory, *data.flags(), "--log", log, "--steps", "0:0"],
                                     work / (label + "-imported"))
    fs.check_refused(proc.returncode, proc.stderr, f"refusal {label}", key)


def check_config_readings():
    """3. The same refusals through the config reading the import shares with the capture helper (no
    process each): model_type stablelm, longrope (and Phi-3's older "su"), nonzero dropouts; the defaults
    of a GLM config that leaves attention_bias and partial_rotary_factor out, recorded as such."""
    cap = fs.nanreplay_capture
    refused = {"stablelm": dict(phi3_config(), model_type="stablelm"),
               "'longrope'": dict(phi3_config(), rope_scaling={"type": "longrope", "long_factor": [1.0] * 3,
                                                               "short_factor": [1.0] * 3}),
               "'su'": dict(phi3_config(), rope_scaling={"type": "su", "long_factor": [1.0] * 3,
                                                         "short_factor": [1.0] * 3}),
               "resid_pdrop": dict(phi3_config(), resid_pdrop=0.1), "embd_pdrop": dict(phi3_config(), embd_pdrop=0.1),
               "attention_dropout": dict(glm_config("glm"), attention_dropout=0.1)}
    for key, cfg in refused.items():
        try:
            cap._refuse_model_type(cfg)
            cap._options_from_config(cfg, LAYERS)
            said = "accepted"
        except cap.CaptureError as e:
            said = str(e)
        fs.check(key in said, f"config reading refuses {key} by name ({said})")
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "capture"))
    from nanreplay_import import model_settle
    from nanreplay_import.outcome import BadInput
    for model_type in ("phi", "stablelm"):
        try:
            model_settle.refuse_model_type([(dict(phi3_config(), model_type=model_type), "config.json")])
            said = "accepted"
        except BadInput as e:
            said = str(e)
        fs.check(f"'{model_type}'" in said and "model_type" in said,
                 f"the import refuses model_type {model_type!r} by name ({said})")
    bare = {k: v for k, v in glm_config("glm").items() if k not in ("attention_bias", "partial_rotary_factor")}
    said = cap._options_from_config(bare, LAYERS)
    fs.check(said["attention_bias"][0] is True and said["partial_rotary_factor"][0] == 0.5
             and "default" in said["attention_bias"][1] and "default" in said["partial_rotary_factor"][1],
             f"GLM without attention_bias / partial_rotary_factor: GlmConfig's defaults, recorded as such ({said})")


def check_moment_split(model):
    """An optimizer's moments follow their parameters: the import's Mapper (which maps both) splits a
    qkv_proj-shaped and a gate_up_proj-shaped tensor into exactly the row blocks Phi3Attention and
    Phi3MLP slice."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "capture"))
    from nanreplay_import.naming import Mapper
    mapper = Mapper("hf", {"num_heads": H, "num_kv_heads": G, "hidden_size": C, "head_dim": None,
                           "model_type": "phi3"})
    moments = {k: torch.randn(v.shape) for k, v in model.named_parameters()}
    out = mapper.map(moments, "test")
    qkv, gate_up = moments["model.layers.1.self_attn.qkv_proj.weight"], moments["model.layers.1.mlp.gate_up_proj.weight"]
    p = "model.layers.1."
    fs.check(torch.equal(out[p + "self_attn.q_proj.weight"], qkv[:H * D])
             and torch.equal(out[p + "self_attn.k_proj.weight"], qkv[H * D:(H + G) * D])
             and torch.equal(out[p + "self_attn.v_proj.weight"], qkv[(H + G) * D:])
             and torch.equal(out[p + "mlp.gate_proj.weight"], gate_up[:FF])
             and torch.equal(out[p + "mlp.up_proj.weight"], gate_up[FF:])
             and not any("qkv_proj" in k or "gate_up_proj" in k for k in out),
             "a moment of qkv_proj / gate_up_proj splits into q, k, v and gate, up as the parameters do")


# ---- the presets, and bf16 ---------------------------------------------------------------------------

# Each preset's family and the options its manifest must say (the reference reads its sizes from the manifest).
PRESETS = {"clean-phi3": ("phi3", {"partial_rotary_factor": 0.75, "tie_embeddings": True, "sliding_window": 8}),
           "clean-glm4": ("glm4", {"partial_rotary_factor": 0.5, "rope_style": "interleaved",
                                   "attention_bias": True, "norm_layout": "sandwich"})}


def dims_of_manifest(m):
    return Dims(m["vocab_size"], m["hidden_size"], m["num_heads"], m.get("num_kv_heads", m["num_heads"]),
                m["hidden_size"] // m["num_heads"], m["intermediate_size"], m["num_layers"], m["norm_eps"],
                m["rope_theta"])


def check_preset(cli, work, preset):
    """Every step of `nanreplay synth PRESET` against the reference on the bundle's own weights and batches."""
    family, options = PRESETS[preset]
    bundle_dir = work / preset
    synth_cache.synth(cli, preset, bundle_dir)
    rc, report, err = fs.replay(cli, bundle_dir, work / f"out-{preset}")
    if not fs.check(report is not None and rc == 0, f"{preset} replays (exit {rc}; {err.strip()[-300:]})"):
        return
    bundle = reference_model.Bundle(bundle_dir)
    m = bundle.manifest["model"]
    wrong = {k: m.get(k) for k, v in options.items() if m.get(k) != v}
    fs.check(not wrong, f"{preset}'s manifest says the family's options (differing: {wrong})")
    dirs = {e["step"]: e["dir"] for e in bundle.manifest["steps"]}
    for row in report["steps"]:
        model = ForCausalLM(family, m["partial_rotary_factor"], window=m.get("sliding_window"),
                            tied=m.get("tie_embeddings", False), dims=dims_of_manifest(m))
        load_bundle_weights(model, read_safetensors(bundle.root / dirs[row["step"]] / "model.safetensors"))
        fs.compare_bundle_step(bundle, row, model, f"{preset} step {row['step']}")


def manifest_model(family, factor, window=None, tied=False):
    """Bundle v1's model section of this file's sizes for `family` (the options `nanreplay import` sets)."""
    m = {"arch": "llama", "vocab_size": V, "hidden_size": C, "num_layers": LAYERS, "num_heads": H, "num_kv_heads": G,
         "intermediate_size": FF, "max_seq_len": 64, "norm_eps": EPS, "rope_theta": THETA, "tie_embeddings": tied,
         "partial_rotary_factor": factor, "attention_mask": "additive_finfo_min"}
    if window is not None:
        m["sliding_window"] = window
    if family != "phi3":
        m.update(rope_style="interleaved", attention_bias=True)
    if family == "glm4":
        m["norm_layout"] = "sandwich"
    return m


def check_bf16(cli, work, data):
    """Phi-3 (partial rotary 0.75, tied, a window of 5) and GLM-4-0414 from one-step bf16 bundles, against the
    reference with its rounding points on."""
    stream = fs.token_stream(V, 2, T, seed=7)
    cases = [("phi3", 0.75, 5, True, 5), ("glm4", 0.5, None, False, 6)]
    for family, factor, window, tied, seed in cases:
        model = init(ForCausalLM(family, factor, window=window, tied=tied), seed)
        fs.check_bf16_step(cli, work, f"{family}-bf16", manifest_model(family, factor, window, tied), model,
                           split_named, stream, 2, T, f"{family} in bf16 (partial rotary {factor})")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cli", required=True)
    ap.add_argument("--work", required=True)
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    data = import_support.Data(work, V, T, 2, 1, num_samples=16, seed=3)
    cli = args.cli
    check_config_readings()

    # 1. Phi-4-mini's shape of Phi-3 (partial rotary 0.75, tied head) with Phi-3-mini's window; GLM-4; GLM-4-0414.
    phi3 = init(ForCausalLM("phi3", 0.75, window=5, tied=True), 1)
    imported = import_and_replay(cli, work, data, "phi3", phi3, phi3_config(factor=0.75, window=5, tied=True),
                                 {"sliding_window": 5, "attention_mask": "additive_finfo_min", "num_kv_heads": G,
                                  "intermediate_size": FF, "tie_embeddings": True, "partial_rotary_factor": 0.75,
                                  "rope_style": None})
    check_moment_split(phi3)
    batch = data.batch(data.rows(0))
    with torch.no_grad():
        phi3_loss = float(phi3(*batch))
    # 2. k and v (qkv_proj's second and third blocks), gate and up (gate_up_proj's halves), swapped.
    check_swapped(cli, work, imported, "phi3-kv", "model.layers.0.self_attn.k_proj.weight",
                  "model.layers.0.self_attn.v_proj.weight", phi3_loss)
    glm = init(ForCausalLM("glm", 0.5), 3)
    glm_want = {"rope_style": "interleaved", "partial_rotary_factor": 0.5, "attention_bias": True}
    imported = import_and_replay(cli, work, data, "glm", glm, glm_config("glm"), glm_want)
    with torch.no_grad():
        glm_loss = float(glm(*batch))
    check_swapped(cli, work, imported, "glm-gate-up", "model.layers.0.mlp.gate_proj.weight",
                  "model.layers.0.mlp.up_proj.weight", glm_loss)
    glm4 = init(ForCausalLM("glm4", 0.5), 4)
    import_and_replay(cli, work, data, "glm4", glm4, glm_config("glm4"), dict(glm_want, norm_layout="sandwich"))

    for preset in PRESETS:
        check_preset(cli, work, preset)
    check_bf16(cli, work, data)

    # 3. A refusal through the command.
    refusal(cli, work, data, "phi", phi3, dict(phi3_config(), model_type="phi"), "'phi'")
    fs.finish()


if __name__ == "__main__":
    main()
