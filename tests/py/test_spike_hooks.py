"""Cross-check of the spike localisation (docs/spikes.md) against PyTorch forward hooks.

`nanreplay synth spike-token` writes a bundle whose last step's batch holds a sample that spikes the loss
without going non-finite; `spike-logit-growth` one whose head 2 of layer 1 has query-key logits that grow
step by step until the loss spikes. Here a plain nn.Module llama (torch_models.py) loads each step's
checkpoint, runs every micro-batch of the step with forward hooks on the embedding, every decoder layer
and the final norm, and on each attention's q_proj and k_proj (from whose outputs, rotated as the module
rotates them, each head's scores q k^T / sqrt(D) over the visible keys are taken), and records each hooked
tensor's max |x| and rms per step (max over micro-batches, rms pooled), and the (micro-batch, sample,
position) of its largest element. The spike rule of docs/spikes.md, written here from that page (robust
z-score of the log change beyond the median change of the steps before, and the factor above both that
trend and the step before), must flag the same step and the same first site (and head) in execution order
as `nanreplay run`'s report.json `spike`, with the same sample, position and micro-batch; the replayed
losses must match the eager ones to 1e-5, and report.json's `head_logit_growth` each listed head's largest
logit per step to 1e-4.

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


def site_keys(model):
    """(site name, head) in execution order: each layer's attn.scores per head between attn_norm and attn.out."""
    keys = []
    for name, _ in hooked_sites(model):
        if name.endswith(".attn.out"):
            attn = model.model.layers[int(name.split(".")[1])].self_attn
            keys += [(name.replace("attn.out", "attn.scores"), h) for h in range(attn.heads)]
        keys.append((name, None))
    return keys


def scores_hooks(model, record):
    """Forward hooks on every attention's q_proj and k_proj: each head's |scores| over the visible keys."""
    handles = []
    for i, layer in enumerate(model.model.layers):
        attn, held = layer.self_attn, {}

        def keep_q(_module, _inputs, output, held=held):
            held["q"] = output.detach()

        def on_k(_module, _inputs, output, held=held, attn=attn, i=i):
            B, T, _ = output.shape
            H, G, D = attn.heads, attn.kv_heads, attn.head_dim
            q = torch_models.rotate_half_rope(held["q"].view(B, T, H, D).transpose(1, 2), attn.theta)
            k = torch_models.rotate_half_rope(output.detach().view(B, T, G, D).transpose(1, 2), attn.theta)
            scores = (q @ k.repeat_interleave(H // G, 1).transpose(-2, -1) / math.sqrt(D)).abs()
            hidden = torch.triu(torch.ones(T, T, dtype=torch.bool), 1)
            for h in range(H):
                record((f"layers.{i}.attn.scores", h), scores[:, h].masked_fill(hidden, 0.0), B * T * (T + 1) // 2)

        handles += [attn.q_proj.register_forward_hook(keep_q), attn.k_proj.register_forward_hook(on_k)]
    return handles


def step_statistics(bundle, model, step):
    """Per site key: max |x|, pooled rms, and the micro-batch / sample / position of the largest |x| per micro-batch."""
    d = bundle.manifest["data"]
    mbs, accum = d["micro_batch_size"], d.get("grad_accum_steps", 1)
    ids = bundle.samples(step)[0]  # rank 0 (the presets here have one rank)
    stats = {key: {"max_abs": 0.0, "sum_sq": 0.0, "count": 0, "where": []} for key in site_keys(model)}
    current = {}

    def record(key, x, count):
        """x: |tensor| as (B, T, ...), zero where not counted."""
        s = stats[key]
        flat = int(torch.argmax(x))
        row = x[0].numel()
        b, t = flat // row, (flat // (row // x.shape[1])) % x.shape[1]
        s["where"].append((float(x.max()), current["micro"], current["rows"][b], t))
        s["max_abs"] = max(s["max_abs"], float(x.max()))
        s["sum_sq"] += float((x.double() ** 2).sum())
        s["count"] += count

    def hook(name):
        def on_output(_module, _inputs, output):
            x = (output[0] if isinstance(output, tuple) else output).detach().abs()
            record((name, None), x, x.numel())
        return on_output

    handles = [module.register_forward_hook(hook(name)) for name, module in hooked_sites(model)]
    handles += scores_hooks(model, record)
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
    """The first (step, site, head, micro-batch, sample, position, statistic) that leaves its trajectory,
    the losses, and each head's largest |score| per step."""
    bundle = reference_model.Bundle(bundle_dir)
    cfg = dict(bundle.manifest["model"])
    model = torch_models.LlamaForCausalLM(cfg)
    history, losses, head_logits, found = {}, {}, {}, None
    for entry in bundle.manifest["steps"]:
        step = entry["step"]
        weights = reference_model.read_safetensors(Path(bundle_dir) / entry["dir"] / "model.safetensors")
        if cfg.get("tie_embeddings"):
            weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
        model.load_state_dict(weights)
        stats, losses[step] = step_statistics(bundle, model, step)
        for key in site_keys(model):
            s = stats[key]
            if key[1] is not None:
                head_logits.setdefault(key, []).append(s["max_abs"])
            rms = math.sqrt(s["sum_sq"] / s["count"])
            # At one place, the statistic with the larger score (docs/spikes.md).
            judged = [(deviation([p[statistic] for p in history.get(key, [])], value), statistic)
                      for statistic, value in (("max_abs", s["max_abs"]), ("rms", rms))]
            judged.sort(key=lambda j: -j[0][0] if j[0] else math.inf)
            for d, statistic in judged:
                if found is None and d and d[0] >= SITE_ZSCORE and d[1] >= SITE_RATIO:
                    # The earliest micro-batch whose own largest value leaves the trajectory (execution order).
                    for largest, micro, sample, position in s["where"]:
                        own = deviation([p[statistic] for p in history[key]], largest if statistic == "max_abs" else rms)
                        if own and own[0] >= SITE_ZSCORE and own[1] >= SITE_RATIO:
                            found = {"step": step, "site": key[0], "head": key[1], "micro_batch": micro,
                                     "sample": sample, "position": position, "statistic": statistic}
                            break
            history.setdefault(key, []).append({"max_abs": s["max_abs"], "rms": rms})
        if found is not None:
            return found, losses, head_logits
    return None, losses, head_logits


def check_preset(cli, work, preset):
    bundle = work / preset
    if not bundle.exists():
        subprocess.run([cli, "synth", preset, str(bundle)], check=True, capture_output=True)
    run = subprocess.run([cli, "run", str(bundle), "--out", str(work / f"out-{preset}"), "--json"],
                         capture_output=True, text=True)
    assert run.returncode == 1, f"{preset}: run exited {run.returncode}: {run.stderr}"
    report = json.loads(run.stdout)
    spike = report["spike"]
    assert spike and spike["reproduced"], f"{preset}: nanreplay reproduces no spike: {spike}"
    eager, losses, head_logits = eager_spike(bundle)
    assert eager is not None, f"{preset}: the hooks find no site that leaves its trajectory"
    for step in report["steps"]:
        err = abs(step["loss"] - losses[step["step"]]) / abs(losses[step["step"]])
        assert err < 1e-5, f"{preset} step {step['step']}: replayed loss {step['loss']} vs eager {losses[step['step']]}"
    for key in ("step", "site", "head", "micro_batch", "sample", "position", "statistic"):
        assert spike[key] == eager[key], f"{preset} {key}: nanreplay {spike[key]!r}, hooks {eager[key]!r} ({spike} vs {eager})"
    growth = report["head_logit_growth"]
    assert growth and growth["steps"] == [s["step"] for s in report["steps"]], f"{preset}: head_logit_growth {growth}"
    for head in growth["heads"]:
        eager_series = head_logits[(f"layers.{head['layer']}.attn.scores", head["head"])]
        for ours, theirs in zip(head["max_logit"], eager_series, strict=True):
            assert abs(ours - theirs) <= 1e-4 * theirs, f"{preset} {head}: eager {eager_series}"
    print(f"ok: {preset}: spike at step {eager['step']} {eager['site']} head {eager['head']} "
          f"sample {eager['sample']} position {eager['position']}")
    return report


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cli", required=True)
    ap.add_argument("--work", required=True)
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    check_preset(args.cli, work, "spike-token")
    report = check_preset(args.cli, work, "spike-logit-growth")
    mechanism = report["spike_check"]["mechanism"]
    assert mechanism and mechanism["name"] == "attention_logit_growth", f"no mechanism: {mechanism}"
    assert (mechanism["layer"], mechanism["head"]) == (report["spike"]["layer"], report["spike"]["head"])


if __name__ == "__main__":
    main()
