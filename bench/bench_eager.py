"""One bundle step's forward and backward in eager PyTorch, timed on request:
the baseline of bench/bench_replay.cpp's "replay / eager" ratio. With
--train, a whole training step (clip_grad_norm_ and torch.optim.AdamW too):
the baseline of its "derived step / eager training step" ratio.

The model is tests/py/reference_model.py's llama or gpt2 (plain torch ops, as
a training script would write them) on the step's checkpoint and batch; the
step is every rank's micro-batches with gradient accumulation, then the
global gradient norm, as the replay computes it. Weights and tokens are read
once; each request times one whole step.

Protocol (stdin/stdout, one line each): "step" -> "SECONDS LOSS GRAD_NORM";
"quit" ends. bench_replay starts this with Debian's /usr/bin/python3
(python3-torch, the same LibTorch 1.13 the replay links) and the same
thread count, and interleaves its requests with its own timed steps.
Usage: /usr/bin/python3 bench/bench_eager.py --bundle DIR --step N --threads T
"""
import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "py"))
import reference_model  # noqa: E402


def training_optimizer(m, params, lr):
    """torch.optim.AdamW as the manifest configures it (single-tensor, as the replay's update)."""
    o = m["optimizer"]
    decay = [v for k, v in params.items() if not any(reference_model.matches_glob(g, k) for g in o.get("no_decay", []))]
    plain = [v for k, v in params.items() if any(reference_model.matches_glob(g, k) for g in o.get("no_decay", []))]
    return torch.optim.AdamW([{"params": decay, "weight_decay": o["weight_decay"]}, {"params": plain, "weight_decay": 0.0}],
                             lr=lr, betas=tuple(o["betas"]), eps=o["eps"], foreach=False)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bundle", required=True)
    ap.add_argument("--step", type=int, required=True)
    ap.add_argument("--threads", type=int, required=True)
    ap.add_argument("--train", action="store_true",
                    help="a whole training step: also clip_grad_norm_ and torch.optim.AdamW (the manifest's settings)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    bundle = reference_model.Bundle(args.bundle)
    m = bundle.manifest
    cfg, d = m["model"], m["data"]
    if m.get("precision", {}).get("compute", "fp32") != "fp32":
        sys.exit("bench_eager: fp32 bundles only")
    step_dir = next(e["dir"] for e in m["steps"] if e["step"] == args.step)
    params = {k: v.float().requires_grad_(True)
              for k, v in reference_model.read_safetensors(bundle.root / step_dir / "model.safetensors").items()}
    loss_fn = reference_model.llama_loss if cfg["arch"] == "llama" else reference_model.gpt2_loss
    world, accum, rows = d.get("world_size", 1), d.get("grad_accum_steps", 1), d["micro_batch_size"]
    batches = [[bundle.batch(ids[k * rows:(k + 1) * rows]) for k in range(accum)] for ids in bundle.samples(args.step)]

    def step():
        total = {k: torch.zeros_like(v) for k, v in params.items()}
        loss_sum = 0.0
        for rank_batches in batches:
            for v in params.values():
                v.grad = None
            for inputs, targets in rank_batches:
                loss = loss_fn(cfg, params, inputs, targets)
                loss_sum += loss.item() / accum
                (loss / accum).backward()
            for k, v in params.items():
                if v.grad is not None:
                    total[k] += v.grad / world
        norm = torch.norm(torch.stack([g.norm() for g in total.values()])).item()
        if optimizer is not None:
            for k, v in params.items():
                v.grad = total[k]
            if m["optimizer"].get("grad_clip") is not None:
                torch.nn.utils.clip_grad_norm_(list(params.values()), m["optimizer"]["grad_clip"])
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return loss_sum / world, norm

    lr = json.loads((bundle.root / step_dir / "state.json").read_text())["lr"]
    optimizer = training_optimizer(m, params, lr) if args.train else None

    for line in sys.stdin:
        if line.strip() != "step":
            break
        start = time.perf_counter()
        loss, norm = step()
        seconds = time.perf_counter() - start
        print(f"{seconds:.6f} {loss:.9g} {norm:.9g}", flush=True)


if __name__ == "__main__":
    main()
