"""Cross-check of the optimizers beyond AdamW (docs/optimizers.md) against
PyTorch's and Hugging Face's own update code.

For each optimizer, `nanreplay synth clean-fp32 --optimizer FILE --lr LR
--steps 11` trains a tiny llama with nanreplay's update rules, writing a
checkpoint and the optimizer state at every step; a twin written with
`--checkpoint-every 10` holds only the first and the last. Then:

1. per step: the reference computes the step's gradients
   (reference_model.step_gradients), clips them with torch's own
   clip_grad_norm_, applies the reference optimizer to the step's checkpoint
   and optimizer state, and must land on the next checkpoint within 1e-6
   relative (max |difference| / max |value| per tensor, parameters and state);
2. end to end (three of the cases): `nanreplay run --json --no-probes` on the
   twin rolls nine steps forward from its first checkpoint and compares its
   own update of step 109 with the real checkpoint of step 110 (no
   SYSTEM_UPDATE_MISMATCH, SYSTEM_TRAJECTORY_DIVERGED or SYSTEM_BIT_FLIP), and
   every derived step's loss equals the reference's loss of that step within
   1e-6, and every derived update's statistics (report.json update_stats:
   each tensor's update RMS, and for Adam its g^2 against the bias-corrected
   exp_avg_sq the update starts from, for Adafactor against its factored
   second moment; docs/optimizers.md#update-statistics)
   equal the reference's, computed from its own update, gradients and state
   (reference_update_stats), within 1e-3; so do those `run` measures on the
   per-step bundle between its checkpoints. Muon's parameters: see check_per_step.

The references: torch.optim.Adam and torch.optim.AdamW themselves (torch 1.13
has them, amsgrad included); torch.optim.Adafactor (torch >= 2.5,
torch/optim/_adafactor.py), transformers.optimization.Adafactor and
torch.optim.Muon (torch >= 2.9, torch/optim/_muon.py) transcribed below from
their upstream source, since the torch here predates them. Muon's
Newton-Schulz runs on bf16 tensors on a GPU; on this CPU each bf16 matmul is
an fp32 matmul of the bf16 values rounded to bf16, as the bundle format says.
MuonClip's per-head maxima come from the reference model's own attention
scores.

MuonClip on latent attention (muonclip-mla): `synth clean-deepseek-mla` with a
Muon group and qk_clip, five steps, checked per step as above and rolled
forward through `run`. Its model is test_family_deepseek_mla.py's
DeepseekV3ForCausalLM (transformers' modeling_deepseek_v3.py), its MuonClip
Megatron-LM's (mla_qk_clip). At the first step the check must also fail for
three mistakes (the shared rotary key k_pe rescaled, q_pe by sqrt(g) rather
than g, v rescaled with k_nope) and for no MuonClip at all.
Run by CTest with Debian's /usr/bin/python3 (python3-torch).
"""
import argparse
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

# Muon's bf16 Newton-Schulz grows a one-ulp gradient difference, and the BLAS's
# summation order follows its thread count: the reference and the CLI both run
# on the two threads CTest gives every test, also when this runs by hand.
os.environ.setdefault("OMP_NUM_THREADS", "2")
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import reference_model  # noqa: E402
import test_family_deepseek_mla as mla  # noqa: E402  (DeepSeek-V3's reference model)

TOLERANCE = 1e-6
LOSS_TOLERANCE = 1e-6
STATS_TOLERANCE = 1e-3  # the update statistics: differences of nearly equal parameters, ratios of squares
FIRST, STEPS = 100, 11
MLA_STEPS = 5
TAU_MLA = 1.0
MUON_GROUP = {"name": "muon", "params": ["model.layers.*_proj.weight"], "kind": "muon"}

# Rolled forward end to end through `run` (the rest: per step only; tests/test_optim_cli.cpp rolls
# every kind forward through an incident).
ROLLED = ("adam-groups", "adafactor-hf", "muonclip-exact", "muonclip-mla")
# run on the per-step bundle too, its update statistics between checkpoints
STATS_BETWEEN = ("adam-groups", "adafactor-hf", "muonclip-exact")
# Cases on another preset than clean-fp32: name -> (preset, steps)
PRESETS = {"muonclip-mla": ("clean-deepseek-mla", MLA_STEPS)}
# name -> (manifest "optimizer" section, state.json lr)
CASES = {
    "adam-groups": ({"kind": "adam", "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1, "amsgrad": True,
                     "grad_clip": 1.0, "no_decay": ["*norm.weight"],
                     "groups": [{"name": "embed", "params": ["model.embed_tokens.*"], "weight_decay": 0.0,
                                 "amsgrad": False}]},
                    {"default": 3e-3, "embed": 1e-2}),
    "adamw-amsgrad": ({"kind": "adamw", "betas": [0.9, 0.95], "weight_decay": 0.1, "amsgrad": True,
                       "grad_clip": 1.0}, 3e-3),
    "adafactor": ({"kind": "adafactor", "weight_decay": 0.01, "grad_clip": 1.0}, 1e-2),
    "adafactor-hf": ({"kind": "adafactor_hf", "beta1": 0.9, "weight_decay": 0.01}, 1e-3),
    "adafactor-hf-manual": ({"kind": "adafactor_hf", "relative_step": False, "scale_parameter": False,
                             "clip_threshold": 1.0, "eps": [1e-30, 1e-3]}, 1e-3),
    # Momentum and Nesterov: the buffers to 1e-6; the Muon parameters' update is checked exactly below.
    "muon-nesterov": ({"kind": "adamw", "betas": [0.9, 0.95], "weight_decay": 0.1, "grad_clip": 1.0,
                       "groups": [dict(MUON_GROUP, nesterov=True)]}, {"default": 3e-3, "muon": 2e-2}),
    # momentum 0: the next momentum_buffer is the step's clipped gradient bit for bit, which the
    # reference then uses (see exact_gradient); tau between the heads' largest logits, so some clip.
    "muonclip-exact": ({"kind": "adamw", "betas": [0.9, 0.95], "weight_decay": 0.1, "grad_clip": 1.0,
                        "groups": [dict(MUON_GROUP, momentum=0.0, adjust_lr_fn="match_rms_adamw",
                                        qk_clip={"tau": 0.02})]}, {"default": 3e-3, "muon": 2e-2}),
    # Latent attention: q_b_proj and kv_b_proj in the Muon group (kv_a_proj_with_mqa, "_mqa.weight", is not);
    # tau under every head's largest logit at the first step, between them at the next ones. The untied
    # lm_head is Muon's too: AdamW's first update divides its near-zero gradients (|g| ~ eps) by
    # themselves, which lifts the reference's other summation order past 1e-6.
    "muonclip-mla": ({"kind": "adamw", "betas": [0.9, 0.95], "weight_decay": 0.1, "grad_clip": 1.0,
                      "groups": [dict(MUON_GROUP, params=MUON_GROUP["params"] + ["lm_head.weight"], momentum=0.0,
                                      adjust_lr_fn="match_rms_adamw", qk_clip={"tau": TAU_MLA})]},
                     {"default": 3e-3, "muon": 2e-2}),
}


# ---- torch.optim.Adafactor (torch/optim/_adafactor.py, _single_tensor_adafactor) ----
def adafactor_step(param, grad, state, lr, beta2_decay=-0.8, eps=(None, 1e-3), d=1.0, weight_decay=0.0,
                   maximize=False):
    grad = grad if not maximize else -grad
    eps1, eps2 = eps
    if eps1 is None:
        eps1 = torch.finfo(param.dtype).eps
    state["step"] += 1
    step_float = state["step"]
    one_minus_beta2_t = step_float ** beta2_decay
    rho_t = min(lr, 1 / (step_float ** 0.5))
    alpha = max(eps2, param.norm(2).item() / (param.numel() ** 0.5)) * rho_t
    if weight_decay != 0:
        param.mul_(1 - lr * weight_decay)
    if grad.dim() > 1:
        row_var, col_var = state["row_var"], state["col_var"]
        row_mean = torch.linalg.vector_norm(grad, dim=-1, keepdim=True).square_().div_(grad.size(-1))
        row_var.lerp_(row_mean, one_minus_beta2_t)
        col_mean = torch.linalg.vector_norm(grad, dim=-2, keepdim=True).square_().div_(grad.size(-2))
        col_var.lerp_(col_mean, one_minus_beta2_t)
        var_estimate = row_var @ col_var
        var_estimate.div_(row_var.mean(dim=-2, keepdim=True).clamp_(min=eps1))
    else:
        variance = state["variance"]
        grad_squared = grad * grad
        variance.lerp_(grad_squared, one_minus_beta2_t)
        var_estimate = variance.clone()
    update = var_estimate.clamp_(min=eps1 * eps1).rsqrt_()
    update.mul_(grad)
    denom = max(1.0, update.norm(2).item() / ((update.numel() ** 0.5) * d))
    param.add_(update, alpha=-alpha / denom)


# ---- transformers.optimization.Adafactor.step ----
def hf_rms(tensor):
    return tensor.norm(2) / (tensor.numel() ** 0.5)


def hf_get_lr(group, state):
    rel_step_sz = group["lr"]
    if group["relative_step"]:
        min_step = 1e-6 * state["step"] if group["warmup_init"] else 1e-2
        rel_step_sz = min(min_step, 1.0 / math.sqrt(state["step"]))
    param_scale = 1.0
    if group["scale_parameter"]:
        param_scale = max(group["eps"][1], state["RMS"])
    return param_scale * rel_step_sz


def hf_approx_sq_grad(exp_avg_sq_row, exp_avg_sq_col):
    r_factor = (exp_avg_sq_row / exp_avg_sq_row.mean(dim=-1, keepdim=True)).rsqrt_().unsqueeze(-1)
    c_factor = exp_avg_sq_col.unsqueeze(-2).rsqrt()
    return torch.mul(r_factor, c_factor)


def adafactor_hf_step(p, grad, state, lr, eps=(1e-30, 1e-3), clip_threshold=1.0, decay_rate=-0.8, beta1=None,
                      weight_decay=0.0, scale_parameter=True, relative_step=True, warmup_init=False):
    group = {"lr": None if relative_step else lr, "eps": eps, "clip_threshold": clip_threshold,
             "decay_rate": decay_rate, "beta1": beta1, "weight_decay": weight_decay,
             "scale_parameter": scale_parameter, "relative_step": relative_step, "warmup_init": warmup_init}
    factored = len(grad.shape) >= 2
    state["step"] += 1
    state["RMS"] = hf_rms(p)
    lr = hf_get_lr(group, state)
    beta2t = 1.0 - math.pow(state["step"], group["decay_rate"])
    update = (grad ** 2) + group["eps"][0]
    if factored:
        exp_avg_sq_row, exp_avg_sq_col = state["exp_avg_sq_row"], state["exp_avg_sq_col"]
        exp_avg_sq_row.mul_(beta2t).add_(update.mean(dim=-1), alpha=(1.0 - beta2t))
        exp_avg_sq_col.mul_(beta2t).add_(update.mean(dim=-2), alpha=(1.0 - beta2t))
        update = hf_approx_sq_grad(exp_avg_sq_row, exp_avg_sq_col)
        update.mul_(grad)
    else:
        exp_avg_sq = state["exp_avg_sq"]
        exp_avg_sq.mul_(beta2t).add_(update, alpha=(1.0 - beta2t))
        update = exp_avg_sq.rsqrt().mul_(grad)
    update.div_((hf_rms(update) / group["clip_threshold"]).clamp_(min=1.0))
    update.mul_(lr)
    if group["beta1"] is not None:
        exp_avg = state["exp_avg"]
        exp_avg.mul_(group["beta1"]).add_(update, alpha=(1 - group["beta1"]))
        update = exp_avg
    if group["weight_decay"] != 0:
        p.add_(p, alpha=(-group["weight_decay"] * lr))
    p.add_(-update)


# ---- torch.optim.Muon (torch/optim/_muon.py), bf16 as on a GPU ----
def bf16_mm(a, b):
    return (a.float() @ b.float()).bfloat16()


def bf16_scale(a, s):
    return (a.float() * s).bfloat16()


def bf16_add(a, b):
    return (a.float() + b.float()).bfloat16()


def zeropower_via_newtonschulz(grad, ns_coefficients, ns_steps, eps):
    a, b, c = ns_coefficients
    ortho_grad = grad.bfloat16()
    if grad.size(0) > grad.size(1):
        ortho_grad = ortho_grad.T
    norm = ortho_grad.float().norm().bfloat16()                    # ortho_grad.norm()
    floor = torch.clamp(norm.float(), min=eps).bfloat16()           # .clamp(min=eps)
    ortho_grad = (ortho_grad.float() / floor.float()).bfloat16()   # div_
    for _ in range(ns_steps):
        gram_matrix = bf16_mm(ortho_grad, ortho_grad.T)
        gram_update = bf16_add(bf16_scale(gram_matrix, b), bf16_mm(bf16_scale(gram_matrix, c), gram_matrix))  # b*G + (c*G) @ G
        ortho_grad = bf16_add(bf16_scale(ortho_grad, a), bf16_mm(gram_update, ortho_grad))
    if grad.size(0) > grad.size(1):
        ortho_grad = ortho_grad.T
    return ortho_grad


def adjust_lr(lr, adjust_lr_fn, param_shape):
    A, B = param_shape[:2]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        adjusted_ratio = math.sqrt(max(1, A / B))
    elif adjust_lr_fn == "match_rms_adamw":
        adjusted_ratio = 0.2 * math.sqrt(max(A, B))
    else:
        adjusted_ratio = 1.0
    return lr * adjusted_ratio


def muon_step(param, grad, state, lr, weight_decay=0.1, momentum=0.95, nesterov=True,
              ns_coefficients=(3.4445, -4.7750, 2.0315), eps=1e-7, ns_steps=5, adjust_lr_fn=None, qk_clip=None):
    buf = state["momentum_buffer"]
    buf.lerp_(grad, 1 - momentum)
    update = grad.lerp(buf, momentum) if nesterov else buf
    update = zeropower_via_newtonschulz(update, ns_coefficients, ns_steps, eps)
    adjusted_lr = adjust_lr(lr, adjust_lr_fn, param.shape)
    param.mul_(1 - lr * weight_decay)
    param.add_(update, alpha=-adjusted_lr)
    state["step"] += 1


# ---- torch.optim.Adam / AdamW themselves, one parameter at a time ----
def adam_family_step(param, grad, state, lr, kind, betas=(0.9, 0.999), eps=1e-8, weight_decay=None, amsgrad=False,
                     decay=True):
    if weight_decay is None:
        weight_decay = 0.01 if kind == "adamw" else 0.0
    cls = torch.optim.AdamW if kind == "adamw" else torch.optim.Adam
    p = torch.nn.Parameter(param.clone())
    opt = cls([p], lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay if decay else 0.0,
              amsgrad=amsgrad, foreach=False)
    torch_state = {"step": torch.tensor(float(state["step"])), "exp_avg": state["exp_avg"], "exp_avg_sq": state["exp_avg_sq"]}
    if amsgrad:
        torch_state["max_exp_avg_sq"] = state["max_exp_avg_sq"]
    opt.state[p] = torch_state
    p.grad = grad.clone()
    opt.step()
    param.copy_(p.detach())
    state["step"] += 1


STATE_KEYS = {"adam": ["exp_avg", "exp_avg_sq"], "adamw": ["exp_avg", "exp_avg_sq"],
              "adafactor": [], "adafactor_hf": [], "muon": ["momentum_buffer"]}


def hyper(rule, keys):
    return {k: rule[k] for k in keys if k in rule}


def rule_of(optimizer, name):
    """(group name, rule dict) of parameter `name`: first matching group, else the top level.
    A group of the top level's kind takes the top level's hyper-parameters it does not set."""
    top = {k: v for k, v in optimizer.items() if k not in ("groups", "grad_clip", "no_decay")}
    top.setdefault("kind", "adamw")
    for group in optimizer.get("groups", []):
        if any(reference_model.matches_glob(g, name) for g in group["params"]):
            kind = group.get("kind", top["kind"])
            rule = dict(top) if kind == top["kind"] else {}
            rule.update({k: v for k, v in group.items() if k not in ("name", "params")})
            rule["kind"] = kind
            return group["name"], rule
    return "default", top


def step_one(param, grad, state, lr, rule, decay):
    kind = rule["kind"]
    if kind in ("adam", "adamw"):
        adam_family_step(param, grad, state, lr, kind, decay=decay,
                         **hyper(rule, ["betas", "eps", "weight_decay", "amsgrad"]))
    elif kind == "adafactor":
        args = hyper(rule, ["beta2_decay", "d", "weight_decay", "maximize"])
        if "eps" in rule:
            args["eps"] = tuple(rule["eps"])
        if not decay:
            args["weight_decay"] = 0.0
        adafactor_step(param, grad, state, lr, **args)
    elif kind == "adafactor_hf":
        args = hyper(rule, ["clip_threshold", "decay_rate", "beta1", "weight_decay", "scale_parameter",
                            "relative_step", "warmup_init"])
        if "eps" in rule:
            args["eps"] = tuple(rule["eps"])
        if not decay:
            args["weight_decay"] = 0.0
        adafactor_hf_step(param, grad, state, lr, **args)
    elif kind == "muon":
        args = hyper(rule, ["weight_decay", "momentum", "nesterov", "eps", "ns_steps", "adjust_lr_fn"])
        if "ns_coefficients" in rule:
            args["ns_coefficients"] = tuple(rule["ns_coefficients"])
        if not decay:
            args["weight_decay"] = 0.0
        muon_step(param, grad, state, lr, **args)
    else:
        raise ValueError(kind)


def load_state(stored, name, rule):
    """The parameter's state as its optimizer keeps it, from optimizer.safetensors."""
    step = stored[name + ".step"] if name + ".step" in stored else stored["step"]
    state = {"step": int(step.reshape(-1)[0].item())}
    for key in stored:
        if key.startswith(name + ".") and key != name + ".step" and "." not in key[len(name) + 1:]:
            state[key[len(name) + 1:]] = stored[key].float().clone()
    return state


class LogitMax:
    """Wraps reference_model.attention_probs: per layer and head, the largest visible scaled score."""

    def __init__(self, num_layers):
        self.num_layers, self.calls = num_layers, []
        self.original = reference_model.attention_probs

    def __enter__(self):
        def recording(q, k, H, G, rnd=lambda t: t, softcap=None, window=None):
            B, T, _ = q.shape
            D = q.shape[-1] // H
            qq = q.view(B, T, H, D).transpose(1, 2)
            kk = k.view(B, T, G, D).transpose(1, 2).repeat_interleave(H // G, dim=1)
            scores = rnd(rnd(qq @ kk.transpose(-2, -1)) / math.sqrt(D))
            mask = torch.triu(torch.ones(T, T, dtype=torch.bool), 1)
            self.calls.append(scores.detach().masked_fill(mask, float("-inf")).amax(dim=(0, 2, 3)))
            return self.original(q, k, H, G, rnd, softcap, window)
        reference_model.attention_probs = recording
        return self

    def __exit__(self, *exc):
        reference_model.attention_probs = self.original

    def per_layer(self):
        return [torch.stack(self.calls[l::self.num_layers]).amax(0) for l in range(self.num_layers)]


def qk_clip(params, rule_for, maxima, cfg):
    """MuonClip as the bundle format states it, from the maxima of the step."""
    H, G = cfg["num_heads"], cfg.get("num_kv_heads", cfg["num_heads"])
    D = cfg["hidden_size"] // H
    clipped = 0
    for layer, heads in enumerate(maxima):
        for which in ("q", "k"):
            name = f"model.layers.{layer}.self_attn.{which}_proj.weight"
            rule = rule_for(name)
            if "qk_clip" not in rule:
                continue
            tau = rule["qk_clip"]["tau"]
            g = [tau / m if m > tau else 1.0 for m in heads.tolist()]
            rows = range(H) if which == "q" else range(G)
            for h in rows:
                gh = g[h] if which == "q" else min(g[h * (H // G):(h + 1) * (H // G)])
                if gh < 1.0:
                    params[name][h * D:(h + 1) * D].mul_(math.sqrt(gh))
                    clipped += 1
    return clipped


class LatentLogitMax:
    """Per layer and head, the largest scaled score of the reference's DeepseekV3Attention: it stands in
    for torch.nn.functional in test_family_deepseek_mla and reads the softmax's input, the scaled scores
    plus the causal mask (0 on a visible key, finfo.min on a hidden one, so each row's max is a visible
    key's, as the diagonal always is)."""

    def __init__(self, num_layers):
        self.num_layers, self.calls = num_layers, []

    def softmax(self, x, dim=-1, dtype=None):
        self.calls.append(x.detach().amax(dim=(0, 2, 3)))
        return F.softmax(x, dim=dim, dtype=dtype)

    def __getattr__(self, name):
        return getattr(F, name)

    def __enter__(self):
        mla.F = self
        return self

    def __exit__(self, *exc):
        mla.F = F

    def per_layer(self):
        return [torch.stack(self.calls[l::self.num_layers]).amax(0) for l in range(self.num_layers)]


def llama_step(bundle, params, step):
    """The reference's loss, gradients and per-layer head maxima of a llama step (reference_model)."""
    with LogitMax(bundle.manifest["model"]["num_layers"]) as logits:
        loss, _, _, _, grads = reference_model.step_gradients(bundle, params, step)
    return loss, grads, logits.per_layer()


def latent_step(bundle, params, step):
    """The same of a latent attention step, by test_family_deepseek_mla's DeepseekV3ForCausalLM on the
    step's weights and batches: mean over ranks of the mean over micro-batches."""
    m, d = bundle.manifest["model"], bundle.manifest["data"]
    if not set(m) <= mla.UNDERSTOOD or bundle.manifest["precision"]["compute"] != "fp32":
        raise SystemExit(f"FAIL the reference does not implement this manifest: {sorted(set(m) - mla.UNDERSTOOD)}")
    model = mla.DeepseekV3ForCausalLM(m["num_layers"], mla.config_of_manifest(m))
    named = dict(mla.named(model))
    with torch.no_grad():
        for k, p in named.items():
            p.copy_(params[k])
    ranks = bundle.samples(step)
    accum, mbs = d.get("grad_accum_steps", 1), d["micro_batch_size"]
    total, loss = {k: torch.zeros_like(v) for k, v in named.items()}, 0.0
    with LatentLogitMax(m["num_layers"]) as logits:
        for ids in ranks:
            model.zero_grad(set_to_none=True)
            for micro in range(accum):
                micro_loss = model(*bundle.batch(ids[micro * mbs:(micro + 1) * mbs]))
                loss += micro_loss.item() / accum / len(ranks)
                (micro_loss / accum).backward()
            for k, p in named.items():
                total[k] += p.grad / len(ranks)
    return loss, total, logits.per_layer()


# What mla_qk_clip gets wrong when asked (check_mla_mistakes): each must miss the next checkpoint.
MLA_MISTAKES = {"k_pe_scaled": "the shared rotary key k_pe (kv_a_proj_with_mqa) rescaled by sqrt(min g)",
                "q_pe_sqrt": "q_pe rescaled by sqrt(g), not g",
                "v_scaled": "kv_b_proj's v rows rescaled with k_nope",
                "no_clip": "no MuonClip"}


def mla_qk_clip(params, rule_for, maxima, cfg, mistake=None):
    """Kimi K2's MuonClip of latent attention as Megatron-LM applies it after the optimizer step
    (megatron/core/optimizer/qk_clip.py clip_qk; megatron/core/transformer/multi_latent_attention.py
    MLASelfAttention.clip_qk, _clip_q_proj_weight and _clip_kv_proj_weight, at d98e8a64): when a head's
    largest logit exceeds qk_clip_threshold, eta = clamp(threshold / max_logits, max=1) per head; q's nope
    rows times eta ** qk_clip_alpha, its rope rows times eta; the kv up-projection's k rows times
    eta ** (1 - alpha), its v rows and the kv down-projection (k_pe) untouched; alpha 0.5, the default of
    transformer_config.py. Megatron's linear_q_up_proj (linear_q_proj without q_lora_rank) and
    linear_kv_up_proj lay their rows out per head as Hugging Face's q_b_proj (q_proj) and kv_b_proj do:
    [qk_head_dim, qk_pos_emb_head_dim] and [qk_head_dim, v_head_dim], Megatron's qk_head_dim being
    qk_nope_head_dim. Returns the heads rescaled."""
    if mistake == "no_clip":
        return 0
    latent = cfg["latent_attention"]
    H, N, R, Dv = cfg["num_heads"], latent["qk_nope_head_dim"], latent["qk_rope_head_dim"], latent["v_head_dim"]
    alpha, clipped = 0.5, 0
    for layer, max_logits in enumerate(maxima):
        prefix = f"model.layers.{layer}.self_attn."
        q_name = prefix + ("q_b_proj.weight" if latent["q_lora_rank"] else "q_proj.weight")
        rule = rule_for(q_name)
        if "qk_clip" not in rule or not torch.any(max_logits > rule["qk_clip"]["tau"]):
            continue
        threshold = rule["qk_clip"]["tau"]
        eta = torch.clamp(threshold / max_logits, max=1.0).view(H, 1, 1)
        q = params[q_name].view(H, N + R, -1)
        q[:, :N, :].mul_(torch.pow(eta, alpha))
        q[:, N:, :].mul_(torch.pow(eta, alpha) if mistake == "q_pe_sqrt" else eta)
        kv = params[prefix + "kv_b_proj.weight"].view(H, N + Dv, -1)
        kv[:, :N, :].mul_(torch.pow(eta, 1 - alpha))
        if mistake == "v_scaled":
            kv[:, N:, :].mul_(torch.pow(eta, 1 - alpha))
        if mistake == "k_pe_scaled":
            params[prefix + "kv_a_proj_with_mqa.weight"][-R:].mul_(torch.pow(eta.min(), 1 - alpha))
        clipped += int((max_logits > threshold).sum())
    return clipped


def check_mla_mistakes(unclipped, rule_for, maxima, cfg, next_params, step):
    """Each of MLA_MISTAKES, applied to the step's update, departs from the next checkpoint by far more
    than the tolerance: the per-step check tells them apart from MuonClip as Megatron-LM applies it."""
    failures = []
    for mistake, what in MLA_MISTAKES.items():
        wrong = {n: t.clone() for n, t in unclipped.items()}
        mla_qk_clip(wrong, rule_for, maxima, cfg, mistake)
        err = max(rel_diff(wrong[n], next_params[n].float()) for n in wrong)
        print(f"     step {step}, with {what}: {err:.3g} from the next checkpoint")
        if err <= 100 * TOLERANCE:
            failures.append(f"step {step}: MuonClip with {what} is within {err:.3g} of the next checkpoint")
    return failures


def adafactor_second_moment(grad, state, rule):
    """The second moment Adafactor's update divides by, from the state before this step's gradient:
    outer(row, col) / mean(row) for a matrix (PyTorch's floors the mean at eps1), a vector's own."""
    shape = grad.shape
    if rule["kind"] == "adafactor":
        if grad.dim() <= 1:
            return state["variance"].double()
        eps1 = (rule.get("eps") or [None])[0] or torch.finfo(torch.float32).eps
        row = state["row_var"].double().reshape(*shape[:-1], 1)
        col = state["col_var"].double().reshape(*shape[:-2], 1, shape[-1])
        return row @ col / row.mean(dim=-2, keepdim=True).clamp(min=eps1)
    if grad.dim() < 2:
        return state["exp_avg_sq"].double()
    row = state["exp_avg_sq_row"].double().reshape(shape[:-1])
    col = state["exp_avg_sq_col"].double().reshape(*shape[:-2], shape[-1])
    return (row / row.mean(dim=-1, keepdim=True)).unsqueeze(-1) * col.unsqueeze(-2)


def reference_update_stats(param, grad, state, rule, decay):
    """What nanreplay reports for a parameter's update before it happens: (g2_over_v, _max, _rms) from
    the second update on, else Nones; Nones for Muon. g as the rule reads it (Adam's L2 term added),
    v_hat Adam's exp_avg_sq over its bias correction, or Adafactor's (factored) second moment."""
    if rule["kind"] == "muon" or state["step"] == 0:
        return None, None, None
    if rule["kind"] in ("adafactor", "adafactor_hf"):
        g2, v_hat = grad.double().square(), adafactor_second_moment(grad, state, rule)
        ratio = g2[v_hat > 0] / v_hat[v_hat > 0]
        return ((g2.mean() / v_hat.mean()).item(), ratio.max().item(), ratio.square().mean().sqrt().item())
    g = grad.double()
    wd = rule.get("weight_decay", 0.01 if rule["kind"] == "adamw" else 0.0)
    if rule["kind"] == "adam" and decay and wd != 0 and not rule.get("decoupled_weight_decay", False):
        g = g + wd * param.double()
    beta2 = rule.get("betas", [0.9, 0.999])[1]
    v_hat = state["exp_avg_sq"].double() / (1 - beta2 ** state["step"])
    g2 = g.square()
    held = v_hat > 0
    ratio = g2[held] / v_hat[held]
    return ((g2.mean() / v_hat.mean()).item(), ratio.max().item(), ratio.square().mean().sqrt().item())


def rel_diff(a, b):
    return (a - b).abs().max().item() / max(b.abs().max().item(), 1e-30)


def check_per_step(bundle_dir, optimizer, steps=STEPS):
    """Every step's update by the reference lands on the next checkpoint; returns (failures, clipped heads,
    the reference's loss of each step).

    Muon's Newton-Schulz iteration in bf16 amplifies a one-ulp difference of its input (the reference's
    gradients are not nanreplay's bit for bit: another op order) to a visibly different update, so the
    Muon parameters are compared where the exact gradient is known: with momentum 0 the next
    momentum_buffer is the clipped gradient itself (lerp with weight 1 is exact), and the reference takes
    it from there (exact_gradient). With momentum the buffers are compared, which are elementwise."""
    bundle = reference_model.Bundle(bundle_dir)
    cfg = bundle.manifest["model"]
    latent = cfg.get("latent_attention") is not None
    step_gradients, clip = (latent_step, mla_qk_clip) if latent else (llama_step, qk_clip)
    failures, clipped, losses, updates = [], 0, {}, {}
    for step in range(FIRST, FIRST + steps - 1):
        here, there = bundle_dir / "steps" / str(step), bundle_dir / "steps" / str(step + 1)
        params = {k: v.float().requires_grad_(True) for k, v in reference_model.read_safetensors(here / "model.safetensors").items()}
        stored = reference_model.read_safetensors(here / "optimizer.safetensors")
        losses[step], grads, maxima = step_gradients(bundle, params, step)
        names = list(params)
        for n in names:
            params[n].grad = grads[n].clone()
        if optimizer.get("grad_clip") is not None:
            torch.nn.utils.clip_grad_norm_([params[n] for n in names], optimizer["grad_clip"])
        lr = json.loads((here / "state.json").read_text())["lr"]
        next_params = reference_model.read_safetensors(there / "model.safetensors")
        next_state = reference_model.read_safetensors(there / "optimizer.safetensors")
        plain = {n: params[n].detach().clone() for n in names}
        states = {}
        state_only = set()
        with torch.no_grad():
            for n in names:
                group, rule = rule_of(optimizer, n)
                decay = not any(reference_model.matches_glob(g, n) for g in optimizer.get("no_decay", []))
                states[n] = load_state(stored, n, rule)
                grad = params[n].grad
                lag = reference_update_stats(plain[n], grad, states[n], rule, decay)
                before = plain[n].double().clone()
                if rule["kind"] == "muon":
                    if rule.get("momentum", 0.95) == 0.0:
                        grad = next_state[n + ".momentum_buffer"].float().clone()  # exact_gradient
                    else:
                        state_only.add(n)
                step_one(plain[n], grad, states[n], lr[group] if isinstance(lr, dict) else lr, rule, decay)
                rms = ((plain[n].double() - before).norm() / math.sqrt(before.numel())).item()
                updates[(step, n)] = (rms,) + lag  # before MuonClip, as nanreplay measures it
            rule_for = lambda n: rule_of(optimizer, n)[1]  # noqa: E731
            if latent and step == FIRST:
                failures += check_mla_mistakes(plain, rule_for, maxima, cfg, next_params, step)
            clipped += clip(plain, rule_for, maxima, cfg)
        for n in names:
            err = rel_diff(plain[n], next_params[n].float())
            if err > TOLERANCE and n not in state_only:
                failures.append(f"step {step} -> {step + 1} {n}: {err:.3g}")
            for key, value in states[n].items():
                if key in ("step", "RMS"):
                    continue
                stored_value = next_state[n + "." + key].float().reshape(value.shape)
                err = rel_diff(value, stored_value)
                if err > TOLERANCE:
                    failures.append(f"step {step} -> {step + 1} {n}.{key}: {err:.3g}")
    return failures, clipped, losses, updates


def synth(cli, work, name, optimizer, lr, preset="clean-fp32", steps=STEPS):
    out = work / name
    shutil.rmtree(out, ignore_errors=True)
    spec = work / (name + "-optimizer.json")
    spec.write_text(json.dumps(optimizer))
    run = subprocess.run([cli, "synth", preset, str(out), "--optimizer", str(spec), "--lr", json.dumps(lr),
                          "--steps", str(steps)], capture_output=True, text=True)
    if run.returncode != 0:
        raise SystemExit(f"FAIL {name}: synth exited {run.returncode}: {run.stderr}")
    return out


def rolled_twin(per_step, out, steps=STEPS):
    """The same run with a checkpoint at its first and last step only (what --checkpoint-every writes)."""
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(per_step, out)
    for step in range(FIRST + 1, FIRST + steps - 1):
        for leaf in ("model.safetensors", "optimizer.safetensors"):
            (out / "steps" / str(step) / leaf).unlink()
    return out


def check_update_stats(report, reference):
    """report.json's update_stats against the reference's update of every derived step."""
    failures, compared = [], 0
    for row in report.get("update_stats", []):
        for t in row["tensors"]:
            want = reference.get((row["step"], t["param"]))
            if want is None:
                continue
            compared += 1
            got = (t["update_rms"], t["g2_over_v"], t["g2_over_v_max"], t["g2_over_v_rms"])
            for key, g, w in zip(("update_rms", "g2_over_v", "g2_over_v_max", "g2_over_v_rms"), got, want):
                if (g is None) != (w is None) or (w is not None and abs(g - w) > STATS_TOLERANCE * abs(w)):
                    failures.append(f"step {row['step']} {t['param']} {key}: {g!r}, the reference's {w!r}")
    if compared == 0:
        failures.append("report.json has no update_stats to compare")
    return failures


def check_per_step_stats(cli, work, name, per_step, reference_updates, optimizer):
    """run on the per-step bundle: its update_stats, measured between checkpoints (model(s+1) - model(s),
    g^2 / v from s's optimizer state), against the reference's update of every step. Not the heads
    MuonClip rescales: the checkpoints hold the rescaling, the reference's RMS is before it."""
    clipped = {n for (_, n) in reference_updates if rule_of(optimizer, n)[1].get("qk_clip")}
    reference_updates = {k: v for k, v in reference_updates.items() if k[1] not in clipped}
    run = subprocess.run([cli, "run", str(per_step), "--out", str(work / (name + "-per-step-out")), "--json",
                          "--no-probes"], capture_output=True, text=True)
    if run.returncode != 0:
        return [f"run on the per-step bundle exited {run.returncode}: {run.stderr.strip()}"]
    return ["per step: " + f for f in check_update_stats(json.loads(run.stdout), reference_updates)]


def check_rolled(cli, work, name, rolled_dir, reference_losses, reference_updates, steps=STEPS):
    """run on the twin: ten steps rolled forward from its first checkpoint, its own update of the
    last but one step compared with the real last checkpoint; each derived step's loss against the
    reference's loss of the same step (on the checkpoint the run wrote)."""
    run = subprocess.run([cli, "run", str(rolled_dir), "--out", str(work / (name + "-out")), "--json",
                          "--no-probes"], capture_output=True, text=True)
    if run.returncode != 0:
        return [f"run exited {run.returncode}: {run.stderr.strip()}"]
    report = json.loads(run.stdout)
    codes = [f["code"] for f in report["findings"]]
    failures = [f"the rolled replay reports {bad}" for bad in
                ("SYSTEM_UPDATE_MISMATCH", "SYSTEM_TRAJECTORY_DIVERGED", "SYSTEM_BIT_FLIP") if bad in codes]
    derived = [row for row in report["steps"] if row["params"] == "derived"]
    if len(derived) != steps - 2:
        failures.append(f"expected {steps - 2} derived steps, got {len(derived)}")
    for row in derived:
        want = reference_losses[row["step"]]
        if abs(row["loss"] - want) > LOSS_TOLERANCE * abs(want):
            failures.append(f"derived step {row['step']} loss {row['loss']!r}, the reference's {want!r}")
    return failures + check_update_stats(report, reference_updates)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cli", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--only", help="one case by name")
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    failed = 0
    for name, (optimizer, lr) in CASES.items():
        if args.only and name != args.only:
            continue
        preset, steps = PRESETS.get(name, ("clean-fp32", STEPS))
        per_step = synth(args.cli, work, name, optimizer, lr, preset, steps)
        failures, clipped, losses, updates = check_per_step(per_step, optimizer, steps)
        if "muonclip" in name and clipped == 0:
            failures.append("no head was clipped: tau does not exercise MuonClip")
        if name in ROLLED:
            failures += check_rolled(args.cli, work, name, rolled_twin(per_step, work / (name + "-rolled"), steps),
                                     losses, updates, steps)
        if name in STATS_BETWEEN:
            failures += check_per_step_stats(args.cli, work, name, per_step, updates, optimizer)
        print(f"{'FAIL' if failures else 'ok  '} {name}: {steps - 1} steps against the reference"
              + (", rolled forward" if name in ROLLED else "")
              + (f", {clipped} head rescalings" if clipped else ""))
        for f in failures[:10]:
            print("     " + f)
        failed += bool(failures)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
