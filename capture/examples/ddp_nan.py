"""A 2-process DDP training job that goes NaN on rank 1, captured with nanreplay_capture.

Runnable as it is, on CPU (gloo), started with torch.multiprocessing.spawn:

    /usr/bin/python3 capture/examples/ddp_nan.py --work /tmp/ddp-demo
    nanreplay run /tmp/ddp-demo/incidents/incident-step<step> --out /tmp/ddp-demo/triage

What it shows is the loop every rank runs (see the README's "Capturing an incident"):

  - one Recorder per rank, given the DDP wrapper itself; rank 0 keeps the window and writes;
  - begin_step(step, samples=<this rank's indices>): the recorder gathers every rank's;
  - gradient accumulation with DDP's no_sync() on every micro-batch but the last, so each
    gradient bucket is all-reduced once per step; the recorder's comm hook measures this
    rank's gradient norm before that all-reduce (the bundle's rank_grad_norms);
  - end_step(local_loss=<this rank's own loss>, grad_norm=<what clip_grad_norm_ returned>):
    the recorder gathers the ranks' losses, logs their mean, and returns the bundle path on
    every rank when the loss went non-finite, so every rank stops together.

The data: uint16 tokens, DistributedSampler(shuffle=True, drop_last=True). The planted fault:
the model's norms have eps 0 and token 0 is the padding index (its embedding row is zero and
never trained), so a stray token 0 makes layers.0.input_layernorm divide 0 by 0. It sits in the
sample that rank --fault-rank reads as row 0 of micro-batch --fault-micro at step --fault-step,
at position --fault-position. With --dump-at S the job also calls dump() on every rank at step S
(a healthy window, which nanreplay replays clean: exit 0).

Writes <work>/result.json (rank 0): the bundles, the planted fault, and what the job logged.
"""
import argparse
import faulthandler
import json
import math
import os
import socket
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # capture/, where nanreplay_capture.py is
from nanreplay_capture import Recorder  # noqa: E402

CONFIG = dict(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
              intermediate_size=64, norm_eps=0.0, rope_theta=10000.0)
PAD = 0


# -- a small llama with Hugging Face's parameter names (bundle v1's keys) --------------------------

class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope(x, theta):
    """x: (B, heads, T, D); rotate-half rotary embeddings, positions from 0."""
    T, D = x.shape[-2], x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, D, 2).float() / D))
    ang = torch.outer(torch.arange(T).float(), inv)
    ang = torch.cat([ang, ang], -1)
    return x * ang.cos() + torch.cat([-x[..., D // 2:], x[..., :D // 2]], -1) * ang.sin()


class Attention(nn.Module):
    def __init__(self, c):
        super().__init__()
        C, self.H, self.G, self.theta = c["hidden_size"], c["num_heads"], c["num_kv_heads"], c["rope_theta"]
        self.D = C // self.H
        self.q_proj = nn.Linear(C, C, bias=False)
        self.k_proj = nn.Linear(C, self.G * self.D, bias=False)
        self.v_proj = nn.Linear(C, self.G * self.D, bias=False)
        self.o_proj = nn.Linear(C, C, bias=False)

    def forward(self, x):
        B, T, _ = x.shape
        q = rope(self.q_proj(x).view(B, T, self.H, self.D).transpose(1, 2), self.theta)
        k = rope(self.k_proj(x).view(B, T, self.G, self.D).transpose(1, 2), self.theta)
        v = self.v_proj(x).view(B, T, self.G, self.D).transpose(1, 2)
        k, v = k.repeat_interleave(self.H // self.G, 1), v.repeat_interleave(self.H // self.G, 1)
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.D)
        scores = scores.masked_fill(torch.triu(torch.ones(T, T, dtype=torch.bool), 1), float("-inf"))
        return self.o_proj((torch.softmax(scores, -1) @ v).transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, c):
        super().__init__()
        C, W = c["hidden_size"], c["intermediate_size"]
        self.gate_proj, self.up_proj = nn.Linear(C, W, bias=False), nn.Linear(C, W, bias=False)
        self.down_proj = nn.Linear(W, C, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.input_layernorm = RMSNorm(c["hidden_size"], c["norm_eps"])
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c["hidden_size"], c["norm_eps"])
        self.mlp = MLP(c)

    def forward(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.rope_theta = c["rope_theta"]
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(c["vocab_size"], c["hidden_size"], padding_idx=PAD)
        self.model.layers = nn.ModuleList(Layer(c) for _ in range(c["num_layers"]))
        self.model.norm = RMSNorm(c["hidden_size"], c["norm_eps"])
        self.lm_head = nn.Linear(c["hidden_size"], c["vocab_size"], bias=False)
        for name, p in self.named_parameters():
            if p.dim() == 2:
                with torch.no_grad():
                    nn.init.normal_(p, std=0.02)
                    if "embed" in name:
                        p[PAD].zero_()

    def forward(self, inputs, targets):
        x = self.model.embed_tokens(inputs)
        for layer in self.model.layers:
            x = layer(x)
        logits = self.lm_head(self.model.norm(x))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


# -- data ----------------------------------------------------------------------------------------

class TokenWindows(Dataset):
    """Sample i: tokens [i*L, i*L + L + 1) of a uint16 shard (bundle v1's samples)."""

    def __init__(self, path, seq_len):
        raw = torch.frombuffer(bytearray(Path(path).read_bytes()), dtype=torch.int16)
        self.tokens, self.seq_len = raw.to(torch.int64) & 0xFFFF, seq_len

    def __len__(self):
        return (len(self.tokens) - 1) // self.seq_len

    def __getitem__(self, i):
        return i, self.tokens[i * self.seq_len:i * self.seq_len + self.seq_len + 1]


def write_shard(args, path):
    """Random tokens in [1, vocab), with one stray PAD where the planted fault is. Returns the
    planted sample index (None without a fault)."""
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(1, CONFIG["vocab_size"], (args.samples * args.seq_len + 1,), generator=g)
    bad = None
    if args.fault_step >= 0:
        # DistributedSampler(shuffle=True, drop_last=True, seed): rank r reads perm[r:total:world] in order.
        perm = torch.randperm(args.samples, generator=torch.Generator().manual_seed(args.seed)).tolist()
        total = args.samples // args.world * args.world
        per_step = args.micro_batch * args.accum
        mine = perm[args.fault_rank:total:args.world]
        bad = mine[args.fault_step * per_step + args.fault_micro * args.micro_batch]
        tokens[bad * args.seq_len + args.fault_position] = PAD
    path.write_bytes(tokens.to(torch.int16).numpy().tobytes())
    return bad


# -- the training job, on every rank ---------------------------------------------------------------

def train(rank, args, shard):
    if args.timeout:  # a hung collective prints every thread's stack and ends the process, never hangs CI
        faulthandler.dump_traceback_later(args.timeout, exit=True)
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(args.port)
    dist.init_process_group("gloo", rank=rank, world_size=args.world)
    torch.manual_seed(0)                       # the same initial weights on every rank
    model = Llama(CONFIG)
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)

    dataset = TokenWindows(shard, args.seq_len)
    sampler = DistributedSampler(dataset, num_replicas=args.world, rank=rank, shuffle=True, seed=args.seed,
                                 drop_last=True)
    sampler.set_epoch(0)
    batches = iter(DataLoader(dataset, batch_size=args.micro_batch, sampler=sampler))

    # Every rank: the same Recorder, given the DDP wrapper. Rank 0 records and writes.
    recorder = Recorder(ddp, optimizer, args.work / "incidents", arch="llama", grad_clip=1.0,
                        model_config=dict(num_heads=CONFIG["num_heads"]),
                        data=dict(shards=[str(shard)], seq_len=args.seq_len, micro_batch_size=args.micro_batch,
                                  grad_accum_steps=args.accum,   # world_size: the job's
                                  sampler=dict(kind="randperm", seed=args.seed)),
                        window=args.window)
    logged, bundles = {}, {}
    for step in range(args.steps):
        micro_batches = [next(batches) for _ in range(args.accum)]
        t0 = time.perf_counter()
        recorder.begin_step(step, samples=[int(i) for ids, _ in micro_batches for i in ids])  # this rank's
        t1 = time.perf_counter()
        local, micro_losses = 0.0, []
        for m, (_, window) in enumerate(micro_batches):
            # All-reduce once per step, on the last micro-batch: no_sync() on the others.
            sync = m == args.accum - 1 or args.sync_every_micro_batch
            with (ddp.no_sync() if not sync else _nothing()):
                loss = ddp(window[:, :-1], window[:, 1:])
                (loss / args.accum).backward()
            micro_losses.append(loss.item())
            local += micro_losses[-1] / args.accum
        norm = torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
        t2 = time.perf_counter()
        bundle = recorder.end_step(local_loss=local, grad_norm=norm)   # this rank's own loss
        t3 = time.perf_counter()
        logged[step] = {"local_loss": local, "last_micro_loss": micro_losses[-1], "grad_norm": float(norm),
                        "recorder_s": (t1 - t0) + (t3 - t2), "step_s": t3 - t0}
        if bundle is not None:                                   # on every rank: stop together
            bundles["incident"] = str(bundle)
            break
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step == args.dump_at:                                 # every rank calls dump(); rank 0 writes
            bundles["dump"] = str(recorder.dump(args.work / f"dump-step{step}"))
    gathered = [None] * args.world
    dist.all_gather_object(gathered, logged)
    if rank == 0:
        last = max(logged) if "incident" in bundles else None   # the NaN step pays for the dump
        healthy = [s for s in logged if s >= 2 and s not in (args.dump_at, last)]
        cost = {f"rank{r}": {"recorder_ms": 1e3 * sorted(g[s]["recorder_s"] for s in healthy)[len(healthy) // 2],
                             "step_ms": 1e3 * sorted(g[s]["step_s"] for s in healthy)[len(healthy) // 2]}
                for r, g in enumerate(gathered)} if healthy else {}
        result = {"median_cost": cost, "bundles": bundles, "logged": {str(s): {"loss": sum(g[s]["local_loss"] for g in gathered) / args.world,
                                                         "rank_losses": [g[s]["local_loss"] for g in gathered],
                                                         # what nanoGPT prints: the last micro-batch's
                                                         "rank_last_micro_losses": [g[s]["last_micro_loss"]
                                                                                    for g in gathered],
                                                         "grad_norm": gathered[0][s]["grad_norm"]}
                                                 for s in logged}}
        (args.work / "result.json").write_text(json.dumps(dict(json.loads((args.work / "planted.json").read_text()),
                                                               **result), indent=1))
    # Tear down in order: DDP (its reducer and the recorder's comm hook) before the process group.
    del recorder, ddp
    dist.barrier()
    dist.destroy_process_group()


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def job_arguments(description, timeout):
    """The arguments this job and fsdp_nan.py share: the data, the training loop and the planted fault."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--work", type=Path, required=True, help="directory for the shard, bundles and result.json")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--seq-len", type=int, default=16)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--accum", type=int, default=2)
    ap.add_argument("--samples", type=int, default=128)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--fault-step", type=int, default=8, help="-1: no fault")
    ap.add_argument("--fault-rank", type=int, default=1)
    ap.add_argument("--fault-micro", type=int, default=1)
    ap.add_argument("--fault-position", type=int, default=5)
    ap.add_argument("--dump-at", type=int, default=-1, help="also dump() the window at the end of this step")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=timeout, help="seconds before a rank gives up (0: never)")
    return ap


def prepare(args):
    """The work directory, a free port, the token shard with its planted fault and planted.json; the shard."""
    args.work.mkdir(parents=True, exist_ok=True)
    args.port = args.port or free_port()
    shard = args.work / "tokens.bin"
    bad = write_shard(args, shard)
    (args.work / "planted.json").write_text(json.dumps({
        "planted": None if bad is None else {"step": args.fault_step, "rank": args.fault_rank,
                                             "micro_batch": args.fault_micro, "sample": bad,
                                             "position": args.fault_position}}))
    return shard


def main(argv=None):
    ap = job_arguments(__doc__.split("\n")[0], timeout=120)
    ap.add_argument("--window", type=int, default=10)
    ap.add_argument("--sync-every-micro-batch", action="store_true",
                    help="accumulate without no_sync() (each rank's own gradient then never exists: the bundle "
                         "has no rank_grad_norms)")
    args = ap.parse_args(argv)
    shard = prepare(args)
    started = time.perf_counter()
    mp.spawn(train, args=(args, shard), nprocs=args.world)
    result = json.loads((args.work / "result.json").read_text())
    print(f"{args.world} ranks trained in {time.perf_counter() - started:.1f} s; planted {result['planted']}")
    print(f"healthy steps, median: {json.dumps(result['median_cost'])}")
    for kind, path in result["bundles"].items():
        print(f"{kind} bundle: {path}   (replay: nanreplay run {path} --out {args.work / ('triage-' + kind)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
