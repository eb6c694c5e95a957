"""Cross-check of the spike localisation (docs/spikes.md) against PyTorch forward hooks.

`nanreplay synth spike-token` writes a bundle whose last step's batch holds a sample that spikes the loss
without going non-finite. Here a plain nn.Module llama (torch_models.py) loads each step's checkpoint, runs
every micro-batch of the step with forward hooks on the embedding, every decoder layer and the final norm,
and records each hooked tensor's max |x| and rms per step (max over micro-batches, rms pooled), and the
(micro-batch, sample, position) of its largest element. The spike rule of docs/spikes.md, written here from
that page (robust z-score of the log change beyond the median change of the steps before, and the factor
above both that trend and the step before), must flag the
same step and the same first site in execution order as `nanreplay run`'s report.json `spike`, with the same
sample, position and micro-batch; the replayed losses must match the eager ones to 1e-5.

Run by CTest with Debian's /usr/bin/python3 (python3-torch).
"""
import argparse
import json
import math
import statistics
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import reference_model  # noqa: E402
import torch_models  # noqa: E402

SITE_ZSCORE, SITE_RATIO, MIN_LOG_SCALE, MIN_HISTORY = 6.0, 3.0, 0.05, 1


def deviation(before, value):
    """(score, ratio) of `value` against the log changes of `before`, or None (docs/spikes.md)."""
    logs = [math.log(v) for v in before if math.isfinite(v) and v > 0]
    if not (math.isfinite(value) and value > 0) or len(logs) < MIN_HISTORY + 1:
        return None
    changes = [b - a for a, b in zip(logs, logs[1:])]
    trend = statistics.median(changes)
    spread = max(1.4826 * statistics.median([abs(c - trend) for c in changes]), MIN_LOG_SCALE)
    beyond = math.log(value) - logs[-1] - trend
    return beyond / spread, math.exp(min(beyond, math.log(value) - logs[-1]))


def hooked_sites(model):
    """(site name, module) in forward order: the hooked modules' outputs are these sites."""
    sites = [("embed", model.model.embed_tokens)]
    for i, layer in enumerate(model.model.layers):
        sites += [(f"layers.{i}.attn_norm", layer.input_layernorm), (f"layers.{i}.attn.out", layer.self_attn),
                  (f"layers.{i}.mlp_norm", layer.post_attention_layernorm), (f"layers.{i}.mlp.down", layer.mlp),
                  (f"layers.{i}.output", layer)]
    return sites + [("final_norm", model.model.norm), ("logits", model.lm_head)]


def step_statistics(bundle, model, step):
    """Per site: max |x|, pooled rms, and the micro-batch / sample / position of the largest |x| per micro-batch."""
    d = bundle.manifest["data"]
    mbs, accum = d["micro_batch_size"], d.get("grad_accum_steps", 1)
    ids = bundle.samples(step)[0]  # rank 0 (the presets here have one rank)
    names = [name for name, _ in hooked_sites(model)]
    stats = {name: {"max_abs": 0.0, "sum_sq": 0.0, "count": 0, "where": []} for name in names}
    current = {}

    def hook(name):
        def record(_module, _inputs, output):
            x = (output[0] if isinstance(output, tuple) else output).detach().abs()
            s = stats[name]
            flat = int(torch.argmax(x))
            b, t = flat // (x.shape[1] * x.shape[2]), (flat // x.shape[2]) % x.shape[1]
            s["where"].append((float(x.max()), current["micro"], current["rows"][b], t))
            s["max_abs"] = max(s["max_abs"], float(x.max()))
            s["sum_sq"] += float((x.double() ** 2).sum())
            s["count"] += x.numel()
        return record

    handles = [module.register_forward_hook(hook(name)) for name, module in hooked_sites(model)]
    losses = []
    with torch.no_grad():
        for micro in range(accum):
            rows = ids[micro * mbs:(micro + 1) * mbs]
            current.update(micro=micro, rows=rows)
            inputs, targets = bundle.batch(rows)
            losses.append(float(model(inputs, targets)))
    for h in handles:
        h.remove()
    return stats, sum(losses) / len(losses)


def eager_spike(bundle_dir):
    """The first (step, site, micro-batch, sample, position, statistic) that leaves its trajectory, and the losses."""
    bundle = reference_model.Bundle(bundle_dir)
    cfg = dict(bundle.manifest["model"])
    model = torch_models.LlamaForCausalLM(cfg)
    history, losses = {}, {}
    for entry in bundle.manifest["steps"]:
        step = entry["step"]
        weights = reference_model.read_safetensors(Path(bundle_dir) / entry["dir"] / "model.safetensors")
        if cfg.get("tie_embeddings"):
            weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
        model.load_state_dict(weights)
        stats, losses[step] = step_statistics(bundle, model, step)
        for name, _ in hooked_sites(model):
            s = stats[name]
            rms = math.sqrt(s["sum_sq"] / s["count"])
            for statistic, value in (("max_abs", s["max_abs"]), ("rms", rms)):
                d = deviation([p[statistic] for p in history.get(name, [])], value)
                if d and d[0] >= SITE_ZSCORE and d[1] >= SITE_RATIO:
                    # The earliest micro-batch whose own largest value leaves the trajectory (execution order).
                    for largest, micro, sample, position in s["where"]:
                        own = deviation([p[statistic] for p in history[name]], largest if statistic == "max_abs" else rms)
                        if own and own[0] >= SITE_ZSCORE and own[1] >= SITE_RATIO:
                            return {"step": step, "site": name, "micro_batch": micro, "sample": sample,
                                    "position": position, "statistic": statistic}, losses
            history.setdefault(name, []).append({"max_abs": s["max_abs"], "rms": rms})
    return None, losses


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cli", required=True)
    ap.add_argument("--work", required=True)
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    bundle = work / "spike-token"
    if not bundle.exists():
        subprocess.run([args.cli, "synth", "spike-token", str(bundle)], check=True, capture_output=True)
    run = subprocess.run([args.cli, "run", str(bundle), "--out", str(work / "out"), "--json"],
                         capture_output=True, text=True)
    assert run.returncode == 1, f"run exited {run.returncode}: {run.stderr}"
    report = json.loads(run.stdout)
    spike = report["spike"]
    assert spike and spike["reproduced"], f"nanreplay reproduces no spike: {spike}"
    eager, losses = eager_spike(bundle)
    assert eager is not None, "the hooks find no site that leaves its trajectory"
    for step in report["steps"]:
        err = abs(step["loss"] - losses[step["step"]]) / abs(losses[step["step"]])
        assert err < 1e-5, f"step {step['step']}: replayed loss {step['loss']} vs eager {losses[step['step']]}"
    for key in ("step", "site", "micro_batch", "sample", "position", "statistic"):
        assert spike[key] == eager[key], f"{key}: nanreplay {spike[key]!r}, hooks {eager[key]!r} ({spike} vs {eager})"
    print(f"ok: spike at step {eager['step']} {eager['site']} sample {eager['sample']} position {eager['position']}")


if __name__ == "__main__":
    main()
