"""GPT-OSS's mixture of experts against eager PyTorch written from transformers' own code.

The reference transcribes, from src/transformers/models/gpt_oss/modeling_gpt_oss.py (read at commit
00d4b3d2142cb4ced2f51b90614b5d26bc045015): GptOssTopKRouter (F.linear with bias, torch.topk of the logits,
softmax over the k chosen logits, scattered over zeros: router_scores), GptOssExperts' training branch
(experts in ascending order, gate_up = x @ gate_up_proj[e] + gate_up_proj_bias[e], gate = [..., ::2], up =
[..., 1::2], gate.clamp(max=limit), up.clamp(-limit, limit), glu = gate * sigmoid(gate * alpha),
(up + 1) * glu, @ down_proj[e] + down_proj_bias[e], times the token's score, index_add_ into zeros),
GptOssMLP, and load_balancing_loss_func over every layer's router_scores (what GptOssForCausalLM adds, times
router_aux_loss_coef, when the run asked for router logits). The attention, norms and rotary are
test_family_gpt_oss_attn.py's transcription of the same file; its DenseMLP is replaced by GptOssMLP here.
The reference holds GPT-OSS's own fused parameters ([E, C, 2M] gate_up_proj, [E, M, C] down_proj) and
named() splits them into the bundle's per-expert keys as docs/bundle-format.md says.

1. A handmade fp32 bundle (limit 3 so the clamp bites, aux loss on): loss and gradient norm within 1e-5.
   The check can fail: the reference without the clamp, with gate/up split into halves instead of
   interleaved, or weighted by the softmax over every expert (Qwen3-MoE without renormalising) departs from
   the replayed loss by more than ten times the tolerance; and
   the bundle without swiglu_limit replays to the unclamped reference.
2. The same model in bf16 (the format's rounding points: every linear's input, weight and bias, every
   site; the router's scores fp32): within 1e-4, and departing from the fp32 loss.
3. `nanreplay synth clean-gpt-oss-moe`: its first two steps against the reference built from the bundle's
   model section and weights, within 1e-5.
4. `nanreplay import` of a Hugging Face GPT-OSS checkpoint as save_pretrained writes one (config.json with
   model_type gpt_oss, num_local_experts, swiglu_limit, output_router_logits; model.safetensors under
   GptOssForCausalLM's names: mlp.router.weight/bias, mlp.experts.gate_up_proj [E, C, 2M] and its bias,
   down_proj [E, M, C] and its bias, self_attn.sinks) and its AdamW state keyed by those names, saved after
   one update of a training loop over this reference: the checkpoint step and one step derived by the
   replay's own update (which reads the split moments) within 1e-5 of the loop's loss and gradient norm.
   The check can fail: the reference with gate and up swapped (odd columns gate) departs from the replayed
   loss by more than ten times the tolerance. The manifest says where swiglu_alpha (modeling_gpt_oss.py's
   constant) and the aux loss (output_router_logits) came from. A released checkpoint's MXFP4 experts
   (gate_up_proj_blocks / _scales) are refused naming the key.

    /usr/bin/python3 tests/py/test_family_gpt_oss_moe.py --cli build/nanreplay --work DIR
"""
import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import family_support as fs  # noqa: E402
import reference_model  # noqa: E402  (a bundle's batches and safetensors only)
import test_family_gpt_oss_attn as attn  # noqa: E402  (GPT-OSS's attention, norms and rotary)

E, TOP_K, ALPHA, LIMIT, AUX = 4, 2, 1.702, 3.0, 0.01
MOE = {"num_experts": E, "top_k": TOP_K, "intermediate_size": attn.FF, "router": "top_k_softmax",
       "router_bias": True, "expert_bias": True, "fused_gate_up": True, "expert_activation": "gpt_oss", "swiglu_alpha": ALPHA,
       "swiglu_limit": LIMIT, "router_aux_loss_coef": AUX}


class GptOssTopKRouter(fs.Rounding, torch.nn.Module):
    def __init__(self, cfg, moe):
        super().__init__()
        self.top_k, self.num_experts, self.hidden_dim = moe["top_k"], moe["num_experts"], cfg["hidden_size"]
        self.weight = torch.nn.Parameter(torch.empty(self.num_experts, self.hidden_dim))
        self.bias = torch.nn.Parameter(torch.empty(self.num_experts))
        self.qwen_routing = False  # a perturbation: softmax over every expert, then top-k (Qwen3-MoE)

    def forward(self, hidden_states):
        hidden_states = hidden_states.reshape(-1, self.hidden_dim)
        # the linear's input, weight and bias rounded; the logits are the mlp.router site
        router_logits = self.rnd(F.linear(self.rnd(hidden_states), self.rnd(self.weight), self.rnd(self.bias)))
        if self.qwen_routing:
            probs = F.softmax(router_logits, dim=-1)
            router_top_value, router_indices = torch.topk(probs, self.top_k, dim=-1)
            return torch.zeros_like(router_logits).scatter_(1, router_indices, router_top_value), router_indices
        router_top_value, router_indices = torch.topk(router_logits, self.top_k, dim=-1)  # (seq_len, top_k)
        router_top_value = F.softmax(router_top_value, dim=1, dtype=router_top_value.dtype)
        router_scores = torch.zeros_like(router_logits).scatter_(1, router_indices, router_top_value)
        return router_scores, router_indices


class GptOssExperts(fs.Rounding, torch.nn.Module):
    def __init__(self, cfg, moe):
        super().__init__()
        self.intermediate_size = moe["intermediate_size"]
        self.num_experts = moe["num_experts"]
        self.hidden_size = cfg["hidden_size"]
        self.expert_dim = self.intermediate_size
        self.gate_up_proj = torch.nn.Parameter(torch.empty(self.num_experts, self.hidden_size, 2 * self.expert_dim))
        self.gate_up_proj_bias = torch.nn.Parameter(torch.empty(self.num_experts, 2 * self.expert_dim))
        self.down_proj = torch.nn.Parameter(torch.empty((self.num_experts, self.expert_dim, self.hidden_size)))
        self.down_proj_bias = torch.nn.Parameter(torch.empty(self.num_experts, self.hidden_size))
        self.alpha = moe["swiglu_alpha"]
        self.limit = moe.get("swiglu_limit")  # None: the perturbation without the clamp
        self.halves = False  # a perturbation: gate and up as the two halves, not interleaved
        self.swapped = False  # a perturbation: gate the odd columns, up the even ones

    def forward(self, hidden_states, router_indices=None, routing_weights=None):
        rnd = self.rnd
        batch_size = hidden_states.shape[0]
        hidden_states = hidden_states.reshape(-1, self.hidden_size)  # (num_tokens, hidden_size)
        num_experts = routing_weights.shape[1]
        next_states = torch.zeros_like(hidden_states, dtype=hidden_states.dtype, device=hidden_states.device)
        with torch.no_grad():
            expert_mask = torch.nn.functional.one_hot(router_indices, num_classes=num_experts)
            expert_mask = expert_mask.permute(2, 1, 0)
            expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
        for expert_idx in expert_hit[:]:
            with torch.no_grad():
                _, token_idx = torch.where(expert_mask[expert_idx[0]])
            current_state = rnd(hidden_states[token_idx])
            gate_up = current_state @ rnd(self.gate_up_proj[expert_idx]) + rnd(self.gate_up_proj_bias[expert_idx])
            if self.halves:
                gate, up = gate_up[..., :self.expert_dim], gate_up[..., self.expert_dim:]
            else:
                gate, up = gate_up[..., ::2], gate_up[..., 1::2]
            if self.swapped:
                gate, up = up, gate
            gate, up = rnd(gate), rnd(up)  # the mlp.expert.gate and mlp.expert.up sites
            if self.limit is not None:
                gate = gate.clamp(min=None, max=self.limit)
                up = up.clamp(min=-self.limit, max=self.limit)
            glu = gate * torch.sigmoid(gate * self.alpha)
            gated_output = rnd((up + 1) * glu)  # mlp.expert.act
            out = rnd(gated_output @ rnd(self.down_proj[expert_idx]) + rnd(self.down_proj_bias[expert_idx]))
            weighted_output = out[0] * routing_weights[token_idx, expert_idx, None]
            next_states.index_add_(0, token_idx, weighted_output.to(hidden_states.dtype))
        return rnd(next_states.view(batch_size, -1, self.hidden_size))  # mlp.combine: summed in fp32, rounded once


class GptOssMLP(fs.Rounding, torch.nn.Module):
    """HF's GptOssMLP; returns the routed output alone and appends router_scores to `scores` (what
    check_model_inputs records as router_logits)."""

    def __init__(self, cfg, moe, scores):
        super().__init__()
        self.router = GptOssTopKRouter(cfg, moe)
        self.experts = GptOssExperts(cfg, moe)
        self.scores = scores

    def forward(self, hidden_states):
        router_scores, router_indices = self.router(hidden_states)
        self.scores.append(router_scores)
        return self.experts(hidden_states, router_indices=router_indices, routing_weights=router_scores)


def load_balancing_loss_func(gate_logits, num_experts, top_k):
    """modeling_gpt_oss.load_balancing_loss_func with attention_mask None."""
    compute_device = gate_logits[0].device
    concatenated_gate_logits = torch.cat([layer_gate.to(compute_device) for layer_gate in gate_logits], dim=0)
    routing_weights = torch.nn.functional.softmax(concatenated_gate_logits, dim=-1)
    _, selected_experts = torch.topk(routing_weights, top_k, dim=-1)
    expert_mask = torch.nn.functional.one_hot(selected_experts, num_experts)
    tokens_per_expert = torch.mean(expert_mask.float(), dim=0)
    router_prob_per_expert = torch.mean(routing_weights, dim=0)
    overall_loss = torch.sum(tokens_per_expert * router_prob_per_expert.unsqueeze(0))
    return overall_loss * num_experts


class GptOssForCausalLM(fs.Rounding, torch.nn.Module):
    """GPT-OSS: attn.Model (attention sinks and biases, yarn, layer_types) with GptOssMLP in every layer;
    the loss adds router_aux_loss_coef times the load-balancing loss when the coefficient is set."""

    def __init__(self, rope_scaling, layer_types, moe, cfg=None):
        super().__init__()
        cfg = cfg or attn.CONFIG
        self.model = attn.Model(rope_scaling, bias=True, sinks=True, layer_types=layer_types, cfg=cfg)
        self.scores = []
        for layer in self.model.layers:
            layer.mlp = GptOssMLP(cfg, moe, self.scores)
        self.moe = moe

    def forward(self, input_ids, labels):
        self.scores.clear()
        loss = self.model(input_ids, labels)
        coef = self.moe.get("router_aux_loss_coef", 0.0)
        if coef:
            loss = loss + coef * load_balancing_loss_func(tuple(self.scores), self.moe["num_experts"],
                                                          self.moe["top_k"])
        return loss

    def experts(self):
        return [layer.mlp for layer in self.model.layers]


def named(model):
    """(key, tensor) under the bundle's names: GPT-OSS's fused experts split per expert, gate the even
    columns of gate_up_proj and up the odd ones, each transposed to [M, C] (docs/bundle-format.md)."""
    out = []
    for i, layer in enumerate(model.model.layers):
        prefix = f"model.layers.{i}."
        for k, v in layer.named_parameters():
            if not k.startswith("mlp."):
                out.append((prefix + k, v))
        mlp = layer.mlp
        out += [(prefix + "mlp.gate.weight", mlp.router.weight), (prefix + "mlp.gate.bias", mlp.router.bias)]
        ex = mlp.experts
        for e in range(ex.num_experts):
            w = prefix + f"mlp.experts.{e}."
            out += [(w + "gate_proj.weight", ex.gate_up_proj[e][:, 0::2].t()),
                    (w + "gate_proj.bias", ex.gate_up_proj_bias[e][0::2]),
                    (w + "up_proj.weight", ex.gate_up_proj[e][:, 1::2].t()),
                    (w + "up_proj.bias", ex.gate_up_proj_bias[e][1::2]),
                    (w + "down_proj.weight", ex.down_proj[e].t()),
                    (w + "down_proj.bias", ex.down_proj_bias[e])]
    m = model.model
    out += [("model.embed_tokens.weight", m.embed_tokens.weight), ("model.norm.weight", m.norm.weight),
            ("lm_head.weight", m.lm_head.weight)]
    return out


def load(model, weights):
    """The reference's parameters from a bundle's tensors (named()'s inverse); returns the keys left over."""
    weights = dict(weights)
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            prefix = f"model.layers.{i}."
            for k, v in layer.named_parameters():
                if not k.startswith("mlp."):
                    v.copy_(weights.pop(prefix + k))
            layer.mlp.router.weight.copy_(weights.pop(prefix + "mlp.gate.weight"))
            layer.mlp.router.bias.copy_(weights.pop(prefix + "mlp.gate.bias"))
            ex = layer.mlp.experts
            for e in range(ex.num_experts):
                w = prefix + f"mlp.experts.{e}."
                ex.gate_up_proj[e][:, 0::2] = weights.pop(w + "gate_proj.weight").t()
                ex.gate_up_proj_bias[e][0::2] = weights.pop(w + "gate_proj.bias")
                ex.gate_up_proj[e][:, 1::2] = weights.pop(w + "up_proj.weight").t()
                ex.gate_up_proj_bias[e][1::2] = weights.pop(w + "up_proj.bias")
                ex.down_proj[e] = weights.pop(w + "down_proj.weight").t()
                ex.down_proj_bias[e] = weights.pop(w + "down_proj.bias")
        m = model.model
        m.embed_tokens.weight.copy_(weights.pop("model.embed_tokens.weight"))
        m.norm.weight.copy_(weights.pop("model.norm.weight"))
        m.lm_head.weight.copy_(weights.pop("lm_head.weight"))
    return sorted(weights)


LAYER_TYPES = ["sliding_attention", "full_attention"]


def manifest_model(moe):
    return dict(attn.base_model(attn.YARN), attention_sinks=True, attention_bias=True, o_proj_bias=True,
                sliding_window=attn.WINDOW, layer_types=LAYER_TYPES, moe=moe)


def reference_loss(model, stream, **perturbation):
    """The reference's fp32 loss with one perturbation set on every layer's MLP (then undone)."""
    inputs, targets = fs.batch_of(stream, attn.SAMPLES, attn.T)
    parts = [m.router for m in model.experts()] + [m.experts for m in model.experts()]
    return fs.perturbed_loss(model, inputs, targets, parts, perturbation)


def check_handmade(cli, work):
    """1 and 2."""
    model = attn.init(GptOssForCausalLM(attn.YARN, LAYER_TYPES, MOE), seed=5)
    stream = fs.token_stream(attn.V, attn.SAMPLES, attn.T, seed=6)
    inputs, targets = fs.batch_of(stream, attn.SAMPLES, attn.T)
    loss, norm = fs.loss_and_grad_norm(model(inputs, targets), list(model.parameters()))
    bundle = fs.write_bundle(work / "gpt-oss-moe", manifest_model(MOE), named(model), stream, attn.SAMPLES, attn.T,
                             loss, norm)
    rc, report, err = fs.replay(cli, bundle, work / "out-gpt-oss-moe")
    what = "GPT-OSS MoE (top-k logits softmaxed, biases, clamped gpt_oss activation, aux loss)"
    if not fs.check(report is not None, f"{what}: nanreplay run gave a report (exit {rc}; {err.strip()[-300:]})"):
        return
    fs.compare_step(report, loss, norm, what)
    replayed = report["steps"][0]["loss"]
    for label, change in (("without the clamp", {"limit": None}), ("gate/up as halves", {"halves": True}),
                          ("weighted by the softmax over every expert", {"qwen_routing": True})):
        other = reference_loss(model, stream, **change)
        fs.check(fs.rel_err(replayed, other) > 10 * fs.TOLERANCE,
                 f"the check can fail: the reference {label} departs ({other!r} vs replayed {replayed!r})")
    unclamped = {k: v for k, v in MOE.items() if k != "swiglu_limit"}
    bundle = fs.write_bundle(work / "gpt-oss-moe-unclamped", manifest_model(unclamped), named(model), stream,
                             attn.SAMPLES, attn.T, loss, norm)
    rc, report, err = fs.replay(cli, bundle, work / "out-gpt-oss-moe-unclamped")
    if fs.check(report is not None, f"without swiglu_limit: a report (exit {rc}; {err.strip()[-300:]})"):
        ref = reference_loss(model, stream, limit=None)
        got = report["steps"][0]["loss"]
        fs.check(fs.rel_err(got, ref) <= fs.TOLERANCE, f"without swiglu_limit: the unclamped reference ({got} vs {ref})")
    model.zero_grad()
    fs.check_bf16_step(cli, work, "gpt-oss-moe-bf16", manifest_model(MOE), model, named, stream, attn.SAMPLES,
                       attn.T, "GPT-OSS MoE in bf16 (router scores fp32, expert biases rounded)")


def check_preset(cli, work, preset="clean-gpt-oss-moe"):
    """3. the first two steps of the preset against the reference on the bundle's weights and batches."""
    started = fs.replay_preset_start(cli, work, preset)
    if started is None:
        return
    bundle, report, first_two = started
    m = bundle.manifest["model"]
    moe = m.get("moe") or {}
    fs.check(moe.get("router") == "top_k_softmax" and moe.get("expert_activation") == "gpt_oss"
             and moe.get("router_bias") is True and moe.get("expert_bias") is True and moe.get("fused_gate_up") is True
             and not moe.get("norm_topk_prob") and not moe.get("router_z_loss_coef")
             and set(m) - {"moe"} <= attn.UNDERSTOOD and bundle.manifest["precision"]["compute"] == "fp32",
             f"{preset}'s manifest says only what the reference implements ({m})")
    cfg = attn.config_of_manifest(m)
    dirs = {e["step"]: e["dir"] for e in bundle.manifest["steps"]}
    for row in report["steps"]:
        model = GptOssForCausalLM(m["rope_scaling"], m["layer_types"], moe, cfg=cfg)
        left = load(model, reference_model.read_safetensors(bundle.root / dirs[row["step"]] / "model.safetensors"))
        fs.check(not left, f"{preset} step {row['step']}: every tensor is a reference parameter ({left})")
        fs.compare_bundle_step(bundle, row, model, f"{preset} step {row['step']}")


def hf_config():
    """config.json as GptOssConfig.save_pretrained writes it for the reference's shape."""
    return {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "vocab_size": attn.V,
            "hidden_size": attn.C, "intermediate_size": attn.FF, "num_hidden_layers": attn.LAYERS,
            "num_attention_heads": attn.H, "num_key_value_heads": attn.G, "head_dim": attn.D,
            "max_position_embeddings": attn.T, "rms_norm_eps": attn.EPS, "rope_theta": attn.THETA,
            "rope_scaling": attn.YARN, "sliding_window": attn.WINDOW, "layer_types": LAYER_TYPES,
            "attention_bias": True, "attention_dropout": 0.0, "num_local_experts": E, "num_experts_per_tok": TOP_K,
            "swiglu_limit": LIMIT, "router_aux_loss_coef": AUX, "output_router_logits": True,
            "tie_word_embeddings": False, "hidden_act": "silu", "torch_dtype": "float32"}


def hf_named(model):
    """GptOssForCausalLM's state dict names (the fused experts as they are) for the reference's parameters."""
    return attn.named_as_hf(model.model)


def save_hf(model, opt, directory):
    """save_pretrained's files, and the AdamW state keyed by the same names."""
    directory.mkdir(parents=True, exist_ok=True)
    named = hf_named(model)
    fs.nanreplay_capture.write_safetensors(directory / "model.safetensors", [(k, v.detach().clone()) for k, v in named])
    (directory / "config.json").write_text(json.dumps(hf_config(), indent=2))
    names = {id(p): n for n, p in named}
    state = {names[id(p)]: {k: (v.clone() if torch.is_tensor(v) else v) for k, v in s.items()} for p, s in opt.state.items()}
    groups = [dict({k: v for k, v in g.items() if k != "params"}, params=[names[id(p)] for p in g["params"]])
              for g in opt.param_groups]
    torch.save({"state": state, "param_groups": groups}, directory / "optimizer.pt")


def check_import(cli, work):
    """4. a GPT-OSS checkpoint through `nanreplay import`, replayed against the training loop."""
    import import_support as imp  # noqa: E402  (the training loop, its token data and the import runner)
    work.mkdir(parents=True, exist_ok=True)
    model = attn.init(GptOssForCausalLM(attn.YARN, LAYER_TYPES, MOE), seed=7)
    data = imp.Data(work, attn.V, attn.T, 2, 1, num_samples=16, seed=3)
    opt = imp.adamw(model.parameters())
    swapped = {}

    def save():
        save_hf(model, opt, work / "hf")
        with torch.no_grad():
            for ex in model.experts():
                ex.experts.swapped = True
            swapped["loss"] = float(model(*data.batch(data.rows(1))))
            for ex in model.experts():
                ex.experts.swapped = False
    log = imp.train(model, opt, data, 3, before_step=lambda step: step == 1 and save())
    imp.write_log(work / "log.jsonl", log)
    proc = imp.run_import(cli, ["--checkpoint", work / "hf", "--optimizer", work / "hf" / "optimizer.pt",
                                "--optimizer-class", "torch.optim.AdamW",
                                *data.flags(), "--log", work / "log.jsonl", "--steps", "1:2", "--grad-clip", 1.0],
                          work / "bundle")
    if not fs.check(proc.returncode == 0, f"GPT-OSS import: exit 0 ({proc.stderr.strip()[-300:]})"):
        return
    manifest = json.loads((work / "bundle" / "manifest.json").read_text())
    moe, prov = manifest["model"].get("moe", {}), manifest.get("provenance", {})
    fs.check(all(moe.get(k, attn.FF if k == "intermediate_size" else None) == v for k, v in MOE.items())
             and not moe.get("norm_topk_prob") and not moe.get("router_z_loss_coef"),
             f"GPT-OSS import: model.moe is GPT-OSS's ({moe})")
    fs.check("1.702" in prov.get("model.moe.swiglu_alpha", {}).get("detail", "")
             and "output_router_logits" in prov.get("model.moe.router_aux_loss_coef", {}).get("detail", ""),
             "GPT-OSS import: the provenance says where swiglu_alpha and the aux loss came from")
    rproc, report = imp.run_replay(cli, work / "bundle", work / "out")
    if not fs.check(report is not None, f"GPT-OSS import replays ({rproc.stderr.strip()[-300:]})"):
        return
    imp.check_replay("GPT-OSS import", report, log, 1, 2)
    replayed = report["steps"][0]["loss"]
    fs.check(fs.rel_err(replayed, swapped["loss"]) > 10 * fs.TOLERANCE,
             f"the check can fail: the reference with gate/up swapped departs ({swapped['loss']!r} vs {replayed!r})")
    check_loss_terms(cli, work, data, report, log)
    fs.failures.extend(imp.failures)


def check_loss_terms(cli, work, data, report, log):
    """4b. The report says what the replayed loss adds: the aux loss as the config's output_router_logits said;
    --router-aux-loss-coef 0 (a run that added none) replaces it, is said with its source, and, the run having
    added it, the replay no longer reproduces and the gap names the router terms."""
    import import_support as imp  # noqa: E402
    terms = {t["term"]: t for t in report.get("loss_terms", [])}
    aux = terms.get("router_aux_loss", {})
    fs.check(aux.get("coefficient") == AUX and aux.get("in_logged_loss") is True
             and "output_router_logits" in aux.get("source", "") and terms.get("router_z_loss", {}).get(
                 "coefficient") == 0, f"GPT-OSS import: report.json's loss_terms say the aux loss was added ({terms})")
    proc = imp.run_import(cli, ["--checkpoint", work / "hf", "--optimizer", work / "hf" / "optimizer.pt",
                                "--optimizer-class", "torch.optim.AdamW", *data.flags(), "--log", work / "log.jsonl",
                                "--steps", "1:1", "--grad-clip", 1.0, "--router-aux-loss-coef", 0], work / "no-aux")
    if not fs.check(proc.returncode == 0, f"--router-aux-loss-coef 0: exit 0 ({proc.stderr.strip()[-300:]})"):
        return
    _, without = imp.run_replay(cli, work / "no-aux", work / "no-aux-out")
    if not fs.check(without is not None, "--router-aux-loss-coef 0 replays"):
        return
    aux = {t["term"]: t for t in without.get("loss_terms", [])}.get("router_aux_loss", {})
    fs.check(aux.get("coefficient") == 0 and aux.get("source", "").startswith("flag: --router-aux-loss-coef 0"),
             f"--router-aux-loss-coef 0: the report says no aux loss, from the flag ({aux})")
    gap = [f for f in without["findings"] if f["code"] == "BUNDLE_DOES_NOT_REPRODUCE"]
    fs.check(fs.rel_err(without["steps"][0]["loss"], log[1]["loss"]) > 10 * fs.TOLERANCE and gap
             and "no router_aux_loss" in gap[0]["message"],
             "without the aux loss the run's logged loss is missed, and the gap names the router terms "
             f"({without['steps'][0]['loss']!r} vs {log[1]['loss']!r})")
    refused = imp.run_import(cli, ["--checkpoint", work / "hf", *data.flags(), "--log", work / "log.jsonl",
                                   "--steps", "1:1", "--router-aux-loss-coef", -1], work / "bad-aux")
    fs.check(refused.returncode == 2 and "--router-aux-loss-coef" in refused.stderr
             and len(refused.stderr.strip().splitlines()) == 1, f"a negative coefficient is refused by name "
                                                                f"({refused.stderr.strip()})")


def check_mxfp4_refused(work):
    """4. a released GPT-OSS checkpoint's MXFP4 experts are refused by key (the import run in process)."""
    import contextlib
    import io
    import import_support as imp  # noqa: E402
    import nanreplay_import
    work.mkdir(parents=True, exist_ok=True)
    config = dict(hf_config(), quantization_config={"quant_method": "mxfp4"})
    (work / "config.json").write_text(json.dumps(config))
    packed = torch.int64  # U8 in the release; this writer stores I64, and the key is what is refused
    fs.nanreplay_capture.write_safetensors(work / "model.safetensors", [
        ("model.embed_tokens.weight", torch.zeros(attn.V, attn.C)),
        ("model.layers.0.mlp.experts.gate_up_proj_blocks", torch.zeros(E, 2 * attn.FF, 1, 16, dtype=packed)),
        ("model.layers.0.mlp.experts.gate_up_proj_scales", torch.zeros(E, 2 * attn.FF, 1, dtype=packed))])
    data = imp.Data(work, attn.V, attn.T, 2, 1, num_samples=16, seed=3)
    (work / "log.jsonl").write_text('{"step": 0, "loss": 4.0}\n')
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = nanreplay_import.main([str(a) for a in ["--checkpoint", work, *data.flags(), "--log", work / "log.jsonl",
                                                     "--steps", "0:0", "--out", work / "bundle"]])
    said = err.getvalue().strip()
    fs.check(rc == 2 and "gate_up_proj_blocks" in said and "MXFP4" in said and "\n" not in said,
             f"MXFP4 experts refused naming the key, in one line (exit {rc}): {said}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cli", required=True)
    ap.add_argument("--work", required=True)
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    check_handmade(args.cli, work)
    check_preset(args.cli, work)
    check_import(args.cli, work / "import")
    check_mxfp4_refused(work / "mxfp4")
    fs.finish()


if __name__ == "__main__":
    main()
