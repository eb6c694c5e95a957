"""model.head_dim and model.partial_rotary_factor against eager PyTorch written from Hugging Face's code.

The reference is transformers' modeling_qwen3.py transcribed (Qwen3RMSNorm, the default rotary
embedding over `head_dim`, q_norm / k_norm over each head before rotary, repeat_kv, eager attention:
scores * head_dim**-0.5 plus the causal mask of finfo.min, softmax in fp32), with the partial rotary
of modeling_phi.py's PhiAttention (rotary on q[..., :int(head_dim * partial_rotary_factor)], the rest
passed, frequencies over that width as _compute_default_rope_parameters computes them). Variants:

- Qwen3 at toy size: 4 query heads and 2 kv heads of head_dim 12 over hidden 32 (4 * 12 != 32), so
  q_proj is [48, 32] and o_proj [32, 48];
- the same with partial_rotary_factor 0.5 (Phi, GLM): rotary on 6 of each head's 12 dimensions;
- partial rotary alone (head_dim = hidden / heads, factor 0.75: int(8 * 0.75) = 6, no qk_norm).

Each is a one-step fp32 bundle replayed by `nanreplay run`: loss and gradient norm within 1e-5 relative.
The second is also replayed from a bf16 bundle (precision.compute "bf16"): the reference rounds where the
bundle format does (docs/bundle-format.md, "Precision as replayed": every linear's input, weight and bias,
q k^T and the scaled scores, every probe site as it is produced, the QK-norm's input), and the loss and
gradient norm agree within 1e-4 relative; that loss departs from the fp32 one.

    /usr/bin/python3 tests/py/test_family_head_dim.py --cli build/nanreplay --work DIR
"""
import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import family_support as fs  # noqa: E402

V, C, LAYERS, FF, T, SAMPLES, EPS, THETA = 64, 32, 2, 40, 12, 2, 1e-6, 10000.0


# ---- transformers' modeling_qwen3.py (and modeling_phi.py's partial rotary), transcribed --------------

class RMSNorm(fs.Rounding, torch.nn.Module):  # Qwen3RMSNorm
    def __init__(self, hidden_size, eps):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        # every norm's output is a site (or, q_norm / k_norm, rounded as one)
        return self.rnd(self.weight * hidden_states.to(input_dtype))


def default_rope(dim, seq):
    """compute_default_rope_parameters over `dim` (int(head_dim * partial_rotary_factor)), then the
    rotary embedding's forward: cat((freqs, freqs)) and its cos / sin."""
    inv_freq = 1.0 / (THETA ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    position_ids = torch.arange(seq)[None, :].float()
    freqs = (inv_freq[None, :, None].float() @ position_ids[:, None, :]).transpose(1, 2)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


def repeat_kv(hidden_states, n_rep):
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand(batch, num_key_value_heads, n_rep, slen, head_dim)
    return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)


class Attention(fs.Rounding, torch.nn.Module):  # Qwen3Attention, with PhiAttention's partial rotary
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.head_dim = cfg["head_dim"]
        self.num_key_value_groups = cfg["heads"] // cfg["kv_heads"]
        self.scaling = self.head_dim ** -0.5
        self.rotary_ndims = int(self.head_dim * cfg["partial_rotary_factor"])
        self.q_proj = fs.Linear(C, cfg["heads"] * self.head_dim, bias=False)
        self.k_proj = fs.Linear(C, cfg["kv_heads"] * self.head_dim, bias=False)
        self.v_proj = fs.Linear(C, cfg["kv_heads"] * self.head_dim, bias=False)
        self.o_proj = fs.Linear(cfg["heads"] * self.head_dim, C, bias=False)
        if cfg["qk_norm"]:
            self.q_norm = RMSNorm(self.head_dim, eps=EPS)  # "unlike olmo, only on the head dim"
            self.k_norm = RMSNorm(self.head_dim, eps=EPS)

    def forward(self, hidden_states, position_embeddings, attention_mask):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query_states = self.q_proj(hidden_states).view(hidden_shape)
        key_states = self.k_proj(hidden_states).view(hidden_shape)
        if self.cfg["qk_norm"]:  # the QK-norm reads the rounded projection
            query_states, key_states = self.q_norm(self.rnd(query_states)), self.k_norm(self.rnd(key_states))
        query_states, key_states = query_states.transpose(1, 2), key_states.transpose(1, 2)
        value_states = self.rnd(self.v_proj(hidden_states)).view(hidden_shape).transpose(1, 2)  # attn.v
        cos, sin = position_embeddings
        query_rot, query_pass = query_states[..., : self.rotary_ndims], query_states[..., self.rotary_ndims:]
        key_rot, key_pass = key_states[..., : self.rotary_ndims], key_states[..., self.rotary_ndims:]
        query_rot, key_rot = apply_rotary_pos_emb(query_rot, key_rot, cos, sin)
        query_states = self.rnd(torch.cat((query_rot, query_pass), dim=-1))  # attn.q
        key_states = self.rnd(torch.cat((key_rot, key_pass), dim=-1))  # attn.k
        # eager_attention_forward
        key_states = repeat_kv(key_states, self.num_key_value_groups)
        value_states = repeat_kv(value_states, self.num_key_value_groups)
        # q k^T rounded, then the scaled scores (the attn.scores site)
        attn_weights = self.rnd(self.rnd(torch.matmul(query_states, key_states.transpose(2, 3))) * self.scaling)
        attn_weights = attn_weights + attention_mask[:, :, :, : key_states.shape[-2]]
        attn_weights = self.rnd(F.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query_states.dtype))
        attn_output = self.rnd(torch.matmul(attn_weights, value_states)).transpose(1, 2).contiguous()  # context
        return self.rnd(self.o_proj(attn_output.reshape(*input_shape, -1).contiguous()))  # attn.out


class MLP(fs.Rounding, torch.nn.Module):  # Qwen3MLP, hidden_act silu
    def __init__(self):
        super().__init__()
        self.gate_proj = fs.Linear(C, FF, bias=False)
        self.up_proj = fs.Linear(C, FF, bias=False)
        self.down_proj = fs.Linear(FF, C, bias=False)

    def forward(self, x):
        gate, up = self.rnd(self.gate_proj(x)), self.rnd(self.up_proj(x))  # mlp.gate, mlp.up
        return self.rnd(self.down_proj(self.rnd(F.silu(gate) * up)))  # mlp.act, mlp.down


class DecoderLayer(fs.Rounding, torch.nn.Module):  # Qwen3DecoderLayer
    def __init__(self, cfg):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP()
        self.input_layernorm = RMSNorm(C, eps=EPS)
        self.post_attention_layernorm = RMSNorm(C, eps=EPS)

    def forward(self, hidden_states, attention_mask, position_embeddings):
        residual = hidden_states
        hidden_states = self.self_attn(self.input_layernorm(hidden_states), position_embeddings, attention_mask)
        hidden_states = self.rnd(residual + hidden_states)  # attn_residual
        residual = hidden_states
        return self.rnd(residual + self.mlp(self.post_attention_layernorm(hidden_states)))  # output


class Model(fs.Rounding, torch.nn.Module):  # Qwen3ForCausalLM (untied head)
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = torch.nn.Embedding(V, C)
        self.layers = torch.nn.ModuleList([DecoderLayer(cfg) for _ in range(LAYERS)])
        self.norm = RMSNorm(C, eps=EPS)
        self.lm_head = fs.Linear(C, V, bias=False)

    def forward(self, input_ids, labels):
        seq = input_ids.shape[1]
        hidden_states = self.rnd(self.embed_tokens(input_ids))  # embed
        # create_causal_mask for eager attention: 0 where a query sees a key, finfo.min elsewhere
        future = torch.ones(seq, seq, dtype=torch.bool).triu(1)
        mask = torch.zeros(seq, seq).masked_fill(future, torch.finfo(torch.float32).min)[None, None]
        position_embeddings = default_rope(int(self.cfg["head_dim"] * self.cfg["partial_rotary_factor"]), seq)
        for layer in self.layers:
            hidden_states = layer(hidden_states, mask, position_embeddings)
        logits = self.rnd(self.lm_head(self.norm(hidden_states)))  # logits
        return fs.cross_entropy(logits, labels)


# ---- the bundles ------------------------------------------------------------------------------------------

PARAM_ORDER = ["input_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "self_attn.q_norm", "self_attn.k_norm", "post_attention_layernorm", "mlp.gate_proj", "mlp.up_proj",
               "mlp.down_proj"]


def hf_state(model):
    """The model's parameters under Hugging Face's names, in the bundle's order."""
    named = dict(model.named_parameters())
    out = [("model.embed_tokens.weight", named["embed_tokens.weight"])]
    for i in range(LAYERS):
        out += [(f"model.layers.{i}.{n}.weight", named[f"layers.{i}.{n}.weight"]) for n in PARAM_ORDER
                if f"layers.{i}.{n}.weight" in named]
    return out + [("model.norm.weight", named["norm.weight"]), ("lm_head.weight", named["lm_head.weight"])]


VARIANTS = [  # name, Hugging Face config values, the manifest's option keys
    ("qwen3-head_dim", dict(heads=4, kv_heads=2, head_dim=12, qk_norm=True, partial_rotary_factor=1.0),
     {"num_heads": 4, "num_kv_heads": 2, "head_dim": 12, "qk_norm": "head"}),
    ("qwen3-head_dim-partial", dict(heads=4, kv_heads=2, head_dim=12, qk_norm=True, partial_rotary_factor=0.5),
     {"num_heads": 4, "num_kv_heads": 2, "head_dim": 12, "qk_norm": "head", "partial_rotary_factor": 0.5}),
    ("partial-rotary", dict(heads=4, kv_heads=4, head_dim=8, qk_norm=False, partial_rotary_factor=0.75),
     {"num_heads": 4, "num_kv_heads": 4, "partial_rotary_factor": 0.75}),
]


BF16_VARIANT = "qwen3-head_dim-partial"  # every option of the file at once, also replayed in bf16

QWEN3_CONFIG = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": V, "hidden_size": C,
                "intermediate_size": FF, "num_hidden_layers": LAYERS, "num_attention_heads": 4,
                "num_key_value_heads": 2, "head_dim": 12, "max_position_embeddings": 32, "rms_norm_eps": EPS,
                "tie_word_embeddings": False, "hidden_act": "silu", "attention_bias": False,
                "use_sliding_window": False, "sliding_window": None, "max_window_layers": LAYERS,
                "torch_dtype": "float32"}
# How transformers 4 and 5 write the same model's config.json: 5 moves rope_theta into rope_parameters;
# a multimodal wrapper nests the text model (here as transformers 4 writes it) under text_config.
CONFIG_SPELLINGS = {
    "transformers5": dict(QWEN3_CONFIG, rope_parameters={"rope_type": "default", "rope_theta": THETA}),
    "transformers4-text_config": {"model_type": "wrapper", "architectures": ["Wrapper"], "hidden_size": 7,
                                  "text_config": dict(QWEN3_CONFIG, rope_theta=THETA, rope_scaling=None)},
}


def import_qwen3(cli, work, model):
    """A Qwen3 directory as save_pretrained writes it (config.json, model.safetensors), imported by
    `nanreplay import` from each config spelling and replayed: head_dim, qk_norm and the mask read from
    config.json, the loss the reference computes on the imported step's batch."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import import_support as imp  # noqa: E402  (its token data and import runner)
    data = imp.Data(work, V, T, 2, 1, num_samples=16, seed=3)
    inputs, targets = data.batch(data.rows(0))
    loss = float(model(inputs, targets))
    (work / "log.jsonl").write_text(json.dumps({"step": 0, "loss": loss, "lr": 1e-3}) + "\n")
    for spelling, config in CONFIG_SPELLINGS.items():
        directory = work / f"qwen3-{spelling}"
        directory.mkdir(parents=True, exist_ok=True)
        fs.nanreplay_capture.write_safetensors(directory / "model.safetensors", [(k, v.detach()) for k, v in hf_state(model)])
        (directory / "config.json").write_text(json.dumps(config, indent=2))
        bundle = work / f"imported-{spelling}"
        proc = imp.run_import(cli, ["--checkpoint", directory, *data.flags(), "--log", work / "log.jsonl",
                                    "--steps", "0:0"], bundle)
        if not fs.check(proc.returncode == 0, f"import of Qwen3 ({spelling}): exit {proc.returncode} "
                                              f"{proc.stderr.strip()[-300:]}"):
            continue
        m = json.loads((bundle / "manifest.json").read_text())["model"]
        fs.check(m.get("head_dim") == 12 and m.get("qk_norm") == "head" and m.get("num_kv_heads") == 2
                 and m.get("attention_mask") == "additive_finfo_min" and m.get("rope_theta") == THETA,
                 f"import of Qwen3 ({spelling}): head_dim, qk_norm, num_kv_heads, mask, rope_theta read ({m})")
        rc, report, err = fs.replay(cli, bundle, work / f"out-imported-{spelling}")
        if fs.check(report is not None, f"imported Qwen3 ({spelling}) replays (exit {rc}; {err.strip()[-200:]})"):
            step = report["steps"][0]
            fs.check(fs.rel_err(step["loss"], loss) <= fs.TOLERANCE,
                     f"imported Qwen3 ({spelling}): loss {step['loss']} vs reference {loss}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cli", required=True)
    ap.add_argument("--work", required=True)
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    stream = fs.token_stream(V, SAMPLES, T, seed=2)
    inputs, targets = fs.batch_of(stream, SAMPLES, T)
    for name, cfg, keys in VARIANTS:
        torch.manual_seed(0)
        model = Model(cfg)
        with torch.no_grad():  # norms away from 1 and attention that depends on positions
            for pname, p in model.named_parameters():
                p.copy_(1 + 0.2 * torch.randn(p.shape) if "norm" in pname else 0.4 * torch.randn(p.shape))
        loss, norm = fs.loss_and_grad_norm(model(inputs, targets), list(model.parameters()))
        manifest_model = {"arch": "llama", "vocab_size": V, "hidden_size": C, "num_layers": LAYERS,
                          "intermediate_size": FF, "max_seq_len": T, "norm_eps": EPS, "rope_theta": THETA,
                          "tie_embeddings": False, "attention_mask": "additive_finfo_min", **keys}
        bundle = fs.write_bundle(work / name, manifest_model, hf_state(model), stream, SAMPLES, T, loss, norm)
        rc, report, err = fs.replay(args.cli, bundle, work / f"out-{name}")
        if fs.check(report is not None, f"{name}: nanreplay run gave a report (exit {rc}; {err.strip()[-300:]})"):
            fs.compare_step(report, loss, norm, name)
            fs.check((report.get("reproduction") or {}).get("reproduces") is True,
                     f"{name}: the healthy step reproduces what the run logged ({report.get('reproduction')})")
        if name == BF16_VARIANT:
            fs.check_bf16_step(args.cli, work, name + "-bf16", manifest_model, model, hf_state, stream, SAMPLES, T,
                               f"{name} in bf16 (the per-head QK-norm's input rounded, partial rotary in fp32)")
        if name == "qwen3-head_dim":
            import_qwen3(args.cli, work, model)
    # The factor changes the math: the same weights read without it do not give the reference's loss.
    name, cfg, keys = VARIANTS[2]
    bundle = work / name
    manifest = (bundle / "manifest.json").read_text().replace('"partial_rotary_factor": 0.75', '"partial_rotary_factor": 1')
    (bundle / "manifest.json").write_text(manifest)
    rc, report, _ = fs.replay(args.cli, bundle, work / "out-full-rotary")
    if fs.check(report is not None, "full rotary on partial-rotary weights: a report"):
        step = report["steps"][0]
        fs.check(fs.rel_err(step["loss"], step["logged_loss"]) > 1e-4,
                 f"full rotary on partial-rotary weights departs from the reference ({step['loss']} vs "
                 f"{step['logged_loss']})")
    fs.finish()


if __name__ == "__main__":
    main()
