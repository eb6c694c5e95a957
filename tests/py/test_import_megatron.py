"""`nanreplay import` of a Megatron-core GPT checkpoint (torch format: {"model", "args", "iteration"},
the fused TransformerEngine layer spec), with its AdamW state keyed by parameter name in a separate
file, replayed by `nanreplay run` to the losses the original PyTorch model computed.

The model is Megatron-core's GPTModel with TE's fused modules, written here with their semantics
and names: embedding.word_embeddings; per layer self_attention.linear_qkv (a LayerNormLinear: its
layer_norm_weight is the input RMSNorm, its weight q, k and v laid out per query group: for each
group its H/G query heads, then its key head, then its value head), self_attention.linear_proj,
mlp.linear_fc1 (LayerNormLinear: the pre-MLP norm, and gate and up stacked), mlp.linear_fc2;
decoder.final_layernorm; output_layer (untied). Rotary rotate-half (Megatron's default), GQA,
TE's _extra_state entries in the state dict, norm_epsilon 0 in args. The embedding row of token 0 is
zero and first read at the last step, which divides 0 by 0 in layer 0's fused input norm: nanreplay
must name the site, sample and position PyTorch's forward hooks saw (the norm is a parameterless
child module here, so a hook sees its output as the bundle's layers.0.attn_norm).
"""
import argparse
import shutil
import sys
from argparse import Namespace
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import import_support as s  # noqa: E402

C, H, G, L, V, FFN = 32, 4, 2, 2, 64, 48
D = C // H
SEQ, MBS, ACCUM, SEED = 16, 2, 2, 99
FIRST, LAST = 3, 6
SITES = [(r"embedding\.word_embeddings", "embed"),
         (r"decoder\.layers\.(\d+)\.self_attention\.linear_qkv\.norm", "layers.{}.attn_norm"),
         (r"decoder\.layers\.(\d+)\.self_attention\.linear_proj", "layers.{}.attn.out"),
         (r"decoder\.layers\.(\d+)\.mlp\.linear_fc1\.norm", "layers.{}.mlp_norm"),
         (r"decoder\.layers\.(\d+)\.mlp\.linear_fc2", "layers.{}.mlp.down"),
         (r"decoder\.final_layernorm", "final_norm"), (r"output_layer", "logits")]


class RMSNormFn(nn.Module):
    """TE's fused RMSNorm inside a LayerNormLinear (no parameters of its own)."""

    def __init__(self, eps):
        super().__init__()
        self.eps = eps

    def forward(self, x, weight):
        return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps) * weight


class TERMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.norm = RMSNormFn(eps)

    def forward(self, x):
        return self.norm(x, self.weight)


class LayerNormLinear(nn.Module):
    def __init__(self, cin, cout, eps):
        super().__init__()
        self.layer_norm_weight = nn.Parameter(torch.ones(cin))
        self.weight = nn.Parameter(torch.randn(cout, cin) * cin ** -0.5)
        self.norm = RMSNormFn(eps)

    def forward(self, x):
        return F.linear(self.norm(x, self.layer_norm_weight), self.weight)

    def get_extra_state(self):  # TE's fp8 metadata
        return torch.empty(0, dtype=torch.uint8)

    def set_extra_state(self, state):
        pass


class RowLinear(nn.Module):
    def __init__(self, cin, cout):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(cout, cin) * cin ** -0.5)

    def forward(self, x):
        return F.linear(x, self.weight)

    def get_extra_state(self):
        return torch.empty(0, dtype=torch.uint8)

    def set_extra_state(self, state):
        pass


def rotate_half(x):
    x1, x2 = torch.chunk(x, 2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class SelfAttention(nn.Module):
    def __init__(self, eps, base):
        super().__init__()
        self.linear_qkv = LayerNormLinear(C, (H + 2 * G) * D, eps)
        self.linear_proj = RowLinear(H * D, C)
        self.base = base

    def forward(self, x):
        b, t, _ = x.shape
        mixed = self.linear_qkv(x).view(b, t, G, (H // G + 2) * D)
        q, k, v = torch.split(mixed, [H // G * D, D, D], dim=3)
        q = q.reshape(b, t, H, D)
        inv_freq = 1.0 / (self.base ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
        freqs = torch.outer(torch.arange(t, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)[None, :, None, :]
        q = q * emb.cos() + rotate_half(q) * emb.sin()
        k = k * emb.cos() + rotate_half(k) * emb.sin()
        k, v = k.repeat_interleave(H // G, dim=2), v.repeat_interleave(H // G, dim=2)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        scores = q @ k.transpose(-2, -1) / D ** 0.5
        mask = torch.triu(torch.ones(t, t, dtype=torch.bool), 1)
        ctx = torch.softmax(scores.masked_fill(mask, float("-inf")).float(), -1) @ v
        return self.linear_proj(ctx.transpose(1, 2).reshape(b, t, H * D))


class MLP(nn.Module):
    def __init__(self, eps):
        super().__init__()
        self.linear_fc1 = LayerNormLinear(C, 2 * FFN, eps)
        self.linear_fc2 = RowLinear(FFN, C)

    def forward(self, x):
        gate, up = torch.chunk(self.linear_fc1(x), 2, dim=-1)
        return self.linear_fc2(F.silu(gate) * up)


class TransformerLayer(nn.Module):
    def __init__(self, eps, base):
        super().__init__()
        self.self_attention = SelfAttention(eps, base)
        self.mlp = MLP(eps)

    def forward(self, x):
        x = x + self.self_attention(x)
        return x + self.mlp(x)


class Decoder(nn.Module):
    def __init__(self, eps, base):
        super().__init__()
        self.layers = nn.ModuleList(TransformerLayer(eps, base) for _ in range(L))
        self.final_layernorm = TERMSNorm(C, eps)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.final_layernorm(x)


class Embedding(nn.Module):
    def __init__(self):
        super().__init__()
        self.word_embeddings = nn.Embedding(V, C)


class GPTModel(nn.Module):
    def __init__(self, eps=0.0, base=10000.0):
        super().__init__()
        self.embedding = Embedding()
        self.decoder = Decoder(eps, base)
        self.output_layer = RowLinear(C, V)

    def forward(self, tokens, targets):
        x = self.embedding.word_embeddings(tokens)
        logits = self.output_layer(self.decoder(x))
        return F.cross_entropy(logits.reshape(-1, V).float(), targets.reshape(-1))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cli", required=True)
    ap.add_argument("--work", required=True)
    args = ap.parse_args()
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    torch.set_num_threads(1)

    data = s.Data(work, V, SEQ, MBS, ACCUM, num_samples=64, seed=SEED, pad_at=(LAST, 1, 0, 4))
    torch.manual_seed(0)
    model = GPTModel(eps=0.0, base=500000.0)
    with torch.no_grad():
        model.embedding.word_embeddings.weight[s.PAD].zero_()
    opt = s.adamw(model.parameters())
    margs = Namespace(hidden_size=C, num_layers=L, num_attention_heads=H, num_query_groups=G, group_query_attention=True,
                      ffn_hidden_size=FFN, norm_epsilon=0.0, rotary_base=500000, seq_length=SEQ,
                      max_position_embeddings=SEQ, untie_embeddings_and_output_weights=True, normalization="RMSNorm",
                      swiglu=True, add_bias_linear=False, position_embedding_type="rope", padded_vocab_size=V)

    def save():
        torch.save({"model": model.state_dict(), "args": margs, "iteration": FIRST, "checkpoint_version": 3.0},
                   work / "model_optim_rng.pt")
        torch.save(s.name_keyed(model, opt), work / "optimizer.pt")

    proc, manifest = s.incident_case("megatron", args.cli, work, model, opt, data, SITES, save, FIRST, LAST,
                                     ["--checkpoint", work / "model_optim_rng.pt", "--optimizer", work / "optimizer.pt",
                                      # the loop logs from 0; Megatron's own log says "iteration 4" for this step
                                      "--log-numbering", "zero"])
    s.check("naming: megatron (detected: decoder.layers.0.self_attention.linear_qkv.weight)" in proc.stdout,
            "auto-detected Megatron naming")
    if manifest:
        m = manifest["model"]
        s.check(m["num_kv_heads"] == G and m["intermediate_size"] == FFN and m["rope_theta"] == 500000.0
                and m["norm_eps"] == 0.0 and not m["tie_embeddings"] and "rope_style" not in m,
                f"model from args and the fused tensors: GQA, fc1 halves, rotary_base, norm_epsilon, untied {m}")
    return s.finish()


if __name__ == "__main__":
    sys.exit(main())
