"""What the model-family cross-checks (tests/py/test_family_*.py) share: a one-step v1 bundle written
from given weights and tokens, nanreplay's replay of it through the CLI, the check list, and the pieces a
reference needs to emulate bf16 as the bundle format does (docs/bundle-format.md, "Precision as replayed").

bf16 is autocast emulated by rounding: a rounding point casts fp32 to bf16 and back (reference_model's
rounding(), whose autograd rounds the gradient crossing it). A reference module mixes in Rounding and calls
self.rnd at the format's rounding points; Linear rounds its input, weight and bias; set_compute(model,
"bf16") turns them on (fp32, the default: the identity, so the fp32 checks are unchanged).

Each test holds its own eager PyTorch model, transcribed from the family's upstream code (Hugging
Face's modeling_*.py, llama2.c's model.py), never from nanreplay's; this module only moves tensors
and numbers between that model and the CLI. Debian's /usr/bin/python3 (torch 1.13).
"""
import hashlib
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "capture"))
import nanreplay_capture  # noqa: E402  (its safetensors writer)
sys.path.insert(0, str(Path(__file__).resolve().parent))
import reference_model  # noqa: E402
import synth_cache  # noqa: E402
from reference_model import rounding  # noqa: E402  (the cast pair of a rounding point)

STEP = 100
OPTIMIZER = {"kind": "adamw", "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1, "grad_clip": 1.0}
TOLERANCE = 1e-5  # relative, fp32: losses and gradient norms
# Relative, losses and gradient norms, by compute type. bf16: autograd may sum a site's gradients in
# another order than the replay, and one bf16 rounding flipped by that moves a value by ~1e-6 or more.
TOLERANCES = {"fp32": TOLERANCE, "bf16": 1e-4}
failures = []


def keep(t):
    """fp32's rounding point: the tensor as it is."""
    return t


class Rounding:
    """Mixin of a reference module: self.rnd, the rounding point of the compute type (set_compute);
    fp32's identity until set."""
    rnd = staticmethod(keep)


class Linear(Rounding, torch.nn.Linear):
    """torch.nn.Linear under emulated autocast: input, weight and bias rounded to the compute type, the
    product accumulated in fp32; the output stays fp32 until the site it feeds rounds it."""

    def forward(self, x):
        return F.linear(self.rnd(x), self.rnd(self.weight), None if self.bias is None else self.rnd(self.bias))


def set_compute(model, compute):
    """`model` with every module's rounding point that of `compute` ("fp32", "bf16"); returns it."""
    rnd = rounding(compute)
    for module in model.modules():
        module.rnd = rnd
    return model


def check(ok, what):
    print(("ok   " if ok else "FAIL ") + what, flush=True)
    if not ok:
        failures.append(what)
    return ok


def rel_err(a, b):
    return abs(a - b) / max(abs(b), 1e-12)


def token_stream(vocab, samples, seq_len, seed, avoid=()):
    """samples * seq_len + 1 random token ids, none of `avoid` (tokens a test plants itself)."""
    g = torch.Generator().manual_seed(seed)
    allowed = torch.tensor([t for t in range(vocab) if t not in set(avoid)])
    return allowed[torch.randint(len(allowed), (samples * seq_len + 1,), generator=g)]


def batch_of(stream, samples, seq_len):
    """(inputs, targets) of bundle samples 0..samples-1: sample i reads stream[i*T : i*T + T + 1]."""
    rows = torch.stack([stream[i * seq_len:i * seq_len + seq_len + 1] for i in range(samples)])
    return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


def perturbed_loss(model, inputs, targets, parts, perturbation):
    """The model's loss (no grad) with each attribute of `perturbation` set on every module of `parts`
    that has it, then restored: a reference with one mechanism changed, for showing a check can fail."""
    saved = [(p, k, getattr(p, k)) for p in parts for k in perturbation if hasattr(p, k)]
    for p, k, _ in saved:
        setattr(p, k, perturbation[k])
    try:
        with torch.no_grad():
            return float(model(inputs, targets))
    finally:
        for p, k, v in saved:
            setattr(p, k, v)


def write_bundle(root, model, params, stream, samples, seq_len, logged_loss, logged_grad_norm, precision="fp32"):
    """A one-step bundle computing in `precision`: `model` is the manifest's model object, `params`
    [(key, tensor)] in the parameter table's order (stored fp32, the masters), the step's batch samples
    0..samples-1 of `stream` in one micro-batch."""
    root = Path(root)
    if root.exists():
        shutil.rmtree(root)
    (root / "data").mkdir(parents=True)
    (root / "steps" / str(STEP)).mkdir(parents=True)
    shard = stream.to(torch.int32).numpy().astype("<u2").tobytes()
    (root / "data" / "shard_000.bin").write_bytes(shard)
    manifest = {
        "format": "nanreplay.bundle", "version": 1, "model": model, "optimizer": OPTIMIZER,
        "precision": {"compute": precision},
        "data": {"shards": [{"path": "data/shard_000.bin", "dtype": "uint16", "tokens": len(stream),
                             "sha256": hashlib.sha256(shard).hexdigest()}],
                 "seq_len": seq_len, "micro_batch_size": samples, "grad_accum_steps": 1, "world_size": 1,
                 "sampler": {"kind": "explicit"}},
        "steps": [{"step": STEP, "dir": f"steps/{STEP}", "samples": [list(range(samples))]}],
    }
    (root / "manifest.json").write_text(json.dumps(manifest, indent=1))
    nanreplay_capture.write_safetensors(root / "steps" / str(STEP) / "model.safetensors",
                                        [(k, v.detach().float().contiguous()) for k, v in params])
    logged = {"loss": _json_number(logged_loss), "grad_norm": _json_number(logged_grad_norm)}
    (root / "steps" / str(STEP) / "state.json").write_text(json.dumps({"step": STEP, "lr": 1e-3, "logged": logged}))
    return root


def _json_number(x):
    """The bundle's spelling of a logged value: a number, or "nan" / "inf" as a run logs them."""
    return x if math.isfinite(x) else ("nan" if math.isnan(x) else ("inf" if x > 0 else "-inf"))


def loss_and_grad_norm(loss, params):
    """The step's loss and its global gradient norm over `params` (as clip_grad_norm_ computes it)."""
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    norm = torch.norm(torch.stack([torch.norm(g.detach(), 2.0) for g in grads if g is not None]), 2.0)
    return float(loss), float(norm)


def compare_bundle_step(bundle, row, model, what):
    """One replayed step `row` of a reference_model.Bundle against `model` (its weights already that step's):
    the step's micro-batches of rank 0, the mean loss, the gradient norm, compared as compare_step does."""
    d = bundle.manifest["data"]
    ids = bundle.samples(row["step"])[0]  # one rank
    mbs, accum = d["micro_batch_size"], d.get("grad_accum_steps", 1)
    total = 0.0
    for micro in range(accum):
        loss = model(*bundle.batch(ids[micro * mbs:(micro + 1) * mbs]))
        total += float(loss)
        (loss / accum).backward()
    norm = float(torch.norm(torch.stack([p.grad.norm() for p in model.parameters() if p.grad is not None])))
    compare_step({"steps": [row]}, total / accum, norm, what)


def replay(cli, bundle, out, flags=()):
    """`nanreplay run --json` of the bundle, `flags` (e.g. ["--steps", "100,101"]) added: (exit status, report
    or None, stderr)."""
    run = subprocess.run([cli, "run", str(bundle), "--out", str(out), "--json", *flags], capture_output=True, text=True)
    try:
        report = json.loads(run.stdout)
    except ValueError:
        report = None
    return run.returncode, report, run.stderr


def check_refused(rc, err, what, *names):
    """Bad input as the tool must refuse it: exit 2 and one line on stderr naming each of `names` (file, key)."""
    lines = err.strip().splitlines()
    return check(rc == 2 and len(lines) == 1 and all(str(n) in lines[0] for n in names),
                 f"{what} is refused naming {', '.join(map(str, names))} (exit {rc}; {err.strip()[-300:]})")


def replay_preset_start(cli, work, preset):
    """A preset (synthesized through the tests' cache) and `run` of its first two steps, the others being CI's
    time: (reference_model.Bundle, report, the two steps), or None after a failed check."""
    bundle_dir = work / preset
    synth_cache.synth(cli, preset, bundle_dir)
    bundle = reference_model.Bundle(bundle_dir)
    first_two = [e["step"] for e in bundle.manifest["steps"][:2]]
    rc, report, err = replay(cli, bundle_dir, work / f"out-{preset}", ["--steps", ",".join(map(str, first_two))])
    if not check(report is not None and rc == 0 and [r["step"] for r in report["steps"]] == first_two,
                 f"{preset} replays its steps {first_two} (exit {rc}; {err.strip()[-300:]})"):
        return None
    return bundle, report, first_two


def compare_step(report, loss, grad_norm, what, compute="fp32"):
    """The replayed step's loss and gradient norm against the reference's, within TOLERANCES[compute]."""
    if not check(report is not None and report.get("steps"), f"{what}: nanreplay replayed the step"):
        return
    step = report["steps"][0]
    tolerance = TOLERANCES[compute]
    check(rel_err(step["loss"], loss) <= tolerance,
          f"{what}: loss {step['loss']!r} vs reference {loss!r} (rel {rel_err(step['loss'], loss):.2e})")
    check(rel_err(step["grad_norm"], grad_norm) <= tolerance,
          f"{what}: grad norm {step['grad_norm']!r} vs reference {grad_norm!r} "
          f"(rel {rel_err(step['grad_norm'], grad_norm):.2e})")


def check_bf16_step(cli, work, name, manifest_model, model, named, stream, samples, seq_len, what):
    """A one-step bf16 bundle of `model` (a reference: model(input_ids, labels) is the loss; named(model) its
    [(key, tensor)] in the parameter table's order) on samples 0..samples-1 of `stream`: nanreplay's loss and
    gradient norm within TOLERANCES["bf16"] of the reference's with its rounding points on, and that loss
    farther than this from the reference's fp32 loss (so the check tells bf16 from fp32). `model` stays fp32."""
    inputs, targets = batch_of(stream, samples, seq_len)
    with torch.no_grad():
        fp32_loss = float(model(inputs, targets))
    set_compute(model, "bf16")
    try:
        loss, norm = loss_and_grad_norm(model(inputs, targets), list(model.parameters()))
    finally:
        set_compute(model, "fp32")
    check(rel_err(loss, fp32_loss) > TOLERANCES["bf16"],
          f"{what}: the reference's bf16 loss {loss!r} departs from its fp32 loss {fp32_loss!r} "
          f"(rel {rel_err(loss, fp32_loss):.2e})")
    bundle = write_bundle(work / name, manifest_model, named(model), stream, samples, seq_len, loss, norm,
                          precision="bf16")
    rc, report, err = replay(cli, bundle, work / f"out-{name}")
    if check(report is not None, f"{what}: nanreplay run gave a report (exit {rc}; {err.strip()[-300:]})"):
        compare_step(report, loss, norm, what, "bf16")


def cross_entropy(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def finish():
    print(f"{len(failures)} failure(s)" if failures else "all checks passed")
    sys.exit(1 if failures else 0)
