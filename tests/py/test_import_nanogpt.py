"""`nanreplay import` of a nanoGPT checkpoint (ckpt.pt: {"model", "optimizer", "model_args", "iter_num"},
saved from a torch.compile'd model, so every key carries "_orig_mod."), replayed by `nanreplay run`
to the losses the PyTorch model computed.

The model is nanoGPT's module tree (transformer.wte/wpe/h.N/ln_f, lm_head tied to wte; the tanh GELU
bundle v1's gpt2 uses, see docs/import.md for nanoGPT's erf GELU), trained with nanoGPT's
configure_optimizers groups (>= 2-D parameters decayed, the rest not) whose integer ids the import
maps back to names. Batches come from nanoGPT's get_batch (random token offsets, not sample
boundaries), given to the import as {"offsets": ...} per step: it writes the windows read as one
compact shard. Checkpoint at step 2, steps 2..4 rolled forward.
"""
import argparse
import json
import shutil
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import import_support as s  # noqa: E402
import torch_models  # noqa: E402

CFG = dict(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, max_seq_len=16, norm_eps=1e-5)
MODEL_ARGS = dict(n_layer=2, n_head=4, n_embd=32, block_size=16, bias=True, vocab_size=64, dropout=0.0)
SEQ, MBS, ACCUM, SEED = 16, 2, 1, 21
FIRST, LAST = 2, 4


class GetBatch(s.Data):
    """nanoGPT's get_batch: ix = torch.randint(len(data) - block_size, (batch_size,)), rows at those offsets."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        g = torch.Generator().manual_seed(1337)
        self.offsets = {step: torch.randint(len(self.tokens) - self.seq_len - 1, (self.mbs * self.accum,),
                                            generator=g).tolist() for step in range(16)}

    def rows(self, step):
        return self.offsets[step]

    def batch(self, ix):
        w = torch.stack([self.tokens[i:i + self.seq_len + 1] for i in ix])
        return w[:, :-1].contiguous(), w[:, 1:].contiguous()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cli", required=True)
    ap.add_argument("--work", required=True)
    args = ap.parse_args()
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    torch.set_num_threads(1)

    data = GetBatch(work, CFG["vocab_size"], SEQ, MBS, ACCUM, num_samples=48, seed=SEED)
    torch.manual_seed(0)
    model = torch_models.GPT2(CFG)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.2)
    params = {pn: p for pn, p in model.named_parameters()}  # nanoGPT's configure_optimizers
    opt = s.adamw([{"params": [p for p in params.values() if p.dim() >= 2], "weight_decay": 0.1},
                   {"params": [p for p in params.values() if p.dim() < 2], "weight_decay": 0.0}])
    ckpt = work / "ckpt.pt"

    def save(step):
        if step == FIRST:
            sd = {"_orig_mod." + k: v for k, v in model.state_dict().items()}  # torch.compile's wrapper
            torch.save({"model": sd, "optimizer": opt.state_dict(), "model_args": MODEL_ARGS, "iter_num": step,
                        "best_val_loss": 1e9, "config": {}}, ckpt)

    log = s.train(model, opt, data, LAST + 1, before_step=save)
    s.write_log(work / "log.jsonl", log)
    (work / "samples.json").write_text(json.dumps({str(k): {"offsets": v} for k, v in data.offsets.items()}))
    flags = [f for f in data.flags()[:-2]] + ["--samples", work / "samples.json"]  # no --sampler-seed
    proc = s.run_import(args.cli, ["--checkpoint", ckpt, *flags, "--log", work / "log.jsonl",
                                   "--steps", f"{FIRST}:{LAST}", "--grad-clip", 1.0], work / "bundle")
    s.check(proc.returncode == 0, f"import exits 0 {proc.stderr.strip()}")
    s.check("naming: nanogpt (detected: _orig_mod.transformer.wte.weight)" in proc.stdout, "auto-detected nanoGPT naming")
    if proc.returncode == 0:
        m = json.loads((work / "bundle" / "manifest.json").read_text())
        s.check(m["model"]["arch"] == "gpt2" and m["model"]["max_seq_len"] == 16 and m["model"]["num_heads"] == 4
                and len(m["optimizer"]["no_decay"]) == 8 * 2 + 2,
                f"gpt2 from model_args and wpe, no_decay = the biases and LayerNorm weights {m['model']}")
        s.check(m["data"]["shards"][0]["path"] == "data/window.bin" and m["data"]["sampler"]["kind"] == "explicit"
                and m["steps"][0]["original_offsets"] == [data.offsets[FIRST]],
                "offsets: one compact shard of the windows read, explicit samples, original_offsets kept")
        rproc, report = s.run_replay(args.cli, work / "bundle", work / "out")
        s.check(rproc.returncode == 0 and report is not None, f"nanreplay run exits 0 (got {rproc.returncode}) {rproc.stderr.strip()}")
        if report:
            s.check_replay("nanogpt", report, log, FIRST, LAST)
    return s.finish()


if __name__ == "__main__":
    sys.exit(main())
