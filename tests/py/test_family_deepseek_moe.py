"""DeepSeek-V3's (and Kimi K2's) mixture of experts (model.moe router "sigmoid_grouped") against eager PyTorch
written from transformers' src/transformers/models/deepseek_v3/modeling_deepseek_v3.py (read at commit
00b676f8f0489b88652a31d70751cc540dd06305).

The reference transcribes DeepseekV3TopkRouter (router_logits = F.linear(hidden_states.float(), weight.float()):
fp32 logits of the model's bf16 values, never rounded; scores = sigmoid; get_topk_indices under no_grad:
scores_for_choice = scores + e_score_correction_bias, each of n_group groups scored by the sum of its top 2,
torch.topk of topk_group groups, the other experts masked_fill'ed with 0.0, torch.topk of top_k; topk_weights =
the unbiased scores gathered at the chosen, divided by their sum + 1e-20 when norm_topk_prob, times
routed_scaling_factor; kept fp32), DeepseekV3MoE.moe (a zeros_like(hidden_states, dtype=topk_weights.dtype)
accumulator, each expert's output times its fp32 weight index_add_'ed, cast to the hidden type once at the end)
and DeepseekV3MoE.forward (plus shared_experts(residuals), a DeepseekV3MLP of moe_intermediate_size *
n_shared_experts), DeepseekV3DecoderLayer's `layer_idx >= first_k_dense_replace` (the manifest's moe.layers).
The attention, norms, dense MLP and rotary are test_family_deepseek_mla.py's transcription of the same file.
e_score_correction_bias is a buffer, not a parameter: the bundle carries it per step in state.json's
router_score_bias (docs/bundle-format.md, "Mixture of experts").

1. A handmade fp32 bundle (3 layers, layer 0 dense, 8 experts in 4 groups, 2 groups kept, top 2, a shared
   expert, routed_scaling_factor 2.5, a correction bias large enough to move choices): loss and gradient norm
   within 1e-5. The check can fail: the reference weighting by the biased scores, without the group limit,
   without routed_scaling_factor, with softmax instead of sigmoid, or without the correction bias departs
   from the replayed loss by more than ten times the tolerance.
2. The same model in bf16 (the format's rounding points; the router's logits and weights fp32; the routed sum
   cast once before the shared expert's output is added): within 1e-4, departing from the fp32 loss.
3. `nanreplay synth clean-deepseek-moe`: its first two steps (each with its own logged bias) against the
   reference built from the bundle's manifest, weights and state.json biases, within 1e-5; the two steps'
   biases differ.
4. Refusals (exit 2, one line naming the file and key): a step without its layer's bias (state.json,
   router_score_bias["model.layers.1.mlp.gate.e_score_correction_bias"]), a bias of the wrong length, and bad
   moe keys (n_group not dividing num_experts, topk_group above n_group, routed_scaling_factor or
   norm_topk_prob left out, an aux loss, n_group on another router).
5. `nanreplay import` of a DeepSeek-V3 checkpoint as save_pretrained writes one (config.json model_type
   deepseek_v3, first_k_dense_replace 1 of 3 layers, 8 routed experts in 4 groups, a shared expert; model.safetensors
   under DeepseekV3ForCausalLM's names with each MoE layer's nonzero mlp.gate.e_score_correction_bias): the
   manifest's model.moe is check 1's, the biases land in the step's state.json router_score_bias (not among the
   parameters), and the replay is within 1e-5 of the reference's loss and gradient norm. The check can fail: the
   same bundle with the biases zeroed in state.json departs by more than ten times the tolerance. Refused by name
   (exit 2, one line): n_group not dividing n_routed_experts, moe_layer_freq 2, a bias of the wrong length (the
   tensor), a missing bias, and --steps past the checkpoint's step.

    /usr/bin/python3 tests/py/test_family_deepseek_moe.py --cli build/nanreplay --work DIR
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
import test_family_deepseek_mla as mla  # noqa: E402  (DeepSeek-V3's attention, norms, dense MLP, rotary)

LAYERS, E, TOP_K, M, N_GROUP, TOPK_GROUP, SCALING = 3, 8, 2, 16, 4, 2, 2.5
MOE = {"num_experts": E, "top_k": TOP_K, "intermediate_size": M, "router": "sigmoid_grouped", "norm_topk_prob": True,
       "n_group": N_GROUP, "topk_group": TOPK_GROUP, "routed_scaling_factor": SCALING, "router_score_bias": True,
       "shared_expert_intermediate_size": M, "layers": [1, 2]}
# What a perturbed reference changes (check 1); empty: DeepseekV3TopkRouter and DeepseekV3MoE as written.
PERTURB = set()


def bias_key(layer):
    return f"model.layers.{layer}.mlp.gate.e_score_correction_bias"


class DeepseekV3TopkRouter(fs.Rounding, torch.nn.Module):
    def __init__(self, cfg, moe):
        super().__init__()
        self.top_k = moe["top_k"]
        self.n_routed_experts = moe["num_experts"]
        self.routed_scaling_factor = moe["routed_scaling_factor"]
        self.n_group = moe["n_group"]
        self.topk_group = moe["topk_group"]
        self.norm_topk_prob = moe["norm_topk_prob"]
        self.hidden_size = cfg["hidden_size"]
        self.weight = torch.nn.Parameter(torch.empty((self.n_routed_experts, cfg["hidden_size"])))
        self.register_buffer("e_score_correction_bias", torch.zeros(self.n_routed_experts))

    @torch.no_grad()
    def get_topk_indices(self, scores):
        scores_for_choice = scores.view(-1, self.n_routed_experts)
        if "no_bias" not in PERTURB:
            scores_for_choice = scores_for_choice + self.e_score_correction_bias.unsqueeze(0)
        if "no_group_limit" in PERTURB:
            return torch.topk(scores_for_choice, k=self.top_k, dim=-1, sorted=False)[1], scores_for_choice
        group_scores = (
            scores_for_choice.view(-1, self.n_group, self.n_routed_experts // self.n_group)
            .topk(2, dim=-1)[0]
            .sum(dim=-1)
        )
        group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores)
        group_mask.scatter_(1, group_idx, 1)
        score_mask = (
            group_mask.unsqueeze(-1)
            .expand(-1, self.n_group, self.n_routed_experts // self.n_group)
            .reshape(-1, self.n_routed_experts)
        )
        biased = scores_for_choice
        scores_for_choice = scores_for_choice.masked_fill(~score_mask.bool(), 0.0)
        topk_indices = torch.topk(scores_for_choice, k=self.top_k, dim=-1, sorted=False)[1]
        return topk_indices, biased

    def forward(self, hidden_states):
        hidden_states = hidden_states.view(-1, self.hidden_size)
        # A model held in bf16: its hidden states and weight are bf16 values, .type(torch.float32) keeps them.
        router_logits = F.linear(self.rnd(hidden_states).type(torch.float32), self.rnd(self.weight).type(torch.float32))
        scores = router_logits.softmax(-1) if "softmax" in PERTURB else router_logits.sigmoid()
        topk_indices, biased = self.get_topk_indices(scores)
        topk_weights = (biased if "biased_weights" in PERTURB else scores).gather(1, topk_indices)
        if self.norm_topk_prob:
            denominator = topk_weights.sum(dim=-1, keepdim=True) + 1e-20
            topk_weights /= denominator
        if "no_scaling" not in PERTURB:
            topk_weights = topk_weights * self.routed_scaling_factor
        return topk_indices, topk_weights


class DeepseekV3MoE(fs.Rounding, torch.nn.Module):
    def __init__(self, cfg, moe):
        super().__init__()
        expert_cfg = dict(cfg, intermediate_size=moe["intermediate_size"])
        self.gate = DeepseekV3TopkRouter(cfg, moe)
        self.experts = torch.nn.ModuleList([mla.DeepseekV3MLP(expert_cfg) for _ in range(moe["num_experts"])])
        # moe_intermediate_size * n_shared_experts: the manifest's shared_expert_intermediate_size
        self.shared_experts = mla.DeepseekV3MLP(dict(cfg, intermediate_size=moe["shared_expert_intermediate_size"]))

    def moe(self, hidden_states, topk_indices, topk_weights):
        final_hidden_states = torch.zeros_like(hidden_states, dtype=topk_weights.dtype)
        expert_mask = torch.nn.functional.one_hot(topk_indices, num_classes=len(self.experts))
        expert_mask = expert_mask.permute(2, 0, 1)
        for expert_idx in range(len(self.experts)):
            expert = self.experts[expert_idx]
            mask = expert_mask[expert_idx]
            token_indices, weight_indices = torch.where(mask)
            if token_indices.numel() > 0:
                expert_weights = topk_weights[token_indices, weight_indices]
                expert_input = hidden_states[token_indices]
                expert_output = expert(expert_input)
                weighted_output = expert_output * expert_weights.unsqueeze(-1)
                final_hidden_states = final_hidden_states.index_add(0, token_indices, weighted_output)
        return self.rnd(final_hidden_states)  # .type(hidden_states.dtype)

    def forward(self, hidden_states):
        residuals = hidden_states
        orig_shape = hidden_states.shape
        topk_indices, topk_weights = self.gate(hidden_states)
        hidden_states = hidden_states.view(-1, hidden_states.shape[-1])
        hidden_states = self.moe(hidden_states, topk_indices, topk_weights).view(*orig_shape)
        return self.rnd(hidden_states + self.shared_experts(residuals))  # mlp.combine


def build(cfg, moe, layers):
    """DeepseekV3ForCausalLM with DeepseekV3MoE on moe["layers"] (first_k_dense_replace's layers)."""
    model = mla.DeepseekV3ForCausalLM(layers, cfg)
    for i in moe["layers"]:
        model.layers[i].mlp = DeepseekV3MoE(cfg, moe)
    return model


def moes(model):
    return [(i, layer.mlp) for i, layer in enumerate(model.layers) if isinstance(layer.mlp, DeepseekV3MoE)]


def named(model):
    """(key, tensor) under the bundle's names: DeepSeek's mlp.shared_experts.* are mlp.shared_expert.*."""
    return [(k.replace(".mlp.shared_experts.", ".mlp.shared_expert."), v) for k, v in mla.named(model)]


def set_bias(model, biases):
    """Each MoE layer's e_score_correction_bias from {state.json key: [numbers]}."""
    for i, moe in moes(model):
        moe.gate.e_score_correction_bias.copy_(torch.tensor(biases[bias_key(i)], dtype=torch.float64).float())


def random_model(seed):
    torch.manual_seed(seed)
    model = build(mla.CONFIG, MOE, LAYERS)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.3 * torch.randn(p.shape) if "norm" in name else 0.4 * torch.randn(p.shape))
    g = torch.Generator().manual_seed(seed + 1)
    # Large enough to move choices: the sigmoid scores are spread over (0, 1).
    biases = {bias_key(i): (0.3 * torch.randn(E, generator=g)).tolist() for i, _ in moes(model)}
    set_bias(model, biases)
    return model, biases


def add_bias(bundle, biases, step=fs.STEP):
    state_file = Path(bundle) / "steps" / str(step) / "state.json"
    state = json.loads(state_file.read_text())
    state["router_score_bias"] = biases
    state_file.write_text(json.dumps(state))


def manifest_model(moe=None):
    return dict(mla.manifest_model(mla.CONFIG), num_layers=LAYERS, moe=moe or MOE)


def reference_loss(model, stream):
    inputs, targets = fs.batch_of(stream, mla.SAMPLES, mla.T)
    with torch.no_grad():
        return float(model(inputs, targets))


def check_handmade(cli, work):
    """1 and 2."""
    model, biases = random_model(seed=11)
    stream = fs.token_stream(mla.V, mla.SAMPLES, mla.T, seed=12)
    inputs, targets = fs.batch_of(stream, mla.SAMPLES, mla.T)
    loss, norm = fs.loss_and_grad_norm(model(inputs, targets), list(model.parameters()))
    bundle = fs.write_bundle(work / "deepseek-moe", manifest_model(), named(model), stream, mla.SAMPLES, mla.T,
                             loss, norm)
    add_bias(bundle, biases)
    rc, report, err = fs.replay(cli, bundle, work / "out-deepseek-moe")
    what = "DeepSeek-V3 MoE (layer 0 dense, 8 experts in 4 groups, top 2 of 2 groups, bias, x2.5, shared expert)"
    if not fs.check(report is not None, f"{what}: nanreplay run gave a report (exit {rc}; {err.strip()[-300:]})"):
        return
    fs.compare_step(report, loss, norm, what)
    replayed = report["steps"][0]["loss"]
    for perturbation, label in (("biased_weights", "weighting by the biased scores"),
                                ("no_group_limit", "choosing among every expert (no group limit)"),
                                ("no_scaling", "without routed_scaling_factor"),
                                ("softmax", "with softmax instead of sigmoid"),
                                ("no_bias", "without the correction bias")):
        PERTURB.clear()
        PERTURB.add(perturbation)
        try:
            other = reference_loss(model, stream)
        finally:
            PERTURB.clear()
        fs.check(fs.rel_err(replayed, other) > 10 * fs.TOLERANCE,
                 f"the check can fail: the reference {label} departs ({other!r} vs replayed {replayed!r}, "
                 f"rel {fs.rel_err(replayed, other):.2e})")
    model.zero_grad()
    check_bf16(cli, work, model, biases, stream)


def check_bf16(cli, work, model, biases, stream):
    """2. fs.check_bf16_step's check, the bias added to the bundle's state.json."""
    inputs, targets = fs.batch_of(stream, mla.SAMPLES, mla.T)
    fp32_loss = reference_loss(model, stream)
    fs.set_compute(model, "bf16")
    try:
        loss, norm = fs.loss_and_grad_norm(model(inputs, targets), list(model.parameters()))
    finally:
        fs.set_compute(model, "fp32")
    what = "DeepSeek-V3 MoE in bf16 (fp32 router logits and weights, the routed sum cast once)"
    fs.check(fs.rel_err(loss, fp32_loss) > fs.TOLERANCES["bf16"],
             f"{what}: the reference's bf16 loss {loss!r} departs from its fp32 loss {fp32_loss!r}")
    bundle = fs.write_bundle(work / "deepseek-moe-bf16", manifest_model(), named(model), stream, mla.SAMPLES, mla.T,
                             loss, norm, precision="bf16")
    add_bias(bundle, biases)
    rc, report, err = fs.replay(cli, bundle, work / "out-deepseek-moe-bf16")
    if fs.check(report is not None, f"{what}: nanreplay run gave a report (exit {rc}; {err.strip()[-300:]})"):
        fs.compare_step(report, loss, norm, what, "bf16")


def check_refusals(cli, work):
    """4. exit 2, one line naming the file and the key."""
    model, biases = random_model(seed=11)
    stream = fs.token_stream(mla.V, mla.SAMPLES, mla.T, seed=12)
    cases = [
        ("no bias", MOE, {k: v for k, v in biases.items() if k != bias_key(1)}, "state.json", f'["{bias_key(1)}"]'),
        ("short bias", MOE, dict(biases, **{bias_key(2): biases[bias_key(2)][:3]}), "state.json",
         f'["{bias_key(2)}"]'),
        ("bias of a dense layer", MOE, dict(biases, **{bias_key(0): [0.0] * E}), "state.json", f'["{bias_key(0)}"]'),
    ]
    for change, key in (({"n_group": 3}, "model.moe.n_group"), ({"topk_group": 5}, "model.moe.topk_group"),
                        ({"routed_scaling_factor": None}, "model.moe.routed_scaling_factor"),
                        ({"norm_topk_prob": None}, "model.moe.norm_topk_prob"),
                        ({"router_aux_loss_coef": 0.01}, "model.moe.router_aux_loss_coef"),
                        ({"router": "softmax_top_k"}, "model.moe.n_group")):
        moe = {k: v for k, v in dict(MOE, **change).items() if v is not None}
        cases.append((str(change), moe, biases, "manifest.json", key))
    for i, (label, moe, state_bias, file, key) in enumerate(cases):
        bundle = fs.write_bundle(work / f"bad-{i}", manifest_model(moe), named(model), stream, mla.SAMPLES, mla.T,
                                 1.0, 1.0)
        add_bias(bundle, state_bias)
        rc, _, err = fs.replay(cli, bundle, work / f"out-bad-{i}")
        fs.check_refused(rc, err, label, file, key)


def check_preset(cli, work, preset="clean-deepseek-moe"):
    """3. the first two steps of the preset against the reference on each step's weights, batches and bias."""
    started = fs.replay_preset_start(cli, work, preset)
    if started is None:
        return
    bundle, report, first_two = started
    m = bundle.manifest["model"]
    moe = m.get("moe") or {}
    understood = {"num_experts", "top_k", "intermediate_size", "router", "norm_topk_prob", "n_group", "topk_group",
                  "routed_scaling_factor", "router_score_bias", "shared_expert_intermediate_size", "layers",
                  "router_aux_loss_coef", "router_z_loss_coef"}
    fs.check(moe.get("router") == "sigmoid_grouped" and set(moe) <= understood and moe.get("layers") == [1, 2]
             and moe.get("router_score_bias") is True and moe.get("n_group", 1) > 1
             and moe.get("topk_group", 0) < moe.get("n_group", 0) and moe.get("routed_scaling_factor") == 2.5
             and not moe.get("router_z_loss_coef") and not moe.get("router_aux_loss_coef")
             and set(m) - {"moe"} <= mla.UNDERSTOOD and bundle.manifest["precision"]["compute"] == "fp32",
             f"{preset}'s manifest says only what the reference implements, a dense layer among them ({m})")
    cfg = mla.config_of_manifest(m)
    dirs = {e["step"]: e["dir"] for e in bundle.manifest["steps"]}
    states = {s: json.loads((bundle.root / dirs[s] / "state.json").read_text()) for s in first_two}
    fs.check(states[first_two[0]]["router_score_bias"] != states[first_two[1]]["router_score_bias"],
             f"{preset}: the correction bias changes between steps {first_two}")
    for row in report["steps"]:
        model = build(cfg, moe, m["num_layers"])
        weights = reference_model.read_safetensors(bundle.root / dirs[row["step"]] / "model.safetensors")
        with torch.no_grad():
            for k, p in named(model):
                p.copy_(weights.pop(k))
        fs.check(not weights, f"{preset} step {row['step']}: every tensor is a reference parameter ({sorted(weights)})")
        set_bias(model, states[row["step"]]["router_score_bias"])
        fs.compare_bundle_step(bundle, row, model, f"{preset} step {row['step']}")


def hf_checkpoint(hf, model, biases, **config):
    """config.json and model.safetensors as DeepseekV3ForCausalLM.save_pretrained writes them (the buffers too)."""
    hf.mkdir(parents=True, exist_ok=True)
    tensors = [(k, v.detach()) for k, v in mla.named(model)]
    tensors += [(k, torch.tensor(v, dtype=torch.float32)) for k, v in biases.items()]
    fs.nanreplay_capture.write_safetensors(hf / "model.safetensors", tensors)
    cfg = dict(mla.hf_config(mla.CONFIG, num_hidden_layers=LAYERS, first_k_dense_replace=MOE["layers"][0],
                             n_routed_experts=E, num_experts_per_tok=TOP_K, moe_intermediate_size=M,
                             n_shared_experts=1, n_group=N_GROUP, topk_group=TOPK_GROUP, norm_topk_prob=True,
                             routed_scaling_factor=SCALING, scoring_func="sigmoid", topk_method="noaux_tc",
                             moe_layer_freq=1, aux_loss_alpha=0.001), **config)
    (hf / "config.json").write_text(json.dumps(cfg))


def check_import(cli, work):
    """5. the checkpoint through `nanreplay import`, replayed; the bias zeroed must fail; refusals."""
    import contextlib
    import io
    import import_support as imp
    import nanreplay_import
    work.mkdir(parents=True, exist_ok=True)
    model, biases = random_model(seed=31)
    data = imp.Data(work, mla.V, mla.T, mla.SAMPLES, 1, num_samples=8, seed=3)
    loss, norm = fs.loss_and_grad_norm(model(*data.batch(data.rows(0))), list(model.parameters()))
    (work / "log.jsonl").write_text("".join(json.dumps({"step": s, "loss": loss, "grad_norm": norm, "lr": 1e-3}) + "\n"
                                            for s in (0, 1)))
    hf = work / "hf"
    hf_checkpoint(hf, model, biases)
    flags = [*data.flags(), "--log", work / "log.jsonl", "--steps", "0:0"]
    what = "DeepSeek-V3 MoE import (layer 0 dense, 8 experts in 4 groups, shared expert, correction bias)"
    proc = imp.run_import(cli, ["--checkpoint", hf, *flags], work / "bundle")
    if not fs.check(proc.returncode == 0, f"{what}: exit 0 ({proc.stderr.strip()[-300:]})"):
        return
    bundle = work / "bundle"
    m = json.loads((bundle / "manifest.json").read_text())["model"]
    fs.check(m.get("moe") == dict(MOE, router_aux_loss_coef=0.0) and m.get("intermediate_size") == mla.FF,
             f"{what}: model.moe as the config says ({m.get('moe')})")
    state_file = bundle / "steps" / "0" / "state.json"
    state = json.loads(state_file.read_text())
    said = state.get("router_score_bias") or {}
    fs.check(sorted(said) == sorted(biases) and all(
        max(abs(a - b) for a, b in zip(said[k], torch.tensor(biases[k]).float().tolist())) == 0 for k in biases),
        f"{what}: each MoE layer's e_score_correction_bias is in state.json's router_score_bias ({sorted(said)})")
    weights = reference_model.read_safetensors(bundle / "steps" / "0" / "model.safetensors")
    fs.check(not any("e_score_correction_bias" in k or "shared_experts" in k for k in weights)
             and "model.layers.1.mlp.shared_expert.down_proj.weight" in weights,
             f"{what}: the bias is no parameter, shared_experts is mlp.shared_expert")
    rproc, report = imp.run_replay(cli, bundle, work / "out")
    if fs.check(report is not None, f"{what}: replays ({rproc.stderr.strip()[-300:]})"):
        fs.compare_step(report, loss, norm, what)
        replayed = report["steps"][0]["loss"]
        state["router_score_bias"] = {k: [0.0] * E for k in biases}
        state_file.write_text(json.dumps(state))
        _, zeroed = imp.run_replay(cli, bundle, work / "out-zeroed")
        other = zeroed["steps"][0]["loss"] if zeroed else float("nan")
        fs.check(fs.rel_err(replayed, other) > 10 * fs.TOLERANCE,
                 f"{what}: the check can fail: the bias zeroed in state.json departs ({other!r} vs {replayed!r})")

    def refused(label, file, key, config=None, bias=None, extra=()):
        bad = work / "bad"
        hf_checkpoint(bad, model, biases if bias is None else bias, **(config or {}))
        err = io.StringIO()
        argv = [str(a) for a in ["--checkpoint", bad, *flags, *extra, "--out", work / f"moe-{label}"]]
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            rc = nanreplay_import.main(argv)
        fs.check_refused(rc, err.getvalue(), f"{what}: {label}", file, key)

    refused("n_group 3", "config.json", "n_group", config={"n_group": 3})
    refused("moe_layer_freq 2", "config.json", "moe_layer_freq", config={"moe_layer_freq": 2})
    refused("a bias of 3", str(work / "bad"), bias_key(2),
            bias=dict(biases, **{bias_key(2): biases[bias_key(2)][:3]}))
    refused("no bias", str(work / "bad"), bias_key(1), bias={bias_key(2): biases[bias_key(2)]})
    refused("steps past the checkpoint", "command line", "--steps", extra=["--steps", "0:1"])


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
    check_import(args.cli, work / "import")
    fs.finish()


if __name__ == "__main__":
    main()
