"""An independent eager-PyTorch reading of a nanreplay v1 bundle.

Reads manifest.json, safetensors checkpoints and token shards with nothing but
torch and the standard library, draws each step's samples with torch.randperm
itself, and computes the step's loss and global gradient norm the way a plain
PyTorch DDP + gradient-accumulation training loop would. fp32 computes
plainly; bf16 and fp16 follow the bundle format's autocast-by-rounding rules
(docs/bundle-format.md, "Precision as replayed"), written here from that page
as cast pairs at the same points, so autograd rounds gradients where it says
(fp16's loss scale is not modelled: the cross-check runs fp32 and bf16). Used to cross-check
`nanreplay run` (tests/py/test_crosscheck_pytorch.py).
"""
import json
import math
import re
import struct
from pathlib import Path

import torch
import torch.nn.functional as F

DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "I64": torch.int64}


def read_safetensors(path):
    raw = Path(path).read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    base = 8 + n
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        buf = bytearray(raw[base + begin:base + end])
        t = torch.frombuffer(buf, dtype=DTYPES[info["dtype"]]) if buf else torch.empty(0, dtype=DTYPES[info["dtype"]])
        out[name] = t.reshape(info["shape"]).clone()
    return out


class Bundle:
    def __init__(self, root):
        self.root = Path(root)
        self.manifest = json.loads((self.root / "manifest.json").read_text())
        d = self.manifest["data"]
        parts = []
        for shard in d["shards"]:
            raw = bytearray((self.root / shard["path"]).read_bytes())
            dtype = torch.int16 if shard["dtype"] == "uint16" else torch.int32
            t = torch.frombuffer(raw, dtype=dtype).to(torch.int64)
            if shard["dtype"] == "uint16":
                t = t & 0xFFFF
            else:
                t = t & 0xFFFFFFFF
            parts.append(t)
        self.tokens = torch.cat(parts)
        self.seq_len = d["seq_len"]
        self.num_samples = (len(self.tokens) - 1) // self.seq_len

    def samples(self, step):
        d = self.manifest["data"]
        s = d["sampler"]
        if s.get("kind") == "explicit":  # the step's own lists, one per rank
            return next(e["samples"] for e in self.manifest["steps"] if e["step"] == step)
        world = d.get("world_size", 1)
        B = d["micro_batch_size"] * d.get("grad_accum_steps", 1)
        g = torch.Generator()
        g.manual_seed(s["seed"] + s.get("epoch", 0))
        perm = torch.randperm(self.num_samples, generator=g).tolist()
        total = (self.num_samples // world) * world
        start = (step - s.get("epoch_start_step", 0)) * B
        return [perm[r:total:world][start:start + B] for r in range(world)]

    def batch(self, ids):
        rows = [self.tokens[i * self.seq_len:i * self.seq_len + self.seq_len + 1] for i in ids]
        w = torch.stack(rows)
        return w[:, :-1], w[:, 1:]


def rope_inv_freq(D, theta, scaling=None):
    """The D/2 rotary inverse frequencies; scaling: the manifest's rope_scaling (null or llama3)."""
    inv = 1.0 / (theta ** (torch.arange(0, D, 2).float() / D))
    if scaling is None:
        return inv
    if scaling.get("rope_type") != "llama3":
        raise ValueError(f"rope_scaling: only rope_type llama3 is modelled, got {scaling!r}")
    # Llama 3.1, op for op as HF modeling_rope_utils._compute_llama3_parameters (attention factor 1): the same
    # fp32 torch expressions, so that `2 * pi / inv` stays torch's reciprocal-times-scalar and the bits match.
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old / low, inv / factor, inv)  # long wavelengths: divided by factor
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old / high) * ~(wavelen > old / low)  # in between: interpolated
    return torch.where(medium, smoothed, scaled)


def rotary(x, inv_freq, style="rotate_half"):
    # x: (B, heads, T, D). Pair i turns by position * inv_freq[i]; rotate_half (Hugging Face) pairs dims
    # (i, i + D/2), interleaved (Meta's llama, llama2.c, torchtitan) pairs (2i, 2i + 1).
    T, D = x.shape[-2], x.shape[-1]
    ang = torch.outer(torch.arange(T).float(), inv_freq)
    if style == "interleaved":
        x1, x2, cos, sin = x[..., 0::2], x[..., 1::2], ang.cos(), ang.sin()
        return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1).flatten(-2)
    ang = torch.cat([ang, ang], -1)
    x1, x2 = x[..., : D // 2], x[..., D // 2:]
    return x * ang.cos() + torch.cat([-x2, x1], -1) * ang.sin()


def permute_for_rotate_half(w, n_heads):
    """HF convert_llama_weights_to_hf.py's `permute`: q/k rows of an interleaved-rotary checkpoint reordered
    per head (2i, 2i+1 -> i, i + D/2) so rotate_half computes the same scores. A 1-D tensor (bias, norm
    weight) is permuted as rows."""
    dim1 = w.shape[0]
    rows = w.reshape(dim1, -1)
    return rows.view(n_heads, dim1 // n_heads // 2, 2, rows.shape[1]).transpose(1, 2).reshape(w.shape)


LOW_TYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def rounding(compute):
    """A rounding point of docs/bundle-format.md for `compute`: a cast pair (fp32 -> low -> fp32), whose
    autograd rounds the gradient passing through it the same way; the identity for fp32."""
    low = LOW_TYPES.get(compute)
    if low is None:
        return lambda t: t
    return lambda t: t.to(low).to(torch.float32)


def attention_probs(q, k, H, G, rnd=lambda t: t, softcap=None, window=None):
    """Softmax probabilities (B, H, T, T) of q: (B, T, H*D) against k: (B, T, G*D), both rounded (sites).
    softcap c (Gemma 2): the rounded scaled scores s become c * tanh(s / c) in fp32, masked afterwards.
    window W (Mistral): query i sees keys j with i - W < j <= i."""
    B, T, _ = q.shape
    D = q.shape[-1] // H
    q = q.view(B, T, H, D).transpose(1, 2)
    k = k.view(B, T, G, D).transpose(1, 2).repeat_interleave(H // G, dim=1)
    scores = rnd(rnd(q @ k.transpose(-2, -1)) / math.sqrt(D))  # round(round(q k^T) / sqrt(D))
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    mask = torch.triu(torch.ones(T, T, dtype=torch.bool), 1)
    if window is not None:
        mask |= torch.tril(torch.ones(T, T, dtype=torch.bool), -window)
    return rnd(torch.softmax(scores.masked_fill(mask, float("-inf")), -1))


def attention(q, k, v, H, G, rnd=lambda t: t, softcap=None, window=None):
    # q: (B, T, H*D), k/v: (B, T, G*D), each already rounded (probe sites).
    B, T, _ = q.shape
    D = q.shape[-1] // H
    v = v.view(B, T, G, D).transpose(1, 2).repeat_interleave(H // G, dim=1)
    probs = attention_probs(q, k, H, G, rnd, softcap, window)
    return rnd(probs @ v).transpose(1, 2).reshape(B, T, H * D)


def llama_loss(cfg, p, inputs, targets, rnd=lambda t: t):
    """rnd: the rounding point (see rounding()); every probe site but the loss passes it, and
    matmul inputs and weights are rounded before an fp32-accumulated product.

    The manifest's llama-family options, each as the Hugging Face model it comes from: rope_style and
    rope_scaling (Llama 3.1), attention_bias (Qwen2: q/k/v biases, none on o_proj), qk_norm ("head": Qwen3,
    "full": OLMo 2; before rotary), attn_logit_softcap and final_logit_softcap (Gemma 2), sliding_window
    (Mistral, every layer), moe (Qwen3-MoE's sparse MLP in every layer, moe_mlp; the loss adds the router's
    load-balancing and z losses), norm_layout "post" (OLMo 2, transformers' modeling_olmo2.py
    Olmo2DecoderLayer.forward: each sublayer reads the residual itself and its output is normalised,
    post_attention_layernorm after attention, post_feedforward_layernorm after the MLP, before the add).
    Absent or null is the default."""
    H, G = cfg["num_heads"], cfg.get("num_kv_heads", cfg["num_heads"])
    eps, theta = cfg.get("norm_eps", 1e-5), cfg.get("rope_theta", 10000.0)
    B, T = inputs.shape
    D = cfg["hidden_size"] // H
    style, qk_norm = cfg.get("rope_style") or "rotate_half", cfg.get("qk_norm")
    bias, softcap, window = bool(cfg.get("attention_bias")), cfg.get("attn_logit_softcap"), cfg.get("sliding_window")
    final_softcap = cfg.get("final_logit_softcap")
    if style not in ("rotate_half", "interleaved"):
        raise ValueError(f"rope_style: expected rotate_half or interleaved, got {style!r}")
    if qk_norm not in (None, "head", "full"):
        raise ValueError(f"qk_norm: expected null, head or full, got {qk_norm!r}")
    post_norm = cfg.get("norm_layout") == "post"
    if cfg.get("norm_layout") not in (None, "pre", "post"):
        raise ValueError(f"norm_layout: only pre and post are modelled, got {cfg.get('norm_layout')!r}")
    inv_freq = rope_inv_freq(D, theta, cfg.get("rope_scaling"))
    moe, router_logits = cfg.get("moe"), []

    def norm(x, w):  # fp32 from the rounded input; the norm weight is not rounded
        return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w

    def rope(x, heads):
        rotated = rotary(x.view(B, T, heads, D).transpose(1, 2), inv_freq, style)
        return rotated.transpose(1, 2).reshape(B, T, heads * D)

    def lin(x, w, b=None):  # a bias, where there is one, is rounded like the weight
        return F.linear(rnd(x), rnd(w), None if b is None else rnd(b))

    def proj(h, pre, name):
        key = pre + f"self_attn.{name}_proj."
        return lin(h, p[key + "weight"], p[key + "bias"] if bias else None)

    def q_or_k(h, pre, name, heads):  # the q or k site: projection, optional QK-norm, rotary in fp32
        t = proj(h, pre, name)
        if qk_norm is not None:  # the norm reads the rounded projection and is a site of its own
            w, t = p[pre + f"self_attn.{name}_norm.weight"], rnd(t)
            t = rnd(norm(t.view(B, T, heads, D), w).reshape(B, T, heads * D) if qk_norm == "head" else norm(t, w))
        return rnd(rope(t, heads))

    def sublayer_input(x, key):  # pre-norm: the normalised residual (a site); post-norm: the residual itself
        return x if post_norm else rnd(norm(x, p[key]))

    def sublayer_output(t, key):  # post-norm: the sublayer's output normalised before the add (a site)
        return rnd(norm(t, p[key])) if post_norm else t

    x = rnd(F.embedding(inputs, p["model.embed_tokens.weight"]))
    for i in range(cfg["num_layers"]):
        pre = f"model.layers.{i}."
        h = sublayer_input(x, pre + "input_layernorm.weight")
        q, k, v = q_or_k(h, pre, "q", H), q_or_k(h, pre, "k", G), rnd(proj(h, pre, "v"))
        att = attention(q, k, v, H, G, rnd, softcap, window)
        att = rnd(lin(att, p[pre + "self_attn.o_proj.weight"]))
        x = rnd(x + sublayer_output(att, pre + "post_attention_layernorm.weight"))
        h = sublayer_input(x, pre + "post_attention_layernorm.weight")
        if moe is not None:
            mixed, logits = moe_mlp(moe, p, pre, h, rnd, lin)
            router_logits.append(logits)
            x = rnd(x + sublayer_output(mixed, pre + "post_feedforward_layernorm.weight"))
            continue
        gate = rnd(lin(h, p[pre + "mlp.gate_proj.weight"]))
        up = rnd(lin(h, p[pre + "mlp.up_proj.weight"]))
        down = rnd(lin(rnd(F.silu(gate) * up), p[pre + "mlp.down_proj.weight"]))
        x = rnd(x + sublayer_output(down, pre + "post_feedforward_layernorm.weight"))
    x = rnd(norm(x, p["model.norm.weight"]))
    head = p["model.embed_tokens.weight"] if cfg.get("tie_embeddings", False) else p["lm_head.weight"]
    logits = rnd(lin(x, head))
    if final_softcap is not None:  # fp32 from the rounded logits, not rounded again
        logits = torch.tanh(logits / final_softcap) * final_softcap
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    if moe is not None:
        loss = loss + moe_router_losses(moe, router_logits)
    return loss


def moe_top_k(probs, k):
    """The k largest probabilities per token and their experts, ties to the lower expert index (a stable
    descending sort; torch.topk leaves the order of ties unspecified)."""
    values, experts = torch.sort(probs, dim=-1, descending=True, stable=True)
    return values[:, :k], experts[:, :k]


def moe_mlp(moe, p, pre, h, rnd, lin):
    """The MoE block in place of layer `pre`'s MLP, on h (B, T, C), the rounded post_attention_layernorm
    output. Follows Hugging Face's modeling_qwen3_moe.py, Qwen3MoeSparseMoeBlock.forward: router logits
    x @ gate.weight^T, softmax in fp32, top_k, renormalised when norm_topk_prob, then for each expert in
    increasing index the routed tokens' down(silu(gate(x)) * up(x)) times their routing weight,
    index_add_-ed into zeros. bf16 (docs/bundle-format.md's rounding points): the router logits are the
    rounded `mlp.router` site, the probabilities fp32 and unrounded; each expert's gate, up, act and
    down are rounded sites; the weighted sum is fp32 and rounded once (`mlp.combine`).
    Returns (combine (B, T, C), router logits (B*T, E))."""
    B, T, C = h.shape
    E, k = moe["num_experts"], moe["top_k"]
    x = h.reshape(-1, C)
    router = rnd(lin(x, p[pre + "mlp.gate.weight"]))
    probs = torch.softmax(router, dim=-1)
    weights, experts = moe_top_k(probs, k)
    if moe.get("norm_topk_prob", False):
        weights = weights / weights.sum(dim=-1, keepdim=True)
    out = torch.zeros_like(x)
    for e in range(E):
        token, slot = torch.where(experts == e)
        if token.numel() == 0:
            continue
        w = pre + f"mlp.experts.{e}."
        xe = x[token]
        gate = rnd(lin(xe, p[w + "gate_proj.weight"]))
        up = rnd(lin(xe, p[w + "up_proj.weight"]))
        down = rnd(lin(rnd(F.silu(gate) * up), p[w + "down_proj.weight"]))
        out = out.index_add(0, token, down * weights[token, slot, None])
    return rnd(out).view(B, T, C), router


def load_balancing_loss(router_logits, num_experts, top_k):
    """Hugging Face's load_balancing_loss_func (modeling_qwen3_moe.py) without an attention mask: every
    layer's router logits concatenated along tokens, softmax, top_k, the one-hot mask's mean over tokens
    ([top_k, E]) times the mean probability per expert ([E]), summed, times num_experts."""
    logits = torch.cat(router_logits, dim=0)
    probs = torch.softmax(logits, dim=-1)
    _, experts = moe_top_k(probs, top_k)
    mask = F.one_hot(experts, num_experts)
    tokens_per_expert = mask.float().mean(dim=0)
    router_prob_per_expert = probs.mean(dim=0)
    return torch.sum(tokens_per_expert * router_prob_per_expert.unsqueeze(0)) * num_experts


def router_z_loss(router_logits):
    """Mean over layers and tokens of logsumexp(router logits)^2."""
    return torch.logsumexp(torch.cat(router_logits, dim=0), dim=-1).pow(2).mean()


def moe_router_losses(moe, router_logits):
    """router_aux_loss_coef * load balancing + router_z_loss_coef * z loss (a zero coefficient: no term),
    from the (rounded) router logits, in fp32."""
    out = 0.0
    aux, z = moe.get("router_aux_loss_coef", 0.0) or 0.0, moe.get("router_z_loss_coef", 0.0) or 0.0
    if aux:
        out = out + aux * load_balancing_loss(router_logits, moe["num_experts"], moe["top_k"])
    if z:
        out = out + z * router_z_loss(router_logits)
    return out


def gpt2_loss(cfg, p, inputs, targets, rnd=lambda t: t):
    H, C, eps = cfg["num_heads"], cfg["hidden_size"], cfg.get("norm_eps", 1e-5)
    T = inputs.shape[1]

    def ln(x, pre):  # fp32, weight and bias not rounded
        return F.layer_norm(x, (C,), p[pre + ".weight"], p[pre + ".bias"], eps)

    def lin(x, pre):  # linear biases are rounded
        return F.linear(rnd(x), rnd(p[pre + ".weight"]), rnd(p[pre + ".bias"]))

    # Token plus position embedding, rounded once after the sum.
    x = rnd(p["transformer.wte.weight"][inputs] + p["transformer.wpe.weight"][torch.arange(T)])
    for i in range(cfg["num_layers"]):
        pre = f"transformer.h.{i}."
        q, k, v = (rnd(t) for t in lin(rnd(ln(x, pre + "ln_1")), pre + "attn.c_attn").split(C, -1))
        x = rnd(x + rnd(lin(attention(q, k, v, H, H, rnd), pre + "attn.c_proj")))
        up = rnd(lin(rnd(ln(x, pre + "ln_2")), pre + "mlp.c_fc"))
        x = rnd(x + rnd(lin(rnd(F.gelu(up, approximate="tanh")), pre + "mlp.c_proj")))
    logits = rnd(F.linear(rnd(rnd(ln(x, "transformer.ln_f"))), rnd(p["transformer.wte.weight"])))
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def replay_step(bundle, step_dir, step):
    """Loss (mean over ranks of the mean over micro-batches), grad norm, per-rank values."""
    params = {k: v.float().requires_grad_(True) for k, v in read_safetensors(bundle.root / step_dir / "model.safetensors").items()}
    loss, norm, rank_losses, rank_norms, _ = step_gradients(bundle, params, step)
    return loss, norm, rank_losses, rank_norms


def step_gradients(bundle, params, step):
    """replay_step on given parameters; also the all-reduced gradients (unclipped)."""
    m = bundle.manifest
    cfg = m["model"]
    d = m["data"]
    loss_fn = llama_loss if cfg["arch"] == "llama" else gpt2_loss
    rnd = rounding(m.get("precision", {}).get("compute", "fp32"))
    world, accum, mbs = d.get("world_size", 1), d.get("grad_accum_steps", 1), d["micro_batch_size"]
    total = {k: torch.zeros_like(v) for k, v in params.items()}
    rank_losses, rank_norms = [], []
    for rank, ids in enumerate(bundle.samples(step)):
        for v in params.values():
            v.grad = None
        rank_loss = 0.0
        for micro in range(accum):
            inputs, targets = bundle.batch(ids[micro * mbs:(micro + 1) * mbs])
            loss = loss_fn(cfg, params, inputs, targets, rnd)
            rank_loss += loss.item()
            (loss / accum).backward()
        rank_losses.append(rank_loss / accum)
        grads = {k: (v.grad if v.grad is not None else torch.zeros_like(v)) for k, v in params.items()}
        rank_norms.append(torch.norm(torch.stack([g.norm() for g in grads.values()])).item())
        for k in total:
            total[k] += grads[k] / world
    norm = torch.norm(torch.stack([g.norm() for g in total.values()])).item()
    for v in params.values():
        v.grad = None
    return sum(rank_losses) / world, norm, rank_losses, rank_norms, total


def matches_glob(pattern, key):
    """The bundle format's no_decay globs: * any run (dots included), ? one character."""
    regex = "".join(".*" if c == "*" else "." if c == "?" else re.escape(c) for c in pattern)
    return re.fullmatch(regex, key) is not None


def train_window(bundle):
    """Rolls forward from the first step's checkpoint the way the training job
    did, with PyTorch itself: clip_grad_norm_ and torch.optim.AdamW, its state
    loaded from optimizer.safetensors. A step with its own checkpoint starts
    from it. Returns {step: loss}. fp32 only (no loss scaler)."""
    m = bundle.manifest
    o = m["optimizer"]
    steps = sorted(m["steps"], key=lambda e: e["step"])
    first = bundle.root / steps[0]["dir"]
    params = {k: v.float().requires_grad_(True) for k, v in read_safetensors(first / "model.safetensors").items()}
    names = list(params)
    decay = [n for n in names if not any(matches_glob(g, n) for g in o.get("no_decay", []))]
    plain = [n for n in names if n not in decay]
    groups = [{"params": [params[n] for n in decay], "weight_decay": o["weight_decay"]},
              {"params": [params[n] for n in plain], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=1.0, betas=tuple(o["betas"]), eps=o["eps"], foreach=False)
    state = read_safetensors(first / "optimizer.safetensors")
    count = float(state["step"].reshape(-1)[0])
    for n in names:
        opt.state[params[n]] = {"step": torch.tensor(count), "exp_avg": state[n + ".exp_avg"].float().clone(),
                                "exp_avg_sq": state[n + ".exp_avg_sq"].float().clone()}
    losses = {}
    for entry in steps:
        step_dir = bundle.root / entry["dir"]
        if entry is not steps[0] and (step_dir / "model.safetensors").exists():
            stored = read_safetensors(step_dir / "model.safetensors")
            with torch.no_grad():
                for n in names:
                    params[n].copy_(stored[n].float())
        loss, _, _, _, grads = step_gradients(bundle, params, entry["step"])
        losses[entry["step"]] = loss
        for n in names:
            params[n].grad = grads[n].clone()
        if o.get("grad_clip") is not None:
            torch.nn.utils.clip_grad_norm_([params[n] for n in names], o["grad_clip"])
        lr = json.loads((step_dir / "state.json").read_text())["lr"]
        for g in opt.param_groups:
            g["lr"] = lr
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses
