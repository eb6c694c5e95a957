"""Llama 4's mixture of experts against eager PyTorch written from transformers' own code.

The reference transcribes, from src/transformers/models/llama4/modeling_llama4.py (read at commit
000c33fdfde12e1ffafbfcdb3c926df5727a00b6): Llama4Router (nn.Linear without bias; torch.topk of the logits;
the top values scattered over -inf; sigmoid in fp32, cast back to the logits' type), Llama4TextMoe
(routed_in = hidden_states.repeat(E, 1) times each expert's score: the expert's INPUT is scaled; the experts'
outputs summed over dim 0 unweighted; shared_expert(hidden_states) plus that sum), Llama4TextExperts (one
gate_up_proj [E, C, 2M] bmm, gate and up its two halves by chunk(2), up * silu(gate), down_proj [E, M, C]),
the shared expert a Llama4TextMLP of config.intermediate_size, and Llama4TextDecoderLayer's choice
`layer_idx in config.moe_layers` (configuration_llama4.py: range(interleave_moe_layer_step - 1, layers, step)
when not given), the other layers a Llama4TextMLP of intermediate_size_mlp. Llama4ForCausalLM adds no router
loss. The attention, norms and rotary are test_family_llama4_attn.py's transcription of the same file.
The reference holds Llama 4's fused experts and named() splits them into the bundle's per-expert keys, as
docs/bundle-format.md says.

1. A handmade fp32 bundle (layer 0 dense, layer 1 experts: 4 experts, top 1, a shared expert): loss and
   gradient norm within 1e-5. The check can fail: the reference weighting each expert's output instead of
   its input, without the shared expert, or with every expert weighted by the sigmoid of its logit (no top-k
   scatter) departs from the replayed loss by more than ten times the tolerance; and the bundle without
   scale_expert_input replays to the reference that weights the output.
2. The same model in bf16 (the format's rounding points, the router's scores rounded as Llama4Router's cast
   back): within 1e-4, and departing from the fp32 loss.
3. `nanreplay synth clean-llama4-moe`: its first two steps against the reference built from the bundle's
   model section and weights, within 1e-5.
4. Bad moe keys (a layer out of range, listed twice, an empty list, an aux loss with sigmoid_top_k, a zero
   shared width) are refused: exit 2, one line naming manifest.json and the key.

    /usr/bin/python3 tests/py/test_family_llama4_moe.py --cli build/nanreplay --work DIR
"""
import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import family_support as fs  # noqa: E402
import reference_model  # noqa: E402  (a bundle's batches and safetensors only)
import test_family_llama4_attn as attn  # noqa: E402  (Llama 4's attention, norms and rotary)

E, TOP_K, M, MOE_LAYERS = 4, 1, 24, [1]
MOE = {"num_experts": E, "top_k": TOP_K, "intermediate_size": M, "router": "sigmoid_top_k",
       "scale_expert_input": True, "fused_gate_up": True, "shared_expert_intermediate_size": M, "layers": MOE_LAYERS}


class Llama4Router(fs.Rounding, torch.nn.Module):
    def __init__(self, cfg, moe):
        super().__init__()
        self.top_k = moe["top_k"]
        self.weight = torch.nn.Parameter(torch.empty(moe["num_experts"], cfg["hidden_size"]))
        self.every_expert = False  # a perturbation: every expert's sigmoid, no top-k

    def forward(self, hidden_states):
        router_logits = self.rnd(F.linear(self.rnd(hidden_states), self.rnd(self.weight)))  # mlp.router
        router_top_value, router_indices = torch.topk(router_logits, self.top_k, dim=1)
        router_scores = torch.full_like(router_logits, float("-inf")).scatter_(1, router_indices, router_top_value)
        if self.every_expert:
            router_scores = router_logits
        router_scores = self.rnd(torch.sigmoid(router_scores.float()))  # .to(router_scores.dtype)
        return router_scores, router_logits


class Llama4TextExperts(fs.Rounding, torch.nn.Module):
    def __init__(self, cfg, moe):
        super().__init__()
        self.num_experts, self.hidden_size = moe["num_experts"], cfg["hidden_size"]
        self.expert_dim = moe["intermediate_size"]
        self.gate_up_proj = torch.nn.Parameter(torch.empty(self.num_experts, self.hidden_size, 2 * self.expert_dim))
        self.down_proj = torch.nn.Parameter(torch.empty(self.num_experts, self.expert_dim, self.hidden_size))

    def forward(self, hidden_states):
        rnd = self.rnd
        hidden_states = hidden_states.view(self.num_experts, -1, self.hidden_size)
        gate_up = torch.bmm(rnd(hidden_states), rnd(self.gate_up_proj))
        gate, up = gate_up.chunk(2, dim=-1)
        gate, up = rnd(gate), rnd(up)  # mlp.expert.gate, mlp.expert.up
        next_states = rnd(torch.bmm(rnd(up * F.silu(gate)), rnd(self.down_proj)))  # mlp.expert.act, .down
        return next_states.view(-1, self.hidden_size)


class Llama4TextMoe(fs.Rounding, torch.nn.Module):
    """HF's Llama4TextMoe; returns `out` alone (the decoder layer drops the router logits)."""

    def __init__(self, cfg, moe):
        super().__init__()
        self.hidden_dim = cfg["hidden_size"]
        self.experts = Llama4TextExperts(cfg, moe)
        self.router = Llama4Router(cfg, moe)
        self.shared_expert = attn.Llama4TextMLP(dict(cfg, intermediate_size=moe["shared_expert_intermediate_size"]))
        self.scale_output = False  # a perturbation: the score on the expert's output, not its input
        self.no_shared = False     # a perturbation: the routed sum alone

    def forward(self, hidden_states):
        shape = hidden_states.shape
        hidden_states = hidden_states.reshape(-1, self.hidden_dim)
        router_scores, router_logits = self.router(hidden_states)
        routed_in = hidden_states.repeat(router_scores.shape[1], 1)
        scores = router_scores.transpose(0, 1).reshape(-1, 1)
        if not self.scale_output:
            routed_in = self.rnd(routed_in * scores)
        routed_out = self.experts(routed_in)
        if self.scale_output:
            routed_out = routed_out * scores
        routed = self.rnd(routed_out.reshape(router_scores.shape[1], -1, routed_out.shape[-1]).sum(dim=0))
        if self.no_shared:
            return self.rnd(routed).view(shape)
        out = self.shared_expert(hidden_states)
        return self.rnd(out + routed).view(shape)  # mlp.combine


class Llama4MoeText(attn.Llama4Text):
    """Llama4ForCausalLM's text model with Llama4TextMoe on the layers in moe["layers"]."""

    def __init__(self, no_rope_layers, moe, cfg=None):
        cfg = cfg or attn.CONFIG
        super().__init__(no_rope_layers, tuning=True, cfg=cfg)
        for i in moe["layers"]:
            self.layers[i].mlp = Llama4TextMoe(cfg, moe)

    def moes(self):
        return [layer.mlp for layer in self.layers if isinstance(layer.mlp, Llama4TextMoe)]


def named(model):
    """(key, tensor) under the bundle's names: gate_up_proj's first half each expert's gate_proj, its second
    half up_proj, each transposed to [M, C]; down_proj[e] transposed; the router mlp.gate; the shared expert
    mlp.shared_expert.* (docs/bundle-format.md)."""
    out = []
    for i, layer in enumerate(model.layers):
        prefix = f"model.layers.{i}."
        out += [(prefix + k, v) for k, v in layer.named_parameters() if not k.startswith("mlp.")]
        mlp = layer.mlp
        if not isinstance(mlp, Llama4TextMoe):
            out += [(prefix + "mlp." + k, v) for k, v in mlp.named_parameters()]
            continue
        out.append((prefix + "mlp.gate.weight", mlp.router.weight))
        ex = mlp.experts
        for e in range(ex.num_experts):
            w = prefix + f"mlp.experts.{e}."
            out += [(w + "gate_proj.weight", ex.gate_up_proj[e][:, :ex.expert_dim].t()),
                    (w + "up_proj.weight", ex.gate_up_proj[e][:, ex.expert_dim:].t()),
                    (w + "down_proj.weight", ex.down_proj[e].t())]
        out += [(prefix + "mlp.shared_expert." + k, v) for k, v in mlp.shared_expert.named_parameters()]
    out += [("model.embed_tokens.weight", model.embed_tokens.weight), ("model.norm.weight", model.norm.weight),
            ("lm_head.weight", model.lm_head.weight)]
    return out


def load(model, weights):
    """The reference's parameters from a bundle's tensors (named()'s inverse); returns the keys left over."""
    weights = dict(weights)
    with torch.no_grad():
        for key, p in named(model):
            if ".mlp.experts." not in key:
                p.copy_(weights.pop(key))
        for i, layer in enumerate(model.layers):
            if not isinstance(layer.mlp, Llama4TextMoe):
                continue
            ex = layer.mlp.experts
            for e in range(ex.num_experts):
                w = f"model.layers.{i}.mlp.experts.{e}."
                ex.gate_up_proj[e][:, :ex.expert_dim] = weights.pop(w + "gate_proj.weight").t()
                ex.gate_up_proj[e][:, ex.expert_dim:] = weights.pop(w + "up_proj.weight").t()
                ex.down_proj[e] = weights.pop(w + "down_proj.weight").t()
    return sorted(weights)


def init(model, seed):
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.3 * torch.randn(p.shape) if "norm" in name else 0.4 * torch.randn(p.shape))
    return model


def reference_loss(model, stream, **perturbation):
    """The reference's fp32 loss with one perturbation set on every MoE layer (then undone)."""
    inputs, targets = fs.batch_of(stream, attn.SAMPLES, attn.T)
    parts = [m for m in model.moes()] + [m.router for m in model.moes()]
    return fs.perturbed_loss(model, inputs, targets, parts, perturbation)


def check_handmade(cli, work):
    """1 and 2."""
    model = init(Llama4MoeText(attn.NO_ROPE_LAYERS, MOE), seed=5)
    stream = fs.token_stream(attn.V, attn.SAMPLES, attn.T, seed=6)
    inputs, targets = fs.batch_of(stream, attn.SAMPLES, attn.T)
    loss, norm = fs.loss_and_grad_norm(model(inputs, targets), list(model.parameters()))
    manifest_model = dict(attn.MODEL, moe=MOE)
    bundle = fs.write_bundle(work / "llama4-moe", manifest_model, named(model), stream, attn.SAMPLES, attn.T,
                             loss, norm)
    rc, report, err = fs.replay(cli, bundle, work / "out-llama4-moe")
    what = "Llama 4 MoE (layer 1 only, top-1 sigmoid, input scaled, shared expert)"
    if not fs.check(report is not None, f"{what}: nanreplay run gave a report (exit {rc}; {err.strip()[-300:]})"):
        return
    fs.compare_step(report, loss, norm, what)
    replayed = report["steps"][0]["loss"]
    for label, change in (("weighting the expert's output, not its input", {"scale_output": True}),
                          ("without the shared expert", {"no_shared": True}),
                          ("with every expert's sigmoid, no top-k", {"every_expert": True})):
        other = reference_loss(model, stream, **change)
        fs.check(fs.rel_err(replayed, other) > 10 * fs.TOLERANCE,
                 f"the check can fail: the reference {label} departs ({other!r} vs replayed {replayed!r})")
    output_weighted = dict(manifest_model, moe={k: v for k, v in MOE.items() if k != "scale_expert_input"})
    bundle = fs.write_bundle(work / "llama4-moe-output", output_weighted, named(model), stream, attn.SAMPLES,
                             attn.T, loss, norm)
    rc, report, err = fs.replay(cli, bundle, work / "out-llama4-moe-output")
    if fs.check(report is not None, f"without scale_expert_input: a report (exit {rc}; {err.strip()[-300:]})"):
        ref = reference_loss(model, stream, scale_output=True)
        got = report["steps"][0]["loss"]
        fs.check(fs.rel_err(got, ref) <= fs.TOLERANCE,
                 f"without scale_expert_input: the reference weighting outputs ({got} vs {ref})")
    model.zero_grad()
    fs.check_bf16_step(cli, work, "llama4-moe-bf16", manifest_model, model, named, stream, attn.SAMPLES, attn.T,
                       "Llama 4 MoE in bf16 (scores rounded, the routed sum rounded before the shared expert's)")


def check_refusals(cli, work):
    """4. bad moe keys: exit 2, one line naming manifest.json and the key, before any weight is read."""
    cases = (({"layers": [2]}, "model.moe.layers[0]"), ({"layers": [1, 1]}, "model.moe.layers[1]"),
             ({"layers": []}, "model.moe.layers"), ({"router_aux_loss_coef": 0.01}, "model.moe.router_aux_loss_coef"),
             ({"shared_expert_intermediate_size": 0}, "model.moe.shared_expert_intermediate_size"))
    stream = fs.token_stream(attn.V, attn.SAMPLES, attn.T, seed=6)
    for i, (change, key) in enumerate(cases):
        bundle = fs.write_bundle(work / f"bad-{i}", dict(attn.MODEL, moe=dict(MOE, **change)),
                                 [("unused", torch.zeros(1))], stream, attn.SAMPLES, attn.T, 1.0, 1.0)
        rc, _, err = fs.replay(cli, bundle, work / f"out-bad-{i}")
        fs.check_refused(rc, err, f"moe {change}", "manifest.json", key)


def check_preset(cli, work, preset="clean-llama4-moe"):
    """3. the first two steps of the preset against the reference on the bundle's weights and batches."""
    started = fs.replay_preset_start(cli, work, preset)
    if started is None:
        return
    bundle, report, first_two = started
    m = bundle.manifest["model"]
    moe = m.get("moe") or {}
    understood = {"num_experts", "top_k", "intermediate_size", "router", "scale_expert_input", "fused_gate_up",
                  "shared_expert_intermediate_size", "layers", "norm_topk_prob", "router_aux_loss_coef",
                  "router_z_loss_coef"}
    fs.check(moe.get("router") == "sigmoid_top_k" and moe.get("scale_expert_input") is True
             and moe.get("shared_expert_intermediate_size") and moe.get("layers") and set(moe) <= understood
             and not moe.get("norm_topk_prob") and not moe.get("router_z_loss_coef")
             and not moe.get("router_aux_loss_coef") and set(m) - {"moe"} <= attn.UNDERSTOOD
             and len(moe["layers"]) < m["num_layers"] and bundle.manifest["precision"]["compute"] == "fp32",
             f"{preset}'s manifest says only what the reference implements, a dense layer among them ({m})")
    cfg = attn.config_of_manifest(m)
    reference_moe = dict(moe, intermediate_size=moe.get("intermediate_size", m["intermediate_size"]))
    dirs = {e["step"]: e["dir"] for e in bundle.manifest["steps"]}
    for row in report["steps"]:
        model = Llama4MoeText(m["no_rope_layers"], reference_moe, cfg=cfg)
        left = load(model, reference_model.read_safetensors(bundle.root / dirs[row["step"]] / "model.safetensors"))
        fs.check(not left, f"{preset} step {row['step']}: every tensor is a reference parameter ({left})")
        fs.compare_bundle_step(bundle, row, model, f"{preset} step {row['step']}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cli", required=True)
    ap.add_argument("--work", required=True)
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    check_handmade(args.cli, work)
    check_refusals(args.cli, work)
    check_preset(args.cli, work)
    fs.finish()


if __name__ == "__main__":
    main()
