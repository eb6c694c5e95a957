"""Capturing from distributed jobs (docs/capture.md, "Distributed jobs").

1. capture/examples/ddp_nan.py, as a user runs it: a 2-process gloo DDP job started with
   torch.multiprocessing.spawn (DistributedSampler, accumulation with no_sync, AdamW, clipping)
   that goes NaN on rank 1 and dumps automatically; every rank gets the bundle path and stops.
   `nanreplay run` must name rank 1, the planted micro-batch, sample and position; the healthy
   steps must replay to the logged losses, per-rank losses and per-rank gradient norms before the
   all-reduce (the recorder's comm hook), with no SYSTEM_* finding; a dump() of the same job at
   a healthy step must replay with exit 0. The same NaN window logged by the other conventions
   jobs follow (clip_grad_norm_'s global norm as every rank's, rank 0's own loss, rank 0's last
   micro-batch's loss) must name each convention and leave the origin's the only error, at the
   NaN step too. Accumulating without no_sync() must leave rank_grad_norms out rather than
   record wrong ones.
2. The sharded (FSDP) path's gather logic, in one process: torch 1.13's FSDP neither imports on
   Python 3.11 nor runs on CPU, so a stand-in FSDP1 wrapper returns the full state dict and
   optimizer state the way FSDP's FULL_STATE_DICT does (wrapper prefixes, a buffer, names as
   keys), and stand-in DTensor parameters (fully_shard's) have a full_tensor(); the snapshots
   each writes must be byte-identical to those of the unwrapped model.
3. Wrappers are unwrapped (torch.compile's _orig_mod); FSDP without snapshot_every is refused.
4. A DDP model that already has the user's comm hook is refused with a CaptureError naming the fix
   (pass the hook as comm_hook=), and given that way the hook is wrapped and still runs.

~20 s with Debian's /usr/bin/python3 (one thread per process), the NaN window replayed five times.
"""
import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT / "capture"))
sys.path.insert(0, str(ROOT / "capture" / "examples"))
import ddp_nan  # noqa: E402
import nanreplay_capture  # noqa: E402
from nanreplay_capture import CaptureError  # noqa: E402

TOLERANCE = 1e-5
failures = []


def check(ok, what):
    print(("ok   " if ok else "FAIL ") + what)
    if not ok:
        failures.append(what)


def rel(a, b):
    return abs(a - b) / max(abs(b), 1e-12)


def replay(cli, bundle, out):
    shutil.rmtree(out, ignore_errors=True)
    proc = subprocess.run([cli, "run", str(bundle), "--out", str(out)], capture_output=True, text=True)
    path = Path(out) / "report.json"
    return proc, (json.loads(path.read_text()) if path.exists() else None)


def check_steps(label, report, logged, bundle):
    """Healthy steps: replayed loss, per-rank losses and per-rank pre-all-reduce norms against the log."""
    for row in report["steps"]:
        want = logged.get(str(row["step"]))
        if want is None or not math.isfinite(want["loss"]):
            continue
        state = json.loads((Path(bundle) / "steps" / str(row["step"]) / "state.json").read_text())["logged"]
        ok = (rel(row["loss"], want["loss"]) <= TOLERANCE and rel(row["grad_norm"], want["grad_norm"]) <= TOLERANCE
              and all(rel(a, b) <= TOLERANCE for a, b in zip(row["rank_losses"], state["rank_losses"]))
              and len(state.get("rank_grad_norms", [])) == 2
              and all(rel(a, b) <= 1e-4 for a, b in zip(row["rank_grad_norms"], state["rank_grad_norms"])))
        check(ok, f"{label} step {row['step']}: replayed loss {row['loss']:.9g}, ranks {row['rank_losses']}, "
                  f"rank norms {row['rank_grad_norms']} match the log ({want['loss']:.9g}, "
                  f"{state['rank_losses']}, {state.get('rank_grad_norms')})")
    bad = [f["code"] for f in report["findings"] if f["code"].startswith("SYSTEM_")
           or f["code"] in ("DATA_SAMPLER_MISMATCH", "BUNDLE_CHECKSUM_MISMATCH")]
    check(not bad, f"{label}: no finding that says the capture misstates the run {bad}")


def ddp_example(cli, work):
    started = time.perf_counter()
    ddp_nan.main(["--work", str(work), "--steps", "10", "--window", "6", "--fault-step", "7", "--dump-at", "3",
                  "--timeout", "60"])
    result = json.loads((work / "result.json").read_text())
    print(f"the 2-process DDP example ran in {time.perf_counter() - started:.1f} s")
    planted, bundles, logged = result["planted"], result["bundles"], result["logged"]
    check(set(bundles) == {"incident", "dump"}, f"the job dumped on demand and on NaN {sorted(bundles)}")
    check(max(int(s) for s in logged) == planted["step"], "every rank stopped at the NaN step")

    incident = Path(bundles["incident"])
    manifest = json.loads((incident / "manifest.json").read_text())
    check(manifest["data"]["world_size"] == 2 and [e["step"] for e in manifest["steps"]] == list(range(2, 8)),
          f"incident bundle: world_size 2, the last 6 steps {[e['step'] for e in manifest['steps']]}")
    check(all(len(e["samples"]) == 2 for e in manifest["steps"]), "every step lists both ranks' samples")
    proc, report = replay(cli, incident, work / "out-incident")
    check(proc.returncode == 1 and report is not None,
          f"nanreplay run on the incident exits 1 (got {proc.returncode}) {proc.stderr.strip()[-300:]}")
    if report:
        first = report["first_nonfinite"] or {}
        print("nanreplay: first_nonfinite", json.dumps(first))
        for key in ("step", "rank", "micro_batch", "sample", "position"):
            check(first.get(key) == planted[key], f"first_nonfinite.{key} = {first.get(key)!r}, planted {planted[key]!r}")
        check(first.get("site") == "layers.0.attn_norm" and first.get("phase") == "forward",
              f"first_nonfinite at layers.0.attn_norm, forward ({first.get('site')}, {first.get('phase')})")
        check_steps("incident", report, logged, incident)
    incident_by_convention(cli, incident, logged, planted, work)

    dump = Path(bundles["dump"])
    proc, report = replay(cli, dump, work / "out-dump")
    check(proc.returncode == 0 and report is not None and not report["reproduced"],
          f"nanreplay run on the healthy dump() exits 0 (got {proc.returncode}) {proc.stderr.strip()[-300:]}")
    if report:
        check_steps("dump", report, logged, dump)


def json_number(x):
    """As bundle v1 writes numbers: non-finite ones as "nan", "inf", "-inf"."""
    return x if math.isfinite(x) else ("nan" if math.isnan(x) else ("inf" if x > 0 else "-inf"))


def incident_by_convention(cli, incident, logged, planted, work):
    """The NaN window as jobs log it other than the format asks (issue 45): the per-rank norms as
    clip_grad_norm_'s global norm on every rank (NaN on both at the NaN step: the all-reduce spreads
    rank 1's), the loss as rank 0's own or as rank 0's last micro-batch's (nanoGPT's print). Each
    convention must be said (info, naming the NaN step too), the origin must stay rank 1's, and no
    finding may blame the system or the bundle, on the healthy steps or the NaN step. The comm hook
    with the global loss is the capture as written, checked above."""
    cases = [("clip", "global"), ("hook", "rank 0"), ("clip", "rank 0"), ("clip", "last micro-batch")]
    for norms, loss in cases:
        label = f"incident, norms from {'clip_grad_norm_' if norms == 'clip' else 'the comm hook'}, {loss} loss"
        bundle = work / ("incident-" + norms + "-" + loss.replace(" ", "-"))
        shutil.rmtree(bundle, ignore_errors=True)
        shutil.copytree(incident, bundle)
        for state_path in sorted((bundle / "steps").glob("*/state.json")):
            state = json.loads(state_path.read_text())
            job = logged[state_path.parent.name]
            if norms == "clip":
                state["logged"]["rank_grad_norms"] = [json_number(job["grad_norm"])] * 2
            if loss == "rank 0":
                state["logged"]["loss"] = json_number(job["rank_losses"][0])
            elif loss == "last micro-batch":
                state["logged"]["loss"] = json_number(job["rank_last_micro_losses"][0])
            state_path.write_text(json.dumps(state))
        proc, report = replay(cli, bundle, work / ("out-" + bundle.name))
        check(proc.returncode == 1 and report is not None,
              f"{label}: exit 1 (got {proc.returncode}) {proc.stderr.strip()[-300:]}")
        if not report:
            continue
        first = report["first_nonfinite"] or {}
        check(all(first.get(k) == planted[k] for k in ("step", "rank", "sample")),
              f"{label}: the origin is rank {first.get('rank')}'s at step {first.get('step')}")
        said = {f["evidence"].get("tensor"): f for f in report["findings"] if f["code"] == "SYSTEM_LOG_CONVENTION"}
        want = (["loss"] if loss != "global" else []) + (["rank_grad_norms"] if norms == "clip" else [])
        check(sorted(said) == want and all(f["severity"] == "info" and planted["step"] in f["evidence"]["steps"]
                                           for f in said.values()),
              f"{label}: the conventions {sorted(said)} are said as info, the NaN step among their steps")
        if loss == "last micro-batch" and "loss" in said:
            check(said["loss"]["evidence"].get("micro_batch") == 1 and said["loss"]["evidence"].get("rank") == 0,
                  f"{label}: rank 0's micro-batch 1 named ({said['loss']['message']})")
        blamed = [f"{f['code']} ({f['severity']}): {f['message']}" for f in report["findings"]
                  if (f["code"].startswith(("SYSTEM_", "BUNDLE_")) and f["severity"] != "info")
                  or (f["severity"] == "error" and f["evidence"].get("step") != planted["step"])]
        check(not blamed and not report["root_cause"]["code"].startswith(("SYSTEM_", "BUNDLE_")),
              f"{label}: the origin's is the only error, root cause {report['root_cause']['code']} {blamed}")


def ddp_without_no_sync(work):
    """Accumulation without no_sync(): buckets are all-reduced per micro-batch, no rank's own gradient
    exists, so the bundle must carry rank_losses but no rank_grad_norms (rather than wrong ones)."""
    ddp_nan.main(["--work", str(work), "--steps", "3", "--window", "3", "--fault-step", "-1", "--dump-at", "2",
                  "--sync-every-micro-batch", "--timeout", "60"])
    bundle = Path(json.loads((work / "result.json").read_text())["bundles"]["dump"])
    logged = json.loads((bundle / "steps" / "1" / "state.json").read_text())["logged"]
    check(len(logged.get("rank_losses", [])) == 2 and "rank_grad_norms" not in logged,
          f"without no_sync: rank_losses but no rank_grad_norms in state.json ({sorted(logged)})")


def hooked_rank(rank, args, shard, out):
    """One rank of a 2-process job whose DDP model already has the user's comm hook: the recorder must
    refuse it with a CaptureError naming the fix (not PyTorch's "can only be called once"), and
    given the same hook as comm_hook= on a fresh model, wrap it: the hook still runs and the
    recorder measures this rank's norm."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
    calls = []

    def users_hook(state, bucket):
        calls.append(1)
        return default_hooks.allreduce_hook(state, bucket)

    def recorder_for(ddp, **hook):
        optimizer = torch.optim.AdamW(ddp.module.parameters(), lr=1e-3)
        return nanreplay_capture.Recorder(
            ddp, optimizer, out / "incidents", arch="llama", model_config=dict(num_heads=ddp_nan.CONFIG["num_heads"]),
            data=dict(shards=[str(shard)], seq_len=args.seq_len, micro_batch_size=2, grad_accum_steps=1,
                      sampler=dict(kind="randperm", seed=args.seed)), window=2, **hook)
    torch.manual_seed(0)
    hooked = torch.nn.parallel.DistributedDataParallel(ddp_nan.Llama(ddp_nan.CONFIG))
    hooked.register_comm_hook(None, users_hook)
    refused = ""
    try:
        recorder_for(hooked)
    except CaptureError as e:
        refused = "CaptureError: " + str(e)
    except RuntimeError as e:
        refused = "RuntimeError: " + str(e)
    torch.manual_seed(0)
    ddp = torch.nn.parallel.DistributedDataParallel(ddp_nan.Llama(ddp_nan.CONFIG))
    recorder = recorder_for(ddp, comm_hook=users_hook)
    dataset = ddp_nan.TokenWindows(shard, args.seq_len)
    samples = [2 * rank, 2 * rank + 1]
    window = torch.stack([dataset[i][1] for i in samples])
    recorder.begin_step(0, samples=samples)
    loss = ddp(window[:, :-1], window[:, 1:])
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
    recorder.end_step(local_loss=loss.item(), grad_norm=norm)
    if rank == 0:
        (out / "hooked.json").write_text(json.dumps({"refused": refused, "hook_calls": len(calls),
                                                     "norms_from": recorder._norms_from}))
    del recorder, ddp, hooked
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def ddp_with_users_comm_hook(work):
    args = ddp_nan.job_arguments("hooked", timeout=60).parse_args(["--work", str(work), "--fault-step", "-1"])
    shard = ddp_nan.prepare(args)
    torch.multiprocessing.spawn(hooked_rank, args=(args, shard, work), nprocs=2)
    result = json.loads((work / "hooked.json").read_text())
    refused = result["refused"]
    check(refused.startswith("CaptureError: the DistributedDataParallel model already has a comm hook"),
          f"a DDP model with a comm hook is refused by the recorder, not by PyTorch ({refused[:90]!r})")
    check("users_hook" in refused and "comm_hook=hook" in refused and "comm_hook=False" in refused,
          "the refusal names the registered hook and the fix (comm_hook=hook, or comm_hook=False)")
    check(result["norms_from"] == "ddp" and result["hook_calls"] > 0,
          f"comm_hook=the user's hook: wrapped, and it still reduces the gradients ({result})")


class FullyShardedDataParallel(torch.nn.Module):
    """Stands in for FSDP1 (the recorder recognises it by class name): holds the module as FSDP
    does, and its full state dict comes back with FSDP's wrapper prefixes and the module's buffers."""

    def __init__(self, module):
        super().__init__()
        self._fsdp_wrapped_module = module
        self.register_buffer("rope_cache", torch.zeros(3))
        self.gathers = 0


def fake_gather_fsdp1(self, optimizer):
    self.wrapper.gathers += 1
    params = {"_fsdp_wrapped_module." + k: v.detach().clone() for k, v in self.wrapper._fsdp_wrapped_module.state_dict().items()}
    params["rope_cache"] = self.wrapper.rope_cache.clone()
    if not optimizer:
        return params, None
    names = {id(p): n for n, p in self.wrapper._fsdp_wrapped_module.named_parameters()}
    state = {names[id(p)]: {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in st.items()}
             for p, st in self.optimizer.state.items()}
    return params, state


class DTensor(torch.nn.Parameter):
    """Stands in for fully_shard's DTensor parameters (the recorder recognises them by class name and
    gathers each with full_tensor(), collective under FSDP2; here the whole tensor is local)."""

    def full_tensor(self):
        return self.detach()


def fully_shard(module):
    for sub in module.modules():
        for name, p in list(sub._parameters.items()):
            if p is not None:
                sub._parameters[name] = DTensor(p.detach().clone())
    return module


class OptimizedModule(torch.nn.Module):
    """torch.compile's wrapper, as far as the recorder sees it."""

    def __init__(self, module):
        super().__init__()
        self._orig_mod = module


def sharded_gather(work):
    shard = work / "tokens.bin"
    tokens = torch.randint(1, ddp_nan.CONFIG["vocab_size"], (64 * 16 + 1,), generator=torch.Generator().manual_seed(3))
    shard.write_bytes(tokens.to(torch.int16).numpy().tobytes())
    data = dict(shards=[str(shard)], seq_len=16, micro_batch_size=2)
    cfg = dict(num_heads=ddp_nan.CONFIG["num_heads"])
    nanreplay_capture._ShardedGather._gather_fsdp1 = fake_gather_fsdp1

    runs = {}
    for label in ("plain", "fsdp", "fully_shard", "compiled"):
        torch.manual_seed(0)
        model = ddp_nan.Llama(ddp_nan.CONFIG)
        if label == "fully_shard":
            model = fully_shard(model)
        decay = [p for p in model.parameters() if p.dim() == 2]
        rest = [p for p in model.parameters() if p.dim() < 2]
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}], lr=3e-3)
        wrapped = {"plain": model, "fsdp": FullyShardedDataParallel(model), "fully_shard": model,
                   "compiled": OptimizedModule(model)}[label]
        rec = nanreplay_capture.Recorder(wrapped, opt, work / label, arch="llama", model_config=cfg, data=data,
                                         grad_clip=1.0, snapshot_every=2)
        runs[label] = (model, opt, rec, wrapped)
    for step in range(5):
        for label, (model, opt, rec, _) in runs.items():
            rows = [(step * 2 + r) % 60 for r in range(2)]
            rec.begin_step(step, samples=rows)
            w = torch.stack([tokens[i * 16:i * 16 + 17] for i in rows])
            loss = model(w[:, :-1], w[:, 1:])
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            rec.end_step(loss=loss, grad_norm=norm)
            opt.step()
            opt.zero_grad(set_to_none=True)
    bundles = {label: rec.dump(work / f"bundle-{label}") for label, (_, _, rec, _) in runs.items()}
    check(runs["fsdp"][3].gathers == 1 + 3, f"FSDP: gathered once at construction and at the 3 snapshots of 5 steps "
                                            f"with snapshot_every=2 ({runs['fsdp'][3].gathers})")
    check(runs["fully_shard"][2]._sharded is not None, "fully_shard (DTensor parameters) takes the gathering path")
    for label in ("fsdp", "fully_shard", "compiled"):
        same = True
        for sub in sorted(p.relative_to(bundles["plain"]) for p in bundles["plain"].rglob("*.safetensors")):
            same &= (bundles["plain"] / sub).read_bytes() == (bundles[label] / sub).read_bytes()
        files = sorted(str(p.relative_to(bundles[label])) for p in bundles[label].rglob("*.safetensors"))
        check(same and files == ["steps/2/model.safetensors", "steps/2/optimizer.safetensors",
                                 "steps/4/model.safetensors", "steps/4/optimizer.safetensors"],
              f"{label}: the snapshots ({files}) are byte-identical to the unwrapped model's")
        m1 = json.loads((bundles["plain"] / "manifest.json").read_text())
        m2 = json.loads((bundles[label] / "manifest.json").read_text())
        check(m1["model"] == m2["model"] and m1["optimizer"] == m2["optimizer"],
              f"{label}: same manifest model and optimizer (no_decay {m2['optimizer'].get('no_decay')})")

    torch.manual_seed(0)
    model = ddp_nan.Llama(ddp_nan.CONFIG)
    try:
        nanreplay_capture.Recorder(FullyShardedDataParallel(model), torch.optim.AdamW(model.parameters()), work / "x",
                                   arch="llama", model_config=cfg, data=data)
        check(False, "FSDP without snapshot_every is refused")
    except CaptureError as e:
        check("snapshot_every" in str(e), f"FSDP without snapshot_every is refused: {e}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cli", required=True)
    ap.add_argument("--work", required=True)
    args = ap.parse_args()
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    torch.set_num_threads(1)
    started = time.perf_counter()
    ddp_example(args.cli, work / "ddp")
    ddp_without_no_sync(work / "ddp-sync")
    ddp_with_users_comm_hook(work / "ddp-hooked")
    (work / "sharded").mkdir()
    sharded_gather(work / "sharded")
    print(f"{len(failures)} failed; {time.perf_counter() - started:.1f} s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
