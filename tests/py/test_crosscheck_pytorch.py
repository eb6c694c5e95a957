"""Cross-check: nanreplay's replayed loss and gradient norm of every step equal
what an independent eager PyTorch implementation (reference_model.py) computes
on the same weights and batch, to a relative error of 1e-5 in fp32. In bf16 the
reference emulates the bundle format's autocast rounding (docs/bundle-format.md) itself; losses must agree to
1e-5 as well, gradient norms to 1e-4 (autograd may sum a site's incoming
gradients in another order, and one bf16 rounding flip moves the norm ~1e-6).
"PRESET@bf16" replays a synthetic preset's weights with the manifest's
precision switched to bf16. Rolled-forward windows (one checkpoint, every
later step derived) are checked against torch.optim.AdamW stepping the same
model: losses within 1e-5 relative. clean-olmo2 is OLMo 2's post-norm block (reference_model's norm_layout
"post", transcribed from transformers' modeling_olmo2.py). clean-moe (llama with model.moe, Hugging Face Qwen3-MoE's routing
and router losses: reference_model.moe_mlp) is checked in fp32, bf16 and rolled forward.

Bundles come from `nanreplay synth`; the report from `nanreplay run --json`, which `run --stream` (the
layer-streamed replay) must give again, all but its timings, on every one of these bundles.
Run by CTest with Debian's /usr/bin/python3 (python3-torch).
"""
import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import reference_model  # noqa: E402
import synth_cache  # noqa: E402

# The llama family's options (clean-qwen2 ... clean-llama3) in fp32 and bf16.
OPTION_PRESETS = ["clean-qwen2", "clean-qwen3", "clean-olmo2", "clean-gemma2", "clean-llama3", "clean-combined"]
# clean-moe: llama with model.moe (4 experts, top 2, renormalised, aux 0.01, z 0.001), Qwen3-MoE's routing.
PRESETS = (["clean-fp32", "clean-dp", "clean-gqa", "clean-gpt2", "clean-bf16", "clean-gpt2@bf16"]
           + OPTION_PRESETS + [p + "@bf16" for p in OPTION_PRESETS] + ["clean-moe", "clean-moe@bf16"])
# Rolled forward from the first step's checkpoint: nanreplay's own update
# against torch.optim.AdamW and clip_grad_norm_ applied by PyTorch itself.
ROLLED_PRESETS = ["clean-fp32", "clean-gpt2", "clean-dp", "clean-combined", "clean-moe"]
ROLLED_TOLERANCE = 1e-5
VOLATILE = ("timings", "elapsed_seconds")
TOLERANCE = {"fp32": {"loss": 1e-5, "grad_norm": 1e-5}, "bf16": {"loss": 1e-5, "grad_norm": 1e-4}}


def rel_err(a, b):
    return abs(a - b) / max(abs(b), 1e-12)


def replay(cli, bundle_dir, out):
    """`run --json` in memory, then layer by layer: (exit status, report, stderr, what the streamed run changed)."""
    run = subprocess.run([cli, "run", str(bundle_dir), "--out", str(out), "--json"], capture_output=True, text=True)
    if run.returncode != 0:
        return run.returncode, None, run.stderr, []
    streamed = subprocess.run([cli, "run", str(bundle_dir), "--out", str(out) + "-stream", "--json", "--stream",
                               "--scratch", str(out.parent)], capture_output=True, text=True)
    report = json.loads(run.stdout)
    if streamed.returncode != 0:
        return 0, report, streamed.stderr, ["exit status " + str(streamed.returncode)]
    other = json.loads(streamed.stdout)
    differ = [k for k in set(report) | set(other) if k not in VOLATILE and report.get(k) != other.get(k)]
    return 0, report, "", differ


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cli", required=True)
    ap.add_argument("--work", required=True)
    args = ap.parse_args()
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    failures = 0
    checked = 0
    for preset in PRESETS:
        bundle_dir = work / preset
        synth, _, precision = preset.partition("@")
        synth_cache.synth(args.cli, synth, bundle_dir)
        if precision:
            manifest = json.loads((bundle_dir / "manifest.json").read_text())
            manifest["precision"] = {"compute": precision}
            (bundle_dir / "manifest.json").write_text(json.dumps(manifest, indent=2))
        status, report, stderr, streamed_differs = replay(args.cli, bundle_dir, work / (preset + "-out"))
        if status != 0:
            print(f"FAIL {preset}: nanreplay run exited {status}: {stderr}")
            failures += 1
            continue
        checked += 1
        failures += bool(streamed_differs)
        print(f"{'FAIL' if streamed_differs else 'ok  '} {preset}: run --stream gives the same report {streamed_differs}")
        bundle = reference_model.Bundle(bundle_dir)
        tolerance = TOLERANCE[bundle.manifest.get("precision", {}).get("compute", "fp32")]
        entries = {e["step"]: e["dir"] for e in bundle.manifest["steps"]}
        for row in report["steps"]:
            loss, norm, rank_losses, rank_norms = reference_model.replay_step(bundle, entries[row["step"]], row["step"])
            pairs = [("loss", row["loss"], loss), ("grad_norm", row["grad_norm"], norm)]
            pairs += [(f"rank_losses[{r}]", row["rank_losses"][r], v) for r, v in enumerate(rank_losses)]
            pairs += [(f"rank_grad_norms[{r}]", row["rank_grad_norms"][r], v) for r, v in enumerate(rank_norms)]
            for name, ours, theirs in pairs:
                checked += 1
                err = rel_err(ours, theirs)
                limit = tolerance["loss" if "loss" in name else "grad_norm"]
                status = "ok  " if err <= limit else "FAIL"
                if err > limit:
                    failures += 1
                print(f"{status} {preset} step {row['step']} {name}: nanreplay {ours:.9g} pytorch {theirs:.9g} rel err {err:.2e}")
    for preset in ROLLED_PRESETS:
        bundle_dir = work / (preset + "-rolled")
        synth_cache.synth(args.cli, preset, bundle_dir, "--checkpoint-every", "1000")
        status, report, stderr, streamed_differs = replay(args.cli, bundle_dir, work / (preset + "-rolled-out"))
        if status != 0:
            print(f"FAIL {preset} rolled: nanreplay run exited {status}: {stderr}")
            failures += 1
            continue
        checked += 1
        failures += bool(streamed_differs)
        print(f"{'FAIL' if streamed_differs else 'ok  '} {preset} rolled: run --stream gives the same report "
              f"{streamed_differs}")
        theirs = reference_model.train_window(reference_model.Bundle(bundle_dir))
        derived = [row["step"] for row in report["steps"] if row["params"] == "derived"]
        if len(derived) != len(report["steps"]) - 1:
            print(f"FAIL {preset} rolled: expected every step after the first derived, got {derived}")
            failures += 1
        for row in report["steps"]:
            checked += 1
            err = rel_err(row["loss"], theirs[row["step"]])
            status = "ok  " if err <= ROLLED_TOLERANCE else "FAIL"
            if err > ROLLED_TOLERANCE:
                failures += 1
            print(f"{status} {preset} rolled step {row['step']} ({row['params']}) loss: nanreplay {row['loss']:.9g} "
                  f"torch.optim.AdamW {theirs[row['step']]:.9g} rel err {err:.2e}")
    if checked == 0:
        print("FAIL: nothing was compared")
        return 1
    print(f"{checked - failures} passed, {failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
