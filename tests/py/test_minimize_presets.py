"""`nanreplay minimize` on the synthetic presets, through the CLI (docs/minimize.md): in CI the
representative set of preset_sweep.py, with --all every one.

Every preset `nanreplay synth --help` lists is classified below; one that is not fails the test, so a new
preset cannot be skipped silently. For each incident preset (a planted fault): synth, minimize --json, then
bisect --json on MIN (run --json for a flipped bit, which only run's update check names), asserting the same
origin (or the same flipped bit), the sample mapped back to its original index, and the size ratio. Presets
whose fault minimize has no cut for: exit 1, nothing written, and why. A few rolled-forward windows too.
Standard library only; the C++ test (tests/test_cli_minimize.cpp) keeps what needs no sweep.
"""
import argparse
import json
import shutil
import sys
import time
from pathlib import Path

from preset_sweep import add_all_flag, swept
import synth_cache

# A non-finite origin: MIN must be under this fraction of BUNDLE's bytes. One step of four to six, one sample,
# often fewer layers; bit-flip, rewritten-weights, mlp-overflow and olmo2-postnorm-overflow (an up_proj row, a norm
# gain edited outside the optimizer) keep two steps (the update into the checkpoint is the evidence).
ORIGIN = {
    "head-overflow": 0.1, "qwen2-head-overflow": 0.1, "gemma3-local-overflow": 0.1, "repeat-run": 0.1, "mlp-overflow": 0.4,
    "zero-embedding": 0.1, "poisoned-token": 0.1, "fp8-scale-collapse": 0.1, "mislabeled-rope": 0.1,
    "cascade": 0.1, "transient-fp16": 0.1, "router-overflow": 0.1, "expert-overflow": 0.1,
    "glitch-token": 0.1, "demo": 0.1, "bit-flip": 0.5, "rewritten-weights": 0.6,
    "gpt-oss-head-overflow": 0.1, "llama4-nope-overflow": 0.1, "olmo2-postnorm-overflow": 0.6,
    "olmo3-window-overflow": 0.1, "glm4-partial-rotary-overflow": 0.1, "qwen3-qknorm-overflow": 0.1,
}
# No origin, a flipped bit the update check names: the two steps around it (two of four checkpoints).
FLIP = {"silent-bit-flip": 0.5, "spike-bit-flip": 0.5}
# A planted fault whose error finding minimize has no cut for: exit 1, nothing written, the codes named.
NOT_MINIMIZED = {
    "token-out-of-range": ["DATA_TOKEN_OUT_OF_RANGE"],
    "sampler-mismatch": ["DATA_SAMPLER_MISMATCH"],
    "rank-mismatch": ["SYSTEM_RANK_MISMATCH"],
    "not-reproducible": ["SYSTEM_NOT_REPRODUCIBLE"],
    "checksum-mismatch": ["BUNDLE_CHECKSUM_MISMATCH"],
    "wrong-seed": ["BUNDLE_DOES_NOT_REPRODUCE"],
    "site-mismatch": ["SYSTEM_SITE_MISMATCH"],
}
# A planted fault that is only a warning or info (run exits 0): nothing to minimize.
NO_ERROR = ["low-entropy", "fp8-scale-jump", "loss-scale-overflow", "router-collapse"]
# A reproduced spike origin and nothing non-finite (docs/minimize.md, "A spike"): the spike's step and the
# healthy steps its trajectory needs. spike-token keeps one sample a step and layer 0; spike-bad-update
# (lm_head rewritten outside the optimizer) keeps those steps whole, with the optimizer state the update
# check reads. spike-bit-flip's spike does not reproduce: its verdict is the flipped bit (FLIP), and
# site-mismatch's SYSTEM_SITE_MISMATCH has no cut (NOT_MINIMIZED).
# spike-logit-growth's origin (layer 1's scores, head 2) is judged against a trend of growing weights.
SPIKE = {"spike-token": 0.3, "spike-bad-update": 0.8, "spike-logit-growth": 0.8}
SPIKE_KEYS = ("reproduced", "step", "phase", "site", "layer", "head", "expert", "position")
# No fault at all: not run here (tests/test_cli_minimize.cpp runs clean-fp32), but listed.
CLEAN = ["clean-fp32", "clean-bf16", "clean-fp16", "clean-dp", "clean-accum", "clean-gqa", "clean-qwen2",
         "clean-qwen3", "clean-olmo2", "clean-olmo3", "clean-phi3", "clean-glm4",
         "clean-gemma2", "clean-gemma3", "clean-llama3", "clean-combined", "clean-moe",
         "clean-moe-bf16", "clean-gpt2", "clean-site-stats", "clean-gpt-oss-attn", "clean-llama4-attn"]
# Issue 40's frontier mixtures of experts: GPT-OSS's experts (an activation overflow, and the clean model).
ORIGIN["gpt-oss-expert-overflow"] = 0.1
CLEAN += ["clean-gpt-oss-moe"]
# Issue 40's DeepSeek-V3 multi-head latent attention, fp32 and bf16.
CLEAN += ["clean-deepseek-mla", "clean-deepseek-mla-bf16"]
# Issue 40's Llama 4 mixture of experts: a dense layer, a routed one with a shared expert.
CLEAN += ["clean-llama4-moe"]
# Issue 40's DeepSeek-V3 mixture of experts: the grouped sigmoid router with a per-step correction bias.
CLEAN += ["clean-deepseek-moe"]
# Issue 40's incidents in them: one head of a latent-attention layer, one routed expert of a Llama 4 MoE layer.
ORIGIN["deepseek-mla-overflow"] = 0.1
ORIGIN["llama4-moe-overflow"] = 0.1
ORIGIN["deepseek-moe-overflow"] = 0.1  # one routed expert of the grouped sigmoid router
# Issue 40's finite expert outlier: a declared spike that does not reproduce, NUMERIC_EXPERT_OUTLIER_ACTIVATION
# a warning (run exits 0): nothing to minimize.
NO_ERROR += ["expert-spike"]
# Rolled forward (synth --checkpoint-every 10: one checkpoint, and the one a fault edits): fewer bytes to
# start with, so larger ratios.
ROLLED = {"head-overflow": 0.35, "cascade": 0.3, "bit-flip": 0.7, "silent-bit-flip": 0.7}

ORIGIN_KEYS = ("step", "phase", "site", "layer", "head", "expert", "kind", "position")
FLIP_KEYS = ("step", "param", "index", "bit")

failures = []
_started = time.perf_counter()


def check(ok, what):
    print(("ok   " if ok else "FAIL ") + what, flush=True)
    if not ok:
        failures.append(what)
    return ok


def cli_run(cli, *args):
    """`cli args...`, captured as text; a plain `synth` comes from the tests' cache (synth_cache.py)."""
    return synth_cache.run(cli, args)


def listed_presets(cli):
    """The preset names `nanreplay synth --help` prints, one per line after "presets:"."""
    text = cli_run(cli, "synth", "--help").stdout
    lines = text.split("presets:", 1)[1].splitlines() if "presets:" in text else []
    return [line.split()[0] for line in lines if line.strip()]


def json_or_none(text):
    try:
        return json.loads(text)
    except ValueError:
        return None


def synth(cli, preset, bundle, extra=()):
    proc = cli_run(cli, "synth", preset, bundle, *extra)
    return check(proc.returncode == 0, f"{preset}: synth {' '.join(extra)} {proc.stderr.strip()}")


def minimize(cli, label, bundle, out, expect_rc):
    proc = cli_run(cli, "minimize", bundle, "--out", out, "--json")
    report = json_or_none(proc.stdout)
    check(proc.returncode == expect_rc and report is not None,
          f"{label}: minimize exit {proc.returncode} (want {expect_rc}) {proc.stderr.strip()[-300:]}")
    return report


def original_of(manifest, sample):
    """The original index MIN's manifest records for its own sample `sample`."""
    for step in manifest["steps"]:
        for r, rows in enumerate(step["samples"]):
            if sample in rows:
                return step["original_samples"][r][rows.index(sample)]
    return None


def check_size(label, report, max_ratio):
    before, after = report["before"]["bytes"], report["after"]["bytes"]
    check(report["ratio"] < max_ratio and after < max_ratio * before,
          f"{label}: {before} -> {after} bytes, ratio {report['ratio']:.4f} < {max_ratio}")


def check_provenance(label, out, bundle):
    minimized = json.loads((out / "manifest.json").read_text()).get("minimized", {})
    check(minimized.get("from") == str(bundle.resolve()), f"{label}: manifest's minimized.from {minimized.get('from')}")


def check_origin(cli, label, bundle, out, max_ratio):
    report = minimize(cli, label, bundle, out, 0)  # MIN written: exit 0
    if report is None or not check(report["finding"] == "origin" and out.is_dir(), f"{label}: MIN written"):
        return None
    proc = cli_run(cli, "bisect", out, "--json", "--no-samples")
    after = (json_or_none(proc.stdout) or {}).get("origin")
    if not check(proc.returncode == 1 and after is not None, f"{label}: bisect on MIN exit {proc.returncode}"):
        return report
    before = report["origin"]
    diff = [k for k in ORIGIN_KEYS if before.get(k) != after.get(k)]
    check(not diff, f"{label}: bisect on MIN names the same origin {before['site']} step {before['step']} "
                    f"(differs in {diff})")
    check(report["origin_after"] == after, f"{label}: origin_after is what bisect on MIN names")
    if before["sample"] >= 0:
        manifest = json.loads((out / "manifest.json").read_text())
        mapped = original_of(manifest, after["sample"])
        check(mapped == report["original_sample"],
              f"{label}: MIN's sample {after['sample']} maps back to {mapped}, the original {report['original_sample']}")
    check_size(label, report, max_ratio)
    check_provenance(label, out, bundle)
    return report


def check_flip(cli, label, bundle, out, max_ratio, work):
    report = minimize(cli, label, bundle, out, 0)
    if report is None or not check(report["finding"] == "bit_flip" and out.is_dir(), f"{label}: MIN written"):
        return
    flip = report["bit_flip"]
    check(report["origin"] is None and flip["tensor"] == f"steps/{flip['step']}/model.safetensors"
          and any(flip["param"] in line and "one tensor" in line for line in report["kept"]),
          f"{label}: names the one tensor, {flip['param']} {flip['index']} bit {flip['bit']} in {flip['tensor']}")
    check(all(report["bit_flip_after"][k] == flip[k] for k in FLIP_KEYS), f"{label}: bit_flip_after is the same flip")
    steps = sorted(p.name for p in (out / "steps").iterdir())
    check(steps == [str(flip["step"] - 1), str(flip["step"])]
          and (out / "steps" / str(flip["step"] - 1) / "optimizer.safetensors").is_file(),
          f"{label}: MIN holds steps {steps}, the first with its optimizer state")
    # The same check on MIN, as a user would run it: run's update check names the same flip.
    triage = work / f"{label}-triage"
    proc = cli_run(cli, "run", out, "--out", triage, "--json")
    found = [f["evidence"] for f in (json_or_none(proc.stdout) or {}).get("findings", [])
             if f["code"] == "SYSTEM_BIT_FLIP"]
    check(proc.returncode == 1 and any(all(e.get(k) == flip[k] for k in FLIP_KEYS) for e in found),
          f"{label}: run on MIN names the same flipped bit (exit {proc.returncode}, {len(found)} flip(s))")
    md = triage / "report.md"
    check(md.is_file() and "minimized bundle" in md.read_text(), f"{label}: report.md says it is a minimized bundle")
    check_size(label, report, max_ratio)
    check_provenance(label, out, bundle)


def check_spike(cli, label, bundle, out, max_ratio):
    report = minimize(cli, label, bundle, out, 0)
    if report is None or not check(report["finding"] == "spike" and out.is_dir(), f"{label}: MIN written"):
        return
    before = report["spike"]
    proc = cli_run(cli, "bisect", out, "--json", "--no-samples")
    after = (json_or_none(proc.stdout) or {}).get("spike") or {}
    diff = [k for k in SPIKE_KEYS if before.get(k) != after.get(k)]
    check(proc.returncode == 1 and before["reproduced"] and not diff,
          f"{label}: bisect on MIN names the same spike origin {before['site']} step {before['step']}, reproduced "
          f"(exit {proc.returncode}, differs in {diff})")
    steps = [int(p.name) for p in (out / "steps").iterdir()]
    check(max(steps) == before["step"] and len(steps) < report["before"]["steps"],
          f"{label}: MIN holds steps {sorted(steps)}: the spike's and the healthy ones before it")
    if before["sample"] is not None and before["sample"] >= 0:
        mapped = original_of(json.loads((out / "manifest.json").read_text()), after.get("sample"))
        check(mapped == report["original_sample"],
              f"{label}: MIN's sample {after.get('sample')} maps back to {mapped}, the original {report['original_sample']}")
    check_size(label, report, max_ratio)
    check_provenance(label, out, bundle)


def check_nothing(cli, label, bundle, out, codes):
    report = minimize(cli, label, bundle, out, 1)  # nothing to minimize: exit 1, nothing written
    if report is None:
        return
    check(report["finding"] == "none" and report["out"] is None and not out.exists() and report["reason"],
          f"{label}: nothing written ({report['reason']})")
    check(report["not_minimized"] == codes, f"{label}: not_minimized {report['not_minimized']} (want {codes})")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cli", required=True)
    ap.add_argument("--work", required=True)
    add_all_flag(ap)
    args = ap.parse_args()
    work = Path(args.work).resolve()
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    cli = args.cli

    listed = listed_presets(cli)
    known = [*ORIGIN, *FLIP, *NOT_MINIMIZED, *NO_ERROR, *CLEAN, *SPIKE]
    check(len(listed) > 0 and sorted(listed) == sorted(known),
          f"every preset synth lists is classified here (unclassified {sorted(set(listed) - set(known))}, "
          f"gone {sorted(set(known) - set(listed))})")

    def chosen(table):
        return {p: table[p] for p in swept(list(table), args.all, listed=listed)} if isinstance(table, dict) \
            else swept(table, args.all, listed=listed)

    for preset, max_ratio in chosen(ORIGIN).items():
        if synth(cli, preset, work / preset):
            report = check_origin(cli, preset, work / preset, work / f"{preset}-min", max_ratio)
            # The checkpoint holds NaN (bit-flip) or rewritten weights: the update that brought them is kept.
            if preset in ("bit-flip", "rewritten-weights", "mlp-overflow", "olmo2-postnorm-overflow") and report:
                check(report["after"]["steps"] == 2
                      and (work / f"{preset}-min" / "steps" / str(report["origin"]["step"] - 1)
                           / "optimizer.safetensors").is_file(),
                      f"{preset}: two steps kept, the first with its optimizer state")
    for preset, max_ratio in chosen(SPIKE).items():
        if synth(cli, preset, work / preset):
            check_spike(cli, preset, work / preset, work / f"{preset}-min", max_ratio)
    for preset, max_ratio in chosen(FLIP).items():
        if synth(cli, preset, work / preset):
            check_flip(cli, preset, work / preset, work / f"{preset}-min", max_ratio, work)
    for preset, codes in chosen(NOT_MINIMIZED).items():
        if synth(cli, preset, work / preset):
            check_nothing(cli, preset, work / preset, work / f"{preset}-min", codes)
    for preset in chosen(NO_ERROR):
        if synth(cli, preset, work / preset):
            check_nothing(cli, preset, work / preset, work / f"{preset}-min", [])
    for preset, max_ratio in chosen(ROLLED).items():
        label, bundle = f"{preset} rolled", work / f"{preset}-rolled"
        if not synth(cli, preset, bundle, ["--checkpoint-every", "10"]):
            continue
        if preset in FLIP:
            check_flip(cli, label, bundle, work / f"{preset}-rolled-min", max_ratio, work)
        else:
            check_origin(cli, label, bundle, work / f"{preset}-rolled-min", max_ratio)

    print(f"{len(failures)} failed; {time.perf_counter() - _started:.1f} s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
