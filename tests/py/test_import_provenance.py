"""`nanreplay import` says what it did not know (issue 37), and the capture self-check prefers an exact
match. Small models, no long training: a few seconds.

1. A checkpoint without any config: one line names every missing value (num_heads, norm_eps,
   rope_theta); the same values as flags import, and the manifest's provenance says "flag" for each.
2. llama2.c's ckpt.pt (model_args without norm_eps): norm_eps and rope_theta are llama2.c's defaults,
   printed DEFAULTED and recorded "from": "default"; its attention.mask buffer is skipped by name.
3. Missing parameters are listed all at once, beside the checkpoint's own names.
4. FIRST against the checkpoint's counters: iter_num and the optimizer's step count; a logged NaN
   outside the imported steps is an error.
5. HF Trainer's layout: optimizer.pt beside the weights is picked up, trainer_state.json's global_step
   (after the update, logged from 1) decides FIRST.
6. The self-check: a wrong norm_eps within the tolerance loses to the exact one; a wrong head count
   is named.
7. End to end (the CLI): a llama2.c run whose norm_eps was changed to 0.01 imports with the default,
   and the replay's verdict of non-reproduction names the defaulted model.norm_eps.
"""
import argparse
import contextlib
import io
import json
import shutil
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import import_support as s  # noqa: E402
import test_import_llama2c as l2c  # noqa: E402
import test_import_capture_selfcheck as sc  # noqa: E402
import torch_models  # noqa: E402
import nanreplay_import as ni  # noqa: E402
from nanreplay_capture import CaptureError, write_safetensors  # noqa: E402


def run(argv):
    """The script's main() in process: (exit status, stdout, stderr lines)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = ni.main([str(a) for a in argv])
    return rc, out.getvalue(), err.getvalue().strip().splitlines()


def refused(label, argv, *needles):
    rc, _, lines = run(argv)
    lines = [x for x in lines if not x.startswith("nanreplay: warning: ")]  # warnings share stderr: one error line
    line = lines[-1] if lines else ""
    s.check(rc == 2 and len(lines) == 1 and all(n in line for n in needles), f"{label}: exit {rc}, {line!r}")


def manifest_of(out):
    return json.loads((Path(out) / "manifest.json").read_text())


def llama2c_cases(work, data, log):
    torch.manual_seed(0)
    model = l2c.Transformer(l2c.ARGS)
    opt = model.configure_optimizers(0.1, 1e-3, (0.9, 0.95))
    base = [*data.flags(), "--log", log]

    # 1. no config: every missing value in one line; flags instead.
    bare = work / "bare.pt"
    torch.save({"model": model.state_dict()}, bare)
    refused("no config", ["--checkpoint", bare, *base, "--steps", "0:0", "--out", work / "o1"],
            "bare.pt: num_heads, norm_eps, rope_theta: missing", "--num-heads X --norm-eps X --rope-theta X")
    rc, out, err = run(["--checkpoint", bare, *base, "--steps", "0:0", "--num-heads", 4, "--norm-eps", 0,
                        "--rope-theta", 10000, "--out", work / "b1"])
    s.check(rc == 0, f"the values as flags import {err}")
    if rc == 0:
        p = manifest_of(work / "b1")["provenance"]
        s.check(p["model.num_heads"] == {"from": "flag", "detail": "--num-heads", "value": 4}
                and p["model.norm_eps"]["from"] == "flag" and p["model.norm_eps"]["value"] == 0.0
                and p["model.rope_theta"]["from"] == "flag" and p["model.num_kv_heads"]["from"] == "tensors"
                and p["model.rope_style"] == {"from": "naming", "detail": "meta naming: rotary over adjacent pairs, "
                                              "weights as stored", "value": "interleaved"},
                f"provenance: flags, tensors, naming {p}")
    refused("a flag contradicting the tensors", ["--checkpoint", bare, *base, "--steps", "0:0", "--num-heads", 4,
                                                 "--num-kv-heads", 4, "--norm-eps", 0, "--rope-theta", 1e4,
                                                 "--out", work / "o1b"], "--num-kv-heads: num_kv_heads: is 4")

    # 2. llama2.c's own layout, with its attention.mask buffer (a registered buffer, not a parameter).
    sd = dict(model.state_dict())
    for i in range(l2c.ARGS["n_layers"]):
        sd[f"layers.{i}.attention.mask"] = torch.full((1, 1, 16, 16), float("-inf")).triu(1)
    ckpt = work / "ckpt.pt"
    torch.save({"model": sd, "optimizer": opt.state_dict(), "model_args": l2c.ARGS, "iter_num": 0}, ckpt)
    rc, out, err = run(["--checkpoint", ckpt, *base, "--steps", "0:1", "--out", work / "b2"])
    warnings = [line for line in err if line.startswith("nanreplay: warning: ")]
    s.check(rc == 0, f"llama2.c's ckpt.pt with attention.mask imports {err}")
    if rc == 0:
        p = manifest_of(work / "b2")["provenance"]
        s.check(p["model.norm_eps"]["from"] == "default" and p["model.norm_eps"]["value"] == 1e-5
                and "llama2.c" in p["model.norm_eps"]["detail"] and p["model.rope_theta"]["from"] == "default"
                and p["model.num_heads"]["from"] == "checkpoint", f"llama2.c's defaults recorded as defaulted {p}")
        s.check(any("norm_eps: DEFAULTED, llama2.c's ModelArgs default" in w for w in warnings)
                and "DEFAULTED" not in out, f"the import warns of the default as DEFAULTED, on stderr only {warnings}")

    # 3. Two parameters missing: both named, beside the checkpoint's own names left over.
    cut = {k: v for k, v in model.state_dict().items() if "feed_forward.w1" not in k}
    cut["layers.0.feed_forward.gate.weight"] = torch.zeros(96, 32)
    torch.save({"model": cut, "model_args": l2c.ARGS}, work / "cut.pt")
    refused("missing parameters", ["--checkpoint", work / "cut.pt", *base, "--steps", "0:0", "--out", work / "o3"],
            "layers.0.feed_forward.gate.weight", "the checkpoint's names the preset does not know")

    # 4. FIRST against the counters: two updates done, iter_num 2.
    for step in range(2):
        x, y = data.batch(data.rows(step)[:data.mbs])
        model(x, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "model_args": l2c.ARGS}, work / "c2.pt")
    refused("FIRST against the optimizer's step count", ["--checkpoint", work / "c2.pt", *base, "--steps", "1:2",
                                                         "--out", work / "o4"], "--steps: FIRST is 1",
            "the optimizer's step count is 2", "FIRST is 2")
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "model_args": l2c.ARGS, "iter_num": 2},
               work / "c3.pt")
    refused("FIRST against iter_num, numbered from 1", ["--checkpoint", work / "c3.pt", *base, "--steps", "2:3",
                                                        "--log-numbering", "one", "--out", work / "o5"],
            "the checkpoint's iter_num is 2", "FIRST is 3")
    nan_log = s.write_log(work / "nan.jsonl", {i: {"step": i, "lr": 1e-3, "loss": 4.0 if i != 3 else float("nan")}
                                               for i in range(5)})
    refused("a logged NaN after the window", ["--checkpoint", work / "c3.pt", *data.flags(), "--log", nan_log,
                                              "--steps", "2:2", "--out", work / "o6"], "nan.jsonl: step 3.loss: nan",
            "after the last imported step")


HF_CONFIG = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 64, "max_position_embeddings": 16,
             "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "hidden_act": "silu", "tie_word_embeddings": False}


def hf_trainer_case(work, data):
    """checkpoint-2/: config.json, model.safetensors, optimizer.pt (HF Trainer's two groups, integer ids),
    trainer_state.json (global_step 2), rng_state.pth; the log numbered from 1, as the Trainer logs."""
    torch.manual_seed(2)
    model = torch_models.LlamaForCausalLM(dict(sc.HF, norm_eps=1e-6))
    decay = [p for _, p in model.named_parameters() if p.dim() >= 2]
    rest = [p for _, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                            lr=1e-3, betas=(0.9, 0.95), foreach=False)
    ckpt = work / "checkpoint-2"

    def save(step):
        if step == 2:
            ckpt.mkdir()
            (ckpt / "config.json").write_text(json.dumps(HF_CONFIG))
            write_safetensors(ckpt / "model.safetensors", [(n, t.detach().clone()) for n, t in model.state_dict().items()])
            torch.save(opt.state_dict(), ckpt / "optimizer.pt")
            (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": 2, "log_history": []}))
            torch.save({"python": None}, ckpt / "rng_state.pth")

    log = s.train(model, opt, data, 4, before_step=save)  # 0-based; the Trainer's log says step + 1
    hf_log = s.write_log(work / "hf.jsonl", {k + 1: dict(e, step=k + 1) for k, e in log.items()})  # from 1
    rc, out, err = run(["--checkpoint", ckpt, *data.flags(), "--log", hf_log, "--steps", "3:4", "--out", work / "hf"])
    s.check(rc == 0 and "optimizer: AdamW state of" in out and "checkpoint-2/optimizer.pt" in out
            and "trainer_state.json: global_step 2" in out, f"HF Trainer's optimizer.pt and trainer_state picked up {err}")
    rc, out, err = run(["--checkpoint", ckpt, *data.flags(), "--log", hf_log, "--steps", "3:3", "--norm-eps", 1e-5,
                        "--out", work / "hf-flag"])
    p = manifest_of(work / "hf-flag")["provenance"]["model.norm_eps"] if rc == 0 else err
    s.check(rc == 0 and p["from"] == "flag" and p["value"] == 1e-5 and "overrides" in p["detail"]
            and "rms_norm_eps 1e-06" in p["detail"], f"a flag overrides config.json and says so {p}")
    refused("FIRST against trainer_state's global_step", ["--checkpoint", ckpt, *data.flags(), "--log", hf_log,
                                                          "--steps", "2:4", "--out", work / "o7"],
            "trainer_state.json: global_step is 2", "numbered from 1", "FIRST is 3")


def selfcheck_cases(work):
    torch.manual_seed(1)
    model = torch_models.LlamaForCausalLM(dict(sc.HF, norm_eps=1e-6))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.1 if "embed" in n else 0.3)  # eps 1e-6 vs 1e-5: a gap under the 1e-4 tolerance
    for m in model.modules():
        if isinstance(m, torch_models.RMSNorm):
            m.__class__, m._e = sc.HiddenEps, m.eps
            del m.eps
    sc.raises("exact over within tolerance", lambda: sc.record(model, work / "near", 1,
                                                               model_config=dict(num_heads=4, rope_theta=10000.0)),
              "within the replay's tolerance", "norm_eps=1e-06", "gap 0.0e+00")
    # The recorder's own default: rope_theta 10000 that the model does not say, right, so the check passes.
    model = sc.hf_model(rope_theta=10000.0)
    del model.rope_theta
    recorder, _ = sc.record(model, work / "theta", 1, model_config=dict(num_heads=4))
    bundle = recorder.dump()
    p = json.loads((Path(bundle) / "manifest.json").read_text()).get("provenance", {})
    s.check(list(p) == ["model.rope_theta"] and p["model.rope_theta"]["from"] == "default"
            and p["model.rope_theta"]["value"] == 10000.0, f"a capture records the default it assumed {p}")
    torch.manual_seed(1)
    model = torch_models.LlamaForCausalLM(dict(sc.HF, num_heads=8, norm_eps=1e-5))
    sc.raises("a wrong head count", lambda: sc.record(model, work / "heads", 1, model_config=dict(num_heads=4)),
              "num_heads=8, num_kv_heads=2", "the head count")


def end_to_end(cli, work, data):
    """llama2.c with norm_eps changed to 0.01: model_args do not say it, the import defaults 1e-5."""
    torch.manual_seed(0)
    model = l2c.Transformer(l2c.ARGS, norm_eps=0.01)
    opt = model.configure_optimizers(0.1, 1e-3, (0.9, 0.95))
    ckpt = work / "eps.pt"
    log = s.train(model, opt, data, 3, before_step=lambda st: st == 1 and torch.save(
        {"model": model.state_dict(), "optimizer": opt.state_dict(), "model_args": l2c.ARGS, "iter_num": 1}, ckpt))
    s.write_log(work / "eps.jsonl", log)
    proc = s.run_import(cli, ["--checkpoint", ckpt, *data.flags(), "--log", work / "eps.jsonl", "--steps", "1:2"],
                        work / "eps-bundle")
    s.check(proc.returncode == 0 and "nanreplay: warning: norm_eps: DEFAULTED" in proc.stderr
            and "DEFAULTED" not in proc.stdout, f"import exits 0, warns DEFAULTED on stderr {proc.stderr.strip()}")
    if proc.returncode != 0:
        return
    if s.import_command(cli)[0] == cli:  # --json is the command's: one object on stdout, the warning on stderr too
        jproc = s.run_import(cli, ["--json", "--checkpoint", ckpt, *data.flags(), "--log", work / "eps.jsonl",
                                   "--steps", "1:2"], work / "eps-json")
        try:
            obj = json.loads(jproc.stdout)
        except ValueError:
            obj = {}
        s.check(jproc.returncode == 0 and obj.get("valid") is True and obj.get("bundle") == str(work / "eps-json")
                and any("norm_eps: DEFAULTED" in w for w in obj.get("warnings", [])) and obj.get("notes")
                and "nanreplay: warning: norm_eps: DEFAULTED" in jproc.stderr,
                f"import --json: one object with notes and warnings (exit {jproc.returncode}) {jproc.stdout[:300]!r}")
    rproc, report = s.run_replay(cli, work / "eps-bundle", work / "eps-out")
    s.check(report is not None, f"nanreplay run writes a report (exit {rproc.returncode}) {rproc.stderr.strip()}")
    if report is None:
        return
    said = [f for f in report["findings"] if f["code"] in ("BUNDLE_DOES_NOT_REPRODUCE", "SYSTEM_NOT_REPRODUCIBLE")]
    s.check(bool(said) and all("model.norm_eps = 1e-05" in f["message"] for f in said),
            f"the non-reproduction verdict names the defaulted norm_eps {[f['message'][-300:] for f in said]}")
    s.check([d["key"] for d in report.get("defaulted_values", [])] == ["model.norm_eps", "model.rope_theta"],
            f"report.json's defaulted_values {report.get('defaulted_values')}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cli", required=True)
    ap.add_argument("--work", required=True)
    args = ap.parse_args()
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    torch.set_num_threads(1)
    data = s.Data(work, 64, 16, 2, 1, num_samples=32, seed=1)
    log = s.write_log(work / "log.jsonl", {i: {"step": i, "lr": 1e-3, "loss": 4.0} for i in range(6)})
    llama2c_cases(work, data, log)
    hf_trainer_case(work, data)
    selfcheck_cases(work)
    end_to_end(args.cli, work, data)
    return s.finish()


if __name__ == "__main__":
    sys.exit(main())
