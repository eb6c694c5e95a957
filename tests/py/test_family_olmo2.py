"""model.norm_layout "post" (OLMo 2) against eager PyTorch written from transformers' modeling_olmo2.py.

The reference transcribes Olmo2RMSNorm ((weight * x * rsqrt(mean(x^2) + eps)) in fp32), Olmo2Attention
(q_norm / k_norm over the whole projection before the per-head view and rotary, eager attention with
scores * head_dim**-0.5 plus the finfo.min mask), Olmo2MLP and Olmo2DecoderLayer's post-norm residuals:
h = x + post_attention_layernorm(attn(x)), out = h + post_feedforward_layernorm(mlp(h)).

1. A one-step fp32 bundle written from the model (norm_layout post, qk_norm full, attention_mask
   additive_finfo_min): nanreplay's loss and gradient norm within 1e-5 relative.
2. The same bundle in bf16 (precision.compute "bf16"): the reference rounds where the bundle format does
   (docs/bundle-format.md, "Precision as replayed": every linear's input, weight and bias, q k^T and the
   scaled scores, every probe site as it is produced, the QK-norm's input); loss and gradient norm within
   1e-4 relative, and that loss departs from the fp32 one.
3. The same weights read as a pre-norm model (norm_layout dropped, the post-norms renamed to llama's
   input_layernorm / post_attention_layernorm) do not give the reference's loss: the layout matters.
4. `nanreplay import` of the model as save_pretrained writes it (config.json with model_type "olmo2",
   model.safetensors) sets norm_layout post and qk_norm full from config.json, and replays to the loss.

    /usr/bin/python3 tests/py/test_family_olmo2.py --cli build/nanreplay --work DIR
"""
import argparse
import collections
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import family_support as fs  # noqa: E402

V, C, H, LAYERS, FF, T, SAMPLES, EPS, THETA = 64, 32, 4, 2, 40, 12, 2, 1e-6, 10000.0
D = C // H
# The sizes the classes below read (Olmo2Config's hidden_size, num_attention_heads, intermediate_size,
# rms_norm_eps); test_family_olmo3.py builds them at a preset's sizes.
Dims = collections.namedtuple("Dims", "C H FF EPS")
DIMS = Dims(C, H, FF, EPS)


class Olmo2RMSNorm(fs.Rounding, torch.nn.Module):
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
        return self.rnd((self.weight * hidden_states).to(input_dtype))


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


class Olmo2Attention(fs.Rounding, torch.nn.Module):
    def __init__(self, dims=DIMS):
        super().__init__()
        C, H, EPS = dims.C, dims.H, dims.EPS
        D = C // H
        self.head_dim, self.scaling = D, D ** -0.5
        self.q_proj = fs.Linear(C, H * D, bias=False)
        self.k_proj = fs.Linear(C, H * D, bias=False)
        self.v_proj = fs.Linear(C, H * D, bias=False)
        self.o_proj = fs.Linear(H * D, C, bias=False)
        self.q_norm = Olmo2RMSNorm(H * D, EPS)
        self.k_norm = Olmo2RMSNorm(H * D, EPS)

    def forward(self, hidden_states, position_embeddings, attention_mask):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        # the QK-norm reads the rounded projection
        query_states = self.q_norm(self.rnd(self.q_proj(hidden_states)))
        key_states = self.k_norm(self.rnd(self.k_proj(hidden_states)))
        value_states = self.rnd(self.v_proj(hidden_states))  # attn.v
        query_states = query_states.view(hidden_shape).transpose(1, 2)
        key_states = key_states.view(hidden_shape).transpose(1, 2)
        value_states = value_states.view(hidden_shape).transpose(1, 2)
        cos, sin = position_embeddings
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        query_states = self.rnd((query_states * cos) + (rotate_half(query_states) * sin))  # attn.q
        key_states = self.rnd((key_states * cos) + (rotate_half(key_states) * sin))  # attn.k
        # q k^T rounded, then the scaled scores (the attn.scores site)
        attn_weights = self.rnd(self.rnd(torch.matmul(query_states, key_states.transpose(2, 3))) * self.scaling)
        attn_weights = attn_weights + attention_mask
        attn_weights = self.rnd(F.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query_states.dtype))
        attn_output = self.rnd(torch.matmul(attn_weights, value_states)).transpose(1, 2).contiguous()  # context
        return self.rnd(self.o_proj(attn_output.reshape(*input_shape, -1).contiguous()))  # attn.out


class Olmo2MLP(fs.Rounding, torch.nn.Module):
    def __init__(self, dims=DIMS):
        super().__init__()
        C, FF = dims.C, dims.FF
        self.gate_proj = fs.Linear(C, FF, bias=False)
        self.up_proj = fs.Linear(C, FF, bias=False)
        self.down_proj = fs.Linear(FF, C, bias=False)

    def forward(self, x):
        gate, up = self.rnd(self.gate_proj(x)), self.rnd(self.up_proj(x))  # mlp.gate, mlp.up
        return self.rnd(self.down_proj(self.rnd(F.silu(gate) * up)))  # mlp.act, mlp.down


class Olmo2DecoderLayer(fs.Rounding, torch.nn.Module):
    def __init__(self, dims=DIMS):
        super().__init__()
        self.self_attn = Olmo2Attention(dims)
        self.mlp = Olmo2MLP(dims)
        self.post_attention_layernorm = Olmo2RMSNorm(dims.C, dims.EPS)
        self.post_feedforward_layernorm = Olmo2RMSNorm(dims.C, dims.EPS)

    def forward(self, hidden_states, attention_mask, position_embeddings):
        residual = hidden_states
        hidden_states = self.self_attn(hidden_states, position_embeddings, attention_mask)
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = self.rnd(residual + hidden_states)  # attn_residual
        residual = hidden_states
        hidden_states = self.mlp(hidden_states)
        hidden_states = self.post_feedforward_layernorm(hidden_states)
        return self.rnd(residual + hidden_states)  # output


class Olmo2ForCausalLM(fs.Rounding, torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(V, C)
        self.layers = torch.nn.ModuleList([Olmo2DecoderLayer() for _ in range(LAYERS)])
        self.norm = Olmo2RMSNorm(C, EPS)
        self.lm_head = fs.Linear(C, V, bias=False)
        self.inv_freq = 1.0 / (THETA ** (torch.arange(0, D, 2, dtype=torch.int64).float() / D))

    def forward(self, input_ids, labels):
        seq = input_ids.shape[1]
        position_ids = torch.arange(seq)[None, :].float()
        freqs = (self.inv_freq[None, :, None].float() @ position_ids[:, None, :]).transpose(1, 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        position_embeddings = (emb.cos(), emb.sin())
        future = torch.ones(seq, seq, dtype=torch.bool).triu(1)
        mask = torch.zeros(seq, seq).masked_fill(future, torch.finfo(torch.float32).min)[None, None]
        hidden_states = self.rnd(self.embed_tokens(input_ids))  # embed
        for layer in self.layers:
            hidden_states = layer(hidden_states, mask, position_embeddings)
        return fs.cross_entropy(self.rnd(self.lm_head(self.norm(hidden_states))), labels)  # logits


def named_as_hf(model):
    """(key, tensor) under Olmo2ForCausalLM's names, in its module order."""
    return [("model." + k if not k.startswith("lm_head") else k, v) for k, v in model.named_parameters()]


CONFIG = {"architectures": ["Olmo2ForCausalLM"], "model_type": "olmo2", "vocab_size": V, "hidden_size": C,
          "intermediate_size": FF, "num_hidden_layers": LAYERS, "num_attention_heads": H, "num_key_value_heads": H,
          "max_position_embeddings": 32, "rms_norm_eps": EPS, "rope_theta": THETA, "rope_scaling": None,
          "attention_bias": False, "tie_word_embeddings": False, "hidden_act": "silu", "torch_dtype": "float32"}
MODEL = {"arch": "llama", "vocab_size": V, "hidden_size": C, "num_layers": LAYERS, "num_heads": H,
         "intermediate_size": FF, "max_seq_len": T, "norm_eps": EPS, "rope_theta": THETA, "tie_embeddings": False,
         "qk_norm": "full", "norm_layout": "post", "attention_mask": "additive_finfo_min"}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cli", required=True)
    ap.add_argument("--work", required=True)
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    model = Olmo2ForCausalLM()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.3 * torch.randn(p.shape) if "norm" in name else 0.4 * torch.randn(p.shape))
    stream = fs.token_stream(V, SAMPLES, T, seed=4)
    inputs, targets = fs.batch_of(stream, SAMPLES, T)
    loss, norm = fs.loss_and_grad_norm(model(inputs, targets), list(model.parameters()))

    # 1. the bundle written from the model
    bundle = fs.write_bundle(work / "olmo2", MODEL, named_as_hf(model), stream, SAMPLES, T, loss, norm)
    rc, report, err = fs.replay(args.cli, bundle, work / "out-olmo2")
    if fs.check(report is not None, f"olmo2: nanreplay run gave a report (exit {rc}; {err.strip()[-300:]})"):
        fs.compare_step(report, loss, norm, "olmo2 (post-norm)")
    fs.check_bf16_step(args.cli, work, "olmo2-bf16", MODEL, model, named_as_hf, stream, SAMPLES, T,
                       "olmo2 (post-norm) in bf16 (the full QK-norm's input and output rounded)")
    # 3. the same weights as a pre-norm llama: another model
    renamed = [(k.replace("post_attention_layernorm", "input_layernorm")
                 .replace("post_feedforward_layernorm", "post_attention_layernorm"), v) for k, v in named_as_hf(model)]
    pre = {k: v for k, v in MODEL.items() if k != "norm_layout"}
    bundle = fs.write_bundle(work / "as-pre-norm", pre, renamed, stream, SAMPLES, T, loss, norm)
    rc, report, err = fs.replay(args.cli, bundle, work / "out-as-pre-norm")
    if fs.check(report is not None, f"as pre-norm: a report (exit {rc}; {err.strip()[-300:]})"):
        fs.check(fs.rel_err(report["steps"][0]["loss"], loss) > 1e-3,
                 f"the post-norm weights read as pre-norm depart from the reference ({report['steps'][0]['loss']} "
                 f"vs {loss})")
    # 4. import of the save_pretrained directory
    import import_support as imp  # noqa: E402  (its token data and import runner)
    data = imp.Data(work, V, T, 2, 1, num_samples=16, seed=3)
    ids = data.rows(0)
    loss0 = float(model(*data.batch(ids)))
    (work / "log.jsonl").write_text(json.dumps({"step": 0, "loss": loss0, "lr": 1e-3}) + "\n")
    directory = work / "olmo2-hf"
    directory.mkdir(parents=True, exist_ok=True)
    fs.nanreplay_capture.write_safetensors(directory / "model.safetensors", [(k, v.detach()) for k, v in named_as_hf(model)])
    (directory / "config.json").write_text(json.dumps(CONFIG, indent=2))
    imported = work / "olmo2-imported"
    proc = imp.run_import(args.cli, ["--checkpoint", directory, *data.flags(), "--log", work / "log.jsonl",
                                     "--steps", "0:0"], imported)
    if fs.check(proc.returncode == 0, f"import of OLMo 2: exit {proc.returncode} {proc.stderr.strip()[-300:]}"):
        m = json.loads((imported / "manifest.json").read_text())["model"]
        fs.check(m.get("norm_layout") == "post" and m.get("qk_norm") == "full" and m.get("num_layers") == LAYERS
                 and m.get("attention_mask") == "additive_finfo_min",
                 f"import of OLMo 2: norm_layout, qk_norm, layers and mask from config.json ({m})")
        rc, report, err = fs.replay(args.cli, imported, work / "out-imported")
        if fs.check(report is not None, f"imported OLMo 2 replays (exit {rc}; {err.strip()[-200:]})"):
            fs.check(fs.rel_err(report["steps"][0]["loss"], loss0) <= fs.TOLERANCE,
                     f"imported OLMo 2: loss {report['steps'][0]['loss']} vs reference {loss0}")
    fs.finish()


if __name__ == "__main__":
    main()
