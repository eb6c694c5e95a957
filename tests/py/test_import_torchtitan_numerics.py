"""`nanreplay import --torchtitan-numerics`: torchtitan's numerics capture (numerics/rank_<R>_activations.log,
agent_tooling/numerics_debugging/activation_tracer.py) read as the step's logged site statistics, then
`nanreplay run` against them.

The model is test_import_llama2c's (Meta naming, which torchtitan's llama shares: tok_embeddings,
layers.N.attention.wq/wk/wv/wo, attention_norm, feed_forward.w1/w2/w3, ffn_norm, norm, output). The log
is written the way the tracer writes it: per micro-batch, each module's captured ops in dispatch order
(an RMSNorm's pow, mul, mul), keyed module_fqn/op_N_opname with one counter per module that backward
ops share (Phase: backward), tensors under 1000 elements not captured, stats as its _compute_stats.

1. the run's own numbers: no SYSTEM_SITE_MISMATCH, and state.json holds the mapped sites;
2. a machine that computed layers.1's o_proj with another weight: `run` names layers.1.attn.out, the
   first site that differs, with the logged value as `expected`;
3. hostile logs: exit 2, one line naming the file and the key, no bundle left.
"""
import argparse
import json
import shutil
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import import_support as s  # noqa: E402
from test_import_llama2c import ARGS, Transformer  # noqa: E402

SEQ, MBS, ACCUM, SEED, STEP = 16, 2, 2, 1234, 0
MIN_NUMEL = 1000  # the tracer's default: smaller tensors are not captured


def stats_lines(t):
    t64 = t.detach().to(torch.float64)
    return [f"  Shape: {t.shape}, Dtype: {t.dtype}", f"  L2 norm: {t64.norm(p=2).item():.6e}",
            f"  Min: {t.float().min().item():.6e}", f"  Max: {t.float().max().item():.6e}",
            f"  Mean: {t64.mean().item():.6e}"]


class TracerLog:
    """Blocks in the tracer's format, one counter per module, from forward hooks on every leaf module."""

    def __init__(self, model):
        self.blocks, self.counters = [], {}
        for name, module in model.named_modules():
            if name and not list(module.children()):
                module.register_forward_hook(self._hook(name))

    def add(self, fqn, op, tensor, phase="forward"):
        if tensor.numel() < MIN_NUMEL:
            return
        n = self.counters.get(fqn, 0)
        self.counters[fqn] = n + 1
        lines = [f"[{fqn}/op_{n}_{op}]", *stats_lines(tensor), "  Location: llama/model.py:100"]
        self.blocks.append("\n".join(lines + (["  Phase: backward"] if phase != "forward" else [])))

    def _hook(self, name):
        def hook(module, inputs, output):
            x = inputs[0]
            if isinstance(module, torch.nn.Embedding):
                self.add(name, "embedding", output)
            elif isinstance(module, torch.nn.Linear):
                self.add(name, "mm", output.reshape(-1, output.shape[-1]))
            else:  # RMSNorm: x * rsqrt(mean(x^2) + eps) * weight; mean, add, rsqrt are under 1000 elements
                self.add(name, "pow", x.pow(2))
                self.add(name, "mul", module._norm(x.float()))
                self.add(name, "mul", output)
        return hook

    def backward_of_linears(self, model):
        """What the tracer logs of a backward: the linears' mm ops, sharing the modules' counters."""
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear):
                self.add(name, "mm", module.weight.detach() * 0.5, phase="backward")

    def write(self, path):
        path.parent.mkdir(parents=True, exist_ok=True)
        text = (f"Total captured activations: {len(self.blocks)}\nExcluded ops dispatched: detach, t, view\n"
                + "=" * 80 + "\n\n" + "".join(b + "\n\n" for b in self.blocks))
        path.write_text(text)


def capture(model, data, path):
    """The step's forward per micro-batch, logged as the tracer would; the step's mean loss."""
    log = TracerLog(model)
    ids, losses = data.rows(STEP), []
    with torch.no_grad():
        for micro in range(ACCUM):
            losses.append(model(*data.batch(ids[micro * MBS:(micro + 1) * MBS])).item())
            log.backward_of_linears(model)
    log.write(path)
    return sum(losses) / ACCUM


def site_mismatches(report):
    return [f for f in report.get("findings", []) if f.get("code") == "SYSTEM_SITE_MISMATCH"]


def hostile(cli, base, work):
    good = (work / "numerics" / "rank_0_activations.log").read_text()
    cases = [
        ("not a log", "hello\n", "line 1"),
        ("a bad key", good.replace("[layers.0.ffn_norm/op_0_pow]", "[layers.0.ffn_norm\x1b[31m/op_0_pow]", 1), "line "),
        ("a skipped op index", good.replace("[norm/op_1_mul]", "[norm/op_7_mul]", 1), "line "),
        ("a shape beyond any tensor", good.replace("Shape: torch.Size([2, 16, 32])",
                                                  "Shape: torch.Size([99999999, 99999999, 99999999])", 1), ".Shape"),
        ("a norm that is not a number", good.replace("L2 norm: ", "L2 norm: x", 1), ".L2 norm"),
    ]
    for label, text, key in cases:
        path = work / "hostile" / "rank_0_activations.log"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        out = work / "hostile-bundle"
        proc = s.run_import(cli, base + ["--torchtitan-numerics", f"{STEP}={path}"], out)
        lines = proc.stderr.strip().splitlines()
        s.check(proc.returncode == 2 and len(lines) == 1 and str(path) in lines[0] and key in lines[0]
                and "\x1b" not in proc.stderr and not out.exists(),
                f"{label}: exit 2, one line naming the file and {key!r}, nothing written ({proc.returncode}: {lines})")
    proc = s.run_import(cli, base + ["--torchtitan-numerics", f"{STEP + 5}={work / 'numerics'}"], work / "hostile-bundle")
    s.check(proc.returncode == 2 and "--torchtitan-numerics" in proc.stderr,
            f"a step outside --steps is refused naming the flag ({proc.returncode}: {proc.stderr.strip()})")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cli", required=True)
    ap.add_argument("--work", required=True)
    args = ap.parse_args()
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    torch.set_num_threads(1)

    data = s.Data(work, ARGS["vocab_size"], SEQ, MBS, ACCUM, num_samples=64, seed=SEED)
    torch.manual_seed(0)
    model = Transformer(ARGS)
    ckpt = work / "ckpt.pt"
    torch.save({"model": model.state_dict(), "model_args": ARGS, "iter_num": STEP}, ckpt)
    base = ["--checkpoint", ckpt, *data.flags(), "--steps", f"{STEP}:{STEP}"]

    # 1. The run's own numbers.
    loss = capture(model, data, work / "numerics" / "rank_0_activations.log")
    s.write_log(work / "log.jsonl", {STEP: {"step": STEP, "lr": 1e-3, "loss": loss}})
    proc = s.run_import(args.cli, base + ["--log", work / "log.jsonl", "--torchtitan-numerics",
                                          f"{STEP}={work / 'numerics'}"], work / "bundle")
    s.check(proc.returncode == 0, f"import exits 0 {proc.stderr.strip()}")
    state = json.loads((work / "bundle" / "steps" / str(STEP) / "state.json").read_text()) if proc.returncode == 0 else {}
    sites = set(state.get("logged", {}).get("site_stats", {}))
    want = {"embed", "final_norm", "logits"} | {f"layers.{i}.{x}" for i in range(ARGS["n_layers"])
                                                for x in ("attn_norm", "attn.out", "mlp_norm", "mlp.gate", "mlp.up", "mlp.down")}
    s.check(sites == want, f"state.json logs the mapped sites (wq/wk left out, wv under 1000 elements) {sorted(sites)}")
    if proc.returncode == 0:
        rproc, report = s.run_replay(args.cli, work / "bundle", work / "out")
        s.check(report is not None and not site_mismatches(report),
                f"run on the run's own numbers: no SYSTEM_SITE_MISMATCH (exit {rproc.returncode}) {rproc.stderr.strip()}")

    # 2. Another machine: layers.1's o_proj computed with another weight.
    other = Transformer(ARGS)
    other.load_state_dict(model.state_dict())
    with torch.no_grad():
        other.layers[1].attention.wo.weight.mul_(1.5)
    loss = capture(other, data, work / "numerics-other" / "rank_0_activations.log")
    s.write_log(work / "log-other.jsonl", {STEP: {"step": STEP, "lr": 1e-3, "loss": loss}})
    logged = {}
    proc = s.run_import(args.cli, base + ["--log", work / "log-other.jsonl", "--torchtitan-numerics",
                                          f"{STEP}={work / 'numerics-other' / 'rank_0_activations.log'}"], work / "bundle-other")
    s.check(proc.returncode == 0, f"import of the other machine's log exits 0 {proc.stderr.strip()}")
    if proc.returncode == 0:
        logged = json.loads((work / "bundle-other" / "steps" / str(STEP) / "state.json").read_text())["logged"]["site_stats"]
        rproc, report = s.run_replay(args.cli, work / "bundle-other", work / "out-other")
        found = site_mismatches(report or {})
        ev = found[0].get("evidence", {}) if found else {}
        s.check(rproc.returncode == 1 and len(found) == 1 and ev.get("site") == "layers.1.attn.out" and ev.get("step") == STEP,
                f"run names layers.1.attn.out, the first site that differs (exit {rproc.returncode}) {ev}")
        stat = ev.get("statistic")
        s.check(stat in ("max_abs", "rms") and abs(ev.get("expected", 0) - logged["layers.1.attn.out"][stat]) < 1e-9,
                f"its expected value is the logged one, pooled from the log ({ev.get('expected')} vs {logged.get('layers.1.attn.out')})")

    # 3. Hostile logs.
    hostile(args.cli, base + ["--log", work / "log.jsonl"], work)
    return s.finish()


if __name__ == "__main__":
    sys.exit(main())
