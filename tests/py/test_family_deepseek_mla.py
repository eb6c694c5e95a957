"""DeepSeek-V3's multi-head latent attention (model.latent_attention) against eager PyTorch written from
transformers' src/transformers/models/deepseek_v3/modeling_deepseek_v3.py (Kimi K2 runs the same modeling).

The reference transcribes DeepseekV3RMSNorm (fp32, eps 1e-6 for the latents' q_a_layernorm and kv_a_layernorm,
which DeepseekV3Attention builds with the class default, rms_norm_eps for the block's), DeepseekV3RotaryEmbedding
over qk_rope_head_dim (DeepseekV3Config's head_dim) with YaRN (modeling_rope_utils._compute_yarn_parameters,
as test_family_gpt_oss_attn.py transcribes it: cos and sin times get_mscale(factor, mscale) /
get_mscale(factor, mscale_all_dim)), apply_rotary_pos_emb_interleave (rope_interleave, bundle v1's
rope_style "interleaved") and apply_rotary_pos_emb (rotate_half), DeepseekV3Attention (q_a_proj,
q_a_layernorm, q_b_proj or q_proj; kv_a_proj_with_mqa split into the kv latent and one rotary key head,
kv_a_layernorm, kv_b_proj split into k_nope and v; k_rot expanded over the heads; scaling qk_head_dim ** -0.5
times yarn_get_mscale(factor, mscale_all_dim) ** 2), eager_attention_forward with the finfo.min causal mask,
DeepseekV3MLP (dense layers) and DeepseekV3DecoderLayer's pre-norm residuals; an untied lm_head.

1. A one-step fp32 bundle (q_lora_rank 16, kv_lora_rank 8, nope 8, rope 4, v 8, 4 heads, YaRN with mscale 1
   and mscale_all_dim 0.8): loss and gradient norm within 1e-5 relative. The same model in bf16: the reference
   rounds where docs/bundle-format.md "Precision as replayed" and "Multi-head latent attention" say (every
   linear's input, weight and bias, a latent before and after its norm, q k^T and the scaled scores, every
   site; q_pe and k_pe rotate in fp32 from the unrounded projection); within 1e-4, departing from fp32.
2. q_lora_rank null (a plain q_proj, DeepSeek-V2-Lite's layout): within 1e-5.
3. The check fails when a mechanism is removed: the reference without the softmax's mscale, with k_pe left
   out of k, with k_pe given to head 0 only (not shared), with k_nope and v swapped in kv_b_proj's output, and
   nanreplay's replay with rope_style rotate_half: each departs from the other side by more than 1e-4 (that
   replay is within 1e-5 of the reference with rope_interleave false).
4. `nanreplay synth clean-deepseek-mla` (first two steps) and clean-deepseek-mla-bf16 (first step) against the
   reference built from the manifest on each step's weights and batches.
5. `nanreplay import` of a dense DeepSeek-V3 checkpoint as save_pretrained writes one (config.json with
   model_type deepseek_v3, first_k_dense_replace >= num_hidden_layers, head_dim = qk_rope_head_dim, rope_interleave
   and YaRN with mscale_all_dim; model.safetensors under DeepseekV3ForCausalLM's names) plus one multi-token
   prediction layer (model.layers.2.eh_proj/enorm/hnorm/shared_head and a decoder block, as DeepSeek-V3's
   checkpoints carry num_nextn_predict_layers of them): without --mtp-loss-scale the import is refused naming the
   flag and the layer; with --mtp-loss-scale 0 it names the MTP layer as left out, report.json's
   multi_token_prediction says so (test_family_deepseek_mtp.py replays MTP layers), the manifest
   has model.latent_attention (norm_eps 1e-6) and rope_style interleaved, and the replay is within 1e-5 of the
   reference's loss and gradient norm. The same checkpoint with first_k_dense_replace 1 (layer 1 an MoE layer,
   test_family_deepseek_moe.py imports those) and a dense layer 1 is refused naming the MoE layer's missing
   mlp.gate.e_score_correction_bias. DeepSeek's own names (inference/convert.py of
   deepseek-ai/DeepSeek-V3: its mapping table applied to these names) map back onto these, and Megatron's MLA
   names are refused naming the key.

    /usr/bin/python3 tests/py/test_family_deepseek_mla.py --cli build/nanreplay --work DIR
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
import synth_cache  # noqa: E402
from test_family_gpt_oss_attn import compute_yarn_parameters  # noqa: E402  (modeling_rope_utils' YaRN)

V, C, H, LAYERS, FF, T, SAMPLES, EPS, THETA = 64, 32, 4, 2, 48, 16, 2, 1e-5, 10000.0
ROPE = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8, "mscale": 1.0,
        "mscale_all_dim": 0.8, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": True}
# DeepseekV3Config's names; the classes take a `cfg` like it (config_of_manifest gives a bundle's).
CONFIG = {"vocab_size": V, "hidden_size": C, "num_attention_heads": H, "intermediate_size": FF,
          "rms_norm_eps": EPS, "rope_theta": THETA, "rope_scaling": ROPE, "rope_interleave": True,
          "q_lora_rank": 16, "kv_lora_rank": 8, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8}
# What a perturbed reference leaves out (check 3); empty: DeepseekV3Attention as written.
PERTURB = set()


class DeepseekV3RMSNorm(fs.Rounding, torch.nn.Module):
    def __init__(self, hidden_size, eps=1e-6, latent=False):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps
        self.latent = latent  # a latent reaches its norm rounded, as autocast hands q_a_proj's output over

    def forward(self, hidden_states):
        if self.latent:
            hidden_states = self.rnd(hidden_states)
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.rnd(self.weight * hidden_states)  # every norm's output is a site


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


def apply_rotary_pos_emb_interleave(q, k, cos, sin, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    b, h, s, d = q.shape
    q = q.view(b, h, s, d // 2, 2).transpose(4, 3).reshape(b, h, s, d)
    b, h, s, d = k.shape
    k = k.view(b, h, s, d // 2, 2).transpose(4, 3).reshape(b, h, s, d)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


def yarn_get_mscale(scale=1, mscale=1):
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


class DeepseekV3Attention(fs.Rounding, torch.nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.num_heads = cfg["num_attention_heads"]
        self.q_lora_rank = cfg["q_lora_rank"]
        self.qk_rope_head_dim = cfg["qk_rope_head_dim"]
        self.kv_lora_rank = cfg["kv_lora_rank"]
        self.v_head_dim = cfg["v_head_dim"]
        self.qk_nope_head_dim = cfg["qk_nope_head_dim"]
        self.qk_head_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
        C = cfg["hidden_size"]
        if self.q_lora_rank is None:
            self.q_proj = fs.Linear(C, self.num_heads * self.qk_head_dim, bias=False)
        else:
            self.q_a_proj = fs.Linear(C, self.q_lora_rank, bias=False)
            self.q_a_layernorm = DeepseekV3RMSNorm(self.q_lora_rank, latent=True)
            self.q_b_proj = fs.Linear(self.q_lora_rank, self.num_heads * self.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = fs.Linear(C, self.kv_lora_rank + self.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = DeepseekV3RMSNorm(self.kv_lora_rank, latent=True)
        self.kv_b_proj = fs.Linear(self.kv_lora_rank, self.num_heads * (self.qk_nope_head_dim + self.v_head_dim),
                                   bias=False)
        self.o_proj = fs.Linear(self.num_heads * self.v_head_dim, C, bias=False)
        self.scaling = self.qk_head_dim ** (-0.5)
        if cfg["rope_scaling"] is not None and "no_mscale" not in PERTURB:
            mscale_all_dim = cfg["rope_scaling"].get("mscale_all_dim", 0)
            scaling_factor = cfg["rope_scaling"]["factor"]
            if mscale_all_dim:
                mscale = yarn_get_mscale(scaling_factor, mscale_all_dim)
                self.scaling = self.scaling * mscale * mscale

    def forward(self, hidden_states, position_embeddings, attention_mask):
        batch_size, seq_length = hidden_states.shape[:-1]
        query_shape = (batch_size, seq_length, -1, self.qk_head_dim)
        key_shape = (batch_size, seq_length, -1, self.qk_nope_head_dim + self.v_head_dim)
        if self.q_lora_rank is None:
            q_states = self.q_proj(hidden_states)
        else:
            q_states = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))  # attn.q_latent
        q_states = q_states.view(query_shape).transpose(1, 2)
        q_pass, q_rot = torch.split(q_states, [self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        compressed_kv = self.kv_a_proj_with_mqa(hidden_states)
        k_pass, k_rot = torch.split(compressed_kv, [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        k_pass = self.kv_b_proj(self.kv_a_layernorm(k_pass)).view(key_shape).transpose(1, 2)  # attn.kv_latent
        k_pass, value_states = torch.split(k_pass, [self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        if "swap_k_v" in PERTURB:
            k_pass, value_states = value_states, k_pass
        k_rot = k_rot.view(batch_size, 1, seq_length, self.qk_rope_head_dim)
        cos, sin = position_embeddings
        if self.cfg["rope_interleave"]:
            q_rot, k_rot = apply_rotary_pos_emb_interleave(q_rot, k_rot, cos, sin)
        else:
            q_rot, k_rot = apply_rotary_pos_emb(q_rot, k_rot, cos, sin)
        k_rot = k_rot.expand(*k_pass.shape[:-1], -1)
        if "no_k_pe" in PERTURB:
            k_rot = torch.zeros_like(k_rot)
        if "k_pe_head_0" in PERTURB:
            k_rot = k_rot * (torch.arange(self.num_heads) == 0).float().view(1, -1, 1, 1)
        query_states = self.rnd(torch.cat((q_pass, q_rot), dim=-1))  # attn.q
        key_states = self.rnd(torch.cat((k_pass, k_rot), dim=-1))  # attn.k
        value_states = self.rnd(value_states)  # attn.v
        # eager_attention_forward: q k^T rounded, then the scaled scores (attn.scores)
        attn_weights = self.rnd(self.rnd(torch.matmul(query_states, key_states.transpose(2, 3))) * self.scaling)
        attn_weights = attn_weights + attention_mask
        attn_weights = self.rnd(F.softmax(attn_weights, dim=-1, dtype=torch.float32))  # attn.probs
        attn_output = self.rnd(torch.matmul(attn_weights, value_states)).transpose(1, 2).contiguous()  # context
        attn_output = attn_output.reshape(batch_size, seq_length, -1).contiguous()
        return self.rnd(self.o_proj(attn_output))  # attn.out


class DeepseekV3MLP(fs.Rounding, torch.nn.Module):
    def __init__(self, cfg):
        super().__init__()
        C, FF = cfg["hidden_size"], cfg["intermediate_size"]
        self.gate_proj = fs.Linear(C, FF, bias=False)
        self.up_proj = fs.Linear(C, FF, bias=False)
        self.down_proj = fs.Linear(FF, C, bias=False)

    def forward(self, x):
        gate, up = self.rnd(self.gate_proj(x)), self.rnd(self.up_proj(x))  # mlp.gate, mlp.up
        return self.rnd(self.down_proj(self.rnd(F.silu(gate) * up)))  # mlp.act, mlp.down


class DeepseekV3DecoderLayer(fs.Rounding, torch.nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.self_attn = DeepseekV3Attention(cfg)
        self.mlp = DeepseekV3MLP(cfg)  # layer_idx < first_k_dense_replace: dense
        self.input_layernorm = DeepseekV3RMSNorm(cfg["hidden_size"], eps=cfg["rms_norm_eps"])
        self.post_attention_layernorm = DeepseekV3RMSNorm(cfg["hidden_size"], eps=cfg["rms_norm_eps"])

    def forward(self, hidden_states, attention_mask, position_embeddings):
        residual = hidden_states
        hidden_states = self.self_attn(self.input_layernorm(hidden_states), position_embeddings, attention_mask)
        hidden_states = self.rnd(residual + hidden_states)  # attn_residual
        residual = hidden_states
        return self.rnd(residual + self.mlp(self.post_attention_layernorm(hidden_states)))  # output


class DeepseekV3ForCausalLM(fs.Rounding, torch.nn.Module):
    def __init__(self, layers, cfg=None):
        super().__init__()
        cfg = cfg or CONFIG
        C, V = cfg["hidden_size"], cfg["vocab_size"]
        self.embed_tokens = torch.nn.Embedding(V, C)
        self.layers = torch.nn.ModuleList([DeepseekV3DecoderLayer(cfg) for _ in range(layers)])
        self.norm = DeepseekV3RMSNorm(C, eps=cfg["rms_norm_eps"])
        self.lm_head = fs.Linear(C, V, bias=False)
        # DeepseekV3Config's head_dim is qk_rope_head_dim: the rotary's width.
        self.inv_freq, self.attention_scaling = compute_yarn_parameters(
            cfg["qk_rope_head_dim"], cfg["rope_theta"], cfg["rope_scaling"], 64)

    def decoder(self, input_ids):
        """The forward up to the final norm: (hidden states, attention mask, rotary tables); the MTP
        reference (test_family_deepseek_mtp.py) goes on from here."""
        seq = input_ids.shape[1]
        position_ids = torch.arange(seq)[None, :].float()
        freqs = (self.inv_freq[None, :, None].float() @ position_ids[:, None, :]).transpose(1, 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        position_embeddings = (emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling)
        mask = torch.zeros(seq, seq).masked_fill(torch.ones(seq, seq, dtype=torch.bool).triu(1),
                                                 torch.finfo(torch.float32).min)[None, None]
        hidden_states = self.rnd(self.embed_tokens(input_ids))  # embed
        for layer in self.layers:
            hidden_states = layer(hidden_states, mask, position_embeddings)
        return self.norm(hidden_states), mask, position_embeddings

    def forward(self, input_ids, labels):
        hidden_states, _, _ = self.decoder(input_ids)
        return fs.cross_entropy(self.rnd(self.lm_head(hidden_states)), labels)  # logits


def named(model):
    return [("model." + k if not k.startswith("lm_head") else k, v) for k, v in model.named_parameters()]


def manifest_model(cfg):
    latent = {k: cfg[k] for k in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                                  "v_head_dim")}
    return {"arch": "llama", "vocab_size": cfg["vocab_size"], "hidden_size": cfg["hidden_size"], "num_layers": LAYERS,
            "num_heads": cfg["num_attention_heads"], "intermediate_size": cfg["intermediate_size"], "max_seq_len": 64,
            "norm_eps": cfg["rms_norm_eps"], "rope_theta": cfg["rope_theta"], "tie_embeddings": False,
            "rope_style": "interleaved" if cfg["rope_interleave"] else "rotate_half", "rope_scaling": cfg["rope_scaling"],
            "attention_mask": "additive_finfo_min", "latent_attention": dict(latent, norm_eps=1e-6)}


UNDERSTOOD = {"arch", "vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size",
              "max_seq_len", "norm_eps", "rope_theta", "tie_embeddings", "rope_style", "rope_scaling",
              "attention_mask", "latent_attention"}


def config_of_manifest(m):
    """DeepseekV3Config's values of a bundle's model section (the reference's inputs)."""
    latent = m["latent_attention"]
    return {"vocab_size": m["vocab_size"], "hidden_size": m["hidden_size"], "num_attention_heads": m["num_heads"],
            "intermediate_size": m["intermediate_size"], "rms_norm_eps": m["norm_eps"], "rope_theta": m["rope_theta"],
            "rope_scaling": m.get("rope_scaling"), "rope_interleave": m.get("rope_style") == "interleaved",
            **{k: latent[k] for k in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                                      "v_head_dim")}}


def random_model(cfg):
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(LAYERS, cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.3 * torch.randn(p.shape) if "norm" in name else 0.4 * torch.randn(p.shape))
    return model


def replayed_step(cli, work, name, model_section, model, stream):
    """nanreplay's replay of a one-step fp32 bundle of `model`: (report step or None, reference loss, norm)."""
    inputs, targets = fs.batch_of(stream, SAMPLES, T)
    loss, norm = fs.loss_and_grad_norm(model(inputs, targets), list(model.parameters()))
    bundle = fs.write_bundle(work / name, model_section, named(model), stream, SAMPLES, T, loss, norm)
    rc, report, err = fs.replay(cli, bundle, work / f"out-{name}")
    fs.check(report is not None, f"{name}: nanreplay run gave a report (exit {rc}; {err.strip()[-300:]})")
    return report, loss, norm


def check_mechanisms(cli, work, report, model, stream):
    """3. each mechanism removed on one side moves the loss past the check's tolerance."""
    inputs, targets = fs.batch_of(stream, SAMPLES, T)
    replayed = report["steps"][0]["loss"]
    for perturbation, what in (("no_mscale", "the softmax scale without YaRN's mscale"),
                               ("no_k_pe", "k_pe left out of k"),
                               ("k_pe_head_0", "k_pe given to head 0 only, not shared"),
                               ("swap_k_v", "k_nope and v swapped in kv_b_proj's output")):
        PERTURB.clear()
        PERTURB.add(perturbation)
        perturbed = DeepseekV3ForCausalLM(LAYERS, CONFIG)
        perturbed.load_state_dict(model.state_dict())
        with torch.no_grad():
            loss = float(perturbed(inputs, targets))
        fs.check(fs.rel_err(replayed, loss) > 1e-4, f"reference with {what}: departs from the replay "
                                                    f"({loss!r} vs {replayed!r})")
    PERTURB.clear()
    swapped = dict(manifest_model(CONFIG), rope_style="rotate_half")
    other, loss, _ = replayed_step(cli, work, "rotate-half", swapped, model, stream)
    if other is not None:
        fs.check(fs.rel_err(other["steps"][0]["loss"], loss) > 1e-4,
                 f"replay with rope_style rotate_half: departs from the interleaved reference "
                 f"({other['steps'][0]['loss']!r} vs {loss!r})")
        # and is the reference with rope_interleave false (apply_rotary_pos_emb)
        half = DeepseekV3ForCausalLM(LAYERS, dict(CONFIG, rope_interleave=False))
        half.load_state_dict(model.state_dict())
        fs.compare_step(other, *fs.loss_and_grad_norm(half(inputs, targets), list(half.parameters())),
                        "rope_style rotate_half against rope_interleave false")


def check_preset(cli, work, preset, steps, compute):
    """4. the preset's first `steps` steps against the reference on the bundle's weights and batches."""
    bundle_dir = work / preset
    synth_cache.synth(cli, preset, bundle_dir)
    bundle = reference_model.Bundle(bundle_dir)
    chosen = [e["step"] for e in bundle.manifest["steps"][:steps]]
    rc, report, err = fs.replay(cli, bundle_dir, work / f"out-{preset}", ["--steps", ",".join(map(str, chosen))])
    if not fs.check(report is not None and rc == 0 and [r["step"] for r in report["steps"]] == chosen,
                    f"{preset} replays its steps {chosen} (exit {rc}; {err.strip()[-300:]})"):
        return
    m = bundle.manifest["model"]
    fs.check(set(m) <= UNDERSTOOD and m.get("latent_attention") and m.get("tie_embeddings") is False
             and m["latent_attention"].get("norm_eps") == 1e-6
             and m.get("attention_mask", "exclude") in ("exclude", "additive_neg_inf", "additive_finfo_min")
             and (m.get("rope_scaling") or {}).get("rope_type") == "yarn"
             and bundle.manifest["precision"]["compute"] == compute,
             f"{preset}'s manifest says only what the reference implements "
             f"(not understood: {sorted(set(m) - UNDERSTOOD)}; {m})")
    cfg = config_of_manifest(m)
    dirs = {e["step"]: e["dir"] for e in bundle.manifest["steps"]}
    d = bundle.manifest["data"]
    for row in report["steps"]:
        model = fs.set_compute(DeepseekV3ForCausalLM(m["num_layers"], cfg), compute)
        weights = reference_model.read_safetensors(bundle.root / dirs[row["step"]] / "model.safetensors")
        with torch.no_grad():
            for k, p in named(model):
                p.copy_(weights.pop(k))
        fs.check(not weights, f"{preset} step {row['step']}: every tensor is a reference parameter ({sorted(weights)})")
        ids = bundle.samples(row["step"])[0]
        mbs, accum = d["micro_batch_size"], d.get("grad_accum_steps", 1)
        total = 0.0
        for micro in range(accum):
            loss = model(*bundle.batch(ids[micro * mbs:(micro + 1) * mbs]))
            total += float(loss)
            (loss / accum).backward()
        norm = float(torch.norm(torch.stack([p.grad.norm() for p in model.parameters() if p.grad is not None])))
        fs.compare_step({"steps": [row]}, total / accum, norm, f"{preset} step {row['step']}", compute)


def hf_config(cfg, **changes):
    """config.json as DeepseekV3Config.save_pretrained writes it: dense (first_k_dense_replace covers every
    layer), its head_dim the rotary width, one multi-token prediction layer."""
    return dict({"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
                 "vocab_size": cfg["vocab_size"], "hidden_size": cfg["hidden_size"],
                 "intermediate_size": cfg["intermediate_size"], "moe_intermediate_size": 16,
                 "num_hidden_layers": LAYERS, "num_attention_heads": cfg["num_attention_heads"],
                 "num_key_value_heads": cfg["num_attention_heads"], "n_shared_experts": 1, "n_routed_experts": 4,
                 "num_experts_per_tok": 2, "first_k_dense_replace": LAYERS, "n_group": 1, "topk_group": 1,
                 "norm_topk_prob": True, "routed_scaling_factor": 2.5, "head_dim": cfg["qk_rope_head_dim"],
                 **{k: cfg[k] for k in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                                        "v_head_dim", "rms_norm_eps", "rope_theta", "rope_scaling", "rope_interleave")},
                 "max_position_embeddings": 64, "attention_bias": False, "attention_dropout": 0.0,
                 "tie_word_embeddings": False, "hidden_act": "silu", "num_nextn_predict_layers": 1,
                 "torch_dtype": "float32"}, **changes)


def mtp_layer(model):
    """A multi-token prediction layer's tensors at index LAYERS (DeepSeek-V3's model.layers.61 in the release)."""
    C = CONFIG["hidden_size"]
    block = [(k.replace("model.layers.0.", f"model.layers.{LAYERS}."), v) for k, v in named(model)
             if k.startswith("model.layers.0.")]
    return block + [(f"model.layers.{LAYERS}.{k}", torch.ones(shape)) for k, shape in (
        ("eh_proj.weight", (C, 2 * C)), ("enorm.weight", (C,)), ("hnorm.weight", (C,)),
        ("shared_head.norm.weight", (C,)), ("shared_head.head.weight", (V, C)))]


def deepseek_names(hf):
    """DeepSeek's own names for Hugging Face's, as deepseek-ai/DeepSeek-V3 inference/convert.py renames them."""
    mapping = {"embed_tokens": "embed", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
               "q_proj": "wq", "q_a_proj": "wq_a", "q_a_layernorm": "q_norm", "q_b_proj": "wq_b",
               "kv_a_proj_with_mqa": "wkv_a", "kv_a_layernorm": "kv_norm", "kv_b_proj": "wkv_b", "o_proj": "wo",
               "gate": "gate", "gate_proj": "w1", "down_proj": "w2", "up_proj": "w3", "norm": "norm", "lm_head": "head"}
    out = {}
    for name, t in hf.items():
        name = name[len("model."):] if name.startswith("model.") else name
        name = name.replace("self_attn", "attn").replace("mlp", "ffn")
        key = name.split(".")[-2]
        out[name.replace(key, mapping[key])] = t
    return out


def check_naming_tables(model):
    """5. DeepSeek's own names map onto Hugging Face's; Megatron's MLA names are refused by key."""
    from nanreplay_import.naming import Mapper
    from nanreplay_import.outcome import BadInput
    hf = dict(named(model))
    cfg = {"num_heads": H, "num_kv_heads": H, "hidden_size": C, "head_dim": None, "model_type": "deepseek_v3"}
    back = Mapper("deepseek", cfg).map(deepseek_names(hf), "ckpt")
    fs.check(sorted(back) == sorted(hf) and all(back[k] is hf[k] for k in hf),
             f"DeepSeek's own names map onto Hugging Face's ({sorted(set(back) ^ set(hf))})")
    key = "decoder.layers.0.self_attention.linear_kv_down_proj.weight"
    try:
        Mapper("megatron", cfg).map({key: torch.zeros(12, C)}, "ckpt")
        fs.check(False, "Megatron's MLA names are refused")
    except BadInput as e:
        fs.check(e.key == key and "multi-latent" in e.what, f"Megatron's MLA names are refused naming the key: {e}")
    key = "mtp.layers.0.eh_proj.weight"
    try:
        Mapper("megatron", cfg).map({key: torch.zeros(C, 2 * C)}, "ckpt")
        fs.check(False, "Megatron's MTP names are refused")
    except BadInput as e:
        fs.check(e.key == key and "multi-token prediction" in e.what and "--mtp-loss-scale" in e.what,
                 f"Megatron's MTP names are refused naming the key: {e}")


def check_import(cli, work):
    """5. a dense DeepSeek-V3 checkpoint with an MTP layer through `nanreplay import`, replayed; an MoE config
    over its dense layers refused."""
    import contextlib
    import io
    import json
    import import_support as imp  # noqa: E402  (token data, the import and replay runners)
    import nanreplay_import
    work.mkdir(parents=True, exist_ok=True)
    model = random_model(CONFIG)
    check_naming_tables(model)
    data = imp.Data(work, V, T, SAMPLES, 1, num_samples=8, seed=3)
    loss, norm = fs.loss_and_grad_norm(model(*data.batch(data.rows(0))), list(model.parameters()))
    (work / "log.jsonl").write_text(json.dumps({"step": 0, "loss": loss, "grad_norm": norm, "lr": 1e-3}) + "\n")
    hf = work / "hf"
    hf.mkdir(exist_ok=True)
    tensors = [(k, v.detach()) for k, v in named(model)] + mtp_layer(model)
    fs.nanreplay_capture.write_safetensors(hf / "model.safetensors", tensors)
    (hf / "config.json").write_text(json.dumps(hf_config(CONFIG)))
    flags = [*data.flags(), "--log", work / "log.jsonl", "--steps", "0:0"]
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = nanreplay_import.main([str(a) for a in ["--checkpoint", hf, *flags, "--out", work / "unsaid"]])
    said = err.getvalue().strip()
    fs.check(rc == 2 and len(said.splitlines()) == 1 and "--mtp-loss-scale" in said
             and f"model.layers.{{{LAYERS}}}" in said,
             f"DeepSeek-V3 import with MTP layers and no --mtp-loss-scale: refused naming the flag and the layers "
             f"(exit {rc}): {said}")
    flags += ["--mtp-loss-scale", 0]  # the run's loss left them out (test_family_deepseek_mtp.py replays them)
    proc = imp.run_import(cli, ["--checkpoint", hf, *flags], work / "bundle")
    if fs.check(proc.returncode == 0, f"DeepSeek-V3 import: exit 0 ({proc.stderr.strip()[-300:]})"):
        fs.check("multi-token prediction" in proc.stdout and f"model.layers.{{{LAYERS}}}" in proc.stdout
                 and "left out of the replayed loss (--mtp-loss-scale 0)" in proc.stdout,
                 "DeepSeek-V3 import: the MTP layer is named as left out")
        m = json.loads((work / "bundle" / "manifest.json").read_text())["model"]
        fs.check(m.get("latent_attention") == manifest_model(CONFIG)["latent_attention"]
                 and m.get("rope_style") == "interleaved" and "head_dim" not in m and m.get("num_kv_heads") == H,
                 f"DeepSeek-V3 import: latent attention as the config says ({m})")
        rproc, report = imp.run_replay(cli, work / "bundle", work / "out")
        if fs.check(report is not None, f"DeepSeek-V3 import replays ({rproc.stderr.strip()[-300:]})"):
            fs.compare_step(report, loss, norm, "DeepSeek-V3 import (dense, latent attention, MTP left out)")
            said = report.get("multi_token_prediction") or {}
            fs.check(said.get("replayed") is False and "--mtp-loss-scale 0" in said.get("detail", ""),
                     f"DeepSeek-V3 import: report.json says the MTP layer was left out ({said})")
    moe = dict(tensors, **{"model.layers.1.mlp.experts.0.gate_proj.weight": torch.zeros(16, C)})
    fs.nanreplay_capture.write_safetensors(hf / "model.safetensors", list(moe.items()))
    (hf / "config.json").write_text(json.dumps(hf_config(CONFIG, first_k_dense_replace=1)))
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = nanreplay_import.main([str(a) for a in ["--checkpoint", hf, *flags, "--out", work / "moe"]])
    said = err.getvalue().strip()
    fs.check(rc == 2 and len(said.splitlines()) == 1 and "model.layers.1.mlp.gate.e_score_correction_bias" in said,
             f"a DeepSeek-V3 MoE layer (first_k_dense_replace 1) over a dense layer 1 is refused naming its router's "
             f"missing correction bias (exit {rc}): {said}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cli", required=True)
    ap.add_argument("--work", required=True)
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    model = random_model(CONFIG)
    stream = fs.token_stream(V, SAMPLES, T, seed=4)
    report, loss, norm = replayed_step(args.cli, work, "mla", manifest_model(CONFIG), model, stream)
    if report is not None:
        fs.compare_step(report, loss, norm, "DeepSeek-V3 latent attention (q and kv latents, YaRN mscale)")
        check_mechanisms(args.cli, work, report, model, stream)
    fs.check_bf16_step(args.cli, work, "mla-bf16", manifest_model(CONFIG), model, named, stream, SAMPLES, T,
                       "DeepSeek-V3 latent attention in bf16 (latents rounded before and after their norms)")
    plain_q = dict(CONFIG, q_lora_rank=None)
    report, loss, norm = replayed_step(args.cli, work, "mla-plain-q", manifest_model(plain_q), random_model(plain_q),
                                       stream)
    if report is not None:
        fs.compare_step(report, loss, norm, "latent attention with q_lora_rank null (a plain q_proj)")
    check_import(args.cli, work / "import")
    check_preset(args.cli, work, "clean-deepseek-mla", 2, "fp32")
    check_preset(args.cli, work, "clean-deepseek-mla-bf16", 1, "bf16")
    fs.finish()


if __name__ == "__main__":
    main()
