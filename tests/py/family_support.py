"""What the model-family cross-checks (tests/py/test_family_*.py) share: a one-step v1 bundle written
from given weights and tokens, nanreplay's replay of it through the CLI, and the check list.

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

STEP = 100
OPTIMIZER = {"kind": "adamw", "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1, "grad_clip": 1.0}
TOLERANCE = 1e-5  # relative, fp32: losses and gradient norms
failures = []


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


def write_bundle(root, model, params, stream, samples, seq_len, logged_loss, logged_grad_norm):
    """A one-step fp32 bundle: `model` is the manifest's model object, `params` [(key, tensor)] in the
    parameter table's order, the step's batch samples 0..samples-1 of `stream` in one micro-batch."""
    root = Path(root)
    if root.exists():
        shutil.rmtree(root)
    (root / "data").mkdir(parents=True)
    (root / "steps" / str(STEP)).mkdir(parents=True)
    shard = stream.to(torch.int32).numpy().astype("<u2").tobytes()
    (root / "data" / "shard_000.bin").write_bytes(shard)
    manifest = {
        "format": "nanreplay.bundle", "version": 1, "model": model, "optimizer": OPTIMIZER,
        "precision": {"compute": "fp32"},
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


def replay(cli, bundle, out):
    """`nanreplay run --json` of the bundle: (exit status, report or None, stderr)."""
    run = subprocess.run([cli, "run", str(bundle), "--out", str(out), "--json"], capture_output=True, text=True)
    try:
        report = json.loads(run.stdout)
    except ValueError:
        report = None
    return run.returncode, report, run.stderr


def compare_step(report, loss, grad_norm, what):
    """The replayed step's loss and gradient norm against the reference's, within TOLERANCE."""
    if not check(report is not None and report.get("steps"), f"{what}: nanreplay replayed the step"):
        return
    step = report["steps"][0]
    check(rel_err(step["loss"], loss) <= TOLERANCE,
          f"{what}: loss {step['loss']!r} vs reference {loss!r} (rel {rel_err(step['loss'], loss):.2e})")
    check(rel_err(step["grad_norm"], grad_norm) <= TOLERANCE,
          f"{what}: grad norm {step['grad_norm']!r} vs reference {grad_norm!r} "
          f"(rel {rel_err(step['grad_norm'], grad_norm):.2e})")


def cross_entropy(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def finish():
    print(f"{len(failures)} failure(s)" if failures else "all checks passed")
    sys.exit(1 if failures else 0)
