"""The capture helper's naming presets and its self-check (the capture half of `nanreplay import`'s
issue): on the first captured step the recorder computes bundle v1's model on the step's real
batch and compares its loss with the loss the user's model logged.

1. param_names="meta" on llama2.c's model (Meta names, interleaved rotary, tied head): the preset
   renames, implies rope_style "interleaved", norm_eps is read off the renamed norm modules, num_heads
   and rope_theta off model.params; the self-check passes, and the dumped bundle replays to the
   logged losses (fp32, 1e-5).
2. The same model renamed by hand (a dict), rope_style left at its default: CaptureError naming
   rope_style='interleaved'.
3. An HF-named llama whose norms keep eps = 1e-6 where the recorder cannot see it (the spec's default
   1e-5 is assumed): CaptureError naming norm_eps=1e-06.
4. An HF-named llama with rope_theta 500000 that does not say so: CaptureError naming
   rope_theta=500000.0.
5. The self-check's reference (nanreplay_capture.reference_loss) computes, for every llama option
   and for gpt2, the same fp32 loss as the suite's independent reading of the bundle format
   (tests/py/reference_model.py).
"""
import argparse
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import import_support as s  # noqa: E402
import reference_model as rm  # noqa: E402
import test_rope_styles as trs  # noqa: E402  (its random llama parameters for every option)
import test_import_llama2c as l2c  # noqa: E402  (llama2.c's model)
import torch_models  # noqa: E402
from nanreplay_capture import CaptureError, Recorder, reference_loss  # noqa: E402

SEQ, MBS, SEED = 16, 2, 3
HF = dict(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64,
          norm_eps=1e-6, rope_theta=10000.0)


def record(model, work, steps, **kwargs):
    """A few training steps under a Recorder; returns (recorder, logged losses) or raises CaptureError."""
    work.mkdir(parents=True, exist_ok=True)
    data = s.Data(work, 64, SEQ, MBS, 1, num_samples=48, seed=SEED)
    opt = s.adamw(model.parameters())
    recorder = Recorder(model, opt, work / "incidents", arch="llama", window=steps, grad_clip=1.0,
                        data=dict(shards=[str(data.path)], seq_len=SEQ, micro_batch_size=MBS,
                                  sampler=dict(kind="randperm", seed=SEED)), **kwargs)
    log = {}
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = s.lr_at(step)
        recorder.begin_step(step)
        loss = model(*data.batch(data.rows(step)))
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        log[step] = {"step": step, "lr": s.lr_at(step), "loss": loss.item(), "grad_norm": float(norm)}
        recorder.end_step(loss=loss, grad_norm=norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return recorder, log


def raises(label, fn, *needles):
    try:
        fn()
    except CaptureError as e:
        text = str(e)
        print(f"     {text}")
        s.check(all(n in text for n in needles), f"{label}: CaptureError names {list(needles)}")
        return
    s.check(False, f"{label}: no CaptureError")


def hf_model(**changes):
    torch.manual_seed(1)
    model = torch_models.LlamaForCausalLM(dict(HF, **changes))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.002 if "embed" in n else 0.3)  # small embeddings: eps shows in the first norm
    return model


class HiddenEps(torch_models.RMSNorm):
    """An RMSNorm that keeps its eps under a name no recorder would look for."""

    def forward(self, x):
        return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + self._e) * self.weight


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cli", required=True)
    ap.add_argument("--work", required=True)
    args = ap.parse_args()
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    torch.set_num_threads(1)

    # 1. The meta preset.
    torch.manual_seed(0)
    model = l2c.Transformer(l2c.ARGS)
    model.params = SimpleNamespace(n_heads=l2c.ARGS["n_heads"], rope_theta=10000.0)  # llama2.c's ModelArgs
    recorder, log = record(model, work / "preset", 3, param_names="meta")
    cfg = recorder.model_config
    s.check(cfg.get("rope_style") == "interleaved" and cfg["norm_eps"] == 1e-5 and cfg["num_heads"] == 4
            and cfg["tie_embeddings"] and cfg["rope_theta"] == 10000.0,
            f"param_names='meta': interleaved, eps off the renamed norms, heads and theta off model.params {cfg}")
    r = recorder.self_check_result
    s.check(r is not None and r["step"] == 0 and r["relative"] < 1e-6,
            f"the self-check ran on step 0 and matched ({r})")
    bundle = recorder.dump(work / "preset" / "bundle")
    proc, report = s.run_replay(args.cli, bundle, work / "preset" / "out")
    s.check(proc.returncode == 0 and report is not None, f"the preset's bundle replays (exit {proc.returncode}) {proc.stderr.strip()}")
    if report:
        s.check_replay("meta preset", report, log, 0, 2, derived=False)

    # 2. Meta's layout renamed by hand, rotary left at rotate_half.
    torch.manual_seed(0)
    model = l2c.Transformer(l2c.ARGS)
    by_hand = {n: t for n, t in ((n, nanreplay_rename(n)) for n, _ in model.named_parameters())}
    by_hand["output.weight"] = "lm_head.weight"
    raises("wrong rotary convention", lambda: record(model, work / "rotary", 1, param_names=by_hand,
                                                     model_config=dict(num_heads=4)),
           "rope_style='interleaved'", "rotary convention")

    # 3. eps 1e-6 that the recorder cannot see (it assumes bundle v1's default 1e-5).
    model = hf_model()
    for m in model.modules():
        if isinstance(m, torch_models.RMSNorm):
            m.__class__, m._e = HiddenEps, m.eps
            del m.eps
    raises("wrong eps", lambda: record(model, work / "eps", 1, model_config=dict(num_heads=4, rope_theta=10000.0)),
           "norm_eps=1e-06", "(the recorder used norm_eps=1e-05)")

    # 4. rope_theta 500000 that the model does not say (bundle v1's default 10000 is assumed).
    model = hf_model(rope_theta=500000.0, norm_eps=1e-5)
    del model.rope_theta
    raises("wrong theta", lambda: record(model, work / "theta", 1, model_config=dict(num_heads=4)),
           "rope_theta=500000.0", "(the recorder used rope_theta=10000.0)")

    # 5. The self-check's reference against reference_model.py, option by option.
    g = torch.Generator().manual_seed(4)
    x, y = torch.randint(0, trs.V, (2, trs.T), generator=g), torch.randint(0, trs.V, (2, trs.T), generator=g)
    cases = [{}, {"rope_style": "interleaved"}, {"rope_scaling": trs.LLAMA3}, {"attention_bias": True},
             {"qk_norm": "head"}, {"qk_norm": "full"}, {"attn_logit_softcap": 5.0}, {"final_logit_softcap": 3.0},
             {"sliding_window": 3}, {"tie_embeddings": True},
             {"rope_style": "interleaved", "qk_norm": "full", "attention_bias": True, "sliding_window": 4}]
    gaps = []
    for extra in cases:
        cfg = dict(trs.CFG, **extra)
        p = trs.random_params(cfg.get("qk_norm"))
        gaps.append(abs(float(rm.llama_loss(cfg, p, x, y)) - float(reference_loss(cfg, p, x, y))))
    torch.manual_seed(2)
    gpt2 = torch_models.GPT2(dict(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, max_seq_len=16, norm_eps=1e-5))
    gcfg = dict(arch="gpt2", vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, max_seq_len=16, norm_eps=1e-5)
    gp = dict(gpt2.named_parameters())
    gx, gy = x[:, :16] % 64, y[:, :16] % 64
    gaps.append(abs(float(rm.gpt2_loss(gcfg, gp, gx, gy)) - float(reference_loss(gcfg, gp, gx, gy))))
    s.check(max(gaps) <= 1e-6, f"the self-check's reference matches reference_model.py for {len(cases)} llama option "
                               f"sets and gpt2 (largest gap {max(gaps):.1e})")
    return s.finish()


def nanreplay_rename(name):
    import re
    from nanreplay_capture import META_NAMES
    for pattern, target in META_NAMES:
        m = re.fullmatch(pattern, name)
        if m:
            return target.format(*m.groups())
    return name


if __name__ == "__main__":
    sys.exit(main())
