"""model.attention_mask against eager PyTorch, on a llama2.c model whose layer 0 head 0 scores +inf at
one future key (query position 1, key position 7 of sample 0) and finite everywhere a query may look.

The reference is llama2.c's model.py (karpathy/llama2.c) transcribed: its manual attention adds a -inf
mask to the scores (torch 1.13 has no scaled_dot_product_attention, so llama2.c takes that path), so
inf + -inf makes query 1's row NaN and the loss NaN. The other masks are the same model with the line
that masks swapped for the way each framework writes it: Hugging Face eager (+ finfo(fp32).min: inf
stays inf, the row is NaN too), nanoGPT's masked_fill(-inf) (the future key excluded: finite) and
Hugging Face GPT-2's torch.where(mask, scores, finfo.min) (finite). Through the CLI, for each
attention_mask value: the same loss and gradient norm (1e-5 relative), or a NaN loss whose first
non-finite value is the probabilities of that head's row, as PyTorch's own tensors show it; on a
clean copy of the model (no planted inf) the absent key and both additive masks replay to PyTorch's
finite loss and gradient norm.
Where the planted +inf poisons the row, report.json's first_nonfinite carries masked_score (layer 0, head
0, sample 0, query 1, masked key 7, raw score +inf, the mask and its arithmetic: +inf + (-inf) = NaN, or
+inf + finfo.min = +inf), report.md and the terminal say it in one sentence; excluded or filled, the row
stays finite and no report names a masked score.
Last, llama2.c's own ckpt.pt of the poisoned model goes through `nanreplay import`, which names the
mask from the Meta naming (additive -inf), and its replay is NaN at the same head and query, the
masked score named the same way.

    /usr/bin/python3 tests/py/test_family_mask.py --cli build/nanreplay --work DIR
"""
import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import family_support as fs  # noqa: E402
from family_support import check  # noqa: E402
from llama2c_model import RMSNorm, apply_rotary_emb, precompute_freqs_cis  # noqa: E402

V, C, H, LAYERS, FF, T, SAMPLES = 64, 32, 4, 2, 48, 12, 2
D = C // H
TOKEN_A, TOKEN_B = 3, 5        # A's embedding alone holds feature 0, B's feature 1
POS_A, POS_B = 1, 7            # cos(7 - 1) > 0: the rotated q_A . k_B stays positive
BIG = 1e19                     # q_A[0] * k_B[0] ~ 1e39: +inf in fp32


# How each framework masks the scores (T, T) of a causal attention; `future` is True above the diagonal.
def llama2c_additive(scores, future):   # llama2.c / Meta: scores + triu(full(-inf), 1)
    mask = torch.triu(torch.full(future.shape, float("-inf")), diagonal=1)
    return scores + mask


def hf_eager_additive(scores, future):  # Hugging Face eager: scores + causal_mask (0 / finfo.min)
    return scores + torch.zeros(future.shape).masked_fill(future, torch.finfo(torch.float32).min)


def nanogpt_fill(scores, future):       # nanoGPT: att.masked_fill(bias == 0, float('-inf'))
    return scores.masked_fill(future, float("-inf"))


def hf_gpt2_where(scores, future):      # Hugging Face GPT-2 eager: torch.where(causal_mask, w, finfo.min)
    return torch.where(~future, scores, torch.tensor(torch.finfo(scores.dtype).min))


# ---- llama2.c's model.py, transcribed (ModelArgs fields as used; dropout 0; flash off; its norm and
# rotary in llama2c_model.py) ----

class Attention(torch.nn.Module):
    def __init__(self, masking, seen):
        super().__init__()
        self.head_dim = D
        self.wq = torch.nn.Linear(C, H * D, bias=False)
        self.wk = torch.nn.Linear(C, H * D, bias=False)
        self.wv = torch.nn.Linear(C, H * D, bias=False)
        self.wo = torch.nn.Linear(H * D, C, bias=False)
        self.masking, self.seen = masking, seen

    def forward(self, x, freqs_cos, freqs_sin):
        bsz, seqlen, _ = x.shape
        xq, xk, xv = self.wq(x), self.wk(x), self.wv(x)
        xq = xq.view(bsz, seqlen, H, D)
        xk = xk.view(bsz, seqlen, H, D)
        xv = xv.view(bsz, seqlen, H, D)
        xq, xk = apply_rotary_emb(xq, xk, freqs_cos, freqs_sin)
        xq, xk, xv = xq.transpose(1, 2), xk.transpose(1, 2), xv.transpose(1, 2)
        scores = torch.matmul(xq, xk.transpose(2, 3)) / math.sqrt(self.head_dim)
        future = torch.ones(seqlen, seqlen, dtype=torch.bool).triu(1)
        scores = self.masking(scores, future)  # llama2.c: scores + self.mask[:, :, :seqlen, :seqlen]
        scores = F.softmax(scores.float(), dim=-1).type_as(xq)
        self.seen.append(scores.detach())
        output = torch.matmul(scores, xv)
        output = output.transpose(1, 2).contiguous().view(bsz, seqlen, -1)
        return self.wo(output)


class FeedForward(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = torch.nn.Linear(C, FF, bias=False)
        self.w2 = torch.nn.Linear(FF, C, bias=False)
        self.w3 = torch.nn.Linear(C, FF, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(torch.nn.Module):
    def __init__(self, masking, seen):
        super().__init__()
        self.attention = Attention(masking, seen)
        self.feed_forward = FeedForward()
        self.attention_norm = RMSNorm(C, eps=1e-5)
        self.ffn_norm = RMSNorm(C, eps=1e-5)

    def forward(self, x, freqs_cos, freqs_sin):
        h = x + self.attention.forward(self.attention_norm(x), freqs_cos, freqs_sin)
        return h + self.feed_forward.forward(self.ffn_norm(h))


class Transformer(torch.nn.Module):
    def __init__(self, masking):
        super().__init__()
        self.probs = []  # each layer's softmax output, for naming the first non-finite value
        self.tok_embeddings = torch.nn.Embedding(V, C)
        self.layers = torch.nn.ModuleList([TransformerBlock(masking, self.probs) for _ in range(LAYERS)])
        self.norm = RMSNorm(C, eps=1e-5)
        self.output = torch.nn.Linear(C, V, bias=False)
        self.tok_embeddings.weight = self.output.weight  # llama2.c ties them
        freqs_cos, freqs_sin = precompute_freqs_cis(D, T)
        self.register_buffer("freqs_cos", freqs_cos, persistent=False)
        self.register_buffer("freqs_sin", freqs_sin, persistent=False)

    def forward(self, tokens, targets):
        _bsz, seqlen = tokens.shape
        h = self.tok_embeddings(tokens)
        freqs_cos, freqs_sin = self.freqs_cos[:seqlen], self.freqs_sin[:seqlen]
        for layer in self.layers:
            h = layer(h, freqs_cos, freqs_sin)
        logits = self.output(self.norm(h))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)


# ---- the weights, the planted score and the bundle --------------------------------------------------------

def llama2c_weights(poisoned):
    """A seeded llama2.c model's state dict. Poisoned: layer 0 head 0's rotary pair (0, 1) reads feature 0
    in q and feature 1 in k at BIG, nothing else; no other token holds those features in layer 0's input,
    so only A's query meets B's key with a score beyond fp32. Head 0's values are zero, so its scores get
    no gradient and the gradients stay finite where the row does; a NaN row still spreads (NaN * 0)."""
    torch.manual_seed(0)
    model = Transformer(nanogpt_fill)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn(p.shape) if "norm" in name else 0.3 * torch.randn(p.shape))
        emb = model.tok_embeddings.weight
        emb[:, :2] = 0
        emb[TOKEN_A, 0] = emb[TOKEN_B, 1] = 1.0
        if poisoned:
            att = model.layers[0].attention
            att.wq.weight[:2] = 0
            att.wk.weight[:2] = 0
            att.wq.weight[0, 0] = BIG
            att.wk.weight[0, 1] = BIG
            att.wv.weight[:D] = 0  # head 0 adds nothing: no gradient reaches its scores (0 * BIG, not BIG)
    return {k: v.clone() for k, v in model.state_dict().items()}


HF_NAMES = {"attention.wq": "self_attn.q_proj", "attention.wk": "self_attn.k_proj",
            "attention.wv": "self_attn.v_proj", "attention.wo": "self_attn.o_proj", "feed_forward.w1": "mlp.gate_proj",
            "feed_forward.w3": "mlp.up_proj", "feed_forward.w2": "mlp.down_proj", "attention_norm": "input_layernorm",
            "ffn_norm": "post_attention_layernorm"}
LAYER_ORDER = ["attention_norm", "attention.wq", "attention.wk", "attention.wv", "attention.wo", "ffn_norm",
               "feed_forward.w1", "feed_forward.w3", "feed_forward.w2"]


def bundle_params(state):
    """llama2.c's names as the bundle's (Hugging Face's), weights as stored: rope_style interleaved."""
    out = [("model.embed_tokens.weight", state["tok_embeddings.weight"])]
    for i in range(LAYERS):
        out += [(f"model.layers.{i}.{HF_NAMES[n]}.weight", state[f"layers.{i}.{n}.weight"]) for n in LAYER_ORDER]
    return out + [("model.norm.weight", state["norm.weight"])]


def model_object(mask):
    model = {"arch": "llama", "vocab_size": V, "hidden_size": C, "num_layers": LAYERS, "num_heads": H,
             "intermediate_size": FF, "max_seq_len": T, "norm_eps": 1e-5, "rope_theta": 10000.0,
             "tie_embeddings": True, "rope_style": "interleaved"}
    if mask is not None:
        model["attention_mask"] = mask
    return model


def the_stream():
    stream = fs.token_stream(V, SAMPLES, T, seed=1, avoid=(TOKEN_A, TOKEN_B))
    stream[POS_A], stream[POS_B] = TOKEN_A, TOKEN_B  # sample 0 (stream[0:T+1])
    return stream


def reference(state, masking, stream):
    """(loss, grad norm, each layer's probabilities) of llama2.c's model with `masking` on the step's batch."""
    model = Transformer(masking)
    model.load_state_dict(state, strict=False)
    inputs, targets = fs.batch_of(stream, SAMPLES, T)
    loss = model(inputs, targets)
    loss_value, norm = fs.loss_and_grad_norm(loss, list(model.parameters()))
    return loss_value, norm, model.probs


# What the report says each poisoning mask did to the row (docs/report-format.md, masked_score).
ARITHMETIC = {"additive_neg_inf": "+inf + (-inf) = NaN", "additive_finfo_min": "+inf + finfo.min = +inf"}

MASKS = [  # (manifest value, how the framework masks, whether the planted +inf poisons the row)
    (None, nanogpt_fill, False),  # absent: what a bundle meant before attention_mask existed
    ("exclude", nanogpt_fill, False),
    ("additive_neg_inf", llama2c_additive, True),
    ("additive_finfo_min", hf_eager_additive, True),
    ("fill_finfo_min", hf_gpt2_where, False),
]


def import_llama2c(cli, work, poisoned):
    """llama2.c's own ckpt.pt of the poisoned model, imported: the Meta naming's mask (additive -inf) and
    rotary (interleaved) set without a config saying so, and the replay NaN where PyTorch's is."""
    import import_support as imp  # noqa: E402  (its token data and import runner)
    data = imp.Data(work, V, T, SAMPLES, 1, num_samples=8, seed=5)
    for token in (TOKEN_A, TOKEN_B):
        data.tokens[data.tokens == token] = 10
    first = data.rows(0)[0]
    data.tokens[first * T + POS_A], data.tokens[first * T + POS_B] = TOKEN_A, TOKEN_B
    data.path.write_bytes(data.tokens.to(torch.int16).numpy().tobytes())
    model = Transformer(llama2c_additive)
    model.load_state_dict(poisoned, strict=False)
    loss = float(model(*data.batch(data.rows(0))))
    check(math.isnan(loss), f"llama2.c import: PyTorch's loss on the step's batch is NaN ({loss})")
    (work / "log.jsonl").write_text(json.dumps({"step": 0, "loss": "nan", "lr": 1e-3}) + "\n")
    ckpt = work / "ckpt.pt"
    torch.save({"model": model.state_dict(), "model_args": dict(dim=C, n_layers=LAYERS, n_heads=H, n_kv_heads=H,
                                                                vocab_size=V, hidden_dim=FF, multiple_of=16,
                                                                max_seq_len=T, dropout=0.0)}, ckpt)
    bundle = work / "llama2c-imported"
    proc = imp.run_import(cli, ["--checkpoint", ckpt, *data.flags(), "--log", work / "log.jsonl", "--steps", "0:0"],
                          bundle)
    if not check(proc.returncode == 0, f"llama2.c import: exit {proc.returncode} {proc.stderr.strip()[-300:]}"):
        return
    m = json.loads((bundle / "manifest.json").read_text())["model"]
    check(m.get("attention_mask") == "additive_neg_inf" and m.get("rope_style") == "interleaved",
          f"llama2.c import: additive -inf mask and interleaved rotary from the meta naming ({m})")
    rc, report, err = fs.replay(cli, bundle, work / "out-llama2c-imported")
    if check(report is not None, f"llama2.c import replays (exit {rc}; {err.strip()[-200:]})"):
        origin = report.get("first_nonfinite") or {}
        check(report["steps"][0]["loss"] == "nan" and origin.get("site") == "layers.0.attn.probs"
              and origin.get("sample") == first and origin.get("position") == POS_A and origin.get("head") == 0,
              f"llama2.c import: NaN at layer 0's probabilities, sample {first}, query {POS_A}, head 0 "
              f"(got {report['steps'][0]['loss']}, {origin})")
        check_masked_score(origin, "additive_neg_inf", first, "llama2.c import")


def check_masked_score(origin, mask, sample, what):
    """The origin's masked_score: query POS_A of layer 0 head 0 scored +inf at masked key POS_B."""
    masked = origin.get("masked_score") or {}
    check(masked.get("layer") == 0 and masked.get("head") == 0 and masked.get("sample") == sample
          and masked.get("query_position") == POS_A and masked.get("masked_key_positions") == [POS_B]
          and masked.get("raw_score") == "inf" and masked.get("attention_mask") == mask
          and masked.get("arithmetic") == ARITHMETIC[mask] and masked.get("poisons_row") is True,
          f"{what}: first_nonfinite.masked_score names layer 0 head 0, sample {sample}, query {POS_A}, masked key "
          f"{POS_B}, +inf, {ARITHMETIC[mask]} (got {masked})")


def check_masked_score_text(cli, bundle, out, mask):
    """report.md and the terminal say the same in one sentence."""
    markdown = (out / "report.md").read_text().replace("\\", "") if (out / "report.md").exists() else ""  # unescaped
    sentence = f"query position {POS_A} scored +inf at masked key {POS_B} (attention_mask {mask}): {ARITHMETIC[mask]}"
    check(sentence in markdown, f"{mask}: report.md says \"{sentence}\"")
    if mask == "additive_neg_inf":  # the terminal renders the same sentence: one run suffices
        proc = subprocess.run([cli, "run", str(bundle), "--out", str(out.parent / "out-text")], capture_output=True,
                              text=True)
        check("Masked score: layer 0, head 0, sample 0, " + sentence in proc.stdout + proc.stderr,
              f"{mask}: the terminal says \"{sentence}\" ({(proc.stdout + proc.stderr)[-600:]})")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cli", required=True)
    ap.add_argument("--work", required=True)
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    stream = the_stream()

    clean = llama2c_weights(poisoned=False)
    clean_loss, clean_norm, _ = reference(clean, llama2c_additive, stream)
    check(math.isfinite(clean_loss), f"the clean model's loss is finite ({clean_loss})")
    poisoned = llama2c_weights(poisoned=True)
    for mask, masking, poisons in MASKS:
        name = mask or "absent"
        loss, norm, probs = reference(poisoned, masking, stream)
        row = probs[0][0, 0]  # layer 0, sample 0, head 0: (query, key)
        if poisons:
            check(math.isnan(loss), f"{name}: PyTorch's loss is NaN ({loss})")
            check(bool(row[POS_A].isnan().all()) and bool(row[:POS_A].isfinite().all()),
                  f"{name}: PyTorch's layer 0 head 0 row of query {POS_A} is NaN, the rows before it finite")
        else:
            check(math.isfinite(loss), f"{name}: PyTorch's loss is finite ({loss})")
        bundle = fs.write_bundle(work / f"poisoned-{name}", model_object(mask), bundle_params(poisoned), stream,
                                 SAMPLES, T, loss, norm)
        rc, report, err = fs.replay(args.cli, bundle, work / f"out-{name}")
        if not check(report is not None, f"{name}: nanreplay run gave a report (exit {rc}; {err.strip()[-300:]})"):
            continue
        step = report["steps"][0]
        if poisons:
            origin = report.get("first_nonfinite") or {}
            check(step["loss"] == "nan", f"{name}: the replayed loss is NaN as PyTorch's ({step['loss']!r})")
            check(origin.get("site") == "layers.0.attn.probs" and origin.get("head") == 0
                  and origin.get("position") == POS_A and origin.get("kind") == "nan",
                  f"{name}: the first non-finite value is layer 0's probabilities, head 0, query {POS_A}, NaN "
                  f"(got {origin.get('site')}, head {origin.get('head')}, position {origin.get('position')}, "
                  f"{origin.get('kind')})")
            check(report.get("reproduced") is True, f"{name}: the replay reproduces the logged NaN")
            check_masked_score(origin, mask, 0, name)
            check_masked_score_text(args.cli, bundle, work / f"out-{name}", mask)
        else:
            fs.compare_step(report, loss, norm, f"{name} (planted +inf excluded)")
            check(report.get("first_nonfinite") is None, f"{name}: no non-finite value in the replay")
            markdown = (work / f"out-{name}" / "report.md").read_text()
            check("masked_score" not in json.dumps(report) and "Masked score" not in markdown,
                  f"{name}: the row stays finite, and no report names a masked score")
        if mask not in (None, "additive_neg_inf", "additive_finfo_min"):
            continue  # exclude is the absent key's; fill_finfo_min the excluding one's, checked poisoned above
        clean_bundle = fs.write_bundle(work / f"clean-{name}", model_object(mask), bundle_params(clean), stream,
                                       SAMPLES, T, clean_loss, clean_norm)
        rc, report, err = fs.replay(args.cli, clean_bundle, work / f"clean-out-{name}")
        if check(report is not None, f"{name}, clean model: nanreplay run gave a report (exit {rc})"):
            fs.compare_step(report, clean_loss, clean_norm, f"{name}, clean model")
    import_llama2c(args.cli, work, poisoned)
    fs.finish()


if __name__ == "__main__":
    main()
