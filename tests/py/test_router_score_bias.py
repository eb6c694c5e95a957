"""DeepSeek-V3's router per step in report.json, and its correction bias derived for rolled-forward steps.

The reference is test_family_deepseek_moe.py's transcription of transformers' DeepseekV3TopkRouter and
DeepseekV3MoE (modeling_deepseek_v3.py), on the weights, batches and state.json biases of
`nanreplay synth clean-deepseek-moe` (fp32), and torchtitan's expert-bias update transcribed below.

1. The first step, full probes: steps[].router_logit_max per MoE layer and expert within 1e-5 relative of the
   reference's largest router_logits (F.linear of the fp32 hidden states, before the sigmoid) over every token of
   every micro-batch; null for the dense layer 0. expert_tokens equal the reference's top-k choices counted per
   expert. router_score_bias is state.json's, source "logged". The check can fail: the maxima after the sigmoid
   depart by more than ten times the tolerance.
2. The preset written with one checkpoint (--checkpoint-every 1000), the rolled-forward steps' router_score_bias
   removed from their state.json and model.moe.score_bias_update {"rule": "sign_centred", "rate": RATE} added:
   every rolled-forward step replays with source "derived" and a bias exactly (fp32) equal to torchtitan's rule
   applied to the step before's bias and that step's own expert_tokens from the report. The check can fail:
   the rule without the mean subtracted (DeepSeek-V3's paper) or with the sign flipped differs. The derived bias
   is what the step replays with: its loss differs from the replay with the logged (made-up) bias.
   The same with "rule": "sign": equal to the uncentred rule, not to the centred one.
3. The logged biases kept and the key added: source "logged", and router_score_bias_derived_gap equal to the
   largest |reference derived - logged|. report.md says which steps were derived, and that the logged differ.
4. --nproc 2, --nproc 2 --split layers (the preset has one rank: both share out the layers, at other
   boundaries) and --stream give the same router_logit_max, expert_tokens, biases and losses.
5. Refusals (exit 2, one line): the stripped window without the key (state.json's router_score_bias[...],
   naming model.moe.score_bias_update); a bad rule and a rate of 0 (manifest.json's key); the key with
   router_score_bias false.
6. minimize of a rolled-forward incident (fp16, layer 2's experts a parameter group at lr 1000 on the second
   step, so they overflow at the third, derived, step) writes that step with the bias it replayed with in its
   state.json, and the minimized bundle names the same origin; bisect names run's origin.

    /usr/bin/python3 tests/py/test_router_score_bias.py --cli build/nanreplay --work DIR
"""
import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import family_support as fs  # noqa: E402
import reference_model  # noqa: E402
import synth_cache  # noqa: E402
import test_family_deepseek_moe as ds  # noqa: E402
import test_family_deepseek_mla as mla  # noqa: E402

PRESET = "clean-deepseek-moe"
RATE = 0.001
WINDOW = 4  # steps replayed of the rolled-forward window (the first has the checkpoint)


def torchtitan_update(bias, tokens, coeff, centred=True, flip=False):
    """torchtitan/components/optimizer/optimizer.py, register_moe_load_balancing_hook's _update_expert_bias
    (commit b5bcd76c66d0acb1a08b176d9639425bc55e0b2a), for one layer: tokens_per_expert_E .float(),
    expert_bias_delta_E = load_balance_coeff * torch.sign(tokens.mean() - tokens), minus its mean,
    expert_bias_E.add_(delta) on the fp32 buffer. centred=False: the DeepSeek-V3 paper's rule."""
    tokens_per_expert_E = torch.tensor(tokens).float()
    expert_bias_delta_E = coeff * torch.sign(tokens_per_expert_E.mean() - tokens_per_expert_E)
    if flip:
        expert_bias_delta_E = -expert_bias_delta_E
    if centred:
        expert_bias_delta_E = expert_bias_delta_E - expert_bias_delta_E.mean()
    expert_bias_E = torch.tensor(bias, dtype=torch.float64).float()
    expert_bias_E.add_(expert_bias_delta_E)
    return expert_bias_E.double().tolist()


def run(cli, bundle, out, *flags):
    r = subprocess.run([cli, "run", str(bundle), "--out", str(out), "--json", *map(str, flags)],
                       capture_output=True, text=True)
    try:
        report = json.loads(r.stdout)
    except ValueError:
        report = None
    return r.returncode, report, r.stderr


def reference_router(bundle, step, state):
    """(per MoE layer: max router logit per expert, max sigmoid score per expert, tokens per expert) of `step`."""
    m = bundle.manifest["model"]
    model = ds.build(mla.config_of_manifest(m), m["moe"], m["num_layers"])
    dirs = {e["step"]: e["dir"] for e in bundle.manifest["steps"]}
    weights = reference_model.read_safetensors(bundle.root / dirs[step] / "model.safetensors")
    with torch.no_grad():
        for k, p in ds.named(model):
            p.copy_(weights.pop(k))
    ds.set_bias(model, state["router_score_bias"])
    logits, scores, tokens = {}, {}, {}
    for i, moe in ds.moes(model):
        gate, forward = moe.gate, moe.gate.forward

        def capture(hidden_states, i=i, gate=gate, forward=forward):
            indices, weights_ = forward(hidden_states)
            # DeepseekV3TopkRouter.forward's router_logits (fp32 bundle: no rounding).
            raw = F.linear(hidden_states.view(-1, gate.hidden_size).float(), gate.weight.float())
            fold = (lambda d, v: torch.maximum(d[i], v) if i in d else v)
            logits[i] = fold(logits, raw.amax(0))
            scores[i] = fold(scores, raw.sigmoid().amax(0))
            count = torch.bincount(indices.reshape(-1), minlength=gate.n_routed_experts)
            tokens[i] = tokens[i] + count if i in tokens else count
            return indices, weights_
        gate.forward = capture
    d = bundle.manifest["data"]
    ids = bundle.samples(step)[0]
    mbs = d["micro_batch_size"]
    with torch.no_grad():
        for micro in range(d.get("grad_accum_steps", 1)):
            model(*bundle.batch(ids[micro * mbs:(micro + 1) * mbs]))
    return logits, scores, tokens


def check_first_step(cli, work):
    """1."""
    bundle_dir = work / PRESET
    synth_cache.synth(cli, PRESET, bundle_dir)
    bundle = reference_model.Bundle(bundle_dir)
    first = bundle.manifest["steps"][0]
    fs.check(bundle.manifest["data"].get("world_size", 1) == 1, f"{PRESET}: one rank")
    rc, report, err = run(cli, bundle_dir, work / "out-first", "--steps", first["step"])
    if not fs.check(report is not None and rc == 0, f"{PRESET} replays (exit {rc}; {err.strip()[-300:]})"):
        return
    row = report["steps"][0]
    state = json.loads((bundle.root / first["dir"] / "state.json").read_text())
    logits, scores, tokens = reference_router(bundle, first["step"], state)
    got = row.get("router_logit_max")
    if not fs.check(got is not None and len(got) == bundle.manifest["model"]["num_layers"],
                    f"router_logit_max: one row per layer ({got!r:.200})"):
        return
    fs.check(got[0] is None, "router_logit_max: null for the dense layer 0")
    worst, worst_scores = 0.0, 0.0
    for i in logits:
        for e in range(len(got[i])):
            worst = max(worst, fs.rel_err(got[i][e], float(logits[i][e])))
            worst_scores = max(worst_scores, fs.rel_err(got[i][e], float(scores[i][e])))
    fs.check(worst <= fs.TOLERANCE, f"router_logit_max within {fs.TOLERANCE} of the reference (worst {worst:.3g})")
    fs.check(worst_scores > 10 * fs.TOLERANCE,
             f"the check can fail: the maxima after the sigmoid depart (worst {worst_scores:.3g})")
    for i in tokens:
        fs.check(row["expert_tokens"][i] == tokens[i].tolist(),
                 f"expert_tokens of layer {i}: {row['expert_tokens'][i]} vs the reference's {tokens[i].tolist()}")
    fs.check(not any(row["expert_tokens"][0]), "expert_tokens: zeros for the dense layer 0")
    logged = {str(i): state["router_score_bias"][ds.bias_key(i)] for i in logits}
    fs.check(row.get("router_score_bias") == logged and row.get("router_score_bias_source") == "logged"
             and row.get("router_score_bias_derived_gap", 0) is None,
             f"router_score_bias is state.json's, logged, no gap ({row.get('router_score_bias_source')!r})")
    print(f"router_logit_max within {worst:.3g} of the reference; expert_tokens and router_score_bias equal")


def rolled_bundle(cli, work, name, update=None, strip=True):
    """The preset with one checkpoint; `update`: model.moe.score_bias_update; `strip`: the rolled-forward steps'
    state.json without router_score_bias. Returns (bundle dir, the window's steps, the logged biases by step)."""
    base = work / "rolled-base"
    if not base.exists():
        synth_cache.synth(cli, PRESET, base, "--checkpoint-every", "1000")
    root = work / name
    if root.exists():
        shutil.rmtree(root)
    shutil.copytree(base, root)
    manifest = json.loads((root / "manifest.json").read_text())
    if update is not None:
        manifest["model"]["moe"]["score_bias_update"] = update
    (root / "manifest.json").write_text(json.dumps(manifest, indent=1))
    logged = {}
    steps = [e for e in manifest["steps"]][:WINDOW]
    for e in manifest["steps"]:
        path = root / e["dir"] / "state.json"
        state = json.loads(path.read_text())
        logged[e["step"]] = state.get("router_score_bias")
        if strip and not (root / e["dir"] / "model.safetensors").exists():
            state.pop("router_score_bias", None)
            path.write_text(json.dumps(state))
    return root, [e["step"] for e in steps], logged


def expected_biases(report, rule, rate, flip=False):
    """By step after the first: the reference's bias from the step before's reported bias and expert_tokens."""
    rows = report["steps"]
    return {row["step"]: {layer: torchtitan_update(values, before["expert_tokens"][int(layer)], rate,
                                                   centred=rule == "sign_centred", flip=flip)
                          for layer, values in before["router_score_bias"].items()}
            for before, row in zip(rows, rows[1:])}


def check_derived(cli, work):
    """2 and 3."""
    update = {"rule": "sign_centred", "rate": RATE}
    root, window, logged = rolled_bundle(cli, work, "derived", update)
    steps_flag = f"{window[0]}-{window[-1]}"
    rc, report, err = run(cli, root, work / "out-derived", "--steps", steps_flag)
    if not fs.check(report is not None and [r["step"] for r in report["steps"]] == window,
                    f"the rolled-forward window {window} replays with derived biases (exit {rc}; {err.strip()[-300:]})"):
        return None
    rows = report["steps"]
    fs.check([r["params"] for r in rows] == ["checkpoint"] + ["derived"] * (len(rows) - 1)
             and [r.get("router_score_bias_source") for r in rows] == ["logged"] + ["derived"] * (len(rows) - 1),
             f"the first step's bias is logged, the others derived "
             f"({[r.get('router_score_bias_source') for r in rows]})")
    expected = expected_biases(report, update["rule"], RATE)
    exact = all(rows[i]["router_score_bias"] == expected[rows[i]["step"]] for i in range(1, len(rows)))
    fs.check(exact, "every derived bias equals torchtitan's rule on the step before's bias and expert_tokens (fp32, "
                    "exactly)")
    md = (work / "out-derived" / "report.md").read_text()
    fs.check("## Router correction bias" in md and f"at steps {', '.join(map(str, window[1:]))};" in md,
             "report.md names the steps whose bias was derived")
    for label, rule, flip in (("without the mean subtracted (DeepSeek-V3's paper)", "sign", False),
                              ("with the sign flipped", "sign_centred", True)):
        other = expected_biases(report, rule, RATE, flip)
        differs = any(rows[i]["router_score_bias"] != other[rows[i]["step"]] for i in range(1, len(rows)))
        fs.check(differs, f"the check can fail: the rule {label} gives other biases")
    # The derived bias is what the step replays with.
    kept_root, _, _ = rolled_bundle(cli, work, "logged-kept", update, strip=False)
    rc, kept, err = run(cli, kept_root, work / "out-logged-kept", "--steps", steps_flag)
    if fs.check(kept is not None, f"the window with its logged biases and the key replays (exit {rc}; {err[-300:]})"):
        fs.check(any(a["loss"] != b["loss"] for a, b in zip(rows[1:], kept["steps"][1:])),
                 "a derived step replays with its derived bias: its loss differs from the logged bias's")
        krows = kept["steps"]
        fs.check(all(r.get("router_score_bias_source") == "logged" for r in krows),
                 "with both, each step replays with its logged bias")
        kexpected = expected_biases(kept, update["rule"], RATE)
        gaps_ok = krows[0].get("router_score_bias_derived_gap", 0) is None
        for r in krows[1:]:
            gap = max(abs(a - b) for layer, values in kexpected[r["step"]].items()
                      for a, b in zip(values, logged[r["step"]][ds.bias_key(int(layer))]))
            gaps_ok = gaps_ok and r.get("router_score_bias_derived_gap") == gap and gap > 0
        md = (work / "out-logged-kept" / "report.md").read_text()
        fs.check("differs from the logged one by up to" in md, "report.md says the logged biases differ from the rule's")
        fs.check(gaps_ok, "router_score_bias_derived_gap is max |derived - logged| on every rolled-forward step "
                          f"({[r.get('router_score_bias_derived_gap') for r in krows]})")
    # The paper's rule by name.
    sign_root, _, _ = rolled_bundle(cli, work, "derived-sign", {"rule": "sign", "rate": RATE})
    rc, sign, err = run(cli, sign_root, work / "out-derived-sign", "--steps", steps_flag)
    if fs.check(sign is not None, f"rule \"sign\" replays (exit {rc}; {err[-300:]})"):
        srows = sign["steps"]
        sexp = expected_biases(sign, "sign", RATE)
        fs.check(all(srows[i]["router_score_bias"] == sexp[srows[i]["step"]] for i in range(1, len(srows))),
                 "rule \"sign\": the derived biases equal the uncentred rule's exactly")
        cexp = expected_biases(sign, "sign_centred", RATE)
        fs.check(any(srows[i]["router_score_bias"] != cexp[srows[i]["step"]] for i in range(1, len(srows))),
                 "rule \"sign\" differs from \"sign_centred\"")
    print(f"derived biases equal torchtitan's rule over steps {window}")
    return root, steps_flag, report


ROUTER_KEYS = ("router_logit_max", "expert_tokens", "router_score_bias", "router_score_bias_source", "loss")


def check_processes(cli, work, root, steps_flag, reference):
    """4."""
    for flags in (["--nproc", "2"], ["--nproc", "2", "--split", "layers"], ["--stream"]):
        label = " ".join(flags)
        scratch = work / ("scratch" + label.replace(" ", "").replace("-", ""))
        scratch.mkdir(exist_ok=True)
        rc, got, err = run(cli, root, work / ("out" + label.replace(" ", "").replace("-", "")), "--steps", steps_flag,
                           "--scratch", scratch, *flags)
        if not fs.check(got is not None and rc == 0, f"{label}: replays (exit {rc}; {err.strip()[-300:]})"):
            continue
        differ = [(r["step"], k) for r, g in zip(reference["steps"], got["steps"]) for k in ROUTER_KEYS
                  if r.get(k) != g.get(k)]
        fs.check(not differ and len(got["steps"]) == len(reference["steps"]),
                 f"{label}: the same router keys and losses as one process ({differ[:4]})")


def check_refusals(cli, work):
    """5."""
    root, window, _ = rolled_bundle(cli, work, "no-key")
    rc, _, err = run(cli, root, work / "out-no-key", "--steps", f"{window[0]}-{window[1]}")
    fs.check_refused(rc, err, "a rolled-forward step without its bias and no score_bias_update", "state.json",
                     "router_score_bias[", "model.moe.score_bias_update")
    for i, (update, key) in enumerate(((({"rule": "bogus", "rate": RATE}), "model.moe.score_bias_update.rule"),
                                       ({"rule": "sign", "rate": 0}, "model.moe.score_bias_update.rate"),
                                       ({"rule": "sign"}, "model.moe.score_bias_update.rate"),
                                       ({"rule": "sign", "rate": RATE, "every": 2}, "model.moe.score_bias_update.every"))):
        root, window, _ = rolled_bundle(cli, work, f"bad-{i}", update)
        rc, _, err = run(cli, root, work / f"out-bad-{i}", "--steps", window[0])
        fs.check_refused(rc, err, f"score_bias_update {update}", "manifest.json", key)
    root, window, _ = rolled_bundle(cli, work, "bad-no-bias", {"rule": "sign", "rate": RATE})
    manifest = json.loads((root / "manifest.json").read_text())
    manifest["model"]["moe"]["router_score_bias"] = False
    (root / "manifest.json").write_text(json.dumps(manifest))
    rc, _, err = run(cli, root, work / "out-bad-no-bias", "--steps", window[0])
    fs.check_refused(rc, err, "score_bias_update without a bias", "manifest.json", "model.moe.score_bias_update")


def check_minimize(cli, work):
    """6."""
    root, _, _ = rolled_bundle(cli, work, "incident", {"rule": "sign_centred", "rate": RATE})
    manifest = json.loads((root / "manifest.json").read_text())
    manifest["precision"]["compute"] = "fp16"
    manifest["optimizer"]["groups"] = [{"name": "hot", "params": ["model.layers.2.mlp.experts.*"]}]
    (root / "manifest.json").write_text(json.dumps(manifest))
    blown = manifest["steps"][1]["step"]
    for e in manifest["steps"]:
        path = root / e["dir"] / "state.json"
        state = json.loads(path.read_text())
        state["lr"] = {"default": state["lr"], "hot": 1000.0 if e["step"] == blown else state["lr"]}
        path.write_text(json.dumps(state))
    rc, report, err = run(cli, root, work / "out-incident")
    first = (report or {}).get("first_nonfinite") or {}
    if not fs.check(rc == 1 and first.get("layer") == 2 and first.get("step") == blown + 1,
                    f"the incident: layer 2's experts overflow at the derived step {blown + 1} (exit {rc}; "
                    f"{first.get('step')} {first.get('site')}; {err.strip()[-200:]})"):
        return
    b = subprocess.run([cli, "bisect", str(root), "--json"], capture_output=True, text=True)
    origin = json.loads(b.stdout).get("origin") or {} if b.stdout.strip() else {}
    fs.check(b.returncode == 1 and (origin.get("step"), origin.get("site")) == (first["step"], first["site"]),
             f"bisect, walking the derived biases in order, names run's origin ({origin.get('step')} "
             f"{origin.get('site')}; exit {b.returncode}; {b.stderr.strip()[-200:]})")
    r = subprocess.run([cli, "minimize", str(root), "--out", str(work / "incident-min"), "--json"],
                       capture_output=True, text=True)
    kept = sorted(int(p.name) for p in (work / "incident-min" / "steps").iterdir()) if r.returncode == 0 else []
    if not fs.check(blown + 1 in kept, f"minimize keeps the derived step {blown + 1} ({kept}; {r.stderr[-200:]})"):
        return
    state = json.loads((work / "incident-min" / "steps" / str(blown + 1) / "state.json").read_text())
    written = {name.split(".")[2]: v for name, v in state.get("router_score_bias", {}).items()}
    replayed = next(s for s in report["steps"] if s["step"] == blown + 1)["router_score_bias"]
    fs.check(written == replayed, "minimize writes the derived step with the bias it replayed with, logged")
    rc, again, err = run(cli, work / "incident-min", work / "out-incident-min")
    again_first = (again or {}).get("first_nonfinite") or {}
    fs.check(rc == 1 and (again_first.get("step"), again_first.get("site")) == (first["step"], first["site"]),
             f"the minimized bundle names the same origin (exit {rc}; {err.strip()[-200:]})")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cli", required=True)
    ap.add_argument("--work", required=True)
    args = ap.parse_args()
    work = Path(args.work)
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    check_first_step(args.cli, work)
    derived = check_derived(args.cli, work)
    if derived is not None:
        check_processes(args.cli, work, *derived)
        check_minimize(args.cli, work)
    check_refusals(args.cli, work)
    fs.finish()


if __name__ == "__main__":
    main()
