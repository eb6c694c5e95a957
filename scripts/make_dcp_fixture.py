#!/usr/bin/env python3
"""Writes tests/fixtures/dcp/: a torch.distributed.checkpoint (DCP) directory written by PyTorch 2.x
itself, the way torchtitan saves one, for tests/py/test_import_dcp.py (which runs on Debian 12's
torch 1.13, where torch.distributed.checkpoint does not exist, so nanreplay_import.py parses the
format itself).

The run: a tiny llama in torchtitan's llama3 layout (tok_embeddings, layers.N.attention.wq/wk/wv/wo,
attention_norm, ffn_norm, feed_forward.w1/w2/w3, norm, output; rotary by complex multiplication of
adjacent pairs, nn.RMSNorm, untied head), torch.optim.AdamW (single tensor), trained on one uint16
shard in DistributedSampler order. norm_eps is 0 and token 0's embedding row is zero and first read
at the last step, so that step divides 0 by 0 in layers.0.attention_norm. At the start of step
FIRST (before its update) two ranks (gloo, CPU) save the state as DTensors sharded on dim 0 with
torch.distributed.checkpoint.save, as FSDP2 training does: the model's parameters at the top level
(torchtitan flattens them) and the optimizer as get_optimizer_state_dict returns it, keyed by
parameter name. Rank 0 goes on training to LAST and writes what the job logged (log.jsonl), the
tokens, and what PyTorch's own forward hooks saw first (expected.json). It then reads the
checkpoint back both with PyTorch's reader and with nanreplay_import.py's parser of the format and
checks that every tensor and value agrees bit for bit.

Two ways to run it:

  # inside a root with PyTorch >= 2.2 (writes the fixture into DIR)
  python3 scripts/make_dcp_fixture.py --out DIR

  # on a Debian host as root: make a Debian 13 (trixie) root with python3-torch 2.6 under
  # build-dcp-root/ (debootstrap --variant=minbase, then apt-get install python3-torch; several
  # minutes the first time, network to deb.debian.org), run the above in it, copy the result to
  # tests/fixtures/dcp/
  sudo python3 scripts/make_dcp_fixture.py --debian-root build-dcp-root

The fixture is deterministic up to PyTorch's CPU kernels; it is about 200 KB.
"""
import argparse
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CFG = dict(dim=16, n_layers=2, n_heads=2, n_kv_heads=1, vocab_size=32, ffn=32, norm_eps=0.0, rope_theta=10000.0)
SEQ, MBS, ACCUM, NUM_SAMPLES, SEED = 8, 2, 1, 32, 1234
FIRST, LAST = 3, 6
PAD, PAD_AT = 0, (LAST, 0, 1, 3)  # the one token 0: step, micro-batch, row, position
WORLD = 2


def in_debian_root(rootfs):
    """Host side: build or reuse the trixie root, run this script in it, copy the fixture out."""
    rootfs = Path(rootfs).resolve() / "rootfs"
    env_chroot = ["chroot", str(rootfs), "/usr/bin/env", "-i", "HOME=/root", "PATH=/usr/sbin:/usr/bin:/sbin:/bin",
                  "LANG=C.UTF-8"]
    if not (rootfs / "usr/bin/python3").exists():
        rootfs.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(["debootstrap", "--variant=minbase", "--components=main", "trixie", str(rootfs),
                        os.environ.get("DEBIAN_MIRROR", "http://deb.debian.org/debian")], check=True)
    if not (rootfs / "usr/lib/python3/dist-packages/torch").exists():
        shutil.copy("/etc/resolv.conf", rootfs / "etc/resolv.conf")
        subprocess.run(env_chroot + ["bash", "-c", "export DEBIAN_FRONTEND=noninteractive; apt-get update -q && "
                                     "apt-get install -y -q --no-install-recommends python3-torch python3-numpy"], check=True)
    work = rootfs / "root/nanreplay"
    shutil.rmtree(work, ignore_errors=True)
    (work / "scripts").mkdir(parents=True)
    shutil.copytree(ROOT / "capture", work / "capture", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(Path(__file__), work / "scripts/make_dcp_fixture.py")
    mounted = []
    try:
        subprocess.run(["mount", "-t", "proc", "proc", str(rootfs / "proc")], check=True)
        mounted.append(rootfs / "proc")
        subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(rootfs / "tmp")], check=True)
        mounted.append(rootfs / "tmp")
        subprocess.run(env_chroot + ["GLOO_SOCKET_IFNAME=lo", "python3", "/root/nanreplay/scripts/make_dcp_fixture.py",
                                     "--out", "/root/nanreplay/fixture"], check=True)
    finally:
        for m in reversed(mounted):
            subprocess.run(["umount", str(m)])
    dest = ROOT / "tests/fixtures/dcp"
    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(work / "fixture", dest)
    print(f"wrote {dest}")


def write_fixture(out):
    import torch.multiprocessing as mp
    out = Path(out)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    mp.spawn(_rank, args=(str(out),), nprocs=WORLD, join=True)
    _cross_check(out)


def _model():
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    def precompute_freqs_cis(dim, end, theta):  # torchtitan/models/llama3/model.py
        freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
        t = torch.arange(end, device=freqs.device)
        freqs = torch.outer(t, freqs).float()
        return torch.polar(torch.ones_like(freqs), freqs)

    def apply_rotary_emb(xq, xk, freqs_cis):
        xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
        xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
        fc = freqs_cis.view(1, xq_.shape[1], 1, xq_.shape[-1])
        xq_out = torch.view_as_real(xq_ * fc).flatten(3)
        xk_out = torch.view_as_real(xk_ * fc).flatten(3)
        return xq_out.type_as(xq), xk_out.type_as(xk)

    class Attention(nn.Module):
        def __init__(self, c):
            super().__init__()
            self.n_heads, self.n_kv_heads = c["n_heads"], c["n_kv_heads"]
            self.head_dim = c["dim"] // c["n_heads"]
            self.wq = nn.Linear(c["dim"], c["n_heads"] * self.head_dim, bias=False)
            self.wk = nn.Linear(c["dim"], self.n_kv_heads * self.head_dim, bias=False)
            self.wv = nn.Linear(c["dim"], self.n_kv_heads * self.head_dim, bias=False)
            self.wo = nn.Linear(c["n_heads"] * self.head_dim, c["dim"], bias=False)

        def forward(self, x, freqs_cis):
            bs, seqlen, _ = x.shape
            xq = self.wq(x).view(bs, seqlen, -1, self.head_dim)
            xk = self.wk(x).view(bs, seqlen, -1, self.head_dim)
            xv = self.wv(x).view(bs, seqlen, -1, self.head_dim)
            xq, xk = apply_rotary_emb(xq, xk, freqs_cis)
            rep = self.n_heads // self.n_kv_heads
            keys = xk.repeat_interleave(rep, dim=2)
            values = xv.repeat_interleave(rep, dim=2)
            xq, xk, xv = xq.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2)
            scores = xq @ xk.transpose(-2, -1) / math.sqrt(self.head_dim)
            mask = torch.triu(torch.ones(seqlen, seqlen, dtype=torch.bool), 1)
            probs = torch.softmax(scores.masked_fill(mask, float("-inf")), -1)
            return self.wo((probs @ xv).transpose(1, 2).contiguous().view(bs, seqlen, -1))

    class FeedForward(nn.Module):
        def __init__(self, dim, hidden):
            super().__init__()
            self.w1 = nn.Linear(dim, hidden, bias=False)
            self.w2 = nn.Linear(hidden, dim, bias=False)
            self.w3 = nn.Linear(dim, hidden, bias=False)

        def forward(self, x):
            return self.w2(F.silu(self.w1(x)) * self.w3(x))

    class TransformerBlock(nn.Module):
        def __init__(self, c):
            super().__init__()
            self.attention = Attention(c)
            self.feed_forward = FeedForward(c["dim"], c["ffn"])
            self.attention_norm = nn.RMSNorm(c["dim"], eps=c["norm_eps"])
            self.ffn_norm = nn.RMSNorm(c["dim"], eps=c["norm_eps"])

        def forward(self, x, freqs_cis):
            h = x + self.attention(self.attention_norm(x), freqs_cis)
            return h + self.feed_forward(self.ffn_norm(h))

    class Transformer(nn.Module):
        def __init__(self, c):
            super().__init__()
            self.tok_embeddings = nn.Embedding(c["vocab_size"], c["dim"])
            self.register_buffer("freqs_cis", precompute_freqs_cis(c["dim"] // c["n_heads"], SEQ, c["rope_theta"]),
                                 persistent=False)
            self.layers = nn.ModuleDict({str(i): TransformerBlock(c) for i in range(c["n_layers"])})
            self.norm = nn.RMSNorm(c["dim"], eps=c["norm_eps"])
            self.output = nn.Linear(c["dim"], c["vocab_size"], bias=False)

        def forward(self, tokens, targets):
            h = self.tok_embeddings(tokens)
            for layer in self.layers.values():
                h = layer(h, self.freqs_cis[:tokens.shape[1]])
            logits = self.output(self.norm(h))
            return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1))

    torch.manual_seed(0)
    model = Transformer(CFG)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.3)
        model.tok_embeddings.weight[PAD].zero_()  # never read before PAD_AT's step
    return model


def lr_at(step):
    return 2e-3 * min(1.0, (step + 1) / 4)


def _rank(rank, out):
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    out = Path(out)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out}/.rendezvous", rank=rank, world_size=WORLD)
    mesh = init_device_mesh("cpu", (WORLD,))

    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(1, CFG["vocab_size"], (NUM_SAMPLES * SEQ + 1,), generator=g)
    perm = torch.randperm(NUM_SAMPLES, generator=torch.Generator().manual_seed(SEED)).tolist()
    B = MBS * ACCUM

    def rows(step):
        return perm[step * B:(step + 1) * B]

    step, micro, row, position = PAD_AT
    pad_sample = rows(step)[micro * MBS + row]
    tokens[pad_sample * SEQ + position] = PAD

    def batch(ids):
        w = torch.stack([tokens[i * SEQ:i * SEQ + SEQ + 1] for i in ids])
        return w[:, :-1], w[:, 1:]

    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=lr_at(0), betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                            foreach=False)
    names = {id(p): n for n, p in model.named_parameters()}
    found = {}

    def hook_for(name):
        def hook(module, inputs, output):
            if found or not isinstance(output, torch.Tensor) or "where" not in state:
                return
            bad = ~torch.isfinite(output.detach())
            if bad.any():
                flat = int(bad.reshape(-1).nonzero()[0])
                s, m, ids = state["where"]
                b, t, c = output.shape if output.dim() == 3 else (1, 1, output.numel())
                found.update(module=name, step=s, micro_batch=m, sample=ids[flat // (t * c)], position=(flat // c) % t,
                             kind="nan" if math.isnan(float(output.reshape(-1)[flat])) else "inf")
        return hook

    state = {}
    for name, module in model.named_modules():
        module.register_forward_hook(hook_for(name))
    log = []
    for step in range(LAST + 1):
        if step == FIRST:
            shard = lambda t: distribute_tensor(t.detach().clone(), mesh, [Shard(0)])  # noqa: E731
            sd = {n: shard(p) for n, p in model.named_parameters()}  # torchtitan: model weights at the top level
            osd = opt.state_dict()
            sd["optimizer"] = {
                "state": {names[id(p)]: {"step": opt.state[p]["step"].clone(), "exp_avg": shard(opt.state[p]["exp_avg"]),
                                         "exp_avg_sq": shard(opt.state[p]["exp_avg_sq"])} for p in model.parameters()},
                "param_groups": [dict({k: v for k, v in grp.items() if k != "params"},
                                      params=[names[id(p)] for p in model.parameters()]) for grp in osd["param_groups"]],
            }
            sd["train_state"] = {"step": FIRST}
            dcp.save(sd, checkpoint_id=str(out / f"checkpoint/step-{FIRST}"))
            dist.barrier()
            if rank != 0:
                break
        for grp in opt.param_groups:
            grp["lr"] = lr_at(step)
        total = 0.0
        ids_all = rows(step)
        for m in range(ACCUM):
            ids = ids_all[m * MBS:(m + 1) * MBS]
            state["where"] = (step, m, ids)
            loss = model(*batch(ids))
            (loss / ACCUM).backward()
            total += loss.item()
        norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
        num = lambda x: x if math.isfinite(x) else ("nan" if math.isnan(x) else "inf")  # noqa: E731
        log.append({"step": step, "lr": lr_at(step), "loss": num(total / ACCUM), "grad_norm": num(norm)})
        if not math.isfinite(total):
            break
        opt.step()
        opt.zero_grad(set_to_none=True)
    if rank == 0:
        (out / "tokens.bin").write_bytes(bytes(tokens.to(torch.int16).contiguous().view(torch.uint8).tolist()))
        (out / "log.jsonl").write_text("".join(json.dumps(e) + "\n" for e in log))
        (out / "expected.json").write_text(json.dumps({
            "torch": torch.__version__, "world_size_at_save": WORLD, "first": FIRST, "last": LAST,
            "model": CFG, "seq_len": SEQ, "micro_batch_size": MBS, "grad_accum": ACCUM, "sampler_seed": SEED,
            "grad_clip": 1.0, "pad_sample": pad_sample, "hooks_first_nonfinite": found}, indent=2) + "\n")
    dist.destroy_process_group()
    if rank == 0:
        (out / ".rendezvous").unlink(missing_ok=True)


def _cross_check(out):
    """The fixture read by PyTorch's reader and by nanreplay_import.py's own parser of the format."""
    import torch
    sys.path.insert(0, str(ROOT / "capture"))
    import nanreplay_import as ni
    path = Path(out) / f"checkpoint/step-{FIRST}"
    theirs = ni.read_dcp_with_torch(path)
    mine = ni.read_dcp_from_format(path)

    def walk(a, b, where):
        if isinstance(a, torch.Tensor):
            assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), where
            return 1
        if isinstance(a, dict):
            assert isinstance(b, dict) and set(a) == set(b), (where, sorted(a), sorted(b) if isinstance(b, dict) else b)
            return sum(walk(a[k], b[k], f"{where}.{k}") for k in a)
        if isinstance(a, (list, tuple)):
            assert isinstance(b, (list, tuple)) and len(a) == len(b), where
            return sum(walk(x, y, f"{where}[{i}]") for i, (x, y) in enumerate(zip(a, b)))
        assert a == b, (where, a, b)
        return 0

    n = walk(theirs, mine, "state_dict")
    md = ni.read_dcp_metadata(path)
    chunked = sum(len(v.chunks) > 1 for v in md.state_dict_metadata.values() if hasattr(v, "chunks"))
    files = sorted(p.name for p in path.iterdir())
    print(f"cross-check: {n} tensors identical through PyTorch's reader and nanreplay_import's parser; "
          f"{chunked} tensors in more than one chunk; files {files}")
    if chunked == 0:
        raise SystemExit("expected sharded tensors (chunks from two ranks)")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="write the fixture here (needs PyTorch >= 2.2)")
    ap.add_argument("--debian-root", help="as root on the host: build/reuse a trixie root here and run in it")
    args = ap.parse_args()
    if args.debian_root:
        in_debian_root(args.debian_root)
    elif args.out:
        write_fixture(args.out)
    else:
        ap.error("give --out or --debian-root")


if __name__ == "__main__":
    main()
