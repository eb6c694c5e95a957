"""`nanreplay import` of a llama2.c checkpoint (torch.save ckpt.pt: {"model", "optimizer", "model_args",
"iter_num"}), replayed by `nanreplay run` to the losses the original PyTorch model computed.

The model is karpathy/llama2.c's model.py, written here with its semantics: Meta naming
(tok_embeddings, layers.N.attention.wq, feed_forward.w1/w2/w3, attention_norm, ffn_norm, norm,
output), interleaved rotary through a complex-style multiply of adjacent pairs, RMSNorm as
x * rsqrt(mean(x^2) + eps), the output head tied to the embedding, configure_optimizers' two groups
(>= 2-D parameters with weight decay, the rest without) with integer ids. model_args gives neither
norm_eps nor rope_theta (llama2.c hard-codes 1e-5 and 10000: bundle v1's defaults).

1. a healthy window: checkpoint at step 3, steps 3..5 rolled forward by the replay (AdamW state
   recovered from the integer ids), losses and gradient norms within 1e-5 of PyTorch's;
2. an incident: the same checkpoint with token PAD's embedding row zeroed and norm_eps 0 (--config),
   no optimizer state (only the first step replays): nanreplay names the site, sample and position
   PyTorch's forward hooks saw.
"""
import argparse
import json
import math
import shutil
import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import import_support as s  # noqa: E402
from llama2c_model import RMSNorm, apply_rotary_emb, precompute_freqs_cis  # noqa: E402

ARGS = dict(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, multiple_of=16, max_seq_len=16, dropout=0.0)
SEQ, MBS, ACCUM, SEED = 16, 2, 2, 1234
FIRST, LAST = 3, 5
PAD_AT = (FIRST, 1, 0, 5)  # step, micro-batch, row, position of the one PAD token
SITES = [(r"tok_embeddings", "embed"), (r"layers\.(\d+)\.attention_norm", "layers.{}.attn_norm"),
         (r"layers\.(\d+)\.attention\.wq", "layers.{}.attn.q"), (r"layers\.(\d+)\.attention\.wk", "layers.{}.attn.k"),
         (r"layers\.(\d+)\.attention\.wv", "layers.{}.attn.v"), (r"layers\.(\d+)\.attention\.wo", "layers.{}.attn.out"),
         (r"layers\.(\d+)\.ffn_norm", "layers.{}.mlp_norm"), (r"layers\.(\d+)\.feed_forward\.w1", "layers.{}.mlp.gate"),
         (r"layers\.(\d+)\.feed_forward\.w3", "layers.{}.mlp.up"), (r"layers\.(\d+)\.feed_forward\.w2", "layers.{}.mlp.down"),
         (r"norm", "final_norm"), (r"output", "logits")]


# --- llama2.c's model.py (dropout 0, no flash path; its norm and rotary in llama2c_model.py) ---------

def repeat_kv(x, n_rep):
    bs, slen, n_kv_heads, head_dim = x.shape
    if n_rep == 1:
        return x
    return x[:, :, :, None, :].expand(bs, slen, n_kv_heads, n_rep, head_dim).reshape(bs, slen, n_kv_heads * n_rep, head_dim)


class Attention(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.n_kv_heads = a["n_kv_heads"]
        self.n_local_heads = a["n_heads"]
        self.n_rep = self.n_local_heads // self.n_kv_heads
        self.head_dim = a["dim"] // a["n_heads"]
        self.wq = nn.Linear(a["dim"], a["n_heads"] * self.head_dim, bias=False)
        self.wk = nn.Linear(a["dim"], self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(a["dim"], self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(a["n_heads"] * self.head_dim, a["dim"], bias=False)
        mask = torch.full((1, 1, a["max_seq_len"], a["max_seq_len"]), float("-inf"))
        self.register_buffer("mask", torch.triu(mask, diagonal=1), persistent=False)

    def forward(self, x, freqs_cos, freqs_sin):
        bsz, seqlen, _ = x.shape
        xq, xk, xv = self.wq(x), self.wk(x), self.wv(x)
        xq = xq.view(bsz, seqlen, self.n_local_heads, self.head_dim)
        xk = xk.view(bsz, seqlen, self.n_kv_heads, self.head_dim)
        xv = xv.view(bsz, seqlen, self.n_kv_heads, self.head_dim)
        xq, xk = apply_rotary_emb(xq, xk, freqs_cos, freqs_sin)
        xk, xv = repeat_kv(xk, self.n_rep), repeat_kv(xv, self.n_rep)
        xq, xk, xv = xq.transpose(1, 2), xk.transpose(1, 2), xv.transpose(1, 2)
        scores = torch.matmul(xq, xk.transpose(2, 3)) / math.sqrt(self.head_dim)
        scores = scores + self.mask[:, :, :seqlen, :seqlen]
        scores = F.softmax(scores.float(), dim=-1).type_as(xq)
        output = torch.matmul(scores, xv)
        output = output.transpose(1, 2).contiguous().view(bsz, seqlen, -1)
        return self.wo(output)


class FeedForward(nn.Module):
    def __init__(self, dim, hidden_dim, multiple_of):
        super().__init__()
        hidden_dim = 4 * dim
        hidden_dim = int(2 * hidden_dim / 3)
        hidden_dim = multiple_of * ((hidden_dim + multiple_of - 1) // multiple_of)
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, layer_id, a, norm_eps):
        super().__init__()
        self.attention = Attention(a)
        self.feed_forward = FeedForward(a["dim"], None, a["multiple_of"])
        self.layer_id = layer_id
        self.attention_norm = RMSNorm(a["dim"], eps=norm_eps)
        self.ffn_norm = RMSNorm(a["dim"], eps=norm_eps)

    def forward(self, x, freqs_cos, freqs_sin):
        h = x + self.attention.forward(self.attention_norm(x), freqs_cos, freqs_sin)
        return h + self.feed_forward.forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, a, norm_eps=1e-5):
        super().__init__()
        self.tok_embeddings = nn.Embedding(a["vocab_size"], a["dim"])
        self.layers = nn.ModuleList(TransformerBlock(i, a, norm_eps) for i in range(a["n_layers"]))
        self.norm = RMSNorm(a["dim"], eps=norm_eps)
        self.output = nn.Linear(a["dim"], a["vocab_size"], bias=False)
        self.tok_embeddings.weight = self.output.weight  # weight tying
        freqs_cos, freqs_sin = precompute_freqs_cis(a["dim"] // a["n_heads"], a["max_seq_len"])
        self.register_buffer("freqs_cos", freqs_cos, persistent=False)
        self.register_buffer("freqs_sin", freqs_sin, persistent=False)
        self.apply(self._init_weights)
        for pn, p in self.named_parameters():
            if pn.endswith("w3.weight") or pn.endswith("wo.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * a["n_layers"]))

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02 * 10)  # larger than llama2.c's: a livelier test

    def forward(self, tokens, targets):
        _bsz, seqlen = tokens.shape
        h = self.tok_embeddings(tokens)
        freqs_cos, freqs_sin = self.freqs_cos[:seqlen], self.freqs_sin[:seqlen]
        for layer in self.layers:
            h = layer(h, freqs_cos, freqs_sin)
        h = self.norm(h)
        logits = self.output(h)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)

    def configure_optimizers(self, weight_decay, learning_rate, betas):
        param_dict = {pn: p for pn, p in self.named_parameters() if p.requires_grad}
        decay_params = [p for n, p in param_dict.items() if p.dim() >= 2]
        nodecay_params = [p for n, p in param_dict.items() if p.dim() < 2]
        optim_groups = [{"params": decay_params, "weight_decay": weight_decay},
                        {"params": nodecay_params, "weight_decay": 0.0}]
        return torch.optim.AdamW(optim_groups, lr=learning_rate, betas=betas, foreach=False)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cli", required=True)
    ap.add_argument("--work", required=True)
    args = ap.parse_args()
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    torch.set_num_threads(1)

    data = s.Data(work, ARGS["vocab_size"], SEQ, MBS, ACCUM, num_samples=64, seed=SEED, pad_at=PAD_AT)
    torch.manual_seed(0)
    model = Transformer(ARGS)
    opt = model.configure_optimizers(0.1, 1e-3, (0.9, 0.95))
    ckpt = work / "ckpt.pt"

    def save(step):
        if step == FIRST:  # llama2.c saves at the top of the iteration, before its update
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "model_args": ARGS,
                        "iter_num": step, "best_val_loss": 1e9, "config": {"batch_size": MBS}}, ckpt)

    log = s.train(model, opt, data, LAST + 1, before_step=save)
    s.write_log(work / "log.jsonl", log)

    proc = s.run_import(args.cli, ["--checkpoint", ckpt, *data.flags(), "--log", work / "log.jsonl",
                                   "--steps", f"{FIRST}:{LAST}", "--grad-clip", 1.0], work / "bundle")
    s.check(proc.returncode == 0, f"import exits 0 {proc.stderr.strip()}")
    s.check("naming: meta (detected: layers.0.attention.wq.weight)" in proc.stdout, "auto-detected Meta naming")
    s.check("format: torch" in proc.stdout, "auto-detected a torch.save file")
    manifest = json.loads((work / "bundle" / "manifest.json").read_text()) if proc.returncode == 0 else {}
    m = manifest.get("model", {})
    s.check(m.get("rope_style") == "interleaved" and m.get("tie_embeddings") is True and m.get("norm_eps") == 1e-5
            and m.get("rope_theta") == 10000.0 and m.get("num_kv_heads") == 2 and m.get("intermediate_size") == 96,
            f"manifest model: interleaved, tied, spec defaults for eps and theta, GQA, w1 rows {m}")
    o = manifest.get("optimizer", {})
    s.check(o.get("betas") == [0.9, 0.95] and o.get("weight_decay") == 0.1 and len(o.get("no_decay", [])) == 5,
            f"optimizer from param_groups, no_decay = the 1-D parameters {o}")
    if proc.returncode == 0:
        s.inspect_ok(args.cli, work / "bundle")
        rproc, report = s.run_replay(args.cli, work / "bundle", work / "out")
        s.check(rproc.returncode == 0 and report is not None, f"nanreplay run exits 0 (got {rproc.returncode}) {rproc.stderr.strip()}")
        if report:
            s.check_replay("llama2.c", report, log, FIRST, LAST)

    # The incident: the checkpoint with PAD's row zeroed, norm_eps 0, no optimizer state.
    saved = torch.load(ckpt)
    sd = saved["model"]
    sd["tok_embeddings.weight"][s.PAD].zero_()  # output.weight shares it (tied), as in the saved file
    bad = work / "ckpt-incident.pt"
    torch.save({"model": sd, "model_args": ARGS, "iter_num": FIRST}, bad)
    broken = Transformer(ARGS, norm_eps=0.0)
    broken.load_state_dict(sd)
    hooks = s.FirstNonfinite(broken, SITES)
    ids = data.rows(FIRST)
    losses = []
    with torch.no_grad():
        for micro in range(ACCUM):
            hooks.where = (FIRST, micro, ids[micro * MBS:(micro + 1) * MBS])
            losses.append(broken(*data.batch(hooks.where[2])).item())
    incident_log = {FIRST: dict(log[FIRST], loss=sum(losses) / ACCUM, grad_norm=float("nan"))}
    s.write_log(work / "log-incident.jsonl", incident_log)
    (work / "eps0.json").write_text(json.dumps({"norm_eps": 0.0}))
    proc = s.run_import(args.cli, ["--checkpoint", bad, "--config", work / "eps0.json", *data.flags(),
                                   "--log", work / "log-incident.jsonl", "--steps", f"{FIRST}:{FIRST}"], work / "bundle-nan")
    s.check(proc.returncode == 0, f"incident import exits 0 {proc.stderr.strip()}")
    if proc.returncode == 0:
        man = json.loads((work / "bundle-nan" / "manifest.json").read_text())
        s.check(man["model"]["norm_eps"] == 0.0 and man.get("incident", {}).get("step") == FIRST,
                f"--config's norm_eps 0 and the logged NaN as the incident {man['model']['norm_eps']} {man.get('incident')}")
        rproc, report = s.run_replay(args.cli, work / "bundle-nan", work / "out-nan")
        s.check(rproc.returncode == 1 and report is not None, f"nanreplay run exits 1 (got {rproc.returncode}) {rproc.stderr.strip()}")
        if report:
            print("PyTorch hooks:", hooks.found)
            print("nanreplay:", json.dumps(report.get("first_nonfinite")))
            s.check_origin("llama2.c incident", report, hooks.found)
            s.check(hooks.found and hooks.found["sample"] == data.pad_sample and hooks.found["position"] == PAD_AT[3],
                    "the NaN starts where the PAD token is")
    return s.finish()


if __name__ == "__main__":
    sys.exit(main())
