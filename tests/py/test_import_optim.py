"""`nanreplay import` of optimizer states beyond AdamW, read by the names of their state entries and
their param_groups' hyper-parameters: torch.optim.Adam and AdamW (a real torch.save'd state_dict()
with integer ids), torch.optim.Adafactor (row_var/col_var/variance), transformers' Adafactor
(exp_avg_sq_row/exp_avg_sq_col/exp_avg_sq/exp_avg, RMS) and torch.optim.Muon (momentum_buffer). The
LibTorch/PyTorch here (1.13) has neither Adafactor nor Muon: those state dicts are written by hand
with the entry and key names of upstream's torch/optim/_adafactor.py, torch/optim/_muon.py and
transformers/optimization.py. Each import must give the manifest the right `kind` and
hyper-parameters and be replayed by `nanreplay run` (which checks the bundle as `inspect` does; the
logged loss is made up, so exit 1 is fine); an unknown class and Adam-vs-AdamW contradictions are
refused by name, exit 2, one line. Tiny: a 1-layer llama, no training.

Then a Muon run end to end (muon_run_rolled): a 2-layer llama (torch_models) trained ten steps in PyTorch
with torch.optim.Muon over its hidden matrices, transcribed from upstream's torch/optim/_muon.py in
test_optim_crosscheck.muon_step (imported, not copied), and torch.optim.AdamW itself over the rest, each on
its own lr schedule; imported at its first step by the importer `nanreplay import` runs, with
--aux-optimizer and the log's lr and aux_lr, rolled forward by `nanreplay run` and compared with the PyTorch run step by step.
"""
import argparse
import math
import contextlib
import io
import json
import shutil
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import import_support as s  # noqa: E402
import nanreplay_capture as cap  # noqa: E402
import nanreplay_import as ni  # noqa: E402

V, D, F, H = 32, 16, 24, 2
SEQ, MBS, FIRST, LAST = 8, 2, 3, 4
CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": V, "hidden_size": D,
          "intermediate_size": F, "num_hidden_layers": 1, "num_attention_heads": H, "num_key_value_heads": H,
          "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
          "hidden_act": "silu", "torch_dtype": "float32"}


def params():
    g = torch.Generator().manual_seed(3)
    shapes = [("model.embed_tokens.weight", (V, D)),
              ("model.layers.0.self_attn.q_proj.weight", (D, D)), ("model.layers.0.self_attn.k_proj.weight", (D, D)),
              ("model.layers.0.self_attn.v_proj.weight", (D, D)), ("model.layers.0.self_attn.o_proj.weight", (D, D)),
              ("model.layers.0.mlp.gate_proj.weight", (F, D)), ("model.layers.0.mlp.up_proj.weight", (F, D)),
              ("model.layers.0.mlp.down_proj.weight", (D, F)),
              ("model.layers.0.input_layernorm.weight", (D,)), ("model.layers.0.post_attention_layernorm.weight", (D,)),
              ("model.norm.weight", (D,)), ("lm_head.weight", (V, D))]
    return [(n, torch.ones(sh) if len(sh) == 1 else torch.randn(sh, generator=g) * 0.05) for n, sh in shapes]


def write_inputs(work):
    ckpt = work / "hf"
    ckpt.mkdir(parents=True)
    (ckpt / "config.json").write_text(json.dumps(CONFIG))
    cap.write_safetensors(ckpt / "model.safetensors", params())
    tokens = torch.randint(1, V, (64 * SEQ + 1,), generator=torch.Generator().manual_seed(5))
    (work / "tokens.bin").write_bytes(bytes(tokens.to(torch.int16).contiguous().view(torch.uint8).tolist()))
    s.write_log(work / "log.jsonl", {st: {"step": st, "lr": 1e-3, "loss": 3.4} for st in range(FIRST, LAST + 1)})
    return ckpt


def flags(work, ckpt, optim, extra=()):
    return ["--checkpoint", ckpt, "--optimizer", optim, *extra, "--data", work / "tokens.bin", "--seq-len", SEQ,
            "--micro-batch-size", MBS, "--sampler-seed", 1, "--log", work / "log.jsonl", "--steps", f"{FIRST}:{LAST}"]


def torch_state(cls, **kw):
    """A real torch.optim state_dict(): one group over the parameters in model order, after one step
    (integer ids, as optimizer.state_dict() writes them)."""
    ps = [torch.nn.Parameter(t.clone()) for _, t in params()]
    opt = cls(ps, lr=1e-3, **kw)
    sum((p * p).sum() for p in ps).backward()
    opt.step()
    for st in opt.state.values():
        st["step"] = torch.tensor(float(FIRST))
    return opt.state_dict()


def by_name(entries, group):
    """A state dict keyed by parameter name (get_optimizer_state_dict's layout)."""
    return {"state": entries, "param_groups": [dict(group, params=list(entries))]}


def adafactor_torch():
    st = {}
    for n, t in params():
        e = {"step": torch.tensor(float(FIRST))}
        if t.dim() > 1:
            e["row_var"] = torch.rand(t.shape[0], 1) * 1e-3
            e["col_var"] = torch.rand(1, t.shape[1]) * 1e-3
        else:
            e["variance"] = torch.rand(t.shape) * 1e-3
        st[n] = e
    return by_name(st, {"lr": 1e-2, "beta2_decay": -0.8, "eps": (None, 1e-3), "d": 1.0, "weight_decay": 0.0,
                        "foreach": None, "maximize": False})


def adafactor_hf():
    st = {}
    for n, t in params():
        e = {"step": FIRST, "RMS": 0.5, "exp_avg": torch.zeros(t.shape)}
        if t.dim() > 1:
            e["exp_avg_sq_row"] = torch.rand(t.shape[0]) * 1e-3
            e["exp_avg_sq_col"] = torch.rand(t.shape[1]) * 1e-3
        else:
            e["exp_avg_sq"] = torch.rand(t.shape) * 1e-3
        st[n] = e
    return by_name(st, {"lr": None, "eps": (1e-30, 1e-3), "clip_threshold": 1.0, "decay_rate": -0.8, "beta1": 0.9,
                        "weight_decay": 0.01, "scale_parameter": True, "relative_step": True, "warmup_init": False})


def muon():
    """torch.optim.Muon over the 2-D parameters; its run's AdamW over the rest (by name)."""
    st = {n: {"momentum_buffer": torch.randn(t.shape) * 1e-3} for n, t in params() if t.dim() == 2}
    rest = {n: {"step": torch.tensor(float(FIRST)), "exp_avg": torch.randn(t.shape) * 1e-3,
                "exp_avg_sq": torch.rand(t.shape) * 1e-6} for n, t in params() if t.dim() != 2}
    return (by_name(st, {"lr": 2e-2, "weight_decay": 0.1, "momentum": 0.95, "nesterov": True,
                         "ns_coefficients": (3.4445, -4.775, 2.0315), "eps": 1e-7, "ns_steps": 5,
                         "adjust_lr_fn": "match_rms_adamw", "use_addmm": False}),
            by_name(rest, {"lr": 2e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.0, "amsgrad": False,
                           "maximize": False, "foreach": None, "capturable": False, "differentiable": False,
                           "fused": None}))


def import_in_process(argv, out):
    """The importer's main() here (no interpreter and torch start per case): (exit code, stderr)."""
    shutil.rmtree(out, ignore_errors=True)
    buf_out, buf_err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(buf_out), contextlib.redirect_stderr(buf_err):
        rc = ni.main([str(a) for a in argv] + ["--out", str(out)])
    return rc, buf_err.getvalue()


def imported(cli, work, ckpt, label, state, extra=(), replay=True):
    path = work / f"{label}.pt"
    torch.save(state, path)
    out = work / f"bundle-{label}"
    rc, err = import_in_process(flags(work, ckpt, path, extra), out)
    s.check(rc == 0, f"{label}: import exits 0 ({err.strip()[-300:]})")
    if rc != 0:
        return None
    if replay:  # run checks the bundle as inspect does, then replays the derived step (exit 1: the
        # logged loss, made up here, is not the model's)
        rp = subprocess.run([cli, "run", str(out), "--out", str(work / f"run-{label}")], capture_output=True, text=True)
        s.check(rp.returncode in (0, 1) and (work / f"run-{label}" / "report.json").exists(),
                f"{label}: nanreplay run replays it (exit {rp.returncode} {rp.stderr.strip()[-300:]})")
    return json.loads((out / "manifest.json").read_text())["optimizer"]


def provenance(work, label):
    """The imported bundle's provenance block (docs/bundle-format.md, "Provenance")."""
    path = work / f"bundle-{label}" / "manifest.json"
    return json.loads(path.read_text()).get("provenance", {}) if path.exists() else {}


def refused(cli, work, ckpt, label, state, extra, key_part):
    path = work / f"{label}.pt"
    torch.save(state, path)
    out = work / f"bundle-{label}"
    rc, err = import_in_process(flags(work, ckpt, path, extra), out)
    lines = [x for x in err.strip().splitlines() if not x.startswith("nanreplay: warning: ")]
    s.check(rc == 2 and len(lines) == 1 and key_part in lines[0] and "Traceback" not in err,
            f"{label}: refused, exit 2, one line naming {key_part!r} (exit {rc}: {err.strip()})")


MUON_LR, ADAMW_LR = 0.02, 3e-4


def two_learning_rates(cli, work, ckpt, mu, rest):
    """Muon at 0.02 over the 2-D weights and AdamW at 3e-4 over the rest (torchtitan's
    OptimizersContainer, or a hand-written loop, saves each optimizer's state_dict): each optimizer's
    lr from the log (`lr`, `aux_lr`) by group into state.json, refused by name without `aux_lr`. The
    replay of such a run over ten steps: muon_run_rolled."""
    mu = dict(mu, param_groups=[dict(mu["param_groups"][0], lr=MUON_LR)])
    torch.save(dict(rest, param_groups=[dict(rest["param_groups"][0], lr=ADAMW_LR)]), work / "two-lr-adamw.pt")
    extra = ["--optimizer-class", "torch.optim.Muon", "--aux-optimizer", work / "two-lr-adamw.pt"]
    refused(cli, work, ckpt, "two-lr-no-aux-lr", mu, extra, "aux_lr")
    plain_log = (work / "log.jsonl").read_text()
    s.write_log(work / "log.jsonl", {st: {"step": st, "lr": MUON_LR, "aux_lr": ADAMW_LR, "loss": 3.4}
                                     for st in range(FIRST, LAST + 1)})
    try:
        o = imported(cli, work, ckpt, "two-lr", mu, extra, replay=False)
    finally:
        (work / "log.jsonl").write_text(plain_log)
    if o is None:
        return
    lr = json.loads((work / "bundle-two-lr" / "steps" / str(FIRST) / "state.json").read_text()).get("lr")
    want = {"default": MUON_LR, **{g["name"]: (ADAMW_LR if g["name"].startswith("aux_") else MUON_LR)
                                   for g in o.get("groups", [])}}
    s.check(lr == want and any(g.startswith("aux_") for g in want), f"state.json lr by group: {lr}, want {want}")


# ---- A Muon run rolled forward ten steps against the references (muon_run_rolled) ----
RUN = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_layers": 2, "num_heads": 4,
       "num_kv_heads": 2, "rope_theta": 10000.0, "norm_eps": 1e-5}
RUN_HF = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 64, "hidden_size": 32,
          "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
          "hidden_act": "silu", "torch_dtype": "float32"}
RUN_MUON = {"weight_decay": 0.1, "momentum": 0.95, "nesterov": True, "ns_coefficients": (3.4445, -4.775, 2.0315),
            "eps": 1e-7, "ns_steps": 5, "adjust_lr_fn": "match_rms_adamw"}
RUN_FIRST, RUN_STEPS, RUN_SEQ, RUN_MBS = 2, 10, 16, 2
RUN_TOLERANCE, RUN_STATS_TOLERANCE = 1e-6, 1e-3  # losses and gradient norms; update RMS (test_optim_crosscheck)


def muon_lr(step):
    """Muon's schedule: a decay. With adjust_lr_fn "match_rms_adamw" Muon takes AdamW-sized rates."""
    return 4e-4 * (1.0 - step / 40)


def adamw_lr(step):
    """AdamW's own schedule, a warmup: each step's pair of rates differs."""
    return 2e-3 * min(1.0, (step + 1) / 8)


def train_muon_run(work):
    """The reference run: a tiny llama (torch_models), torch.optim.Muon over the hidden matrices (the
    transcription of torch/optim/_muon.py in test_optim_crosscheck.muon_step) and torch.optim.AdamW over
    the rest, each with its own lr schedule, clip_grad_norm_ 1.0. Saved at the start of RUN_FIRST as a
    Hugging Face directory and two name-keyed optimizer state dicts. Returns (log, {(step, param):
    update RMS}, data)."""
    import test_optim_crosscheck as oc
    import torch_models
    torch.manual_seed(11)
    model = torch_models.LlamaForCausalLM(RUN)
    data = s.Data(work, RUN["vocab_size"], RUN_SEQ, RUN_MBS, 1, num_samples=64, seed=3)
    named = dict(model.named_parameters())
    hidden = [n for n, p in named.items() if p.dim() == 2 and n.startswith("model.layers.")]
    adamw = torch.optim.AdamW([p for n, p in named.items() if n not in hidden], lr=adamw_lr(0), betas=(0.9, 0.95),
                              eps=1e-8, weight_decay=0.1, foreach=False)
    muon = {n: {"momentum_buffer": torch.zeros_like(named[n]), "step": 0} for n in hidden}
    log, updates = {}, {}
    for step in range(RUN_FIRST + RUN_STEPS + 1):
        if step == RUN_FIRST:
            save_muon_run(work, model, adamw, muon, hidden, step)
        for g in adamw.param_groups:
            g["lr"] = adamw_lr(step)
        loss = model(*data.batch(data.rows(step)))
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(list(named.values()), 1.0)
        log[step] = {"step": step, "lr": muon_lr(step), "aux_lr": adamw_lr(step), "loss": loss.item(),
                     "grad_norm": float(norm)}
        before = {n: p.detach().double().clone() for n, p in named.items()}
        with torch.no_grad():
            for n in hidden:
                oc.muon_step(named[n].data, named[n].grad, muon[n], muon_lr(step), **RUN_MUON)
        adamw.step()
        model.zero_grad(set_to_none=True)
        for n, p in named.items():
            updates[(step, n)] = ((p.detach().double() - before[n]).norm() / math.sqrt(p.numel())).item()
    return log, updates, data


def save_muon_run(work, model, adamw, muon, hidden, step):
    ckpt = work / "hf"
    ckpt.mkdir(parents=True, exist_ok=True)
    (ckpt / "config.json").write_text(json.dumps(RUN_HF))
    cap.write_safetensors(ckpt / "model.safetensors", [(k, v.detach().clone()) for k, v in model.state_dict().items()])
    group = dict(RUN_MUON, lr=muon_lr(step - 1), use_addmm=False, params=hidden)  # the scheduler's last lr
    torch.save({"state": {n: {"momentum_buffer": muon[n]["momentum_buffer"].clone()} for n in hidden},
                "param_groups": [group]}, work / "muon.pt")
    torch.save(s.name_keyed(model, adamw), work / "adamw.pt")


def rolled_departures(cli, work, label, log, updates, data):
    """Import the run's first checkpoint with `log` (every later step derived), replay it, and list every
    derived step whose loss or gradient norm (of the derived parameters) or any tensor's update RMS departs
    from the reference run's."""
    last = RUN_FIRST + RUN_STEPS
    s.write_log(work / f"{label}.jsonl", log)
    # The importer's main(), which `nanreplay import` runs, in this process: no interpreter and torch start.
    rc, err = import_in_process(["--checkpoint", work / "hf", "--optimizer", work / "muon.pt",
                                 "--optimizer-class", "torch.optim.Muon", "--aux-optimizer", work / "adamw.pt",
                                 "--aux-optimizer-class", "torch.optim.AdamW", *data.flags(), "--log",
                                 work / f"{label}.jsonl", "--steps", f"{RUN_FIRST}:{last}", "--grad-clip", 1.0],
                                work / f"bundle-{label}")
    if rc != 0:
        return [f"import exits {rc}: {err.strip()[-300:]}"]
    rp = subprocess.run([cli, "run", str(work / f"bundle-{label}"), "--out", str(work / f"run-{label}"), "--json",
                         "--no-probes"], capture_output=True, text=True)
    if rp.returncode not in (0, 1) or not rp.stdout.strip():
        return [f"run exits {rp.returncode}: {rp.stderr.strip()[-300:]}"]
    report = json.loads(rp.stdout)
    rows = {r["step"]: r for r in report["steps"]}
    out = [] if [rows[k]["params"] for k in sorted(rows)] == ["checkpoint"] + ["derived"] * RUN_STEPS else [
        f"steps {[(k, rows[k]['params']) for k in sorted(rows)]}, want {RUN_FIRST} then {RUN_STEPS} derived"]
    worst = 0.0
    for step in range(RUN_FIRST + 1, last + 1):
        for key in ("loss", "grad_norm"):
            got, want = (rows.get(step) or {}).get(key), log[step][key]
            relative = s.rel_err(got, want) if got is not None else math.inf
            worst = max(worst, relative)
            if relative > RUN_TOLERANCE:
                out.append(f"derived step {step} {key} {got!r}, the reference's {want!r} ({relative:.3g} relative)")
    for row in report.get("update_stats", []):
        for t in row["tensors"]:
            want = updates[(row["step"], t["param"])]
            if abs(t["update_rms"] - want) > RUN_STATS_TOLERANCE * want:
                out.append(f"step {row['step']} {t['param']} update RMS {t['update_rms']!r}, the reference's {want!r}")
    print(f"{label}: largest relative difference of a derived step's loss or gradient norm {worst:.3g}")
    return out


def muon_run_rolled(cli, work, show_departure):
    """A Muon run's two optimizers, each with its own lr schedule, imported at one checkpoint and rolled
    forward ten steps (docs/rolling-forward.md): every derived step's loss and gradient norm equal the
    reference run's to 1e-6 relative (they are functions of the derived parameters), every update's RMS to
    1e-3. With --show-departure, the same with the log's aux_lr replaced by its lr (AdamW at Muon's rate):
    the check must fail, and the departures are printed."""
    work.mkdir(parents=True, exist_ok=True)
    log, updates, data = train_muon_run(work)
    failures = rolled_departures(cli, work, "muon-run", log, updates, data)
    for f in failures[:8]:
        print("     " + f)
    s.check(not failures, f"Muon + AdamW rolled forward {RUN_STEPS} steps from one checkpoint: derived losses "
                          f"and gradient norms within {RUN_TOLERANCE}, update RMS within {RUN_STATS_TOLERANCE}")
    if show_departure:
        wrong = {k: dict(e, aux_lr=e["lr"]) for k, e in log.items()}
        departed = rolled_departures(cli, work, "muon-run-aux-lr-ignored", wrong, updates, data)
        for f in departed[:6]:
            print("     " + f)
        s.check(bool(departed), f"with aux_lr ignored (AdamW at Muon's lr) the check fails: {len(departed)} departures")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cli", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--show-departure", action="store_true", help="also replay with aux_lr ignored: must fail")
    args = ap.parse_args()
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    ckpt = write_inputs(work)
    cli = args.cli

    o = imported(cli, work, ckpt, "adamw", torch_state(torch.optim.AdamW, betas=(0.9, 0.95), weight_decay=0.1),
                 replay=False)  # AdamW's own path, replayed by the other import tests
    s.check(o is not None and o["kind"] == "adamw" and o["betas"] == [0.9, 0.95] and o["weight_decay"] == 0.1,
            f"AdamW by default for exp_avg/exp_avg_sq: {o}")
    # exp_avg/exp_avg_sq do not say Adam or AdamW: with a weight decay the class changes the math, so the
    # AdamW the importer takes is recorded as a default; without one the two coincide.
    kind_from = lambda label: provenance(work, label).get("optimizer.kind", {}).get("from")  # noqa: E731
    s.check(kind_from("adamw") == "default", f"AdamW assumed under weight decay, recorded as a default: "
                                               f"{provenance(work, 'adamw').get('optimizer.kind')}")
    o = imported(cli, work, ckpt, "adamw-nodecay", torch_state(torch.optim.AdamW, weight_decay=0.0), replay=False)
    s.check(o is not None and o["kind"] == "adamw" and kind_from("adamw-nodecay") == "checkpoint",
            f"no weight decay: Adam and AdamW coincide, not a default: {provenance(work, 'adamw-nodecay')}")
    o = imported(cli, work, ckpt, "adamw-amsgrad", torch_state(torch.optim.AdamW, weight_decay=0.1, amsgrad=True))
    s.check(o is not None and o["kind"] == "adamw" and o["amsgrad"] is True and o["weight_decay"] == 0.1,
            f"AdamW with amsgrad (max_exp_avg_sq) read by name: {o}")
    o = imported(cli, work, ckpt, "adam", torch_state(torch.optim.Adam, betas=(0.9, 0.95), weight_decay=0.01,
                                                      amsgrad=True), ["--optimizer-class", "torch.optim.Adam"])
    s.check(o is not None and o["kind"] == "adam" and o["betas"] == [0.9, 0.95] and o["weight_decay"] == 0.01
            and o["amsgrad"] is True, f"Adam (--optimizer-class), L2 weight decay and amsgrad from param_groups: {o}")
    s.check(kind_from("adam") == "flag", f"the class from --optimizer-class: {provenance(work, 'adam')}")
    sd = torch_state(torch.optim.Adam, weight_decay=0.01)
    for g in sd["param_groups"]:
        g["decoupled_weight_decay"] = False  # PyTorch 2.7's Adam says it in its param_groups
    o = imported(cli, work, ckpt, "adam-dwd", sd, replay=False)
    s.check(o is not None and o["kind"] == "adam" and o.get("decoupled_weight_decay") is False,
            f"Adam inferred from param_groups' decoupled_weight_decay false: {o}")
    refused(cli, work, ckpt, "adamw-contradicted", sd, ["--optimizer-class", "torch.optim.AdamW"], "param_groups")
    stepless = torch_state(torch.optim.AdamW, weight_decay=0.1)
    for st in stepless["state"].values():
        del st["step"]  # moments without their update count: bias correction would be guessed
    refused(cli, work, ckpt, "adamw-stepless", stepless, [], ".step")

    o = imported(cli, work, ckpt, "adafactor", adafactor_torch())
    s.check(o is not None and o["kind"] == "adafactor" and o["beta2_decay"] == -0.8 and o["eps"] == [None, 1e-3]
            and o["d"] == 1.0 and "lr" not in o and "foreach" not in o, f"torch.optim.Adafactor: {o}")
    flat = {}  # flatten_optimizer_state_dict's layout (torchtitan, DCP)
    for n, e in adafactor_torch()["state"].items():
        flat.update({f"state.{n}.{k}": v for k, v in e.items()})
        flat.update({f"param_groups.{n}.{k}": v for k, v in adafactor_torch()["param_groups"][0].items()
                     if k != "params"})
    o = imported(cli, work, ckpt, "adafactor-flat", flat, replay=False)
    s.check(o is not None and o.get("kind") == "adafactor" and o.get("beta2_decay") == -0.8 and "groups" not in o,
            f"torch.optim.Adafactor in the flattened layout: {o}")
    o = imported(cli, work, ckpt, "adafactor-hf", adafactor_hf(), ["--optimizer-class", "transformers.Adafactor"])
    s.check(o is not None and o["kind"] == "adafactor_hf" and o["beta1"] == 0.9 and o["relative_step"] is True
            and o["eps"] == [1e-30, 1e-3] and o["weight_decay"] == 0.01, f"transformers' Adafactor: {o}")
    # As HF Trainer saves it (optim="adafactor"): optimizer.state_dict(), integer ids, the matrices with weight
    # decay in group 0 and the norms without in group 1.
    hf = adafactor_hf()
    names = [n for n, _ in params()]
    order = [n for n, t in params() if t.dim() == 2] + [n for n, t in params() if t.dim() != 2]
    g = dict(hf["param_groups"][0])
    by_id = {"state": {i: hf["state"][n] for i, n in enumerate(order)},
             "param_groups": [dict(g, params=list(range(9))), dict(g, weight_decay=0.0, params=list(range(9, 12)))]}
    o = imported(cli, work, ckpt, "adafactor-hf-ids", by_id, replay=False)
    grp = (o or {}).get("groups", [{}])
    s.check(o is not None and o["kind"] == "adafactor_hf" and o["weight_decay"] == 0.01 and len(grp) == 1
            and grp[0].get("weight_decay") == 0.0 and sorted(grp[0].get("params", [])) ==
            sorted(n for n in names if n not in order[:9]), f"HF Trainer's two groups by integer id: {o}")
    b = work / "bundle-adafactor-hf" / "steps" / str(FIRST) / "optimizer.safetensors"
    if b.exists():
        header = json.loads(b.read_bytes()[8:8 + int.from_bytes(b.read_bytes()[:8], "little")])
        s.check("model.layers.0.mlp.up_proj.weight.exp_avg_sq_row" in header and
                "model.norm.weight.exp_avg_sq" in header and not any(k.endswith(".RMS") for k in header),
                "transformers' Adafactor state under the spec's names, RMS left to the replay")
    # Muon takes only the 2-D parameters: the norms go to the run's second optimizer, an AdamW.
    mu, rest = muon()
    torch.save(rest, work / "muon-adamw.pt")
    torch.save(mu, work / "muon-alone.pt")  # alone, it leaves the 1-D norms to Muon: the replay refuses it
    import_in_process(flags(work, ckpt, work / "muon-alone.pt"), work / "bundle-muon-alone")
    ip = subprocess.run([cli, "inspect", str(work / "bundle-muon-alone")], capture_output=True, text=True)
    s.check(ip.returncode == 2 and "optimizer.kind" in ip.stderr and "2-D" in ip.stderr,
            f"Muon alone over 1-D norms: inspect refuses it by name ({ip.returncode}: {ip.stderr.strip()})")
    torch.save(dict(rest, param_groups=[dict(rest["param_groups"][0], lr=3e-3)]), work / "muon-adamw-lr.pt")
    refused(cli, work, ckpt, "muon-lr", mu, ["--aux-optimizer", work / "muon-adamw-lr.pt"], "param_groups.lr")
    o = imported(cli, work, ckpt, "muon", mu, ["--optimizer-class", "torch.optim.Muon",
                                               "--aux-optimizer", work / "muon-adamw.pt"])
    aux = (o or {}).get("groups", [{}])[-1]
    s.check(o is not None and o["kind"] == "muon" and o["momentum"] == 0.95 and o["nesterov"] is True
            and o["ns_coefficients"] == [3.4445, -4.775, 2.0315] and o["adjust_lr_fn"] == "match_rms_adamw"
            and o["ns_steps"] == 5 and o["weight_decay"] == 0.1, f"torch.optim.Muon: {o}")
    s.check(aux.get("kind") == "adamw" and aux.get("betas") == [0.9, 0.95] and aux.get("weight_decay") == 0.0
            and sorted(aux.get("params", [])) == sorted(n for n, t in params() if t.dim() == 1),
            f"the Muon run's AdamW: a group of its own over the 1-D parameters: {aux}")

    two_learning_rates(cli, work, ckpt, mu, rest)
    muon_run_rolled(cli, work / "muon-run", args.show_departure)

    # A norm in both optimizers' groups (join_optimizer_groups, shared with the capture helper).
    both = by_name(dict(rest["state"]), rest["param_groups"][0])
    both["state"]["model.layers.0.self_attn.q_proj.weight"] = dict(next(iter(rest["state"].values())))
    both["param_groups"][0]["params"] = list(both["state"])
    torch.save(both, work / "muon-adamw-both.pt")
    refused(cli, work, ckpt, "muon-both", mu, ["--optimizer-class", "torch.optim.Muon", "--aux-optimizer",
                                                work / "muon-adamw-both.pt"], "is in both optimizers' groups")
    # Megatron's Muon (emerging_optimizers' OrthogonalizedOptimizer: momentum_beta, use_nesterov, ... in its
    # param_groups) is not torch.optim.Muon, even when the flag says so.
    emerging = by_name(dict(mu["state"]), {"lr": 2e-2, "momentum_beta": 0.95, "use_nesterov": True, "weight_decay": 0.1,
                                           "use_decoupled_wd": True, "use_independent_wd": False})
    refused(cli, work, ckpt, "muon-emerging", emerging, ["--optimizer-class", "torch.optim.Muon", "--aux-optimizer",
                                                          work / "muon-adamw.pt"], "param_groups.0.momentum_beta")
    refused(cli, work, ckpt, "unknown-class", adafactor_torch(), ["--optimizer-class", "torch.optim.SGD"],
            "torch.optim.SGD")
    sgd = by_name({n: {"momentum_buffer": torch.zeros(t.shape)} for n, t in params()},
                  {"lr": 0.1, "momentum": 0.9, "dampening": 0, "nesterov": False, "weight_decay": 0})
    refused(cli, work, ckpt, "sgd-inferred", sgd, [], "momentum_buffer")
    return s.finish()


if __name__ == "__main__":
    sys.exit(main())
