"""Write a synthetic llama incident bundle (docs/bundle-format.md) of any shape without holding the model.

The parameters come from a seeded generator (normal, std 0.02; norm weights 1.0) and go to
model.safetensors a few MB at a time: the header is written first (every shape and dtype is known up
front), then each tensor's rows, chunk by chunk, in header order. So a 7B bundle needs a few hundred MB
of memory, and the same arguments always give the same bytes.

--plant-layer L plants a fault the replay must name: in layer L, head H's q_proj rows are scaled by s and
its kv head's k_proj rows are set to the same scaled rows, so q == k for every token. At position 0
(rotary is the identity there) the score q.k / sqrt(D) is then a sum of squares, with no cancellation,
sized to 16x the compute type's largest value: the first non-finite value is layers.L.attn.scores, head H,
query 0, key 0 of the last step's first sample, +inf. Every site before it stays far from the limit.

--experts E (with --top-k, --expert-intermediate, --shared-intermediate, --first-dense N) makes layers
N.. mixtures of experts (model.moe: Qwen3-MoE's softmax router, norm_topk_prob, a shared expert when
--shared-intermediate > 0): DeepSeek-V3's layout at any width, for memory figures
(bench/bench_moe_memory.py).

Every step holds a full checkpoint and no optimizer state (so no update check): with --steps N the
first N-1 share one unplanted checkpoint (hard links) and only the last is planted, logging loss "nan".
Written into a staging directory beside OUT and renamed into place; an existing OUT is refused.
Prints one JSON line: what was written, how long it took, and the planted origin.

Usage: /usr/bin/python3 scripts/make_llama_bundle.py OUT [--hidden 256 --layers 4 --heads 4 --kv-heads 4
       --intermediate 672 --vocab 1024 --seq-len 128 --micro-batch 1 --steps 1 --storage bf16|fp32
       --compute fp32|bf16|fp16 --plant-layer L --plant-head H --seed 0 --llama2-7b
       --experts E --top-k K --expert-intermediate I --shared-intermediate S --first-dense N]
"""
import argparse
import hashlib
import json
import math
import os
import shutil
import signal
import struct
import sys
import time
from pathlib import Path

import torch

LLAMA2_7B = dict(hidden=4096, layers=32, heads=32, kv_heads=32, intermediate=11008, vocab=32000, storage="bf16")
STORAGE = {"bf16": (torch.bfloat16, "BF16", 2), "fp32": (torch.float32, "F32", 4)}
LIMIT = {"fp32": torch.finfo(torch.float32).max, "bf16": torch.finfo(torch.bfloat16).max, "fp16": 65504.0}
CHUNK = 1 << 22  # elements generated at a time: 16 MB of fp32, whatever the tensor's size
FIRST_STEP = 100


def param_specs(a):
    """(key, shape) in the bundle's parameter order (docs/bundle-format.md, llama, untied)."""
    C, D = a.hidden, a.hidden // a.heads
    specs = [("model.embed_tokens.weight", [a.vocab, C])]
    for i in range(a.layers):
        p = f"model.layers.{i}."
        specs += [(p + "input_layernorm.weight", [C]),
                  (p + "self_attn.q_proj.weight", [C, C]),
                  (p + "self_attn.k_proj.weight", [a.kv_heads * D, C]),
                  (p + "self_attn.v_proj.weight", [a.kv_heads * D, C]),
                  (p + "self_attn.o_proj.weight", [C, C]),
                  (p + "post_attention_layernorm.weight", [C])]
        specs += moe_specs(a, p) if moe_layer(a, i) else [(p + "mlp.gate_proj.weight", [a.intermediate, C]),
                                                          (p + "mlp.up_proj.weight", [a.intermediate, C]),
                                                          (p + "mlp.down_proj.weight", [C, a.intermediate])]
    return specs + [("model.norm.weight", [C]), ("lm_head.weight", [a.vocab, C])]


def moe_layer(a, i):
    return a.experts > 0 and i >= a.first_dense


def moe_specs(a, p):
    """A mixture of experts' parameters in the bundle's order: router, experts, the shared expert."""
    C, I, S = a.hidden, a.expert_intermediate, a.shared_intermediate
    specs = [(p + "mlp.gate.weight", [a.experts, C])]
    for e in range(a.experts):
        q = f"{p}mlp.experts.{e}."
        specs += [(q + "gate_proj.weight", [I, C]), (q + "up_proj.weight", [I, C]), (q + "down_proj.weight", [C, I])]
    if S:
        specs += [(p + "mlp.shared_expert.gate_proj.weight", [S, C]), (p + "mlp.shared_expert.up_proj.weight", [S, C]),
                  (p + "mlp.shared_expert.down_proj.weight", [C, S])]
    return specs


def moe_config(a):
    moe = {"num_experts": a.experts, "top_k": a.top_k, "intermediate_size": a.expert_intermediate,
           "norm_topk_prob": True, "layers": [i for i in range(a.layers) if moe_layer(a, i)]}
    if a.shared_intermediate:
        moe["shared_expert_intermediate_size"] = a.shared_intermediate
    return moe


def make_plant(a):
    """The row edit of layer L (None without a plant) and the origin it must produce."""
    C, D = a.hidden, a.hidden // a.heads
    g = a.plant_head // (a.heads // a.kv_heads)  # the kv head the planted query head reads
    # q_i = W_i . rmsnorm(x) with |rmsnorm(x)|^2 ~= C, so an unscaled q element has std 0.02 sqrt(C).
    # Planted q elements of size u give a score at position 0 of ~ u^2 D / sqrt(D); aim it at 16x the limit
    # (a chi-square of D terms rarely falls below 1/16 of its mean). The other query heads of the same kv head
    # then see scores of ~ 0.02 sqrt(C) u D^(1/4): far below the limit, so head H is the first.
    u = math.sqrt(16 * LIMIT[a.compute] / math.sqrt(D))
    scale = u / (0.02 * math.sqrt(C))
    q_key = f"model.layers.{a.plant_layer}.self_attn.q_proj.weight"
    k_key = f"model.layers.{a.plant_layer}.self_attn.k_proj.weight"
    q_rows, k_rows = (a.plant_head * D, (a.plant_head + 1) * D), (g * D, (g + 1) * D)
    saved = {}

    def edit(key, r0, x):
        # x holds rows [r0, r0 + len(x)) of `key`; rewrite those of the planted head in place.
        lo, hi = (q_rows if key == q_key else k_rows if key == k_key else (0, 0))
        lo, hi = max(lo, r0), min(hi, r0 + len(x))
        if lo >= hi:
            return x
        if key == q_key:
            x[lo - r0:hi - r0] *= scale
            saved[lo] = x[lo - r0:hi - r0].clone()  # q_proj comes before k_proj in the file
        else:
            rows = torch.cat([saved[k] for k in sorted(saved)])  # the head's D scaled q rows
            x[lo - r0:hi - r0] = rows[lo - k_rows[0]:hi - k_rows[0]]
        return x

    origin = dict(site=f"layers.{a.plant_layer}.attn.scores", layer=a.plant_layer, head=a.plant_head,
                  phase="forward", kind="inf", position=0, q_k_scale=scale)
    return edit, origin


def write_safetensors(path, specs, storage, seed, edit=None):
    """Stream every tensor into `path`: header first, then rows chunk by chunk. Returns the file's size."""
    dtype, tag, size = STORAGE[storage]
    header, offset = {"__metadata__": {"format": "pt", "writer": "make_llama_bundle.py"}}, 0
    for key, shape in specs:
        n = math.prod(shape) * size
        header[key] = {"dtype": tag, "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # pad with spaces so the data starts 8-byte aligned, as safetensors does
    gen = torch.Generator()
    gen.manual_seed(seed)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for key, shape in specs:
            cols = shape[1] if len(shape) == 2 else shape[0]
            rows = shape[0] if len(shape) == 2 else 1
            step = max(1, CHUNK // cols)
            for r0 in range(0, rows, step):
                n = min(step, rows - r0)
                if key.endswith("norm.weight"):
                    x = torch.ones(n, cols)
                else:
                    x = torch.empty(n, cols).normal_(0.0, 0.02, generator=gen)
                if edit:
                    x = edit(key, r0, x)
                x = x.to(dtype)
                # numpy has no bf16: write its bits as int16 (little-endian, as the format wants)
                f.write((x.view(torch.int16) if dtype == torch.bfloat16 else x).numpy().data)
        written = f.tell()
    assert written == 8 + len(text) + offset, (written, offset)
    return written


def write_json(path, obj):
    path.write_text(json.dumps(obj, indent=2) + "\n")


def build(a, stage):
    """Write the whole bundle into `stage`; return what to print."""
    specs = param_specs(a)
    steps = list(range(FIRST_STEP, FIRST_STEP + a.steps))
    edit, origin = make_plant(a) if a.plant_layer is not None else (None, None)

    # Token data: one shard of random ids, a few spare samples; each step reads distinct explicit samples
    # (explicit rather than randperm, so the bundle does not depend on this torch's randperm).
    data_gen = torch.Generator()
    data_gen.manual_seed(a.seed + 1)
    per_step = a.micro_batch * a.world_size  # each rank's micro-batch, rank after rank
    num_samples = max(64, 2 * per_step * a.steps)
    tokens = torch.randint(0, a.vocab, (num_samples * a.seq_len + 1,), generator=data_gen)
    wide = a.vocab > 65536
    raw = tokens.to(torch.int32 if wide else torch.int16)  # uint16 ids above 32767 keep their bits
    (stage / "data").mkdir()
    (stage / "data" / "tokens.bin").write_bytes(raw.numpy().tobytes())
    picks = torch.randperm(num_samples, generator=data_gen)[:per_step * a.steps].tolist()
    samples = {s: [picks[k * per_step + r * a.micro_batch:k * per_step + (r + 1) * a.micro_batch]
                   for r in range(a.world_size)] for k, s in enumerate(steps)}

    # Checkpoints: one unplanted file shared (hard links) by every step but a planted last one.
    model_bytes = 0
    shared = None
    for s in steps:
        d = stage / "steps" / str(s)
        d.mkdir(parents=True)
        planted = edit is not None and s == steps[-1]
        state = {"step": s, "lr": 3e-4}
        if a.compute == "fp16":
            state["loss_scale"] = 1024.0
        if planted:  # the healthy steps log nothing: their loss is unknown without a forward here
            state["logged"] = {"loss": "nan", "grad_norm": "nan"}
        write_json(d / "state.json", state)
        if shared is not None and not planted:
            os.link(shared, d / "model.safetensors")
            continue
        model_bytes += write_safetensors(d / "model.safetensors", specs, a.storage, a.seed, edit if planted else None)
        if not planted:
            shared = d / "model.safetensors"

    manifest = {
        "format": "nanreplay.bundle", "version": 1,
        "model": {"arch": "llama", "vocab_size": a.vocab, "hidden_size": a.hidden, "num_layers": a.layers,
                  "num_heads": a.heads, "num_kv_heads": a.kv_heads, "intermediate_size": a.intermediate,
                  "max_seq_len": a.seq_len, "norm_eps": 1e-5, "rope_theta": 10000.0, "tie_embeddings": False},
        "precision": {"compute": a.compute},
        "optimizer": {"kind": "adamw", "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1,
                      "grad_clip": 1.0, "no_decay": ["*norm.weight"]},
        "data": {"shards": [{"path": "data/tokens.bin", "dtype": "uint32" if wide else "uint16",
                             "tokens": len(tokens),
                             "sha256": hashlib.sha256((stage / "data" / "tokens.bin").read_bytes()).hexdigest()}],
                 "seq_len": a.seq_len, "micro_batch_size": a.micro_batch, "grad_accum_steps": 1,
                 "world_size": a.world_size, "sampler": {"kind": "explicit"}},
        "steps": [{"step": s, "dir": f"steps/{s}", "samples": samples[s]} for s in steps],
        "generator": {"script": "scripts/make_llama_bundle.py", "seed": a.seed, "storage": a.storage},
    }
    if origin:
        manifest["incident"] = {"step": steps[-1], "symptom": "loss=nan"}
        origin.update(step=steps[-1], sample=samples[steps[-1]][0][0], micro_batch=0, rank=0)
    if a.experts:
        manifest["model"]["moe"] = moe_config(a)
    write_json(stage / "manifest.json", manifest)
    return dict(parameters=sum(math.prod(shape) for _, shape in specs), model_bytes=model_bytes, planted=origin)


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", type=Path)
    for name in ("hidden", "layers", "heads", "kv-heads", "intermediate", "vocab"):
        ap.add_argument("--" + name, type=int)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--world-size", type=int, default=1, help="data-parallel ranks, each its own micro-batch")
    ap.add_argument("--steps", type=int, default=1, help="steps in the window; the last one is planted")
    ap.add_argument("--storage", choices=sorted(STORAGE))
    ap.add_argument("--compute", choices=sorted(LIMIT), default="fp32")
    ap.add_argument("--plant-layer", type=int)
    ap.add_argument("--plant-head", type=int, help="default: num_heads // 2")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--llama2-7b", action="store_true", help="Llama 2 7B's shape, bf16 storage (explicit options win)")
    ap.add_argument("--experts", type=int, default=0, help="routed experts per MoE layer (0: a dense model)")
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--expert-intermediate", type=int, help="each expert's width (default: --intermediate)")
    ap.add_argument("--shared-intermediate", type=int, default=0, help="the shared expert's width (0: none)")
    ap.add_argument("--first-dense", type=int, default=0, help="the first N layers stay dense")
    a = ap.parse_args(argv)
    defaults = dict(LLAMA2_7B) if a.llama2_7b else dict(hidden=256, layers=4, vocab=1024, storage="bf16")
    for key, value in defaults.items():
        if getattr(a, key) is None:
            setattr(a, key, value)
    a.heads = a.heads or max(1, a.hidden // 64)
    a.kv_heads = a.kv_heads or a.heads
    a.intermediate = a.intermediate or int(a.hidden * 8 / 3) // 16 * 16
    a.expert_intermediate = a.expert_intermediate or a.intermediate
    if a.plant_head is None:
        a.plant_head = a.heads // 2
    problems = [what for bad, what in [
        (a.hidden % a.heads or (a.hidden // a.heads) % 2, "--hidden must be a multiple of --heads, head_dim even"),
        (a.heads % a.kv_heads, "--kv-heads must divide --heads"),
        (min(a.layers, a.vocab, a.intermediate, a.seq_len, a.micro_batch, a.steps, a.world_size) < 1,
         "sizes must be > 0"),
        (a.vocab > 2 ** 32, "--vocab must fit uint32"),
        (a.experts and not 1 <= a.top_k <= a.experts, "--top-k must be in [1, experts]"),
        (a.experts and not 0 <= a.first_dense < a.layers, "--first-dense must leave a layer with experts"),
        (a.plant_layer is not None and not 0 <= a.plant_layer < a.layers, "--plant-layer must be in [0, layers)"),
        (not 0 <= a.plant_head < a.heads, "--plant-head must be in [0, heads)")] if bad]
    if problems:
        ap.error(problems[0])
    return a


def main(argv=None):
    a = parse(argv)
    out = a.out.absolute()
    if os.path.lexists(out):
        sys.exit(f"make_llama_bundle: error: {out} exists; refusing to overwrite it")
    if not out.parent.is_dir():
        sys.exit(f"make_llama_bundle: error: {out.parent} is not a directory")
    need = (1 if a.plant_layer is None or a.steps == 1 else 2) * sum(
        math.prod(s) for _, s in param_specs(a)) * STORAGE[a.storage][2]
    free = shutil.disk_usage(out.parent).free
    if need > free:
        sys.exit(f"make_llama_bundle: error: {out.parent} has {free / 2**30:.1f} GiB free, "
                 f"the bundle needs {need / 2**30:.1f} GiB")
    stage = out.parent / f".{out.name}.staging-{os.getpid()}"
    t0 = time.perf_counter()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that `finally` removes the staging directory
    stage.mkdir()
    try:
        info = build(a, stage)
        if os.path.lexists(out):  # appeared while we wrote
            sys.exit(f"make_llama_bundle: error: {out} exists; refusing to overwrite it")
        os.rename(stage, out)
    finally:
        shutil.rmtree(stage, ignore_errors=True)  # nothing left behind when it fails or is interrupted
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file() and f.name != "model.safetensors")
    print(json.dumps(dict(bundle=str(out), bytes=size + info["model_bytes"], seconds=round(time.perf_counter() - t0, 2),
                          **{k: getattr(a, k) for k in ("hidden", "layers", "heads", "kv_heads", "intermediate",
                                                        "vocab", "seq_len", "micro_batch", "world_size", "steps",
                                                        "experts", "top_k", "first_dense",
                                                        "storage",
                                                        "compute", "seed")}, **info)))


if __name__ == "__main__":
    main()
