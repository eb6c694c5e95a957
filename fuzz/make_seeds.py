#!/usr/bin/env python3
"""Writes the fuzzers' seed corpora: small valid inputs and near-valid ones
(one thing wrong each), so libFuzzer starts from the formats' real shapes.
Re-run after a format change: python3 fuzz/make_seeds.py (from the repo root).
The trace reader's seeds are real traces, written by the CLI itself:
python3 fuzz/make_seeds.py --cli build/nanreplay (needs a built nanreplay)."""
import argparse
import json
import os
import shutil
import struct
import subprocess
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))


def write(target, name, data):
    path = os.path.join(HERE, "corpus", target, name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as out:
        out.write(data if isinstance(data, bytes) else data.encode())


# ---- manifest.json ---------------------------------------------------------
MANIFEST = {
    "format": "nanreplay.bundle", "version": 1,
    "model": {"arch": "llama", "vocab_size": 512, "hidden_size": 128, "num_layers": 4,
              "num_heads": 4, "num_kv_heads": 4, "intermediate_size": 344,
              "max_seq_len": 128, "norm_eps": 1e-5, "rope_theta": 10000.0,
              "tie_embeddings": False},
    "precision": {"compute": "fp32"},
    "optimizer": {"kind": "adamw", "betas": [0.9, 0.95], "eps": 1e-8,
                  "weight_decay": 0.1, "grad_clip": 1.0, "no_decay": ["*.bias", "*norm*"]},
    "data": {"shards": [{"path": "data/shard_000.bin", "dtype": "uint16", "tokens": 65536,
                         "sha256": "0" * 64}],
             "seq_len": 64, "micro_batch_size": 4, "grad_accum_steps": 2, "world_size": 1,
             "sampler": {"kind": "randperm", "seed": 1234, "epoch": 0, "epoch_start_step": 0}},
    "steps": [{"step": 100, "dir": "steps/100"}, {"step": 101, "dir": "steps/101"}],
    "incident": {"step": 105, "symptom": "loss=nan"},
}


def variant(edit):
    doc = json.loads(json.dumps(MANIFEST))
    edit(doc)
    return json.dumps(doc, indent=1)


write("fuzz_manifest", "spec_example.json", json.dumps(MANIFEST, indent=2))
write("fuzz_manifest", "gpt2.json", variant(lambda d: d["model"].update(
    arch="gpt2", intermediate_size=512, tie_embeddings=True)))
write("fuzz_manifest", "fp8.json", variant(lambda d: d["precision"].update(
    compute="fp8", fp8={"fwd": "e4m3", "bwd": "e5m2", "amax_history_len": 16, "margin": 0})))
write("fuzz_manifest", "explicit_sampler.json", variant(lambda d: (
    d["data"]["sampler"].update(kind="explicit"),
    [s.update(samples=[[0, 1, 2, 3, 4, 5, 6, 7]]) for s in d["steps"]])))
write("fuzz_manifest", "gqa_bf16.json", variant(lambda d: (
    d["model"].update(num_kv_heads=2), d["precision"].update(compute="bf16"))))
write("fuzz_manifest", "missing_model.json", variant(lambda d: d.pop("model")))
write("fuzz_manifest", "negative_layers.json", variant(lambda d: d["model"].update(num_layers=-4)))
write("fuzz_manifest", "string_seq_len.json", variant(lambda d: d["data"].update(seq_len="nan")))
write("fuzz_manifest", "escaping_dir.json", variant(lambda d: d["steps"][0].update(dir="../x")))
write("fuzz_manifest", "huge_number.json", variant(lambda d: d["model"].update(norm_eps=1e308)))
# JSON allows numbers no double holds; the parser must refuse them as input errors.
write("fuzz_manifest", "overflowing_number.json",
      json.dumps(MANIFEST).replace('"norm_eps": 1e-05', '"norm_eps": 1e400'))
write("fuzz_manifest", "minimal.json", json.dumps({
    "format": "nanreplay.bundle", "version": 1,
    "model": {"arch": "gpt2", "vocab_size": 8, "hidden_size": 4, "num_layers": 1,
              "num_heads": 1, "max_seq_len": 4},
    "data": {"shards": [{"path": "a", "dtype": "uint32", "tokens": 9}], "seq_len": 2,
             "micro_batch_size": 1, "sampler": {"kind": "randperm", "seed": 0}},
    "steps": [{"step": 0, "dir": "s"}]}))

# ---- steps/<n>/state.json ----------------------------------------------------
STATE = {"step": 105, "lr": 0.0003, "loss_scale": 65536.0,
         "fp8_scales": {"model.layers.0.self_attn.q_proj": {"input": 1.0, "weight": 1.0,
                                                           "grad_output": 2.0}},
         "logged": {"loss": 3.21, "grad_norm": 0.97, "rank_grad_norms": [0.97],
                    "rank_losses": [3.21]},
         "skipped": False}
write("fuzz_step_state", "spec_example.json", json.dumps(STATE, indent=2))
write("fuzz_step_state", "minimal.json", '{"step": 0}')
write("fuzz_step_state", "nonfinite.json", json.dumps(
    {"step": 7, "lr": "inf", "loss_scale": "nan", "logged": {"loss": "-inf", "grad_norm": "NaN",
                                                             "rank_losses": ["nan", 1.5]}}))
write("fuzz_step_state", "negative_lr.json", '{"step": 1, "lr": -0.1}')
write("fuzz_step_state", "wrong_types.json", '{"step": "1", "logged": []}')
write("fuzz_step_state", "nested.json", '{"step": 1, "logged": {"x": [[[[[[[[1]]]]]]]]}}')


# ---- safetensors -------------------------------------------------------------
def safetensors(header, data, pad=True, claimed=None):
    text = json.dumps(header, separators=(",", ":"))
    if pad:
        text += " " * ((8 - len(text) % 8) % 8)
    raw = text.encode()
    return struct.pack("<Q", len(raw) if claimed is None else claimed) + raw + data


write("fuzz_safetensors_header", "empty.safetensors", safetensors({}, b""))
write("fuzz_safetensors_header", "one_f32.safetensors", safetensors(
    {"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}}, struct.pack("<4f", 1, 2, 3, 4)))
write("fuzz_safetensors_header", "mixed.safetensors", safetensors(
    {"__metadata__": {"format": "pt"},
     "a": {"dtype": "BF16", "shape": [3], "data_offsets": [0, 6]},
     "b": {"dtype": "F16", "shape": [1], "data_offsets": [6, 8]},
     "step": {"dtype": "I64", "shape": [], "data_offsets": [8, 16]},
     "z": {"dtype": "U8", "shape": [0, 5], "data_offsets": [16, 16]}}, bytes(range(16))))
write("fuzz_safetensors_header", "unpadded.safetensors", safetensors(
    {"x": {"dtype": "F64", "shape": [1], "data_offsets": [0, 8]}}, b"\0" * 8, pad=False))
write("fuzz_safetensors_header", "overlap.safetensors", safetensors(
    {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
     "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, b"\0" * 12))
write("fuzz_safetensors_header", "gap.safetensors", safetensors(
    {"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, b"\0" * 8))
write("fuzz_safetensors_header", "terabyte_shape.safetensors", safetensors(
    {"a": {"dtype": "F32", "shape": [1048576, 1048576], "data_offsets": [0, 4]}}, b"\0" * 4))
write("fuzz_safetensors_header", "overflow_shape.safetensors", safetensors(
    {"a": {"dtype": "F32", "shape": [4294967296, 4294967296, 4], "data_offsets": [0, 4]}}, b"\0" * 4))
write("fuzz_safetensors_header", "long_claim.safetensors", safetensors({}, b"", claimed=1 << 40))
write("fuzz_safetensors_header", "truncated.safetensors", safetensors(
    {"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 7))


# ---- trace.h5: real traces, small enough for libFuzzer ------------------------
def trace_seeds(cli):
    def nanreplay(*args, allowed=(0,)):
        done = subprocess.run([cli, *args], capture_output=True, text=True)
        if done.returncode not in allowed:
            raise SystemExit(f"nanreplay {' '.join(args)}: exit {done.returncode}: {done.stderr}")

    with tempfile.TemporaryDirectory() as work:
        # Only step rows (15 KB), and one step of a planted overflow with every probe (70 KB).
        nanreplay("synth", "clean-fp32", os.path.join(work, "clean"))
        nanreplay("run", os.path.join(work, "clean"), "--out", os.path.join(work, "a"), "--no-probes", "--quiet")
        nanreplay("synth", "head-overflow", os.path.join(work, "overflow"))
        nanreplay("run", os.path.join(work, "overflow"), "--out", os.path.join(work, "b"), "--steps", "103",
                  "--quiet", allowed=(1,))
        for name, source in (("steps_only.h5", "a"), ("one_step_nonfinite.h5", "b")):
            path = os.path.join(HERE, "corpus", "fuzz_trace_reader", name)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            shutil.copyfile(os.path.join(work, source, "trace.h5"), path)


parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--cli", help="a built nanreplay: also write the trace reader's seeds")
arguments = parser.parse_args()
if arguments.cli:
    trace_seeds(os.path.abspath(arguments.cli))
