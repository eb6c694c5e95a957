"""Shared by the tests/py/test_import_*.py tests: a training loop that logs what a job logs, forward
hooks that see the first non-finite module output, running `nanreplay import` (or, while the CLI
has no import command, capture/nanreplay_import.py directly) and `nanreplay run`, and the checks
that the replay reproduces the PyTorch run.

Not a test itself (no test_ prefix): CTest registers only tests/py/test_*.py.
"""
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
SCRIPT = ROOT / "capture" / "nanreplay_import.py"
sys.path.insert(0, str(ROOT / "capture"))
import nanreplay_capture  # noqa: E402,F401  (write_safetensors)

TOLERANCE = 1e-5
PAD = 0
failures = []
_started = time.perf_counter()


def check(ok, what):
    print(("ok   " if ok else "FAIL ") + what, flush=True)
    if not ok:
        failures.append(what)


def finish():
    print(f"{len(failures)} failed; {time.perf_counter() - _started:.1f} s")
    return 1 if failures else 0


_import_cmd = None


def import_command(cli):
    """`<cli> import` when the CLI has that command, else this interpreter running the script
    (NANREPLAY_IMPORT_SCRIPT=1 forces the script)."""
    global _import_cmd
    if _import_cmd is None:
        use_cli = os.environ.get("NANREPLAY_IMPORT_SCRIPT") != "1" and subprocess.run(
            [cli, "import", "--help"], capture_output=True).returncode == 0
        _import_cmd = [cli, "import"] if use_cli else [sys.executable, str(SCRIPT)]
        print("import command: " + " ".join(_import_cmd))
    return _import_cmd


def run_import(cli, args, out):
    shutil.rmtree(out, ignore_errors=True)
    proc = subprocess.run(import_command(cli) + [str(a) for a in args] + ["--out", str(out)],
                          capture_output=True, text=True)
    print(proc.stdout.rstrip())
    if proc.returncode != 0:
        print(proc.stderr.rstrip())
    return proc


def run_replay(cli, bundle, out):
    shutil.rmtree(out, ignore_errors=True)
    proc = subprocess.run([cli, "run", str(bundle), "--out", str(out)], capture_output=True, text=True)
    path = Path(out) / "report.json"
    return proc, (json.loads(path.read_text()) if path.exists() else None)


def inspect_ok(cli, bundle):
    proc = subprocess.run([cli, "inspect", str(bundle)], capture_output=True, text=True)
    check(proc.returncode == 0, f"nanreplay inspect accepts {Path(bundle).name} {proc.stderr.strip()}")


# ---------------------------------------------------------------------------
# Data and the training loop.

class Data:
    """uint16 tokens in [1, V) over one shard, DistributedSampler order (world 1, drop_last) read
    micro_batch_size at a time; optionally one PAD token at `pad_at` = (step, micro, row, position)."""

    def __init__(self, work, vocab, seq_len, mbs, accum, num_samples, seed, pad_at=None, data_seed=5):
        g = torch.Generator().manual_seed(data_seed)
        self.tokens = torch.randint(1, vocab, (num_samples * seq_len + 1,), generator=g)
        self.seq_len, self.mbs, self.accum, self.seed = seq_len, mbs, accum, seed
        self.perm = torch.randperm(num_samples, generator=torch.Generator().manual_seed(seed)).tolist()
        self.pad_sample = None
        if pad_at is not None:
            step, micro, row, position = pad_at
            self.pad_sample = self.rows(step)[micro * mbs + row]
            self.tokens[self.pad_sample * seq_len + position] = PAD
        self.path = Path(work) / "tokens.bin"
        self.path.write_bytes(bytes(self.tokens.to(torch.int16).contiguous().view(torch.uint8).tolist()))

    def rows(self, step):
        B = self.mbs * self.accum
        return self.perm[step * B:(step + 1) * B]

    def batch(self, ids):
        w = torch.stack([self.tokens[i * self.seq_len:i * self.seq_len + self.seq_len + 1] for i in ids])
        return w[:, :-1].contiguous(), w[:, 1:].contiguous()

    def flags(self):
        return ["--data", self.path, "--token-dtype", "uint16", "--seq-len", self.seq_len,
                "--micro-batch-size", self.mbs, "--grad-accum", self.accum, "--sampler-seed", self.seed]


class FirstNonfinite:
    """Forward hooks on every module: the first output (in completion order) holding a non-finite
    value, decoded as docs/probe-sites.md says ([batch, position, features], first element)."""

    def __init__(self, model, sites):
        self.sites, self.where, self.found = sites, None, None
        for name, module in model.named_modules():
            module.register_forward_hook(self._hook(name))

    def _hook(self, name):
        def hook(module, inputs, output):
            if self.found is not None or not isinstance(output, torch.Tensor) or self.where is None:
                return
            bad = ~torch.isfinite(output.detach())
            if not bad.any():
                return
            flat = int(bad.reshape(-1).nonzero()[0])
            value = float(output.detach().reshape(-1)[flat])
            step, micro, ids = self.where
            found = {"module": name, "site": self.site(name), "step": step, "micro_batch": micro,
                     "kind": "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")}
            if output.dim() == 3:
                B, T, C = output.shape
                found["sample"], found["position"] = ids[flat // (T * C)], (flat // C) % T
            self.found = found
        return hook

    def site(self, name):
        for pattern, site in self.sites:
            m = re.fullmatch(pattern, name)
            if m:
                return site.format(*m.groups())
        return None


def adamw(params_or_groups, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1):
    return torch.optim.AdamW(params_or_groups, lr=lr, betas=betas, eps=1e-8, weight_decay=weight_decay, foreach=False)


def lr_at(step):
    return 2e-3 * min(1.0, (step + 1) / 4)  # a warmup, so that every step's lr differs


def train(model, opt, data, steps, grad_clip=1.0, hooks=None, before_step=None):
    """The job: per step, lr from the schedule, micro-batches in sampler order, clip_grad_norm_,
    AdamW. before_step(step) runs before the step's forward (where a job saves its checkpoint).
    Returns the log {step: {step, lr, loss, grad_norm}}; stops after a non-finite loss."""
    log = {}
    params = [p for p in model.parameters()]
    for step in range(steps):
        if before_step is not None:
            before_step(step)
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        rows = data.rows(step)
        total = 0.0
        for micro in range(data.accum):
            ids = rows[micro * data.mbs:(micro + 1) * data.mbs]
            if hooks is not None:
                hooks.where = (step, micro, ids)
            x, y = data.batch(ids)
            loss = model(x, y)
            (loss / data.accum).backward()
            total += loss.item()
        norm = torch.nn.utils.clip_grad_norm_(params, grad_clip)
        log[step] = {"step": step, "lr": lr_at(step), "loss": total / data.accum, "grad_norm": float(norm)}
        if not math.isfinite(total):
            break
        opt.step()
        opt.zero_grad(set_to_none=True)
    return log


def write_log(path, log):
    def num(x):
        return x if math.isfinite(x) else ("nan" if math.isnan(x) else ("inf" if x > 0 else "-inf"))
    Path(path).write_text("".join(json.dumps({k: num(v) if isinstance(v, float) else v for k, v in e.items()}) + "\n"
                                  for e in log.values()))
    return path


def rel_err(a, b):
    return abs(a - b) / max(abs(b), 1e-12)


def check_replay(label, report, log, first, last, derived=True):
    """Every finite logged step's loss (and grad norm) replayed to TOLERANCE; checkpoint / derived as expected."""
    rows = {r["step"]: r for r in report["steps"]}
    check(sorted(rows) == list(range(first, last + 1)), f"{label}: replayed steps {sorted(rows)}")
    for step in range(first, last + 1):
        e, r = log[step], rows.get(step)
        if r is None or not math.isfinite(e["loss"]):
            continue
        check(r["loss"] is not None and rel_err(r["loss"], e["loss"]) <= TOLERANCE
              and rel_err(r["grad_norm"], e["grad_norm"]) <= TOLERANCE,
              f"{label} step {step} ({r.get('params')}): replayed loss {r['loss']!r:.12} grad norm {r['grad_norm']!r:.12} "
              f"vs PyTorch's {e['loss']:.9g} / {e['grad_norm']:.9g}")
    if derived:
        params = [rows[s].get("params") for s in sorted(rows)]
        check(params == ["checkpoint"] + ["derived"] * (len(params) - 1), f"{label}: rolled forward {params}")
    bad = [f["code"] for f in report["findings"] if f["code"] in (
        "BUNDLE_DOES_NOT_REPRODUCE", "SYSTEM_TRAJECTORY_DIVERGED", "SYSTEM_NOT_REPRODUCIBLE", "DATA_SAMPLER_MISMATCH")]
    check(not bad, f"{label}: no finding that the bundle misstates the run {bad}")


def check_origin(label, report, seen):
    first = report.get("first_nonfinite")
    check(seen is not None and seen.get("site") is not None, f"{label}: PyTorch's hooks saw a non-finite output {seen}")
    check(first is not None, f"{label}: nanreplay names an origin {first}")
    if not first or not seen:
        return
    for key in ("step", "site", "kind", "micro_batch", "sample", "position"):
        check(first.get(key) == seen.get(key), f"{label}: first_nonfinite.{key} = {first.get(key)!r}, "
                                               f"PyTorch's hooks saw {seen.get(key)!r}")
    check(first.get("phase") == "forward" and first.get("rank") == 0, f"{label}: forward, rank 0")


def clone_state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def clone_optimizer(opt):
    sd = opt.state_dict()
    return {"state": {k: {n: (t.clone() if isinstance(t, torch.Tensor) else t) for n, t in s.items()}
                      for k, s in sd["state"].items()},
            "param_groups": [dict(g) for g in sd["param_groups"]]}


def name_keyed(model, opt):
    """The optimizer's state keyed by parameter name, as torch.distributed.checkpoint.state_dict's
    get_optimizer_state_dict returns it: {"state": {name: {...}}, "param_groups": [{..., "params": [names]}]}."""
    names = {id(p): n for n, p in model.named_parameters()}
    state, groups = {}, []
    for g in opt.param_groups:
        for p in g["params"]:
            if p in opt.state:
                state[names[id(p)]] = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in opt.state[p].items()}
        groups.append(dict({k: v for k, v in g.items() if k != "params"}, params=[names[id(p)] for p in g["params"]]))
    return {"state": state, "param_groups": groups}


def incident_case(label, cli, work, model, opt, data, sites, save, first, last, import_flags, hooks_model=None):
    """The common test: train `model` from step 0 to `last` with hooks (save() runs at the start of
    step `first`, where the job checkpoints), import that checkpoint with the job's log, replay it, and
    check the replayed losses and the origin against PyTorch's. Returns (import process, manifest)."""
    work = Path(work)
    hooks = FirstNonfinite(hooks_model or model, sites)
    log = train(model, opt, data, last + 1, hooks=hooks, before_step=lambda step: step == first and save())
    check(len(log) == last + 1 and not math.isfinite(log[last]["loss"]) and all(
        math.isfinite(log[s_]["loss"]) for s_ in range(last)), f"{label}: the PyTorch run goes NaN at step {last}")
    write_log(work / "log.jsonl", log)
    proc = run_import(cli, list(import_flags) + data.flags() + ["--log", work / "log.jsonl", "--steps", f"{first}:{last}",
                                                                "--grad-clip", 1.0], work / "bundle")
    check(proc.returncode == 0, f"{label}: import exits 0 {proc.stderr.strip()}")
    if proc.returncode != 0:
        return proc, None
    manifest = json.loads((work / "bundle" / "manifest.json").read_text())
    inspect_ok(cli, work / "bundle")
    rproc, report = run_replay(cli, work / "bundle", work / "out")
    check(rproc.returncode == 1 and report is not None, f"{label}: nanreplay run exits 1 (got {rproc.returncode}) "
                                                        f"{rproc.stderr.strip()}")
    if report:
        check_replay(label, report, log, first, last)
        print("PyTorch hooks:", hooks.found)
        print("nanreplay:", json.dumps(report.get("first_nonfinite")))
        check_origin(f"{label} incident", report, hooks.found)
        check(hooks.found is not None and hooks.found.get("sample") == data.pad_sample,
              f"{label}: the NaN starts at the zero embedding row's token (sample {data.pad_sample})")
    return proc, manifest
