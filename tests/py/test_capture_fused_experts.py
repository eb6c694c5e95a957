"""Live capture of GPT-OSS's and Llama 4's fused experts (docs/capture.md, "Fused experts").

The models are the eager references of tests/py/test_family_gpt_oss_moe.py (GptOssForCausalLM: GptOssExperts'
gate_up_proj [E, C, 2M] with gate the even columns and up the odd ones, its biases, down_proj [E, M, C], the
router with a bias, sinks, yarn, layer_types, the aux loss) and tests/py/test_family_llama4_moe.py
(Llama4MoeText: Llama4TextExperts' gate_up_proj split in halves, a shared expert, a dense layer of
intermediate_size_mlp, NoPE layers, the L2 QK-norm), transcribed there from transformers' modeling_gpt_oss.py
and modeling_llama4.py; here they carry Hugging Face's parameter names (param_names maps them) and a
model.config holding what save_pretrained writes, as a live GptOssForCausalLM / Llama4ForCausalLM does.

Per family:
1. A 4-step training loop (torch.optim.AdamW, clip_grad_norm_) under the Recorder with snapshot_every=2: the
   self-check passes on step 0 (the bundle's model computes the logged loss) and the dumped bundle replays in
   `nanreplay run`, every step's loss and gradient norm within 1e-5 of the loop's log (steps 0 and 2 from their
   snapshots, 1 and 3 rolled forward: step 3 by AdamW reading step 2's recorded, split moments).
2. The same run saved at step 2 as save_pretrained would (the fused tensors and AdamW state under Hugging
   Face's names) and imported with `nanreplay import`: the captured bundle's step 1 holds the import's keys in
   its order with bit-identical parameters and moments, and the manifests' model sections are equal
   (max_seq_len aside: the import reads max_position_embeddings, the recorder the run's seq_len).
3. The check can fail: the recorder with the family's split swapped (GPT-OSS's interleaved columns read as
   halves, Llama 4's halves read as interleaved) is stopped by its own self-check, and the bundle it writes
   with the self-check off replays to a loss more than ten times the tolerance away from the log.
4. Where the split is not supported, refusal by name: a fused expert tensor updated by another optimizer
   than AdamW; a fused expert model under FSDP (the recorder's sharded branch, entered by a subclass here: torch
   1.13 runs no FSDP job in this test); a model_config['moe'] that contradicts model.config.

    /usr/bin/python3 tests/py/test_capture_fused_experts.py --cli build/nanreplay --work DIR
"""
import argparse
import json
import math
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import family_support as fs  # noqa: E402
import import_support as imp  # noqa: E402  (token data, lr schedule, import and replay runners)
import reference_model  # noqa: E402  (safetensors reader)
import test_family_gpt_oss_attn as gpt_attn  # noqa: E402
import test_family_gpt_oss_moe as gpt  # noqa: E402
import test_family_llama4_attn as l4_attn  # noqa: E402
import test_family_llama4_moe as l4  # noqa: E402
import test_import_llama4 as l4_import  # noqa: E402  (Llama 4's config.json and HF names)

cap = fs.nanreplay_capture
# Full snapshots at steps 0 and 2 (snapshot_every), light records of 1 and 3: the replay rolls step 3 forward
# from step 2's parameters through its recorded, split AdamW moments; step 2 is where the job saves.
STEPS, EVERY, SAVED = 4, 2, 2


class Family:
    """What differs between the two families: the model, its HF names, its config.json and its save."""

    def __init__(self, name, make, hf_named, hf_config, save, vocab, seq_len, split, other_split):
        self.name, self.make, self.hf_named, self.hf_config, self.save = name, make, hf_named, hf_config, save
        self.vocab, self.seq_len, self.split, self.other_split = vocab, seq_len, split, other_split


def gpt_oss():
    return Family("GPT-OSS", lambda: gpt_attn.init(gpt.GptOssForCausalLM(gpt_attn.YARN, gpt.LAYER_TYPES, gpt.MOE), 7),
                  gpt.hf_named, gpt.hf_config, gpt.save_hf, gpt_attn.V, gpt_attn.T, "gate_up", "gate_up_halves")


def llama4():
    return Family("Llama 4", lambda: l4.init(l4.Llama4MoeText(l4_attn.NO_ROPE_LAYERS, l4.MOE), 7),
                  l4_import.hf_named, l4_import.hf_config, l4_import.save_hf, l4_attn.V, l4_attn.T,
                  "gate_up_halves", "gate_up")


def live(family):
    """The reference with model.config as a live Hugging Face model has it, and the map of its parameter
    names onto Hugging Face's."""
    model = family.make()
    model.config = SimpleNamespace(**family.hf_config(), _attn_implementation="eager")
    ids = {id(p): n for n, p in family.hf_named(model)}
    names = {n: ids[id(p)] for n, p in model.named_parameters()}
    return model, names


def train_captured(family, work, split=None, self_check=True, save_at=None, steps=STEPS):
    """The training loop under the Recorder (the experts' split kind replaced by `split` when given). Returns
    (log, data, bundle path, recorder)."""
    model, names = live(family)
    data = imp.Data(work, family.vocab, family.seq_len, 2, 1, num_samples=16, seed=3)
    opt = imp.adamw(model.parameters())
    table = cap.FUSED_EXPERT_NAMES
    saved = {k: list(v) for k, v in table.items()}
    if split is not None:
        for k in table:
            table[k] = [(p, t, split if s == family.split else s) for p, t, s in table[k]]
    try:
        rec = cap.Recorder(model, opt, work / "captures", arch="llama", param_names=lambda n: names[n],
                           data=dict(shards=[str(data.path)], token_dtype="uint16", seq_len=family.seq_len,
                                     micro_batch_size=2), snapshot_every=EVERY, grad_clip=1.0)
        rec.self_check = self_check
        log = {}
        params = list(model.parameters())
        for step in range(steps):
            if save_at == step:
                family.save(model, opt, work / "hf")
            for g in opt.param_groups:
                g["lr"] = imp.lr_at(step)
            rec.begin_step(step, samples=data.rows(step))
            loss = model(*data.batch(data.rows(step)))
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(params, 1.0)
            log[step] = {"step": step, "lr": imp.lr_at(step), "loss": float(loss), "grad_norm": float(norm)}
            rec.end_step(loss=float(loss), grad_norm=float(norm))
            opt.step()
            opt.zero_grad(set_to_none=True)
        bundle = rec.dump(work / "bundle")
    finally:
        table.update(saved)
    return log, data, bundle, rec


def check_capture(cli, family, work):
    """1 and 2."""
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    log, data, bundle, rec = train_captured(family, work, save_at=SAVED)
    result = rec.self_check_result or {}
    fs.check(result.get("relative", 1.0) <= 1e-6,
             f"{family.name} capture: the self-check's reference computes the logged loss (rel "
             f"{result.get('relative', math.nan):.1e})")
    proc, report = imp.run_replay(cli, bundle, work / "out")
    if not fs.check(report is not None, f"{family.name} capture replays ({proc.stderr.strip()[-300:]})"):
        return
    imp.check_replay(f"{family.name} live capture", report, log, 0, STEPS - 1, derived=False)
    kinds = [r.get("params") for r in report["steps"]]
    fs.check(kinds == ["checkpoint", "derived", "checkpoint", "derived"],
             f"{family.name} live capture: steps 1 and 3 rolled forward, 3 through step 2's recorded moments ({kinds})")
    imp.write_log(work / "log.jsonl", log)
    proc = imp.run_import(cli, ["--checkpoint", work / "hf", "--optimizer", work / "hf" / "optimizer.pt",
                                "--optimizer-class", "torch.optim.AdamW", *data.flags(), "--log", work / "log.jsonl",
                                "--steps", f"{SAVED}:{SAVED}", "--grad-clip", 1.0], work / "imported")
    if not fs.check(proc.returncode == 0, f"{family.name} import: exit 0 ({proc.stderr.strip()[-300:]})"):
        return
    compare_with_import(family, bundle, work / "imported")


def compare_with_import(family, captured, imported):
    """2. the captured step SAVED against the import of the checkpoint saved there."""
    got, want = (json.loads((b / "manifest.json").read_text())["model"] for b in (captured, imported))
    differ = sorted(k for k in set(got) | set(want) if k != "max_seq_len" and got.get(k) != want.get(k))
    fs.check(not differ, f"{family.name}: the captured model section is the import's "
                         f"({ {k: (got.get(k), want.get(k)) for k in differ} })")
    for name in ("model.safetensors", "optimizer.safetensors"):
        a = reference_model.read_safetensors(captured / "steps" / str(SAVED) / name)
        b = reference_model.read_safetensors(imported / "steps" / str(SAVED) / name)
        a_keys, b_keys = list(a), list(b)
        same = [k for k in b_keys if k in a and a[k].dtype == b[k].dtype and torch.equal(a[k], b[k])]
        fs.check(a_keys == b_keys and len(same) == len(b_keys),
                 f"{family.name} step {SAVED} {name}: the import's {len(b_keys)} keys in its order, bit-identical "
                 f"({len(same)} equal; order same: {a_keys == b_keys}; "
                 f"{[k for k in b_keys if k not in same][:3]})")


def check_swapped_split(cli, family, work):
    """3. the recorder taking the experts apart as the other family does."""
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    try:
        train_captured(family, work, split=family.other_split)
        fs.check(False, f"{family.name} with the split swapped: the self-check stops the capture")
    except cap.CaptureError as e:
        fs.check("self-check" in str(e), f"{family.name} with the split swapped: the self-check stops the "
                                         f"capture ({str(e)[:160]}...)")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    log, _, bundle, _ = train_captured(family, work, split=family.other_split, self_check=False, steps=1)
    proc, report = imp.run_replay(cli, bundle, work / "out")
    if not fs.check(report is not None and report.get("steps"), f"{family.name} swapped split replays "
                                                                f"({proc.stderr.strip()[-300:]})"):
        return
    got, logged = report["steps"][0]["loss"], log[0]["loss"]
    fs.check(got is not None and fs.rel_err(got, logged) > 10 * fs.TOLERANCE,
             f"the check can fail: {family.name} split as {family.other_split} replays step 0 to {got!r}, "
             f"not the logged {logged!r} (rel {fs.rel_err(got, logged):.1e})")


class _AsIfSharded(cap.Recorder):
    """The Recorder as it sets itself up for an FSDP model (self._sharded set), the model left whole."""

    def _setup_distributed(self, model, optimizer, distributed, record_rank):
        model = super()._setup_distributed(model, optimizer, False, record_rank)
        self._sharded = "FSDP"
        return model


def check_refusals(family, work):
    """4. refusals by name, at construction."""
    data = imp.Data(work, family.vocab, family.seq_len, 2, 1, num_samples=16, seed=3)
    cases = ((f"{family.name} under Adam", cap.Recorder, torch.optim.Adam, {}, ("gate_up_proj", "AdamW")),
             (f"{family.name} under FSDP", _AsIfSharded, imp.adamw, {}, ("gate_up_proj", "FSDP", "nanreplay import")),
             (f"{family.name} with model_config moe top_k 3", cap.Recorder, imp.adamw, {"moe": {"top_k": 3}},
              ("model_config['moe']['top_k'] = 3", "contradicts model.config")))
    for what, recorder, optimizer, given, needles in cases:
        model, names = live(family)
        try:
            recorder(model, optimizer(model.parameters()), work / "captures", arch="llama",
                     param_names=lambda n: names[n], model_config=given,
                     data=dict(shards=[str(data.path)], seq_len=family.seq_len, micro_batch_size=2))
            fs.check(False, f"{what}: refused")
        except cap.CaptureError as e:
            fs.check(all(n in str(e) for n in needles) and "\n" not in str(e), f"{what}: refused by name ({e})")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cli", required=True)
    ap.add_argument("--work", required=True)
    args = ap.parse_args()
    work = Path(args.work)
    for family, tag in ((gpt_oss(), "gpt-oss"), (llama4(), "llama4")):
        check_capture(args.cli, family, work / tag)
        check_swapped_split(args.cli, family, work / f"{tag}-swapped")
        check_refusals(family, work / f"{tag}-swapped")
    fs.failures.extend(imp.failures)
    fs.finish()


if __name__ == "__main__":
    main()
