"""capture/nanreplay_capture.py's Recorder with optimizers beyond AdamW (docs/capture.md, "Optimizers"):
accepted by class name (type(opt).__module__ + __qualname__), hyper-parameters read from the
param_groups and state from optimizer.state by the class's own names, anything else refused by name.

torch.optim.Adam is the real one (amsgrad, L2 weight decay). PyTorch 1.13 has neither torch.optim.Adafactor
nor transformers: those are stand-ins named as upstream names them (torch.optim._adafactor.Adafactor,
transformers.optimization.Adafactor), stepping with test_optim_crosscheck.py's transcriptions of the
upstream update and keeping the upstream state entries. Each records three steps; `nanreplay run`
replays the bundle (the derived updates must match what the stand-in computed). So does torch.optim.Muon
(a stand-in too) in the run it belongs to: Muon over the hidden matrices plus AdamW over the rest, given to
the Recorder as a list, each at its own lr, in both orders and rolled forward from a snapshot. ~10 s.
"""
import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[1] / "capture"))
import nanreplay_capture  # noqa: E402
import test_optim_crosscheck as ref  # noqa: E402
import torch_models  # noqa: E402
from nanreplay_capture import CaptureError  # noqa: E402

LLAMA = dict(vocab_size=64, hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2,
             intermediate_size=48, norm_eps=1e-5, rope_theta=10000.0)
SEQ_LEN, MICRO_BATCH, STEPS = 8, 2, 3
failures = []


def check(ok, what):
    print(("ok   " if ok else "FAIL ") + what, flush=True)
    if not ok:
        failures.append(what)


class _StandIn(torch.optim.Optimizer):
    """An optimizer stepping one parameter at a time with a reference update `rule(p, grad, state, lr, **hyper)`."""
    rule, hyper_keys = None, ()

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            hyper = {k: group[k] for k in self.hyper_keys}
            for p in group["params"]:
                if p.grad is not None:
                    state = self.state[p]
                    if not state:
                        self.init_state(p, state, group)
                    type(self).rule(p, p.grad, state, group["lr"], **hyper)


class Adafactor(_StandIn):
    """torch.optim.Adafactor's state (step, row_var [.., n, 1], col_var [.., 1, m], variance) and group keys."""
    rule, hyper_keys = staticmethod(ref.adafactor_step), ("beta2_decay", "eps", "d", "weight_decay", "maximize")

    def __init__(self, params, lr=1e-2, beta2_decay=-0.8, eps=(None, 1e-3), d=1.0, weight_decay=0.0, maximize=False):
        super().__init__(params, dict(lr=lr, beta2_decay=beta2_decay, eps=eps, d=d, weight_decay=weight_decay,
                                      foreach=None, maximize=maximize))

    def init_state(self, p, state, group):
        state["step"] = torch.tensor(0.0)
        if p.dim() > 1:
            state["row_var"] = p.new_zeros(p.shape[:-1] + (1,))
            state["col_var"] = p.new_zeros(p.shape[:-2] + (1,) + p.shape[-1:])
        else:
            state["variance"] = torch.zeros_like(p)


Adafactor.__module__, Adafactor.__qualname__ = "torch.optim._adafactor", "Adafactor"


class HFAdafactor(_StandIn):
    """transformers.optimization.Adafactor's state (step, exp_avg_sq_row [.., n], exp_avg_sq_col [.., m],
    exp_avg_sq, exp_avg with beta1, RMS) and group keys."""
    rule = staticmethod(ref.adafactor_hf_step)
    hyper_keys = ("eps", "clip_threshold", "decay_rate", "beta1", "weight_decay", "scale_parameter", "relative_step",
                  "warmup_init")

    def __init__(self, params, lr=None, eps=(1e-30, 1e-3), clip_threshold=1.0, decay_rate=-0.8, beta1=None,
                 weight_decay=0.0, scale_parameter=True, relative_step=True, warmup_init=False):
        super().__init__(params, dict(lr=lr, eps=eps, clip_threshold=clip_threshold, decay_rate=decay_rate,
                                      beta1=beta1, weight_decay=weight_decay, scale_parameter=scale_parameter,
                                      relative_step=relative_step, warmup_init=warmup_init))

    def init_state(self, p, state, group):
        state["step"] = 0
        if group["beta1"] is not None:
            state["exp_avg"] = torch.zeros_like(p)
        if p.dim() >= 2:
            state["exp_avg_sq_row"] = p.new_zeros(p.shape[:-1])
            state["exp_avg_sq_col"] = p.new_zeros(p.shape[:-2] + p.shape[-1:])
        else:
            state["exp_avg_sq"] = torch.zeros_like(p)
        state["RMS"] = 0


HFAdafactor.__module__, HFAdafactor.__qualname__ = "transformers.optimization", "Adafactor"


def _muon_rule(p, grad, state, lr, **hyper):
    # test_optim_crosscheck's transcription counts steps in its own dict; upstream's Muon keeps no step.
    ref.muon_step(p, grad, {"momentum_buffer": state["momentum_buffer"], "step": 0}, lr, **hyper)


class Muon(_StandIn):
    """torch.optim.Muon (PyTorch 2.9, torch/optim/_muon.py): 2-D parameters only, state momentum_buffer
    alone, its group keys; stepping with test_optim_crosscheck.py's transcription of the upstream update."""
    rule = staticmethod(_muon_rule)
    hyper_keys = ("weight_decay", "momentum", "nesterov", "ns_coefficients", "eps", "ns_steps", "adjust_lr_fn")

    def __init__(self, params, lr=2e-2, weight_decay=0.1, momentum=0.95, adjust_lr_fn=None):
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=True,
                                      ns_coefficients=(3.4445, -4.775, 2.0315), eps=1e-7, ns_steps=5,
                                      adjust_lr_fn=adjust_lr_fn, use_addmm=False))
        for group in self.param_groups:
            for p in group["params"]:
                if p.dim() != 2:  # as upstream's constructor
                    raise ValueError(f"Muon only supports 2D parameters whereas we found a parameter with size: {p.size()}")

    def init_state(self, p, state, group):
        state["momentum_buffer"] = torch.zeros_like(p)


Muon.__module__, Muon.__qualname__ = "torch.optim._muon", "Muon"


def record(work, label, make_opt, lr=None, steps=STEPS, snapshot_every=None):
    """make_opt(model): the optimizer, or a list of the run's optimizers (each one steps)."""
    torch.manual_seed(0)
    model = torch_models.LlamaForCausalLM(dict(LLAMA))
    opt = make_opt(model)
    opts = opt if isinstance(opt, list) else [opt]
    recorder = nanreplay_capture.Recorder(
        model, opt, work / f"incidents-{label}", arch="llama", window=STEPS, snapshot_every=snapshot_every,
        model_config=dict(num_heads=LLAMA["num_heads"]),
        data=dict(shards=[str(work / "tokens.bin")], seq_len=SEQ_LEN, micro_batch_size=MICRO_BATCH))
    tokens = TOKENS
    for step in range(steps):
        samples = [2 * step, 2 * step + 1]
        window = torch.stack([tokens[i * SEQ_LEN:i * SEQ_LEN + SEQ_LEN + 1] for i in samples])
        recorder.begin_step(step, samples=samples, lr=None if isinstance(opt, list) else
                            lr if lr is not None else opt.param_groups[0]["lr"] or 1e-3)
        loss = model(window[:, :-1], window[:, 1:])
        loss.backward()
        recorder.end_step(loss=loss)
        for o in opts:
            o.step()
            o.zero_grad(set_to_none=True)
    bundle = recorder.dump(work / f"bundle-{label}")
    return json.loads((bundle / "manifest.json").read_text())["optimizer"], bundle


def hidden_and_rest(model):
    """A Muon run's split: the hidden 2-D matrices for Muon; embeddings, norms and the head for AdamW."""
    hidden = [p for n, p in model.named_parameters() if p.dim() == 2 and "embed" not in n and "lm_head" not in n]
    rest = [p for n, p in model.named_parameters() if not any(p is q for q in hidden)]
    return hidden, rest


def muon_and_adamw(model):
    hidden, rest = hidden_and_rest(model)
    return [Muon(hidden, lr=2e-2, weight_decay=0.1),
            torch.optim.AdamW([{"params": [p for p in rest if p.dim() == 2], "weight_decay": 0.1},
                               {"params": [p for p in rest if p.dim() == 1], "weight_decay": 0.0}],
                              lr=3e-3, betas=(0.9, 0.95))]


def header(path):
    raw = Path(path).read_bytes()
    return json.loads(raw[8:8 + int.from_bytes(raw[:8], "little")])


def replayed(cli, bundle, label):
    out = bundle.parent / f"run-{label}"
    shutil.rmtree(out, ignore_errors=True)
    proc = subprocess.run([cli, "run", str(bundle), "--out", str(out)], capture_output=True, text=True)
    check(proc.returncode == 0, f"{label}: nanreplay run replays the recorded steps (exit {proc.returncode} "
                                f"{proc.stderr.strip()[-400:]})")
    report = out / "report.json"
    return json.loads(report.read_text()) if report.exists() else {}


def raises(what, fn, *needles):
    try:
        fn()
    except CaptureError as e:
        missing = [n for n in needles if n not in str(e)]
        check(not missing, f"{what}: CaptureError names {list(needles)}" + (f" (got: {e})" if missing else ""))
        return
    check(False, f"{what}: raises CaptureError (it did not)")


TOKENS = torch.randint(0, LLAMA["vocab_size"], (16 * SEQ_LEN + 1,), generator=torch.Generator().manual_seed(5))


def muon_run(cli, work):
    """A Muon run as 2026 trains: torch.optim.Muon over the hidden matrices, AdamW (decay on the embeddings
    and head, none on the norms) over the rest, each at its own lr; given as a list of optimizers."""
    o, b = record(work, "muon-adamw", muon_and_adamw)
    groups = {g["name"]: g for g in o.get("groups", [])}
    hidden = sorted(k for k in header(b / "steps" / "0" / "model.safetensors")
                    if k.endswith("_proj.weight"))
    check(o["kind"] == "muon" and o["momentum"] == 0.95 and o["ns_steps"] == 5 and o["weight_decay"] == 0.1
          and "betas" not in o, f"Muon first: the top level is Muon's settings: {o}")
    check(sorted(groups) == ["aux_adamw0", "aux_adamw1"] and all(g["kind"] == "adamw" for g in groups.values())
          and groups["aux_adamw0"]["params"] == ["model.embed_tokens.weight", "lm_head.weight"]
          and groups["aux_adamw0"]["weight_decay"] == 0.1 and groups["aux_adamw1"]["weight_decay"] == 0.0
          and groups["aux_adamw1"]["betas"] == [0.9, 0.95] and len(groups["aux_adamw1"]["params"]) == 3,
          f"AdamW's two param groups: groups of kind adamw with their parameters' keys: {o.get('groups')}")
    h = header(b / "steps" / "1" / "optimizer.safetensors")
    check(all(f"{k}.momentum_buffer" in h for k in hidden) and "model.norm.weight.exp_avg_sq" in h
          and "lm_head.weight.exp_avg" in h and not any(k.endswith("_proj.weight.exp_avg") for k in h)
          and "model.norm.weight.momentum_buffer" not in h, "each parameter's state under its own optimizer's names")
    st = json.loads((b / "steps" / "1" / "state.json").read_text())
    check(st["lr"] == {"default": 0.02, "aux_adamw0": 0.003, "aux_adamw1": 0.003},
          f"the two optimizers' lrs: state.json lr keyed by group: {st['lr']}")
    rep = replayed(cli, b, "muon-adamw").get("reproduction", {})
    check(rep.get("reproduces") is True and rep.get("checked_steps") == STEPS, f"Muon + AdamW: the logged losses: {rep}")

    # AdamW first (its settings at the top level, Muon's group of its own kind), snapshot mode: the bundle
    # rolls forward from the older snapshot, the replay applying Muon and AdamW itself.
    o, b = record(work, "adamw-muon", lambda m: muon_and_adamw(m)[::-1], steps=5, snapshot_every=2)
    groups = {g["name"]: g for g in o.get("groups", [])}
    check(o["kind"] == "adamw" and o["no_decay"] and groups.get("aux_muon0", {}).get("kind") == "muon"
          and sorted(groups["aux_muon0"]["params"]) == hidden and groups["aux_muon0"]["momentum"] == 0.95,
          f"AdamW first: Muon's group of its own kind: {o}")
    rep = replayed(cli, b, "adamw-muon")
    derived = [s["step"] for s in rep.get("steps", []) if s.get("params") != "checkpoint"]
    check(rep.get("reproduction", {}).get("reproduces") is True and derived == [3],
          f"rolled forward from step 2's snapshot through Muon and AdamW: {rep.get('reproduction')}, derived {derived}")

    def both(m):
        hidden, rest = hidden_and_rest(m)
        return [Muon(hidden), torch.optim.AdamW(rest + hidden[:1], lr=1e-3)]

    def neither(m):
        hidden, rest = hidden_and_rest(m)
        return [Muon(hidden), torch.optim.AdamW([p for p in rest if p.dim() == 1], lr=1e-3)]
    raises("a parameter in two optimizers", lambda: record(work, "muon-both", both),
           "model.layers.0.self_attn.q_proj.weight is updated by two optimizers", "Muon", "AdamW")
    raises("a parameter in none", lambda: record(work, "muon-neither", neither),
           "parameters the optimizer does not update", "model.embed_tokens.weight", "lm_head.weight")
    raises("an unknown class beside Muon", lambda: record(
        work, "muon-sgd", lambda m: [Muon(hidden_and_rest(m)[0]), torch.optim.SGD(hidden_and_rest(m)[1], lr=0.1)]),
           "torch.optim.sgd.SGD")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cli", required=True)
    ap.add_argument("--work", required=True)
    args = ap.parse_args()
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    (work / "tokens.bin").write_bytes(bytes(TOKENS.to(torch.int16).contiguous().view(torch.uint8).tolist()))

    o, b = record(work, "adam", lambda m: torch.optim.Adam(m.parameters(), lr=1e-3, betas=(0.9, 0.95),
                                                           weight_decay=0.01, amsgrad=True))
    check(o["kind"] == "adam" and o["betas"] == [0.9, 0.95] and o["weight_decay"] == 0.01 and o["amsgrad"] is True,
          f"torch.optim.Adam: kind and hyper-parameters from param_groups: {o}")
    h = header(b / "steps" / "1" / "optimizer.safetensors")
    check("model.norm.weight.max_exp_avg_sq" in h and "model.norm.weight.exp_avg" in h,
          "Adam's state under its names, max_exp_avg_sq with amsgrad")
    replayed(args.cli, b, "adam")

    o, b = record(work, "adafactor", lambda m: Adafactor(m.parameters(), lr=1e-2, weight_decay=0.01))
    check(o["kind"] == "adafactor" and o["eps"] == [None, 1e-3] and o["weight_decay"] == 0.01
          and o["beta2_decay"] == -0.8, f"torch.optim.Adafactor by class name: {o}")
    h = header(b / "steps" / "1" / "optimizer.safetensors")
    check(h.get("model.layers.0.mlp.up_proj.weight.row_var", {}).get("shape") == [48, 1]
          and "model.norm.weight.variance" in h, "Adafactor's row_var/col_var/variance under their names")
    h0 = header(b / "steps" / "0" / "optimizer.safetensors")
    check(h0.get("model.layers.0.mlp.up_proj.weight.col_var", {}).get("shape") == [1, 32],
          "before the first update: the zeros Adafactor starts from, in its shapes")
    replayed(args.cli, b, "adafactor")

    o, b = record(work, "adafactor-hf", lambda m: HFAdafactor(m.parameters(), beta1=0.9, weight_decay=0.01),
                  lr=1e-3)
    check(o["kind"] == "adafactor_hf" and o["beta1"] == 0.9 and o["relative_step"] is True
          and o["eps"] == [1e-30, 1e-3], f"transformers' Adafactor by class name: {o}")
    h = header(b / "steps" / "1" / "optimizer.safetensors")
    check("model.layers.0.mlp.up_proj.weight.exp_avg_sq_row" in h and "model.norm.weight.exp_avg" in h
          and not any(k.endswith(".RMS") for k in h), "transformers' Adafactor state under its names, RMS not kept")
    replayed(args.cli, b, "adafactor-hf")

    raises("torch.optim.SGD", lambda: record(work, "sgd", lambda m: torch.optim.SGD(m.parameters(), lr=0.1)),
           "torch.optim.sgd.SGD")
    muon_run(args.cli, work)
    raises("Muon over the 2-D parameters only (the rest in another optimizer)",
           lambda: record(work, "muon", lambda m: Muon([p for p in m.parameters() if p.dim() == 2])),
           "parameters the optimizer does not update")
    raises("a hyper-parameter the class does not have",
           lambda: record(work, "adam-extra", lambda m: torch.optim.Adam(
               [{"params": list(m.parameters()), "momentum": 0.9}], lr=1e-3)), "momentum")
    print(f"{len(failures)} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
