"""Llama 4's text attention against eager PyTorch written from transformers' modeling_llama4.py.

The reference transcribes Llama4TextRMSNorm, Llama4TextL2Norm (x * rsqrt(mean(x^2) + eps) in fp32, no
weight), Llama4TextRotaryEmbedding with modeling_rope_utils._compute_llama3_parameters (Llama 4's
low_freq_factor == high_freq_factor: torch.where never takes the 0/0 blend), apply_rotary_emb (q and k
as complex numbers over adjacent pairs, times polar(1, angle): bundle v1's interleaved rope_style),
Llama4TextAttention (rotary and then the L2 QK-norm on layers whose no_rope_layers entry is 1; on the
NoPE layers, 0, neither, and with attn_temperature_tuning q times log(floor((pos + 1) / floor_scale) + 1)
* attn_scale + 1), eager_attention_forward (scores * head_dim**-0.5 plus the finfo.min mask: the chunked
causal mask on the rotary layers, layer_types' default, and the causal one on the NoPE layers; the same
here, every sequence being within one attention_chunk_size chunk) and the decoder layer's pre-norm
residuals. Llama 4's MoE layers are test_family_llama4_moe.py's (and test_import_llama4.py's): here the MLP
is Llama4TextMLP, its dense layers' SwiGLU. The classes take their shape from `cfg` (Llama4TextConfig's names;
CONFIG, the constants below, when left out).

1. A one-step fp32 bundle (qk_norm l2, no_rope_layers [1, 0], attn_temperature_tuning, llama3 rope_scaling
   with equal factors, attention_chunk_size): loss and gradient norm within 1e-5 relative.
   The same model from a one-step bf16 bundle (precision.compute "bf16"): the reference rounds where the
   bundle format does (docs/bundle-format.md, "Precision as replayed": every linear's input, weight and
   bias, q k^T and the scaled scores, every probe site as it is produced, the L2 QK-norm's input and output;
   the temperature computed in fp32 before the attn.q site); loss and gradient norm within 1e-4 relative,
   and that loss departs from the fp32 one.
2. The same bundle without attn_temperature_tuning, and with no_rope_layers [1, 1], departs from it.
3. An attention_chunk_size shorter than data.seq_len changes the loss (chunks are checked against
   Hugging Face's mask in test_family_chunked_attention.py).
4. `nanreplay synth clean-llama4-attn`: its manifest says only what the reference implements (interleaved
   rotary with llama3 scaling, qk_norm l2, no_rope_layers with a rotary and a NoPE layer,
   attn_temperature_tuning, attention_chunk_size, an untied head, fp32); the reference built from the model
   section (config_of_manifest) on each of the first two steps' model.safetensors and own batches
   (micro_batch_size by grad_accum_steps, the loss the micro-batches' mean): the replayed loss and gradient
   norm within 1e-5 relative.

    /usr/bin/python3 tests/py/test_family_llama4_attn.py --cli build/nanreplay --work DIR
"""
import argparse
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import family_support as fs  # noqa: E402
import reference_model  # noqa: E402  (a bundle's batches and safetensors only)

V, C, H, G, LAYERS, FF, T, SAMPLES, EPS, THETA = 64, 32, 4, 2, 2, 40, 16, 2, 1e-5, 10000.0
D = C // H
ROPE = {"rope_type": "llama3", "factor": 16.0, "low_freq_factor": 1.0, "high_freq_factor": 1.0,
        "original_max_position_embeddings": 16}
NO_ROPE_LAYERS = [1, 0]
FLOOR_SCALE, ATTN_SCALE, CHUNK = 2.0, 0.5, 32  # strong enough to show in 16 positions
# The reference's shape and options under Llama4TextConfig's names, defaulting to the constants above (the
# classes below take a `cfg` like it; config_of_manifest gives a bundle's).
CONFIG = {"vocab_size": V, "hidden_size": C, "num_attention_heads": H, "num_key_value_heads": G, "head_dim": D,
          "intermediate_size": FF, "rms_norm_eps": EPS, "rope_theta": THETA, "rope_scaling": ROPE,
          "floor_scale": FLOOR_SCALE, "attn_scale": ATTN_SCALE, "attention_chunk_size": CHUNK}


def compute_llama3_parameters(dim, base, rope_parameters):
    """transformers' _compute_llama3_parameters, line for line."""
    attention_factor = 1.0
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim))
    factor = rope_parameters["factor"]
    low_freq_factor = rope_parameters["low_freq_factor"]
    high_freq_factor = rope_parameters["high_freq_factor"]
    old_context_len = rope_parameters["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    # Llama 4's low == high: a tensor divided by 0.0 (inf or NaN), which the torch.where below never selects.
    smooth_factor = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed_inv_freq = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
    is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    inv_freq_llama = torch.where(is_medium_freq, smoothed_inv_freq, inv_freq_llama)
    return inv_freq_llama, attention_factor


class Llama4TextL2Norm(fs.Rounding, torch.nn.Module):
    def __init__(self, eps=EPS):  # Llama4TextAttention gives it config.rms_norm_eps
        super().__init__()
        self.eps = eps

    def forward(self, x):  # the QK-norm's output is rounded like a site's
        return self.rnd((x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x))


class Llama4TextRMSNorm(fs.Rounding, torch.nn.Module):
    def __init__(self, hidden_size, eps=EPS):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size))

    def forward(self, x):
        output = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x)
        return self.rnd(output * self.weight)  # every norm's output is a site


def apply_rotary_emb(xq, xk, freqs_cis):
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    xq_out = torch.view_as_real(xq_ * freqs_cis[:, :, None, :]).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs_cis[:, :, None, :]).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


class Llama4TextAttention(fs.Rounding, torch.nn.Module):
    def __init__(self, use_rope, tuning, cfg=None):
        super().__init__()
        cfg = cfg or CONFIG
        C, H, G, D = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
        self.head_dim, self.num_key_value_groups = D, H // G
        self.floor_scale, self.attn_scale = cfg["floor_scale"], cfg["attn_scale"]
        self.scaling = D ** -0.5
        self.use_rope, self.tuning = use_rope, tuning
        self.q_proj = fs.Linear(C, H * D, bias=False)
        self.k_proj = fs.Linear(C, G * D, bias=False)
        self.v_proj = fs.Linear(C, G * D, bias=False)
        self.o_proj = fs.Linear(H * D, C, bias=False)
        if use_rope:
            self.qk_norm = Llama4TextL2Norm(cfg["rms_norm_eps"])

    def forward(self, hidden_states, freqs_cis, attention_mask, cache_position):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query_states = self.q_proj(hidden_states).view(hidden_shape)
        key_states = self.k_proj(hidden_states).view(*input_shape, -1, self.head_dim)
        value_states = self.rnd(self.v_proj(hidden_states)).view(hidden_shape).transpose(1, 2)  # attn.v
        if self.use_rope:
            query_states, key_states = apply_rotary_emb(query_states, key_states, freqs_cis)
        if hasattr(self, "qk_norm"):  # the QK-norm reads its input rounded
            query_states = self.qk_norm(self.rnd(query_states))
            key_states = self.qk_norm(self.rnd(key_states))
        if self.tuning and not self.use_rope:
            attn_scales = (torch.log(torch.floor((cache_position.float() + 1.0) / self.floor_scale) + 1.0)
                           * self.attn_scale + 1.0)
            attn_scales = attn_scales.view((1, input_shape[-1], 1, 1)).expand((*input_shape, 1, 1))
            query_states = (query_states * attn_scales).to(query_states.dtype)
        query_states = self.rnd(query_states).transpose(1, 2)  # attn.q
        key_states = self.rnd(key_states).transpose(1, 2)  # attn.k
        key_states = key_states.repeat_interleave(self.num_key_value_groups, dim=1)  # repeat_kv
        value_states = value_states.repeat_interleave(self.num_key_value_groups, dim=1)
        # q k^T rounded, then the scaled scores (the attn.scores site)
        attn_weights = self.rnd(self.rnd(torch.matmul(query_states, key_states.transpose(2, 3))) * self.scaling)
        attn_weights = self.rnd(F.softmax(attn_weights + attention_mask, dim=-1))  # attn.probs
        attn_output = self.rnd(torch.matmul(attn_weights, value_states)).transpose(1, 2).contiguous()  # context
        return self.rnd(self.o_proj(attn_output.reshape(*input_shape, -1).contiguous()))  # attn.out


class Llama4TextMLP(fs.Rounding, torch.nn.Module):
    def __init__(self, cfg=None):
        super().__init__()
        cfg = cfg or CONFIG
        C, FF = cfg["hidden_size"], cfg["intermediate_size"]
        self.gate_proj = fs.Linear(C, FF, bias=False)
        self.up_proj = fs.Linear(C, FF, bias=False)
        self.down_proj = fs.Linear(FF, C, bias=False)

    def forward(self, x):
        gate, up = self.rnd(self.gate_proj(x)), self.rnd(self.up_proj(x))  # mlp.gate, mlp.up
        return self.rnd(self.down_proj(self.rnd(F.silu(gate) * up)))  # mlp.act, mlp.down


class Llama4TextDecoderLayer(fs.Rounding, torch.nn.Module):
    def __init__(self, use_rope, tuning, cfg=None):
        super().__init__()
        cfg = cfg or CONFIG
        self.self_attn = Llama4TextAttention(use_rope, tuning, cfg)
        self.mlp = Llama4TextMLP(cfg)
        self.input_layernorm = Llama4TextRMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])
        self.post_attention_layernorm = Llama4TextRMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])
        # Llama4TextConfig's default layer_types: chunked where the layer is rotary (no_rope_layers 1)
        self.attention_type = "chunked_attention" if use_rope else "full_attention"

    def forward(self, hidden_states, mask, freqs_cis, cache_position):
        residual = hidden_states
        hidden_states = self.rnd(residual + self.self_attn(self.input_layernorm(hidden_states), freqs_cis, mask,
                                                           cache_position))  # attn_residual
        residual = hidden_states
        return self.rnd(residual + self.mlp(self.post_attention_layernorm(hidden_states)))  # output


class Llama4Text(fs.Rounding, torch.nn.Module):
    """Llama4ForCausalLM's text model (untied lm_head), every layer dense; `cfg` its shape (CONFIG when left out)."""

    def __init__(self, no_rope_layers, tuning=True, cfg=None):
        super().__init__()
        cfg = cfg or CONFIG
        C, V = cfg["hidden_size"], cfg["vocab_size"]
        self.attention_chunk_size = cfg["attention_chunk_size"]
        self.embed_tokens = torch.nn.Embedding(V, C)
        self.layers = torch.nn.ModuleList([Llama4TextDecoderLayer(bool(r), tuning, cfg) for r in no_rope_layers])
        self.norm = Llama4TextRMSNorm(C, cfg["rms_norm_eps"])
        self.lm_head = fs.Linear(C, V, bias=False)
        self.inv_freq, self.attention_scaling = compute_llama3_parameters(cfg["head_dim"], cfg["rope_theta"],
                                                                          cfg["rope_scaling"])

    def forward(self, input_ids, labels):
        seq = input_ids.shape[1]
        cache_position = torch.arange(seq)
        position_ids = cache_position[None, :].float()
        freqs = (self.inv_freq[None, :, None].float() @ position_ids[:, None, :]).transpose(1, 2)
        freqs_cis = torch.polar(torch.ones_like(freqs), freqs) * self.attention_scaling
        q_idx, kv_idx = cache_position[:, None], cache_position[None, :]
        # create_chunked_causal_mask (rotary layers) and create_causal_mask (NoPE): every sequence here is
        # within one attention_chunk_size chunk, so both are the causal mask (test_family_chunked_attention.py
        # checks shorter chunks against Hugging Face's mask functions).
        chunk = self.attention_chunk_size or seq
        masked = {"chunked_attention": (kv_idx > q_idx) | (q_idx // chunk != kv_idx // chunk),
                  "full_attention": kv_idx > q_idx}
        masks = {k: torch.zeros(seq, seq).masked_fill(m, torch.finfo(torch.float32).min)[None, None]
                 for k, m in masked.items()}
        hidden_states = self.rnd(self.embed_tokens(input_ids))  # embed
        for layer in self.layers:
            hidden_states = layer(hidden_states, masks[layer.attention_type], freqs_cis, cache_position)
        return fs.cross_entropy(self.rnd(self.lm_head(self.norm(hidden_states))), labels)  # logits


def named(model):
    return [("model." + k if not k.startswith("lm_head") else k, v) for k, v in model.named_parameters()]


MODEL = {"arch": "llama", "vocab_size": V, "hidden_size": C, "num_layers": LAYERS, "num_heads": H,
         "num_kv_heads": G, "intermediate_size": FF, "max_seq_len": 64, "norm_eps": EPS, "rope_theta": THETA,
         "tie_embeddings": False, "rope_style": "interleaved", "rope_scaling": ROPE, "qk_norm": "l2",
         "no_rope_layers": NO_ROPE_LAYERS,
         "attn_temperature_tuning": {"floor_scale": FLOOR_SCALE, "attn_scale": ATTN_SCALE},
         "attention_chunk_size": CHUNK, "attention_mask": "additive_finfo_min"}


# The model section's keys the reference reads (config_of_manifest); a preset saying anything else fails check 4.
UNDERSTOOD = {"arch", "vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
              "intermediate_size", "max_seq_len", "norm_eps", "rope_theta", "tie_embeddings", "rope_style",
              "rope_scaling", "qk_norm", "no_rope_layers", "attn_temperature_tuning", "attention_chunk_size",
              "attention_mask"}


def config_of_manifest(m):
    """Llama4TextConfig's values of a bundle's model section (the reference's inputs; nanreplay never reads it)."""
    tuning = m.get("attn_temperature_tuning") or {}
    return {"vocab_size": m["vocab_size"], "hidden_size": m["hidden_size"], "num_attention_heads": m["num_heads"],
            "num_key_value_heads": m.get("num_kv_heads", m["num_heads"]),
            "head_dim": m.get("head_dim") or m["hidden_size"] // m["num_heads"],
            "intermediate_size": m["intermediate_size"], "rms_norm_eps": m["norm_eps"], "rope_theta": m["rope_theta"],
            "rope_scaling": m["rope_scaling"], "floor_scale": tuning.get("floor_scale"),
            "attn_scale": tuning.get("attn_scale"), "attention_chunk_size": m.get("attention_chunk_size")}


def check_preset(cli, work, preset="clean-llama4-attn"):
    """4. the first two steps of the preset against the reference on the bundle's weights and batches."""
    started = fs.replay_preset_start(cli, work, preset)
    if started is None:
        return
    bundle, report, first_two = started
    m = bundle.manifest["model"]
    # What the reference implements: Llama 4's interleaved rotary with llama3 scaling, the L2 QK-norm, a
    # rotary and a NoPE layer, the temperature on the NoPE layer, an untied head, an additive finfo.min mask
    # (or -inf, the default: the same probabilities, every causal row having an unmasked key), fp32.
    rope_layers = m.get("no_rope_layers") or []
    fs.check(set(m) <= UNDERSTOOD and m.get("rope_style") == "interleaved" and m.get("qk_norm") == "l2"
             and m.get("tie_embeddings") is False and set(rope_layers) == {0, 1}
             and len(rope_layers) == m["num_layers"] and m.get("attn_temperature_tuning")
             and m.get("attention_mask", "additive_neg_inf") in ("additive_neg_inf", "additive_finfo_min")
             and (m.get("rope_scaling") or {}).get("rope_type") == "llama3"
             and bundle.manifest["precision"]["compute"] == "fp32",
             f"{preset}'s manifest says only what the reference implements, a NoPE layer with temperature tuning "
             f"(not understood: {sorted(set(m) - UNDERSTOOD)}; {m})")
    cfg = config_of_manifest(m)
    dirs = {e["step"]: e["dir"] for e in bundle.manifest["steps"]}
    for row in report["steps"]:
        model = Llama4Text(rope_layers, tuning=True, cfg=cfg)
        weights = reference_model.read_safetensors(bundle.root / dirs[row["step"]] / "model.safetensors")
        with torch.no_grad():
            for k, p in named(model):
                p.copy_(weights.pop(k))
        fs.check(not weights, f"{preset} step {row['step']}: every tensor is a reference parameter ({sorted(weights)})")
        fs.compare_bundle_step(bundle, row, model, f"{preset} step {row['step']}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cli", required=True)
    ap.add_argument("--work", required=True)
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    model = Llama4Text(NO_ROPE_LAYERS)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.3 * torch.randn(p.shape) if "norm" in name else 0.4 * torch.randn(p.shape))
    stream = fs.token_stream(V, SAMPLES, T, seed=4)
    inputs, targets = fs.batch_of(stream, SAMPLES, T)
    loss, norm = fs.loss_and_grad_norm(model(inputs, targets), list(model.parameters()))
    bundle = fs.write_bundle(work / "llama4", MODEL, named(model), stream, SAMPLES, T, loss, norm)
    rc, report, err = fs.replay(args.cli, bundle, work / "out-llama4")
    if fs.check(report is not None, f"llama4: nanreplay run gave a report (exit {rc}; {err.strip()[-300:]})"):
        fs.compare_step(report, loss, norm, "Llama 4 attention (L2 QK-norm, NoPE layer, temperature tuning)")
    fs.check_bf16_step(args.cli, work, "llama4-bf16", MODEL, model, named, stream, SAMPLES, T,
                       "Llama 4 attention in bf16 (the L2 QK-norm's input and output rounded)")
    for what, change in (("without attn_temperature_tuning", {"attn_temperature_tuning": None}),
                         ("with every layer rotary", {"no_rope_layers": [1, 1]})):
        other = {k: v for k, v in dict(MODEL, **change).items() if v is not None}
        bundle = fs.write_bundle(work / "other", other, named(model), stream, SAMPLES, T, loss, norm)
        rc, report, err = fs.replay(args.cli, bundle, work / "out-other")
        if fs.check(report is not None, f"{what}: a report (exit {rc}; {err.strip()[-300:]})"):
            fs.check(fs.rel_err(report["steps"][0]["loss"], loss) > 1e-4,
                     f"{what}: the loss departs ({report['steps'][0]['loss']} vs {loss})")
    # Chunks shorter than the sequence change the rotary layers' keys (test_family_chunked_attention.py
    # checks the chunked loss against Hugging Face's mask): no longer the one-chunk loss.
    long = dict(MODEL, attention_chunk_size=T // 2)
    bundle = fs.write_bundle(work / "long", long, named(model), stream, SAMPLES, T, loss, norm)
    rc, report, err = fs.replay(args.cli, bundle, work / "out-long")
    if fs.check(report is not None, f"attention_chunk_size {T // 2} < seq_len: a report (exit {rc}; {err.strip()[-300:]})"):
        fs.check(fs.rel_err(report["steps"][0]["loss"], loss) > 1e-4,
                 f"attention_chunk_size {T // 2} < seq_len: the loss departs ({report['steps'][0]['loss']} vs {loss})")
    check_preset(args.cli, work)
    fs.finish()


if __name__ == "__main__":
    main()
