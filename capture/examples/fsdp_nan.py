"""A 2-process FSDP training job that goes NaN on rank 1, captured with nanreplay_capture.

Checked with PyTorch 2.6 (Debian 13's python3-torch) on CPU; Debian 12's torch 1.13 cannot run FSDP
at all (docs/capture.md, "FSDP"). scripts/fsdp_check.sh runs it in a Debian 13 root and replays
the bundles with this repository's nanreplay:

    python3 capture/examples/fsdp_nan.py --work /tmp/fsdp-demo                       # FSDP1
    python3 capture/examples/fsdp_nan.py --work /tmp/fsdp2-demo --fsdp fully_shard   # FSDP2
    nanreplay run /tmp/fsdp-demo/incidents/incident-step<step> --out /tmp/fsdp-demo/triage

The same job as ddp_nan.py (its model, data and planted fault: a stray token 0 in the sample rank
--fault-rank reads as row 0 of micro-batch --fault-micro at step --fault-step, at position
--fault-position, makes layers.0.input_layernorm divide 0 by 0), sharded instead of replicated:

  - --fsdp fsdp1 (the default): FullyShardedDataParallel(device_id=cpu), one unit per decoder
    layer plus the root, flat parameters (use_orig_params=False), accumulation under no_sync(),
    clipping with FSDP's own clip_grad_norm_ (the norm over every rank's shard). Runs on torch 2.6
    as it is.
  - --fsdp fully_shard (FSDP2): fully_shard on each decoder layer, then on the whole model, over a
    CPU device mesh; accumulation with set_requires_gradient_sync(False) on every micro-batch but
    the last. torch 2.6's FSDP2 is not made for CPU, and this mode works around three things
    (each explained where it is done in shard_model): torch.cpu.Stream lacks record_event and
    wait_event; re-gathering in backward breaks autograd on CPU, so parameters stay gathered
    between forward and backward (reshard_after_forward=False); and FSDP2 reduce-scatters fp32
    gradients with ReduceOp.AVG, which gloo's reduce-scatter silently treats as a sum (the
    gradients come out world-size times the mean, no error), so the job asks for SUM outright and
    divides its loss by the world size (exact: a power of two).

Every rank creates the Recorder with the sharded model and snapshot_every=K; at each full snapshot
(every K steps) begin_step gathers the full parameters and AdamW moments onto rank 0. The job
times the recorder's calls and records rank 0's resident memory, so result.json carries the cost
of a snapshot step and of a light step (see docs/capture.md, "FSDP"). --size large trains a 21 M
parameter model instead of the 23 K one, to see what a snapshot costs when it is not noise.

Writes <work>/result.json (rank 0): the bundles, the planted fault, what the job logged, the cost.
"""
import faulthandler
import gc
import json
import os
import resource
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # capture/, where nanreplay_capture.py is
sys.path.insert(0, str(HERE))
import ddp_nan  # noqa: E402  (the model, the data and the planted fault)
from nanreplay_capture import Recorder  # noqa: E402

SIZES = {"small": ddp_nan.CONFIG,
         "large": dict(ddp_nan.CONFIG, vocab_size=8192, hidden_size=512, num_layers=4, num_heads=8,
                       num_kv_heads=4, intermediate_size=1536)}


def rss_bytes():
    """This process's resident memory now (Linux /proc)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def shard_model(args, model):
    """The model sharded over the job's ranks: (what the loop calls forward on, what the optimizer
    updates, a context manager factory for the micro-batches that must not reduce, clip(max_norm))."""
    if args.fsdp == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy
        fsdp = FSDP(model, device_id=torch.device("cpu"), auto_wrap_policy=ModuleWrapPolicy({ddp_nan.Layer}))
        return fsdp, fsdp.parameters(), fsdp.no_sync, lambda max_norm: fsdp.clip_grad_norm_(max_norm)
    try:
        from torch.distributed.fsdp import fully_shard  # torch >= 2.6
    except ImportError:
        from torch.distributed._composable.fsdp import fully_shard  # torch 2.4, 2.5
    from torch.distributed.device_mesh import init_device_mesh
    # torch 2.6's CPU stand-in stream (torch.cpu.Stream) lacks two methods FSDP2 calls, so fully_shard on
    # CPU fails at the first forward ("AttributeError: 'Stream' object has no attribute 'record_event'").
    # CPU work runs in program order, so an event that is always complete is exact: supply them.
    if not hasattr(torch.cpu.Stream, "record_event"):
        torch.cpu.Stream.record_event = lambda self, event=None: torch.cpu.Event()
        torch.cpu.Stream.wait_event = lambda self, event: None
    mesh = init_device_mesh("cpu", (args.world,))
    # Parameters stay gathered from forward to backward (ZeRO-2 like): on CPU, torch 2.6's re-gather in
    # backward bumps the version of the tensors forward saved ("RuntimeError: one of the variables needed
    # for gradient computation has been modified by an inplace operation: [torch.FloatTensor [64, 32]],
    # which is output 0 of AsStridedBackward0, is at version 2; expected version 1 instead").
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=False)
    fully_shard(model, mesh=mesh, reshard_after_forward=False)
    # FSDP2 reduce-scatters fp32 gradients with ReduceOp.AVG, which gloo's reduce-scatter silently sums
    # (torch 2.6: gradients 2x the mean of 2 ranks): ask for SUM outright and divide the loss instead.
    for module in model.modules():
        group = module._get_fsdp_state()._fsdp_param_group if hasattr(module, "_get_fsdp_state") else None
        if group is not None:
            group.reduce_scatter_reduce_op = dist.ReduceOp.SUM

    class no_sync:
        def __enter__(self):
            model.set_requires_gradient_sync(False)

        def __exit__(self, *exc):
            model.set_requires_gradient_sync(True)
            return False

    def clip(max_norm):  # a DTensor of the ranks' partial norms, given to end_step as it is
        return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    return model, model.parameters(), no_sync, clip


def train(rank, args, shard):
    if args.timeout:  # a hung collective prints every thread's stack and ends the process, never hangs
        faulthandler.dump_traceback_later(args.timeout, exit=True)
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(args.port)
    os.environ.setdefault("USE_LIBUV", "0")    # Debian's torch 2.6 is built without libuv's TCPStore
    dist.init_process_group("gloo", rank=rank, world_size=args.world)
    cfg = SIZES[args.size]
    torch.manual_seed(0)                       # the same initial weights on every rank
    model = ddp_nan.Llama(cfg)
    rss_model = rss_bytes()
    sharded, params, no_sync, clip = shard_model(args, model)
    optimizer = torch.optim.AdamW(params, lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    # FSDP2 sums the ranks' gradients (see shard_model); FSDP1 averages them itself.
    loss_divisor = args.accum * (args.world if args.fsdp == "fully_shard" else 1)

    dataset = ddp_nan.TokenWindows(shard, args.seq_len)
    sampler = DistributedSampler(dataset, num_replicas=args.world, rank=rank, shuffle=True, seed=args.seed,
                                 drop_last=True)
    sampler.set_epoch(0)
    batches = iter(DataLoader(dataset, batch_size=args.micro_batch, sampler=sampler))

    # Every rank: the same Recorder, given the sharded model. Rank 0 records and writes.
    rss_before = rss_bytes()
    t0 = time.perf_counter()
    recorder = Recorder(sharded, optimizer, args.work / "incidents", arch="llama", grad_clip=1.0,
                        model_config=dict(num_heads=cfg["num_heads"]),
                        data=dict(shards=[str(shard)], seq_len=args.seq_len, micro_batch_size=args.micro_batch,
                                  grad_accum_steps=args.accum,   # world_size: the job's
                                  sampler=dict(kind="randperm", seed=args.seed)),
                        snapshot_every=args.snapshot_every)
    setup = {"recorder_init_s": time.perf_counter() - t0, "rss_model": rss_model, "rss_before_recorder": rss_before,
             "rss_after_recorder": rss_bytes()}
    logged, bundles = {}, {}
    for step in range(args.steps):
        micro_batches = [next(batches) for _ in range(args.accum)]
        t0 = time.perf_counter()
        recorder.begin_step(step, samples=[int(i) for ids, _ in micro_batches for i in ids])  # this rank's
        t1 = time.perf_counter()
        full = recorder._shadow[1] == step     # whether this step took a full snapshot (the gather)
        rss_after_begin = rss_bytes()
        local = 0.0
        for m, (_, window) in enumerate(micro_batches):
            with (no_sync() if m < args.accum - 1 else ddp_nan._nothing()):   # reduce once per step
                loss = sharded(window[:, :-1], window[:, 1:])
                (loss / loss_divisor).backward()
            local += loss.item() / args.accum
        norm = clip(1.0)
        t2 = time.perf_counter()
        bundle = recorder.end_step(local_loss=local, grad_norm=norm)   # this rank's own loss
        t3 = time.perf_counter()
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm   # every rank: collective
        logged[step] = {"local_loss": local, "grad_norm": float(norm), "full": full, "begin_s": t1 - t0,
                        "end_s": t3 - t2, "step_s": t3 - t0, "rss_after_begin": rss_after_begin,
                        "peak_rss": peak_rss_bytes()}
        if bundle is not None:                                   # on every rank: stop together
            bundles["incident"] = str(bundle)
            break
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step == args.dump_at:                                 # every rank calls dump(); rank 0 writes
            bundles["dump"] = str(recorder.dump(args.work / f"dump-step{step}"))
    gathered = [None] * args.world
    dist.all_gather_object(gathered, logged)
    setups = [None] * args.world
    dist.all_gather_object(setups, setup)
    if rank == 0:
        result = {"fsdp": args.fsdp, "size": args.size, "torch": torch.__version__, "world": args.world,
                  "params": sum(p.numel() for p in recorder.params),
                  "snapshot_bytes": recorder.host_bytes_bound // 2, "snapshot_every": args.snapshot_every,
                  "bundles": bundles, "setup": setups, "per_rank_steps": gathered,
                  "cost": cost(gathered, args),
                  "logged": {str(s): {"loss": sum(g[s]["local_loss"] for g in gathered) / args.world,
                                      "rank_losses": [g[s]["local_loss"] for g in gathered],
                                      "grad_norm": gathered[0][s]["grad_norm"]} for s in logged}}
        (args.work / "result.json").write_text(json.dumps(dict(json.loads((args.work / "planted.json").read_text()),
                                                               **result), indent=1))
    # Tear down in order: everything that holds the process group (FSDP, its comm hook's state, the
    # recorder, the closures over the wrapper) before the group itself; a gloo group freed after
    # destroy_process_group, at exit, sometimes aborts ("terminate called without an active exception").
    del recorder, optimizer, sharded, params, no_sync, clip, model
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


def cost(gathered, args):
    """Medians over the healthy steps after the first (which pays for lazy initialisation): the
    recorder's time on snapshot steps (begin_step gathers) and on light steps, per rank."""
    def median(xs):
        xs = sorted(xs)
        return xs[len(xs) // 2] if xs else None
    out = {}
    for r, g in enumerate(gathered):
        last = max(g)
        healthy = [s for s in g if s >= 1 and s not in (args.dump_at, last)]
        snaps = [s for s in healthy if g[s]["full"]]
        light = [s for s in healthy if not g[s]["full"]]
        out[f"rank{r}"] = {
            "snapshot_steps": snaps,
            "snapshot_begin_ms": median([1e3 * g[s]["begin_s"] for s in snaps]),
            "light_recorder_ms": median([1e3 * (g[s]["begin_s"] + g[s]["end_s"]) for s in light]),
            "step_ms": median([1e3 * g[s]["step_s"] for s in light]),
        }
    return out


def main(argv=None):
    ap = ddp_nan.job_arguments(__doc__.split("\n")[0], timeout=300)
    ap.add_argument("--fsdp", choices=("fsdp1", "fully_shard"), default="fsdp1")
    ap.add_argument("--size", choices=sorted(SIZES), default="small")
    ap.add_argument("--snapshot-every", type=int, default=3)
    args = ap.parse_args(argv)
    ddp_nan.CONFIG = SIZES[args.size]  # write_shard draws tokens from [1, vocab_size)
    shard = ddp_nan.prepare(args)
    started = time.perf_counter()
    mp.spawn(train, args=(args, shard), nprocs=args.world)
    result = json.loads((args.work / "result.json").read_text())
    print(f"{args.fsdp}, {result['params']} parameters, torch {result['torch']}: {args.world} ranks trained in "
          f"{time.perf_counter() - started:.1f} s; planted {result['planted']}")
    print(f"cost (medians): {json.dumps(result['cost'])}")
    for kind, path in result["bundles"].items():
        print(f"{kind} bundle: {path}   (replay: nanreplay run {path} --out {args.work / ('triage-' + kind)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
