"""capture/nanreplay_capture.py's Recorder with optimizers beyond AdamW (docs/capture.md, "Optimizers"):
accepted by class name (type(opt).__module__ + __qualname__), hyper-parameters read from the
param_groups and state from optimizer.state by the class's own names, anything else refused by name.

torch.optim.Adam is the real one (amsgrad, L2 weight decay). PyTorch 1.13 has neither torch.optim.Adafactor
nor transformers: those are stand-ins named as upstream names them (torch.optim._adafactor.Adafactor,
transformers.optimization.Adafactor), stepping with test_optim_crosscheck.py's transcriptions of the
upstream update and keeping the upstream state entries. Each records three steps; `nanreplay run`
replays the bundle (the derived updates must match what the stand-in computed). ~10 s.
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


class Muon(_StandIn):
    rule, hyper_keys = staticmethod(ref.muon_step), ()

    def __init__(self, params, lr=2e-2):
        super().__init__(params, dict(lr=lr, weight_decay=0.1, momentum=0.95, nesterov=True,
                                      ns_coefficients=(3.4445, -4.775, 2.0315), eps=1e-7, ns_steps=5,
                                      adjust_lr_fn=None, use_addmm=False))


Muon.__module__, Muon.__qualname__ = "torch.optim._muon", "Muon"


def record(work, label, make_opt, lr=None):
    torch.manual_seed(0)
    model = torch_models.LlamaForCausalLM(dict(LLAMA))
    opt = make_opt(model)
    recorder = nanreplay_capture.Recorder(
        model, opt, work / f"incidents-{label}", arch="llama", window=STEPS,
        model_config=dict(num_heads=LLAMA["num_heads"]),
        data=dict(shards=[str(work / "tokens.bin")], seq_len=SEQ_LEN, micro_batch_size=MICRO_BATCH))
    tokens = TOKENS
    for step in range(STEPS):
        samples = [2 * step, 2 * step + 1]
        window = torch.stack([tokens[i * SEQ_LEN:i * SEQ_LEN + SEQ_LEN + 1] for i in samples])
        recorder.begin_step(step, samples=samples, lr=lr if lr is not None else opt.param_groups[0]["lr"] or 1e-3)
        loss = model(window[:, :-1], window[:, 1:])
        loss.backward()
        recorder.end_step(loss=loss)
        opt.step()
        opt.zero_grad(set_to_none=True)
    bundle = recorder.dump(work / f"bundle-{label}")
    return json.loads((bundle / "manifest.json").read_text())["optimizer"], bundle


def header(path):
    raw = Path(path).read_bytes()
    return json.loads(raw[8:8 + int.from_bytes(raw[:8], "little")])


def replayed(cli, bundle, label):
    out = bundle.parent / f"run-{label}"
    shutil.rmtree(out, ignore_errors=True)
    proc = subprocess.run([cli, "run", str(bundle), "--out", str(out)], capture_output=True, text=True)
    check(proc.returncode == 0, f"{label}: nanreplay run replays the recorded steps (exit {proc.returncode} "
                                f"{proc.stderr.strip()[-400:]})")


def raises(what, fn, *needles):
    try:
        fn()
    except CaptureError as e:
        missing = [n for n in needles if n not in str(e)]
        check(not missing, f"{what}: CaptureError names {list(needles)}" + (f" (got: {e})" if missing else ""))
        return
    check(False, f"{what}: raises CaptureError (it did not)")


TOKENS = torch.randint(0, LLAMA["vocab_size"], (16 * SEQ_LEN + 1,), generator=torch.Generator().manual_seed(5))


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
