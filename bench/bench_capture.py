"""Per-step cost of capture/nanreplay_capture.py on a healthy training step, side by side:
the same llama trained without a Recorder, with the ring of `window` full steps, and in
snapshot mode (a full snapshot every K steps, the last two kept); median step times, the
recorder's own calls (begin_step + end_step), host memory bounds, and one dump of each.

Usage: /usr/bin/python3 bench/bench_capture.py [--hidden 256 --layers 4 --vocab 4096 --seq 128
       --batch 4 --window 10 --snapshot-every 8 --steps 30 --device cpu|cuda --threads N]
       (defaults: a 5.2M-param llama)
"""
import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "capture"))
sys.path.insert(0, str(ROOT / "tests" / "py"))
import nanreplay_capture  # noqa: E402
import torch_models  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--window", type=int, default=10)
    ap.add_argument("--snapshot-every", type=int, default=8)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dev = torch.device(args.device)
    cfg = dict(vocab_size=args.vocab, hidden_size=args.hidden, num_layers=args.layers, num_heads=max(1, args.hidden // 64),
               num_kv_heads=max(1, args.hidden // 64), intermediate_size=int(args.hidden * 8 / 3) // 16 * 16,
               norm_eps=1e-5, rope_theta=10000.0)
    work = Path(tempfile.mkdtemp(prefix="bench-capture-"))
    shard = work / "tokens.bin"
    tokens = torch.randint(0, args.vocab, ((args.steps + 20) * args.batch * args.seq + 1,), dtype=torch.int32)
    shard.write_bytes(tokens.to(torch.int16).numpy().tobytes())
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    def run(mode):
        torch.manual_seed(0)
        model = torch_models.LlamaForCausalLM(cfg).to(dev)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
        rec = None
        if mode:
            snapshots = dict(snapshot_every=args.snapshot_every) if mode == "snapshots" else {}
            rec = nanreplay_capture.Recorder(
                model, opt, work / "incidents", arch="llama", window=args.window, **snapshots,
                model_config=dict(num_heads=cfg["num_heads"], rope_theta=cfg["rope_theta"]),
                data=dict(shards=[str(shard)], seq_len=args.seq, micro_batch_size=args.batch), grad_clip=1.0)
        step_times, call_times = [], []
        for step in range(args.steps):
            ids = list(range(step * args.batch, (step + 1) * args.batch))
            batch = torch.stack([tokens[i * args.seq:(i + 1) * args.seq + 1] for i in ids]).long().to(dev)
            sync()
            t0 = time.perf_counter()
            if rec:
                rec.begin_step(step, samples=ids)
            t1 = time.perf_counter()
            loss = model(batch[:, :-1], batch[:, 1:])
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            loss_value = loss.item()  # the loop logs it anyway
            t2 = time.perf_counter()
            if rec:
                rec.end_step(loss=loss_value, grad_norm=norm)
            t3 = time.perf_counter()
            opt.step()
            opt.zero_grad(set_to_none=True)
            sync()
            if step >= min(max(args.window, 2 * args.snapshot_every), args.steps // 2):  # buffers exist
                step_times.append(time.perf_counter() - t0)
                call_times.append((t1 - t0) + (t3 - t2))
        calls = (statistics.median(call_times), statistics.mean(call_times)) if rec else (0.0, 0.0)
        return statistics.median(step_times), calls, rec, model

    base, _, _, model = run(None)
    params = sum(p.numel() for p in model.parameters())
    print(f"llama {params / 1e6:.1f}M params on {args.device} ({torch.get_num_threads()} threads), "
          f"batch {args.batch}x{args.seq}, ring window {args.window}, snapshot every {args.snapshot_every}")
    print(f"  step without recorder  {base * 1e3:9.2f} ms")
    measured = {}
    for mode in ("ring", "snapshots"):
        with_rec, calls, rec, _ = run(mode)
        t0 = time.perf_counter()
        bundle = rec.dump(work / f"bundle-{mode}")
        dump_s = time.perf_counter() - t0
        size = sum(f.stat().st_size for f in bundle.rglob("*") if f.is_file())
        steps = len(list((bundle / "steps").iterdir()))
        median_calls, mean_calls = calls
        measured[mode] = mean_calls
        print(f"{mode}:")
        print(f"  step with recorder     {with_rec * 1e3:9.2f} ms   ({100 * (with_rec - base) / base:+.1f}%)")
        # The mean counts snapshot mode's one full copy every K steps; the median would hide it.
        print(f"  begin_step + end_step  {median_calls * 1e3:9.2f} ms median, {mean_calls * 1e3:.2f} ms mean "
              f"({100 * mean_calls / base:.1f}% of a step)")
        print(f"  host memory bound      {rec.host_bytes_bound / 2**20:9.1f} MiB")
        print(f"  dump                   {dump_s:9.2f} s    ({size / 2**20:.1f} MiB bundle, {steps} steps)")
    print(f"RATIO recorder calls per step (mean), snapshots / ring: {measured['snapshots'] / measured['ring']:.2f}")


if __name__ == "__main__":
    main()
