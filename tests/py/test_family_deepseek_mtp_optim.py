"""What rolling forward does to DeepSeek-V3's multi-token prediction blocks (model.mtp), against the eager
PyTorch reference of test_family_deepseek_mtp.py (transformers' modeling_deepseek_v3.py and Megatron-LM's
multi_token_prediction.py): MuonClip and the router's correction bias cover the MTP block as any decoder layer.

Each bundle here is written from the reference's weights: two steps (100 with model.safetensors and
optimizer.safetensors, 101 with its state.json only, so the replay derives its parameters), samples 0-1 at
step 100 and 2-3 at step 101, the AdamW state a made-up one of ten updates (so that no first AdamW update
divides a near-zero gradient by itself).

1. MuonClip (Kimi K2; Megatron-LM's clip_qk walks every attention layer, the MTP layers' included): a Muon
   group over model.layers.*_proj.weight (momentum 0, match_rms_adamw) with qk_clip at a tau half the MTP
   block's largest head logit. Step 100's report.json attn_logit_max has a row for the MTP block (layer 2)
   equal to the reference's per-head maxima of its attention within 1e-5. Step 101's loss, grad norm and
   mtp_loss within 1e-5 of the reference that applies the step's update (clip_grad_norm_, AdamW and
   torch.optim.Muon as test_optim_crosscheck.py transcribes them) and then Megatron-LM's MuonClip of latent
   attention (test_optim_crosscheck.mla_qk_clip) to every attention layer from its own maxima. The check can
   fail: the reference that leaves the MTP block unclipped departs by more than 1e-4.
2. `--what-if qk-clip=100` on a one-step fp16 MTP bundle whose MTP block's q_b_proj is scaled up 1e4 times, so
   that its logits overflow fp16 while the decoder's stay far under 100: the overflow is named in layer 2, and
   the what-if's change names "layer 2 head h" for each head h over 100 by the reference's maxima, with its
   largest logit (fp32 scores of the fp16 q and k) within 2e-3 of the reference's, no decoder layer, and resolves it.
3. An MTP block with experts (layers 1 and 2 DeepseekV3MoE, the MTP block's router with its
   e_score_correction_bias) and model.moe.score_bias_update {"rule": "sign_centred"}: step 100's
   expert_tokens has the MTP block's row, equal to the reference's top-k choices counted per expert; step
   101's router_score_bias is derived, for layer 2 exactly (fp32) torchtitan's _update_expert_bias on step
   100's bias and those counts; step 101's loss, grad norm and mtp_loss within 1e-5 of the reference rolled
   forward with those biases. The check can fail: the MTP block's bias left as it was, or moved by layer 1's
   counts, differs from the replay's, and the reference with it left as it was departs by more than 1e-4.
4. The bundles of 1 and 3 replayed `--stream` and `--nproc 2 --split layers`, and copies of them with two
   data-parallel ranks `--nproc 2 --split ranks` (each process records its own layers' or passes' logits and
   token counts, which MuonClip and the bias update read gathered), with probes and without (`--no-probes`:
   report.json wants no maxima, MuonClip still does): report.json (MuonClip's maxima and clipped step, the
   derived biases) and the exit status those of the in-memory replay, bit for bit.

    /usr/bin/python3 tests/py/test_family_deepseek_mtp_optim.py --cli build/nanreplay --work DIR
"""
import argparse
import copy
import json
import os
import re
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "2")  # Muon's bf16 Newton-Schulz, as test_optim_crosscheck.py says
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import family_support as fs  # noqa: E402
import replay_compare as rc  # noqa: E402  (the CLI run through the tests' synth cache)
import test_family_deepseek_mla as mla  # noqa: E402  (DeepSeek-V3's attention, transformers' modeling)
import test_family_deepseek_moe as dsmoe  # noqa: E402  (DeepseekV3MoE and its router)
import test_family_deepseek_mtp as mtp  # noqa: E402  (the model with its MTP depth, Megatron-LM's arithmetic)
import test_optim_crosscheck as optim  # noqa: E402  (AdamW, Muon and MuonClip of latent attention)
import test_router_score_bias as bias_rule  # noqa: E402  (torchtitan's _update_expert_bias)

MTP_LAYER = mla.LAYERS  # the MTP block's layer: num_layers + 1 - 1
FIRST, NEXT = fs.STEP, fs.STEP + 1
ADAMW = {"kind": "adamw", "betas": [0.9, 0.95], "weight_decay": 0.1, "grad_clip": 1.0}
# Muon's lr small: its bf16 Newton-Schulz turns the reference's last-bit gradient differences into one-ulp
# bf16 flips of the update (test_optim_crosscheck.py reads the run's own momentum buffer to avoid them), which at
# 2e-2 move step 101 by 1e-4; MuonClip's rescaling, what this checks, does not depend on the lr.
LR = {"default": 3e-3, "muon": 1e-4}
Q_SCALE, TAU = 1e4, 100.0  # check 2: the MTP block's q_b_proj scaled up; MuonClip's tau
RATE = 0.05  # score_bias_update's rate: large enough that the derived biases move routing choices


def parameters_by_name(model):
    """(bundle key, Parameter) as test_family_deepseek_mtp.bundle_parameters names them, DeepSeek's
    mlp.shared_experts.* being mlp.shared_expert.*."""
    named = list(mla.named(model.main))
    for depth, layer in enumerate(model.mtp):
        prefix = f"model.layers.{MTP_LAYER + depth}."
        named += [(prefix + n + ".weight", getattr(layer, n).weight) for n in ("enorm", "hnorm", "eh_proj")]
        named += [(prefix + k, v) for k, v in layer.transformer_layer.named_parameters()]
        named.append((prefix + "shared_head.norm.weight", layer.final_layernorm.weight))
    return [(k.replace(".mlp.shared_experts.", ".mlp.shared_expert."), v) for k, v in named]


def made_up_state(params, optimizer):
    """{key: the optimizer's state of the parameter} after ten updates: AdamW's moments made up (positive
    second moments), Muon's momentum buffer zero (momentum 0 does not read it)."""
    g = torch.Generator().manual_seed(7)
    state = {}
    for name, p in params:
        rule = optim.rule_of(optimizer, name)[1]
        if rule["kind"] == "muon":
            state[name] = {"step": 10, "momentum_buffer": torch.zeros(p.shape)}
        else:
            state[name] = {"step": 10, "exp_avg": 1e-2 * torch.randn(p.shape, generator=g),
                           "exp_avg_sq": 1e-4 * (1 + torch.rand(p.shape, generator=g))}
    return state


def write_two_steps(root, section, model, optimizer, state, stream, logged, first_state=None, next_state=None):
    """The two-step bundle: step 100 the model's weights and `state` (optimizer.safetensors), step 101 its
    state.json only. `logged`: [(loss, grad norm)] of the two steps; *_state: more state.json keys."""
    params = [(k, v.detach()) for k, v in parameters_by_name(model)]
    root = fs.write_bundle(root, section, params, stream, mla.SAMPLES, mla.T, *logged[0])
    manifest = json.loads((root / "manifest.json").read_text())
    manifest["optimizer"] = optimizer
    manifest["steps"].append({"step": NEXT, "dir": f"steps/{NEXT}",
                              "samples": [list(range(mla.SAMPLES, 2 * mla.SAMPLES))]})
    (root / "manifest.json").write_text(json.dumps(manifest, indent=1))
    tensors = [(f"{name}.{key}", value.float().contiguous()) for name, s in state.items() for key, value in s.items()
               if key != "step"]
    fs.nanreplay_capture.write_safetensors(root / "steps" / str(FIRST) / "optimizer.safetensors",
                                           tensors + [("step", torch.tensor(10, dtype=torch.int64))])
    lr = {k: v for k, v in LR.items() if k == "default" or any(g["name"] == k for g in optimizer.get("groups", []))}
    lr = lr if len(lr) > 1 else lr["default"]
    for step, extra, (loss, norm) in ((FIRST, first_state, logged[0]), (NEXT, next_state, logged[1])):
        path = root / "steps" / str(step) / "state.json"
        (root / "steps" / str(step)).mkdir(parents=True, exist_ok=True)
        body = {"step": step, "lr": lr, "logged": {"loss": loss, "grad_norm": norm}, **(extra or {})}
        path.write_text(json.dumps(body))
    return root


def batches(stream):
    inputs, targets = fs.batch_of(stream, 2 * mla.SAMPLES, mla.T)
    return (inputs[:mla.SAMPLES], targets[:mla.SAMPLES]), (inputs[mla.SAMPLES:], targets[mla.SAMPLES:])


def forward_backward(model, batch):
    """(LM loss, grad norm of LM + MTP, depth losses) as test_family_deepseek_mtp.reference, leaving each
    parameter's .grad."""
    model.zero_grad(set_to_none=True)
    lm_loss, mtp_term, depths = model(*batch)
    (lm_loss + mtp_term).backward()
    for p in model.parameters():
        if p.grad is None:  # an expert no token chose: the replay's zero gradient (docs/rolling-forward.md)
            p.grad = torch.zeros_like(p)
    norm = torch.norm(torch.stack([p.grad.norm() for p in model.parameters()]))
    return float(lm_loss), float(norm), [float(d) for d in depths]


def update(model, optimizer, state, lr, maxima=None, clip_layers=()):
    """The step's update of `model` in place from its .grad: torch's clip_grad_norm_ (max_norm / (norm + 1e-6),
    at most 1), each parameter by its group's rule (test_optim_crosscheck.step_one), then MuonClip of latent
    attention on `clip_layers` from their per-head `maxima`."""
    params = parameters_by_name(model)
    norm = torch.norm(torch.stack([p.grad.norm() for _, p in params]))
    coef = min(1.0, optimizer["grad_clip"] / (float(norm) + 1e-6))
    with torch.no_grad():
        for name, p in params:
            group, rule = optim.rule_of(optimizer, name)
            step_one(p, p.grad * coef, copy.deepcopy(state[name]), lr[group] if isinstance(lr, dict) else lr, rule)
        if maxima is not None:
            by_name = {k: v.data for k, v in params}
            chosen = [maxima[layer] if layer in clip_layers else torch.full_like(maxima[layer], float("-inf"))
                      for layer in range(len(maxima))]
            optim.mla_qk_clip(by_name, lambda n: optim.rule_of(optimizer, n)[1], chosen, SECTION)


def step_one(param, grad, state, lr, rule):
    """test_optim_crosscheck.step_one on a parameter's data (every parameter decays: no no_decay here)."""
    data = param.data
    optim.step_one(data, grad.clone(), state, lr, rule, True)


SECTION = dict(mla.manifest_model(mla.CONFIG), mtp={"num_layers": 1, "loss_scale": mtp.SCALE})
MOE_SECTION = dict(SECTION, moe=dict(dsmoe.MOE, layers=mtp.MOE_LAYERS))


def with_gradients(model, source):
    """A copy of `model` whose parameters hold `source`'s gradients (deepcopy leaves .grad behind)."""
    other = copy.deepcopy(model)
    for p, q in zip(source.parameters(), other.parameters()):
        q.grad = p.grad.clone()
    return other


def check_muonclip(cli, work):
    """1."""
    model = mtp.random_model()
    stream = fs.token_stream(mla.V, 2 * mla.SAMPLES, mla.T, seed=8)
    first, second = batches(stream)
    with optim.LatentLogitMax(MTP_LAYER + 1) as logits:
        loss, norm, _ = forward_backward(model, first)
    maxima = logits.per_layer()
    tau = float(f"{0.5 * float(maxima[MTP_LAYER].max()):.4g}")
    over = [(layer, h) for layer, row in enumerate(maxima) for h, v in enumerate(row.tolist()) if v > tau]
    fs.check(any(layer == MTP_LAYER for layer, _ in over),
             f"MuonClip at tau {tau}: heads of the MTP block (layer {MTP_LAYER}) are over tau ({over})")
    optimizer = dict(ADAMW, groups=[dict(optim.MUON_GROUP, momentum=0.0, adjust_lr_fn="match_rms_adamw",
                                         qk_clip={"tau": tau})])
    state = made_up_state(parameters_by_name(model), optimizer)
    def rolled(clip_layers):
        other = with_gradients(model, model)
        update(other, optimizer, state, LR, maxima, clip_layers)
        return forward_backward(other, second)

    expected = rolled(range(MTP_LAYER + 1))
    bundle = write_two_steps(work / "muonclip", SECTION, model, optimizer, state, stream,
                             [(loss, norm), expected[:2]])
    rc, report, err = fs.replay(cli, bundle, work / "out-muonclip")
    what = "MuonClip with an MTP block"
    if not fs.check([r.get("params") for r in (report or {}).get("steps", [])] == ["checkpoint", "derived"],
                    f"{what}: replays rolling step {NEXT} forward (exit {rc}; {err.strip()[-300:]})"):
        return
    row = report["steps"][0].get("attn_logit_max") or []
    worst = max((fs.rel_err(a, float(b)) for a, b in zip(row[MTP_LAYER], maxima[MTP_LAYER])), default=float("inf")) \
        if len(row) == MTP_LAYER + 1 else float("inf")
    fs.check(worst <= fs.TOLERANCE, f"{what}: step {FIRST}'s attn_logit_max has the MTP block's row {MTP_LAYER}, "
                                    f"the reference's per-head maxima within {worst:.2e} ({len(row)} rows)")
    derived = report["steps"][1]
    got = (derived["loss"], derived["grad_norm"], derived.get("mtp_loss", [float("nan")])[0])
    want = (expected[0], expected[1], expected[2][0])
    errs = [fs.rel_err(a, b) for a, b in zip(got, want)]
    fs.check(max(errs) <= fs.TOLERANCE, f"{what}: step {NEXT}'s loss, grad norm, mtp_loss {got} vs the reference "
                                        f"rolled forward with MuonClip on every attention layer {want} "
                                        f"(worst {max(errs):.2e})")
    unclipped = rolled(range(MTP_LAYER))
    moved = max(fs.rel_err(derived["grad_norm"], unclipped[1]), fs.rel_err(got[2], unclipped[2][0]))
    fs.check(moved > 1e-4, f"{what}: the reference leaving the MTP block unclipped departs by {moved:.2e}")


def check_what_if(cli, work):
    """2."""
    model = mtp.random_model()
    with torch.no_grad():  # the MTP block's logits past fp16's 65504, the decoder's far under TAU
        model.mtp[0].transformer_layer.self_attn.q_b_proj.weight.mul_(Q_SCALE)
    stream = fs.token_stream(mla.V, mla.SAMPLES, mla.T, seed=9)
    inputs, targets = fs.batch_of(stream, mla.SAMPLES, mla.T)
    with optim.LatentLogitMax(MTP_LAYER + 1) as logits, torch.no_grad():
        model(inputs, targets)
    maxima = logits.per_layer()
    decoder, block = max(float(r.max()) for r in maxima[:MTP_LAYER]), float(maxima[MTP_LAYER].max())
    what = f"--what-if qk-clip={TAU} on an fp16 MTP bundle"
    if not fs.check(decoder < TAU < 65504 < block, f"{what}: the decoder's largest logit {decoder:.4g} under tau, "
                                                   f"the MTP block's {block:.4g} over fp16's largest"):
        return
    heads = [h for h, v in enumerate(maxima[MTP_LAYER].tolist()) if v > TAU]
    params = [(k, v.detach()) for k, v in parameters_by_name(model)]
    bundle = fs.write_bundle(work / "what-if", SECTION, params, stream, mla.SAMPLES, mla.T, 1.0, 1.0, precision="fp16")
    rc, report, err = fs.replay(cli, bundle, work / "out-what-if", ["--what-if", f"qk-clip={TAU}"])
    first = (report or {}).get("first_nonfinite") or {}
    fs.check(rc == 1 and first.get("layer") == MTP_LAYER,
             f"{what}: the overflow is named in the MTP block, layer {MTP_LAYER} (exit {rc}; {first.get('site')}; "
             f"{err.strip()[-200:]})")
    outcome = ((report or {}).get("what_if") or [{}])[0]
    change = outcome.get("change", "")
    named = bool(heads) and all(f"layer {MTP_LAYER} head {h} (" in change for h in heads)
    fs.check(named and "layer 0 " not in change and "layer 1 " not in change and f"of {len(heads)} head" in change,
             f"{what}: names the MTP block's heads {heads} as layer {MTP_LAYER}, no decoder layer ({change!r})")
    said = {int(h): float(v) for h, v in re.findall(rf"layer {MTP_LAYER} head (\d+) \(([^,]+),", change)}
    worst = max((fs.rel_err(said.get(h, float("nan")), float(maxima[MTP_LAYER][h])) for h in heads), default=0.0)
    fs.check(worst <= 2e-3, f"{what}: each head's largest logit said (fp32 scores of fp16 q and k) is the "
                            f"reference's within {worst:.2e} ({said})")
    fs.check(outcome.get("resolved") is True, f"{what}: the clipped step resolves the overflow "
                                              f"(resolved {outcome.get('resolved')})")


class TokenCounts:
    """Per MoE layer, the tokens its router sent each expert (DeepseekV3TopkRouter's top-k choices)."""

    def __init__(self, model):
        self.counts = {}
        for layer, moe in ((1, model.main.layers[1].mlp), (MTP_LAYER, model.mtp[0].transformer_layer.mlp)):
            moe.gate.forward = self._counting(layer, moe.gate, moe.gate.forward)

    def _counting(self, layer, gate, forward):
        def counting(hidden_states):
            indices, weights = forward(hidden_states)
            count = torch.bincount(indices.reshape(-1), minlength=gate.n_routed_experts)
            self.counts[layer] = self.counts.get(layer, 0) + count
            return indices, weights
        return counting


def check_score_bias(cli, work):
    """3."""
    model, biases = mtp.random_moe_model()
    stream = fs.token_stream(mla.V, 2 * mla.SAMPLES, mla.T, seed=10)
    first, second = batches(stream)
    counting = copy.deepcopy(model)
    tokens = TokenCounts(counting)
    loss, norm, _ = forward_backward(counting, first)
    section = dict(MOE_SECTION, moe=dict(MOE_SECTION["moe"], score_bias_update={"rule": "sign_centred", "rate": RATE}))
    state = made_up_state(parameters_by_name(model), ADAMW)
    derived = {key: bias_rule.torchtitan_update(values, tokens.counts[int(key.split(".")[2])].tolist(), RATE)
               for key, values in biases.items()}

    def rolled(next_biases):
        other = with_gradients(model, counting)  # the model without the counting routers
        update(other, ADAMW, state, LR["default"])
        mtp.set_moe_bias(other, next_biases)
        return forward_backward(other, second)

    expected = rolled(derived)
    bundle = write_two_steps(work / "score-bias", section, model, ADAMW, state, stream, [(loss, norm), expected[:2]],
                             first_state={"router_score_bias": biases})
    rc, report, err = fs.replay(cli, bundle, work / "out-score-bias")
    what = "score_bias_update with an MoE MTP block"
    if not fs.check([r.get("params") for r in (report or {}).get("steps", [])] == ["checkpoint", "derived"],
                    f"{what}: replays rolling step {NEXT} forward (exit {rc}; {err.strip()[-300:]})"):
        return
    before, after = report["steps"]
    counted = before.get("expert_tokens") or []
    fs.check(len(counted) == MTP_LAYER + 1 and counted[MTP_LAYER] == tokens.counts[MTP_LAYER].tolist(),
             f"{what}: step {FIRST}'s expert_tokens has the MTP block's row {MTP_LAYER}, the reference's top-k "
             f"choices ({counted[MTP_LAYER:]} vs {tokens.counts[MTP_LAYER].tolist()})")
    said = after.get("router_score_bias") or {}
    mtp_key = dsmoe.bias_key(MTP_LAYER)
    fs.check(after.get("router_score_bias_source") == "derived" and said.get(str(MTP_LAYER)) == derived[mtp_key]
             and said.get("1") == derived[dsmoe.bias_key(1)],
             f"{what}: step {NEXT}'s bias derived, the MTP block's exactly torchtitan's rule on its own counts "
             f"({after.get('router_score_bias_source')}; {said.get(str(MTP_LAYER))} vs {derived[mtp_key]})")
    got = (after["loss"], after["grad_norm"], after.get("mtp_loss", [float("nan")])[0])
    want = (expected[0], expected[1], expected[2][0])
    errs = [fs.rel_err(a, b) for a, b in zip(got, want)]
    fs.check(max(errs) <= fs.TOLERANCE, f"{what}: step {NEXT}'s loss, grad norm, mtp_loss {got} vs the reference "
                                        f"rolled forward with the derived biases {want} (worst {max(errs):.2e})")
    # The check can fail: the MTP block's bias kept, or moved by the decoder layer's counts.
    kept = biases[mtp_key]
    by_layer_1 = bias_rule.torchtitan_update(biases[mtp_key], tokens.counts[1].tolist(), RATE)
    fs.check(said.get(str(MTP_LAYER)) not in (kept, by_layer_1),
             f"{what}: the MTP block's bias kept or moved by layer 1's counts differs from the replay's")
    kept_loss = rolled(dict(derived, **{mtp_key: kept}))
    moved = max(fs.rel_err(got[1], kept_loss[1]), fs.rel_err(got[2], kept_loss[2][0]))
    fs.check(moved > 1e-4, f"{what}: the reference with the MTP block's bias kept departs by {moved:.2e}")


def check_streamed_and_split(cli, work):
    """4. Rolling forward with MTP blocks streamed, and split across two processes by layers or by ranks."""
    mtp.data_parallel_copy(work / "muonclip", work / "muonclip-dp")
    mtp.data_parallel_copy(work / "score-bias", work / "score-bias-dp")
    layers, ranks = ["--nproc", "2", "--split", "layers"], ["--nproc", "2", "--split", "ranks"]
    # (bundle, flags of both runs, the ways compared). Without probes report.json asks for no logit maxima:
    # MuonClip alone needs them gathered across processes.
    cases = [("muonclip", [], [["--stream"], layers]), ("muonclip", ["--no-probes"], [layers]),
             ("muonclip-dp", [], [ranks]), ("muonclip-dp", ["--no-probes"], [ranks]),
             ("score-bias", [], [["--stream"], layers]), ("score-bias-dp", ["--no-probes"], [ranks])]
    for name, both, ways in cases:
        bundle, tag = work / name, "".join(both).replace("-", "")
        plain = rc.cli_run(cli, "run", bundle, "--out", work / f"plain-{name}{tag}", "--json", *both)
        if fs.check(plain.returncode in (0, 1) and bool(plain.stdout.strip()),
                    f"{name} {' '.join(both)}: replays in one process (exit {plain.returncode}; "
                    f"{plain.stderr.strip()[-300:]})"):
            mtp.check_same_as_one_process(cli, plain, bundle, work / f"{name}{tag}", name, ways, both)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cli", required=True)
    ap.add_argument("--work", required=True)
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    check_muonclip(args.cli, work)
    check_what_if(args.cli, work)
    check_score_bias(args.cli, work)
    check_streamed_and_split(args.cli, work)
    fs.finish()


if __name__ == "__main__":
    main()
