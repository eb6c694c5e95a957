"""A plain eager PyTorch replay of a bundle's steps, as a whole process: the
baseline of bench_replay's "whole run" ratio (`nanreplay run` from start to
exit against this from start to exit).

What a user would write without nanreplay: import torch, and for every step
read its checkpoint, forward and backward every rank's micro-batches with
gradient accumulation (tests/py/reference_model.py's model, plain torch ops),
and take the global gradient norm; print each step's loss and norm. No probe,
no check, no output file. Checkpoints are read with one read() each and used
in place (torch.frombuffer, no copy), as a safetensors mmap would.
Usage: /usr/bin/python3 bench/eager_replay.py --bundle DIR --threads T [--device cuda:0]
"""
import argparse
import contextlib
import json
import struct
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "py"))
import reference_model  # noqa: E402


def read_checkpoint(path, device):
    raw = bytearray(Path(path).read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    base = 8 + n
    params = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        dtype = reference_model.DTYPES[info["dtype"]]
        width = torch.empty(0, dtype=dtype).element_size()
        t = torch.frombuffer(raw, dtype=dtype, count=(end - begin) // width, offset=base + begin)
        # To the device as stored, widened there (what the replay does too).
        params[name] = t.reshape(info["shape"]).to(device).float().requires_grad_(True)
    return params


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bundle", required=True)
    ap.add_argument("--threads", type=int, required=True)
    ap.add_argument("--device", default="cpu", help="cuda:N: the weights and the passes on that GPU (torch >= 2.0)")
    args = ap.parse_args()
    device = torch.device(args.device)
    torch.set_num_threads(args.threads)
    bundle = reference_model.Bundle(args.bundle)
    bundle.tokens = bundle.tokens.to(device)  # each batch is sliced where the model runs
    m = bundle.manifest
    cfg = m["model"]
    if m.get("precision", {}).get("compute", "fp32") != "fp32":
        sys.exit("eager_replay: fp32 bundles only")
    for entry in sorted(m["steps"], key=lambda e: e["step"]):
        params = read_checkpoint(bundle.root / entry["dir"] / "model.safetensors", device)
        with contextlib.nullcontext() if device.type == "cpu" else device:
            loss, norm, _, _, _ = reference_model.step_gradients(bundle, params, entry["step"])
        print(f"step {entry['step']} loss {loss:.9g} grad_norm {norm:.9g}", flush=True)


if __name__ == "__main__":
    main()
