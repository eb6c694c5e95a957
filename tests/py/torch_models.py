"""Plain PyTorch llama and gpt2 models whose named_parameters() are bundle v1's keys.

Written the way a training engineer would write them (nn.Module trees, HF llama
naming, nanoGPT naming for gpt2), not as a bundle reader: the capture end-to-end
test trains them and captures them, and bench/bench_capture.py times the capture.
Math follows the bundle format's model, docs/bundle-format.md (rotate-half RoPE, RMSNorm as
x / sqrt(mean(x^2) + eps) * w, GELU tanh for gpt2), fp32; llama's optional MoE follows Hugging Face's
modeling_qwen3_moe.py (Qwen3MoeSparseMoeBlock, load_balancing_loss_func).
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


class Qwen3MoeSparseMoeBlock(nn.Module):
    """Hugging Face's Qwen3MoeSparseMoeBlock (modeling_qwen3_moe.py): a router `gate` and `experts`, each a
    SwiGLU MLP (gate_proj, up_proj, down_proj); forward as HF's, the experts looped with index_add_.
    Returns (output, router logits (tokens, num_experts))."""

    def __init__(self, hidden, num_experts, top_k, width, norm_topk_prob=False):
        super().__init__()
        self.num_experts, self.top_k, self.norm_topk_prob = num_experts, top_k, norm_topk_prob
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        self.experts = nn.ModuleList(LlamaMLP(hidden, width) for _ in range(num_experts))

    def forward(self, hidden_states):
        batch_size, sequence_length, hidden_dim = hidden_states.shape
        hidden_states = hidden_states.view(-1, hidden_dim)
        router_logits = self.gate(hidden_states)
        routing_weights = F.softmax(router_logits, dim=1, dtype=torch.float)
        routing_weights, selected_experts = torch.topk(routing_weights, self.top_k, dim=-1)
        if self.norm_topk_prob:
            routing_weights = routing_weights / routing_weights.sum(dim=-1, keepdim=True)
        routing_weights = routing_weights.to(hidden_states.dtype)
        final_hidden_states = torch.zeros((batch_size * sequence_length, hidden_dim), dtype=hidden_states.dtype,
                                          device=hidden_states.device)
        # (num_experts, top_k, tokens): which token chose which expert in which of its top_k slots
        expert_mask = F.one_hot(selected_experts, num_classes=self.num_experts).permute(2, 1, 0)
        for expert_idx in range(self.num_experts):
            idx, top_x = torch.where(expert_mask[expert_idx])
            if top_x.numel() == 0:
                continue
            current_state = hidden_states[None, top_x].reshape(-1, hidden_dim)
            current_hidden_states = self.experts[expert_idx](current_state) * routing_weights[top_x, idx, None]
            final_hidden_states.index_add_(0, top_x, current_hidden_states.to(hidden_states.dtype))
        return final_hidden_states.reshape(batch_size, sequence_length, hidden_dim), router_logits


def load_balancing_loss_func(gate_logits, num_experts, top_k):
    """Hugging Face's load_balancing_loss_func (modeling_qwen3_moe.py), without an attention mask."""
    concatenated_gate_logits = torch.cat(list(gate_logits), dim=0)
    routing_weights = F.softmax(concatenated_gate_logits, dim=-1)
    _, selected_experts = torch.topk(routing_weights, top_k, dim=-1)
    expert_mask = F.one_hot(selected_experts, num_experts)
    tokens_per_expert = torch.mean(expert_mask.float(), dim=0)
    router_prob_per_expert = torch.mean(routing_weights, dim=0)
    overall_loss = torch.sum(tokens_per_expert * router_prob_per_expert.unsqueeze(0))
    return overall_loss * num_experts


class LlamaDecoderLayer(nn.Module):
    """cfg["moe"] (bundle v1's model.moe): a Qwen3MoeSparseMoeBlock in place of the dense MLP."""

    def __init__(self, cfg):
        super().__init__()
        C, eps = cfg["hidden_size"], cfg["norm_eps"]
        self.input_layernorm = RMSNorm(C, eps)
        self.self_attn = LlamaAttention(C, cfg["num_heads"], cfg["num_kv_heads"], cfg["rope_theta"],
                                        bias=cfg.get("attention_bias", False), qk_norm=cfg.get("qk_norm"), eps=eps)
        self.post_attention_layernorm = RMSNorm(C, eps)
        moe = cfg.get("moe")
        if moe:
            self.mlp = Qwen3MoeSparseMoeBlock(C, moe["num_experts"], moe["top_k"],
                                              moe.get("intermediate_size") or cfg["intermediate_size"],
                                              moe.get("norm_topk_prob", False))
        else:
            self.mlp = LlamaMLP(C, cfg["intermediate_size"])

    def forward(self, x, router_logits=None):
        x = x + self.self_attn(self.input_layernorm(x))
        out = self.mlp(self.post_attention_layernorm(x))
        if isinstance(out, tuple):  # the MoE block: (output, router logits)
            out, logits = out
            if router_logits is not None:
                router_logits.append(logits)
        return x + out


class LlamaModel(nn.Module):
    def __init__(self, cfg, padding_idx=None):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg["vocab_size"], cfg["hidden_size"], padding_idx=padding_idx)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg) for _ in range(cfg["num_layers"]))
        self.norm = RMSNorm(cfg["hidden_size"], cfg["norm_eps"])

    def forward(self, tokens, router_logits=None):
        x = self.embed_tokens(tokens)
        for layer in self.layers:
            x = layer(x, router_logits)
        return self.norm(x)


class LlamaForCausalLM(nn.Module):
    """model.* and lm_head.weight, as Hugging Face names them. With cfg["moe"], Qwen3-MoE's sparse MLPs
    (Qwen3MoeForCausalLM's layout; no model.config: a capture passes model_config=dict(moe=...)); the
    loss is cross-entropy + router_aux_loss_coef * HF's load balancing loss + router_z_loss_coef * the
    mean over layers and tokens of logsumexp(router logits)^2."""

    def __init__(self, cfg, padding_idx=None):
        super().__init__()
        self.rope_theta = cfg["rope_theta"]
        self.moe = cfg.get("moe")
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
        router_logits = [] if self.moe else None
        logits = self.lm_head(self.model(inputs, router_logits))
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        if self.moe:
            aux, z = self.moe.get("router_aux_loss_coef", 0.0), self.moe.get("router_z_loss_coef", 0.0)
            if aux:
                loss = loss + aux * load_balancing_loss_func(router_logits, self.moe["num_experts"], self.moe["top_k"])
            if z:
                loss = loss + z * torch.logsumexp(torch.cat(router_logits, 0), dim=-1).pow(2).mean()
        return loss


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
