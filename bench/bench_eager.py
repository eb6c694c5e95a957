"""One bundle step's forward and backward in eager PyTorch, timed on request:
the baseline of bench/bench_replay.cpp's "replay / eager" ratio. With
--train, a whole training step (clip_grad_norm_ and torch.optim.AdamW too):
the baseline of its "derived step / eager training step" ratio. With
--moe-layer N, N passes of one mixture-of-experts layer alone: Hugging Face's
Qwen3MoeSparseMoeBlock (tests/py/torch_models.py) on layer 0's weights,
forward from h = randn(batch, seq, hidden) after manual_seed(0) and backward
from g = randn drawn next, as sum(out * g) (bench_replay's MoeLayer draws
the same h and g): the baseline of its "MoE layer" ratio.

The model is tests/py/reference_model.py's llama or gpt2 (plain torch ops, as
a training script would write them; a mixture of experts, moe_mlp, loops
over the experts as Hugging Face's Qwen3MoeSparseMoeBlock does) on the
step's checkpoint and batch; the step is every rank's micro-batches with
gradient accumulation, then the global gradient norm, as the replay
computes it. Weights and tokens are read once; each request times one whole
step.

Protocol (stdin/stdout, one line each): "step" -> "SECONDS LOSS GRAD_NORM"
(--moe-layer: sum(out * g) and the norm of h's gradient); "quit" ends.
bench_replay starts this with Debian's /usr/bin/python3 (python3-torch, the
same LibTorch 1.13 the replay links) and the same thread count, and
interleaves its requests with its own timed steps.
Usage: /usr/bin/python3 bench/bench_eager.py --bundle DIR --step N --threads T [--train | --moe-layer N]
"""
import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "py"))
import reference_model  # noqa: E402
import torch_models  # noqa: E402


def training_optimizer(m, params, lr):
    """torch.optim.AdamW as the manifest configures it (single-tensor, as the replay's update)."""
    o = m["optimizer"]
    decay = [v for k, v in params.items() if not any(reference_model.matches_glob(g, k) for g in o.get("no_decay", []))]
    plain = [v for k, v in params.items() if any(reference_model.matches_glob(g, k) for g in o.get("no_decay", []))]
    return torch.optim.AdamW([{"params": decay, "weight_decay": o["weight_decay"]}, {"params": plain, "weight_decay": 0.0}],
                             lr=lr, betas=tuple(o["betas"]), eps=o["eps"], foreach=False)


def moe_layer_passes(cfg, data, params, passes):
    """One MoE layer alone: HF's block with layer 0's weights, forward and backward, `passes` times."""
    moe, prefix = cfg["moe"], "model.layers.0.mlp."
    block = torch_models.Qwen3MoeSparseMoeBlock(cfg["hidden_size"], moe["num_experts"], moe["top_k"],
                                                moe.get("intermediate_size") or cfg["intermediate_size"],
                                                moe.get("norm_topk_prob", False))
    block.load_state_dict({k[len(prefix):]: v for k, v in params.items() if k.startswith(prefix)})
    torch.manual_seed(0)
    h = torch.randn(data["micro_batch_size"], data["seq_len"], cfg["hidden_size"])
    g = torch.randn(h.shape)

    def run():
        for _ in range(passes):
            block.zero_grad(set_to_none=True)
            x = h.detach().requires_grad_(True)
            objective = (block(x)[0] * g).sum()
            objective.backward()
        return objective.item(), x.grad.norm().item()
    return run


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bundle", required=True)
    ap.add_argument("--step", type=int, required=True)
    ap.add_argument("--threads", type=int, required=True)
    ap.add_argument("--train", action="store_true",
                    help="a whole training step: also clip_grad_norm_ and torch.optim.AdamW (the manifest's settings)")
    ap.add_argument("--moe-layer", type=int, metavar="PASSES",
                    help="time PASSES passes of one mixture-of-experts layer alone (HF's Qwen3MoeSparseMoeBlock), "
                         "not a step")
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
    timed = moe_layer_passes(cfg, d, params, args.moe_layer) if args.moe_layer else step

    for line in sys.stdin:
        if line.strip() != "step":
            break
        start = time.perf_counter()
        loss, norm = timed()
        seconds = time.perf_counter() - start
        print(f"{seconds:.6f} {loss:.9g} {norm:.9g}", flush=True)


if __name__ == "__main__":
    main()
