"""Plain PyTorch llama and gpt2 models whose named_parameters() are bundle v1's keys.

Written the way a training engineer would write them (nn.Module trees, HF llama
naming, nanoGPT naming for gpt2), not as a bundle reader: the capture end-to-end
test trains them and captures them, and bench/bench_capture.py times the capture.
Math follows the bundle format's model, docs/bundle-format.md (rotate-half RoPE, RMSNorm as
x / sqrt(mean(x^2) + eps) * w, GELU tanh for gpt2), fp32.
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotate_half_rope(x, theta):
    """x: (B, heads, T, D), rotate-half convention, positions from 0."""
    T, D = x.shape[-2], x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, D, 2, device=x.device).float() / D))
    ang = torch.outer(torch.arange(T, device=x.device).float(), inv)
    ang = torch.cat([ang, ang], -1)
    x1, x2 = x[..., : D // 2], x[..., D // 2:]
    return x * ang.cos() + torch.cat([-x2, x1], -1) * ang.sin()


def causal_attention(q, k, v):
    """q: (B, H, T, D), k/v: (B, H, T, D) -> (B, H, T, D)."""
    T, D = q.shape[-2], q.shape[-1]
    scores = q @ k.transpose(-2, -1) / math.sqrt(D)
    mask = torch.triu(torch.ones(T, T, dtype=torch.bool, device=q.device), 1)
    return torch.softmax(scores.masked_fill(mask, float("-inf")), -1) @ v


class LlamaAttention(nn.Module):
    """Optionally with q/k/v biases (Qwen2's attention_bias) and q/k RMSNorms before rotary
    (qk_norm "head": over each head, Qwen3; "full": over the whole projection, OLMo 2)."""

    def __init__(self, hidden, heads, kv_heads, theta, bias=False, qk_norm=None, eps=1e-5):
        super().__init__()
        self.heads, self.kv_heads, self.theta, self.qk_norm = heads, kv_heads, theta, qk_norm
        self.head_dim = hidden // heads
        self.q_proj = nn.Linear(hidden, hidden, bias=bias)
        self.k_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(hidden, hidden, bias=False)
        if qk_norm is not None:  # registered after o_proj, as Hugging Face's modules are
            self.q_norm = RMSNorm(self.head_dim if qk_norm == "head" else hidden, eps)
            self.k_norm = RMSNorm(self.head_dim if qk_norm == "head" else kv_heads * self.head_dim, eps)

    def forward(self, x):
        B, T, _ = x.shape
        H, G, D = self.heads, self.kv_heads, self.head_dim
        q, k = self.q_proj(x), self.k_proj(x)
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.view(B, T, H, D), k.view(B, T, G, D)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        q = rotate_half_rope(q.transpose(1, 2), self.theta)
        k = rotate_half_rope(k.transpose(1, 2), self.theta)
        v = self.v_proj(x).view(B, T, G, D).transpose(1, 2)
        k, v = k.repeat_interleave(H // G, 1), v.repeat_interleave(H // G, 1)  # query head h reads h // (H/G)
        return self.o_proj(causal_attention(q, k, v).transpose(1, 2).reshape(B, T, H * D))


class LlamaMLP(nn.Module):
    def __init__(self, hidden, width):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, width, bias=False)
        self.up_proj = nn.Linear(hidden, width, bias=False)
        self.down_proj = nn.Linear(width, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        C, eps = cfg["hidden_size"], cfg["norm_eps"]
        self.input_layernorm = RMSNorm(C, eps)
        self.self_attn = LlamaAttention(C, cfg["num_heads"], cfg["num_kv_heads"], cfg["rope_theta"],
                                        bias=cfg.get("attention_bias", False), qk_norm=cfg.get("qk_norm"), eps=eps)
        self.post_attention_layernorm = RMSNorm(C, eps)
        self.mlp = LlamaMLP(C, cfg["intermediate_size"])

    def forward(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, cfg, padding_idx=None):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg["vocab_size"], cfg["hidden_size"], padding_idx=padding_idx)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg) for _ in range(cfg["num_layers"]))
        self.norm = RMSNorm(cfg["hidden_size"], cfg["norm_eps"])

    def forward(self, tokens):
        x = self.embed_tokens(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


class LlamaForCausalLM(nn.Module):
    """model.* and lm_head.weight, as Hugging Face names them."""

    def __init__(self, cfg, padding_idx=None):
        super().__init__()
        self.rope_theta = cfg["rope_theta"]
        self.model = LlamaModel(cfg, padding_idx)
        self.lm_head = nn.Linear(cfg["hidden_size"], cfg["vocab_size"], bias=False)
        if cfg.get("tie_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight
        for name, p in self.named_parameters():
            if p.dim() == 2:
                with torch.no_grad():
                    keep = p[padding_idx].clone() if padding_idx is not None and "embed" in name else None
                    nn.init.normal_(p, std=0.02)
                    if keep is not None:
                        p[padding_idx] = keep

    def forward(self, inputs, targets):
        logits = self.lm_head(self.model(inputs))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


class GPT2Block(nn.Module):
    def __init__(self, C, heads, eps):
        super().__init__()
        self.heads = heads
        self.ln_1 = nn.LayerNorm(C, eps=eps)
        self.attn = nn.Module()
        self.attn.c_attn = nn.Linear(C, 3 * C)
        self.attn.c_proj = nn.Linear(C, C)
        self.ln_2 = nn.LayerNorm(C, eps=eps)
        self.mlp = nn.Module()
        self.mlp.c_fc = nn.Linear(C, 4 * C)
        self.mlp.c_proj = nn.Linear(4 * C, C)

    def forward(self, x):
        B, T, C = x.shape
        H = self.heads
        q, k, v = self.attn.c_attn(self.ln_1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, H, C // H).transpose(1, 2) for t in (q, k, v))
        x = x + self.attn.c_proj(causal_attention(q, k, v).transpose(1, 2).reshape(B, T, C))
        # Bundle v1's gpt2 (docs/bundle-format.md) uses the tanh GELU (nanoGPT's nn.GELU() default is the erf form).
        return x + self.mlp.c_proj(F.gelu(self.mlp.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT2(nn.Module):
    """nanoGPT's module tree: transformer.{wte,wpe,h.i,ln_f}, lm_head tied to wte."""

    def __init__(self, cfg):
        super().__init__()
        C = cfg["hidden_size"]
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(cfg["vocab_size"], C),
            wpe=nn.Embedding(cfg["max_seq_len"], C),
            h=nn.ModuleList(GPT2Block(C, cfg["num_heads"], cfg["norm_eps"]) for _ in range(cfg["num_layers"])),
            ln_f=nn.LayerNorm(C, eps=cfg["norm_eps"]),
        ))
        self.lm_head = nn.Linear(C, cfg["vocab_size"], bias=False)
        self.transformer.wte.weight = self.lm_head.weight
        for name, p in self.named_parameters():
            with torch.no_grad():
                if p.dim() == 2:
                    nn.init.normal_(p, std=0.02)
                elif name.endswith(".bias"):
                    p.zero_()

    def forward(self, inputs, targets):
        T = inputs.shape[1]
        x = self.transformer.wte(inputs) + self.transformer.wpe(torch.arange(T, device=inputs.device))
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
