"""`nanreplay import` on hostile input (issue 37): no input runs code, and every hostile input is
exit 2 with one line naming the file and the key, in bounded memory and time.

Pickles: a payload whose unpickling would create a marker file, planted in every reader the import
has (torch.save zip and legacy, a Hugging Face pytorch_model.bin, an --optimizer file, a DCP
.metadata, a DCP tensor item and bytes item, a Megatron common.pt beside a DCP checkpoint): each is
refused, naming the file and the global, and the marker never appears. --trust-pickle is the opt-in,
said on stderr and recorded in the manifest. Sizes: a safetensors header with a negative or absurd
shape or deep nesting, a deeply nested config.json, absurd MoE sizes, a 2 GB config and log (sparse
files: refused by size, before any parsing), a FIFO. And --data given twice accumulates in order,
each shard with its own token width, and a shard given through a relative symlink is resolved.
"""
import argparse
import collections
import contextlib
import io
import json
import os
import pickle
import resource
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import import_support as s  # noqa: E402
import nanreplay_import as ni  # noqa: E402
import test_import_llama2c as l2c  # noqa: E402

FIXTURE = s.ROOT / "tests" / "fixtures" / "dcp"
MARKER = None  # set in main(): the file a payload would create


class Payload:
    """Unpickling calls os.system, which would create MARKER."""

    def __reduce__(self):
        return (os.system, (f"touch {MARKER}",))


class SilentPayload:
    """Unpickling calls exec, which would create MARKER and print nothing."""

    def __reduce__(self):
        return (exec, (f"open({str(MARKER)!r}, 'w').close()",))


def one_line(rc, err, file_part, key_part, label):
    # Warnings (a DEFAULTED value) share stderr with the error: one error line among them.
    lines = [x for x in err.strip().splitlines() if not x.startswith("nanreplay: warning: ")]
    line = lines[-1] if lines else ""
    ok = rc == 2 and len(lines) == 1 and line.startswith("nanreplay: error: ") and file_part in line \
        and f": {key_part}" in line
    s.check(ok, f"{label}: exit {rc}, {len(lines)} line(s): {line!r}")
    return line


def in_process(argv):
    buf_out, buf_err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(buf_out), contextlib.redirect_stderr(buf_err):
        rc = ni.main([str(a) for a in argv])
    return rc, buf_err.getvalue()


def through_command(cli, argv, timeout=120):
    proc = subprocess.run(s.import_command(cli) + [str(a) for a in argv], capture_output=True, text=True,
                          timeout=timeout)
    return proc


def refused_pickle(label, rc, err, file_part, global_name):
    line = one_line(rc, err, file_part, "pickle", label)
    s.check(global_name in line, f"{label}: the line names the refused global {global_name}")
    s.check(not MARKER.exists(), f"{label}: the payload did not run (no {MARKER.name})")
    MARKER.unlink(missing_ok=True)


def poison_dcp_item(src, dst, want_bytes):
    """A copy of the DCP checkpoint src whose first tensor (or bytes) item is the payload, padded to
    the item's length, so .metadata still points at it."""
    shutil.copytree(src, dst)
    md = ni.read_dcp_metadata(dst)
    for fqn, item in md.state_dict_metadata.items():
        if (type(item).__name__ == "BytesStorageMetadata") == want_bytes:
            break
    index, info = next((i, v) for i, v in md.storage_data.items() if i.fqn == fqn)
    blob = pickle.dumps(Payload(), protocol=2)
    assert len(blob) <= info.length
    with open(dst / info.relative_path, "r+b") as f:
        f.seek(info.offset)
        f.write(blob + b"\0" * (info.length - len(blob)))
    return fqn


def check_pickles(cli, work, base, model):
    sd = model.state_dict()
    zipped, legacy = work / "evil.pt", work / "evil_legacy.pt"
    torch.save({"model": sd, "model_args": l2c.ARGS, "x": Payload()}, zipped)
    torch.save({"model": sd, "model_args": l2c.ARGS, "x": Payload()}, legacy, _use_new_zipfile_serialization=False)
    proc = through_command(cli, ["--checkpoint", zipped, *base, "--out", work / "p1"])
    refused_pickle("torch.save zip file, through the command", proc.returncode, proc.stderr, "evil.pt", "system")
    s.check(not (work / "p1").exists(), "torch.save zip file: no bundle written")
    refused_pickle("legacy torch.save file", *in_process(["--checkpoint", legacy, *base, "--out", work / "p2"]),
                   "evil_legacy.pt", "system")

    silent = work / "silent.pt"
    torch.save({"model": sd, "model_args": l2c.ARGS, "x": SilentPayload()}, silent)
    refused_pickle("silent exec payload", *in_process(["--checkpoint", silent, *base, "--out", work / "p3"]),
                   "silent.pt", "builtins.exec")

    hf = work / "hf_evil"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"model_type": "llama", "num_attention_heads": 4}))
    torch.save(collections.OrderedDict(sd, evil=Payload()), hf / "pytorch_model.bin")
    refused_pickle("HF pytorch_model.bin", *in_process(["--checkpoint", hf, *base, "--out", work / "p4"]),
                   "pytorch_model.bin", "system")

    good = work / "good.pt"
    torch.save({"model": sd, "model_args": l2c.ARGS}, good)
    opt = work / "opt_evil.pt"
    torch.save({"state": {}, "param_groups": [{"params": [], "lr": Payload()}]}, opt)
    refused_pickle("--optimizer file",
                   *in_process(["--checkpoint", good, "--optimizer", opt, *base, "--out", work / "p5"]),
                   "opt_evil.pt", "system")

    step = FIXTURE / "checkpoint" / f"step-{json.loads((FIXTURE / 'expected.json').read_text())['first']}"
    meta = work / "dcp_meta"
    shutil.copytree(step, meta)
    (meta / ".metadata").write_bytes(pickle.dumps(Payload(), protocol=2))
    refused_pickle("DCP .metadata", *in_process(["--checkpoint", meta, *base, "--out", work / "p6"]),
                   ".metadata", "system")
    for want_bytes, label in ((False, "DCP tensor item"), (True, "DCP bytes item")):
        d = work / ("dcp_bytes" if want_bytes else "dcp_tensor")
        fqn = poison_dcp_item(step, d, want_bytes)
        refused_pickle(f"{label} ({fqn})", *in_process(["--checkpoint", d, *base, "--out", work / "p7"]),
                       ".distcp", "system")

    scripted = work / "scripted.pt"  # torch.load would hand it to torch.jit.load, which runs its code
    torch.jit.save(torch.jit.script(torch.nn.Linear(2, 2)), scripted)
    rc, err = in_process(["--checkpoint", scripted, *base, "--out", work / "p8"])
    one_line(rc, err, "scripted.pt", "torch.load", "a TorchScript archive")
    s.check("TorchScript" in err, "a TorchScript archive: said to be one")

    check_dcp_structure(step)
    common = work / "dcp_common"
    shutil.copytree(step, common)
    torch.save({"args": Payload()}, common / "common.pt")  # Megatron torch_dist writes one beside .metadata
    with contextlib.redirect_stdout(io.StringIO()):
        loaded, _ = ni.read_dcp(common)
    s.check(isinstance(loaded, dict) and not MARKER.exists(), "a Megatron common.pt beside a DCP checkpoint: not run")

    # What real checkpoints hold beyond tensors loads: Megatron's args and RNG state, TE's extra state.
    import numpy
    extras = work / "extras.pt"
    torch.save({"args": argparse.Namespace(hidden_size=32, params_dtype=torch.bfloat16), "rng": numpy.random.get_state(),
                "extra": io.BytesIO(b"te"), "p": torch.nn.Parameter(torch.ones(2)), "b": b"", "s": {1}}, extras)
    for zipped_format in (True, False):
        torch.save(torch.load(extras), extras, _use_new_zipfile_serialization=zipped_format)
        got = ni._torch_load(extras, extras)
        s.check(got["args"].hidden_size == 32 and got["rng"][0] == "MT19937" and got["extra"].getvalue() == b"te"
                and torch.equal(got["p"], torch.ones(2)), f"Namespace, numpy RNG state, BytesIO, Parameter load "
                                                           f"({'zip' if zipped_format else 'legacy'} format)")


def check_trust(cli, work, base, good):
    proc = through_command(cli, ["--checkpoint", good, *base, "--trust-pickle", "--out", work / "trusted"])
    s.check(proc.returncode == 0 and "--trust-pickle" in proc.stderr,
            f"--trust-pickle imports and says so on stderr {proc.stderr.strip()[-300:]}")
    manifest = work / "trusted" / "manifest.json"
    s.check(manifest.exists() and json.loads(manifest.read_text())["import"].get("trust_pickle") is True,
            "--trust-pickle is recorded in the manifest's import block")


def check_dcp_structure(step):
    """A hostile .metadata's sizes and layout, planted in the fixture's parsed metadata: refused by name
    before any tensor is allocated or any hole is left in one."""
    owner = sys.modules[ni.read_dcp_from_format.__module__]  # the DCP format's module, whose reader calls it
    real = owner.read_dcp_metadata

    def expect(label, change, key_part):
        md = real(step)
        change(md)
        owner.read_dcp_metadata = lambda path: md
        try:
            ni.read_dcp_from_format(step)
            s.check(False, f"DCP metadata, {label}: accepted")
        except ni.BadInput as e:
            s.check(key_part in e.key and (".metadata" in e.file or ".distcp" in e.file),
                    f"DCP metadata, {label}: {e.line()}")
        except Exception as e:  # noqa: BLE001  (what the old reader did: an internal error)
            s.check(False, f"DCP metadata, {label}: {type(e).__name__}: {e}")
        finally:
            owner.read_dcp_metadata = real

    def pieces(md, fqn):
        return [i for i in md.storage_data if i.fqn == fqn]

    def huge(md):
        md.state_dict_metadata["tok_embeddings.weight"].size = [2**19, 2**19]

    def overlap(md):  # rank 1's chunk moved onto rank 0's: a gap would stay uninitialised
        first, second = pieces(md, "tok_embeddings.weight")[:2]
        second.offset = first.offset

    def far_index(md):
        md.planner_data["tok_embeddings.weight"] = ("tok_embeddings.weight", 10**12)

    expect("a size larger than the bytes stored", huge, "tok_embeddings.weight")
    expect("overlapping chunks", overlap, "tok_embeddings.weight")
    expect("a list index far past the entries", far_index, "planner_data")


def safetensors_file(path, header, data=b""):
    raw = json.dumps(header).encode() if not isinstance(header, bytes) else header
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


def check_sizes(cli, work, base):
    neg = safetensors_file(work / "neg.safetensors", {"w": {"dtype": "F32", "shape": [-1, -4], "data_offsets": [0, 16]}},
                           b"\0" * 16)
    one_line(*in_process(["--checkpoint", neg, *base, "--out", work / "s1"]), "neg.safetensors", "w",
             "safetensors: a negative shape")
    huge = safetensors_file(work / "huge.safetensors",
                            {"w": {"dtype": "F32", "shape": [0, 2**62, 2**62], "data_offsets": [0, 0]}})
    one_line(*in_process(["--checkpoint", huge, *base, "--out", work / "s2"]), "huge.safetensors", "w",
             "safetensors: a huge zero-size tensor")
    deep = safetensors_file(work / "deep.safetensors", b'{"w":' + b"[" * 100000 + b"]" * 100000 + b"}")
    one_line(*in_process(["--checkpoint", deep, *base, "--out", work / "s3"]), "deep.safetensors", "header",
             "safetensors: a deeply nested header")

    hf = work / "hf_deep"
    hf.mkdir()
    (hf / "config.json").write_text('{"a":' + "[" * 100000 + "]" * 100000 + "}")
    one_line(*in_process(["--checkpoint", hf, *base, "--out", work / "s4"]), "config.json", "json",
             "a deeply nested config.json")

    for raw, count, label in (({"num_experts": 10**9, "num_experts_per_tok": 2}, None, "an absurd expert count"),
                              ({"num_experts": 1e300, "num_experts_per_tok": 2}, None, "a float expert count"),
                              ({"num_experts": 512, "num_experts_per_tok": 2}, 40, "more experts than tensors")):
        try:
            ni._moe_config(raw, "config.json", 2, count)
            s.check(False, f"MoE config, {label}: accepted")
        except ni.BadInput as e:
            s.check(e.file == "config.json" and e.key == "num_experts", f"MoE config, {label}: {e.line()}")

    big = work / "big.json"
    with open(big, "wb") as f:
        f.truncate(2 * 2**30)  # sparse: 2 GB on paper, nothing on disk
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    t0 = time.perf_counter()
    proc = through_command(cli, ["--checkpoint", work / "good.pt", "--config", big, *base, "--out", work / "s5"])
    seconds = time.perf_counter() - t0
    one_line(proc.returncode, proc.stderr, "big.json", "file", "a 2 GB --config")
    rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    s.check(seconds < 60 and max(rss, before) < 1_500_000,
            f"a 2 GB --config: refused by size in {seconds:.1f} s, peak RSS {rss // 1024} MB (never read)")
    big_log = work / "big.jsonl"
    with open(big_log, "wb") as f:
        f.truncate(2 * 2**30)
    flags = [a if a != base[base.index("--log") + 1] else big_log for a in base]
    one_line(*in_process(["--checkpoint", work / "good.pt", *flags, "--out", work / "s6"]), "big.jsonl", "file",
             "a 2 GB --log")
    big.unlink()
    big_log.unlink()

    fifo = work / "fifo.pt"
    os.mkfifo(fifo)
    try:
        proc = through_command(cli, ["--checkpoint", fifo, *base, "--out", work / "s7"], timeout=60)
        one_line(proc.returncode, proc.stderr, "fifo.pt", "--checkpoint", "a FIFO as --checkpoint")
        s.check("FIFO" in proc.stderr, "a FIFO as --checkpoint: said to be a FIFO")
    except subprocess.TimeoutExpired:
        s.check(False, "a FIFO as --checkpoint: the import hung")
    log_fifo = work / "log.fifo"
    os.mkfifo(log_fifo)
    flags = [a if a != base[base.index("--log") + 1] else log_fifo for a in base]
    one_line(*in_process(["--checkpoint", work / "good.pt", *flags, "--out", work / "s8"]), "log.fifo", "--log",
             "a FIFO as --log")


def check_data(cli, work, base_no_data, good):
    a = work / "a.bin"
    b = work / "b.bin"
    g = torch.Generator().manual_seed(3)
    a.write_bytes(torch.randint(1, 64, (16 * 20 + 1,), generator=g).to(torch.int16).numpy().tobytes())
    b.write_bytes(torch.randint(1, 64, (16 * 20,), generator=g).to(torch.int32).numpy().tobytes())
    (work / "links").mkdir()
    os.symlink("../b.bin", work / "links" / "b_link.bin")  # relative: dangles if linked as a link
    out = work / "two_shards"
    proc = through_command(cli, ["--checkpoint", good, "--data", a, "--data", work / "links" / "b_link.bin",
                                 "--token-dtype", "uint16", "--token-dtype", "uint32", *base_no_data, "--out", out])
    s.check(proc.returncode == 0, f"--data twice, per-shard --token-dtype, a symlinked shard: imports "
                                  f"{proc.stderr.strip()[-300:]}")
    if proc.returncode != 0:
        return
    manifest = json.loads((out / "manifest.json").read_text())
    s.check("trust_pickle" not in manifest["import"], "without --trust-pickle the manifest says nothing of it")
    shards = manifest["data"]["shards"]
    s.check([(x["path"], x["dtype"], x["tokens"]) for x in shards]
            == [("data/a.bin", "uint16", 321), ("data/b_link.bin", "uint32", 320)],
            f"both shards kept, in order, each with its own width: {[(x['path'], x['dtype']) for x in shards]}")
    copied = out / "data" / "b_link.bin"
    s.check(copied.is_file() and not copied.is_symlink() and copied.read_bytes() == b.read_bytes(),
            "the symlinked shard is resolved: a regular file with the target's bytes")
    rc, err = in_process(["--checkpoint", good, "--data", a, "--data", b, "--token-dtype", "uint16",
                          "--token-dtype", "uint32", "--token-dtype", "uint16", *base_no_data, "--out", work / "d2"])
    one_line(rc, err, "command line", "--token-dtype", "three --token-dtype for two shards")


def main():
    global MARKER
    ap = argparse.ArgumentParser()
    ap.add_argument("--cli", required=True)
    ap.add_argument("--work", required=True)
    args = ap.parse_args()
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    MARKER = work / "PAYLOAD_RAN"
    torch.set_num_threads(1)

    data = s.Data(work, 64, 16, 2, 1, num_samples=32, seed=1)
    torch.manual_seed(0)
    model = l2c.Transformer(l2c.ARGS)
    log = s.write_log(work / "log.jsonl", {i: {"step": i, "lr": 1e-3, "loss": 4.0} for i in range(2)})
    base = [*data.flags(), "--log", log, "--steps", "0:0"]
    check_pickles(args.cli, work, base, model)
    good = work / "good.pt"
    check_trust(args.cli, work, base, good)
    check_sizes(args.cli, work, base)
    no_data = [a for a in base if a not in ("--data", data.path, "--token-dtype", "uint16")]
    check_data(args.cli, work, no_data, good)
    return s.finish()


if __name__ == "__main__":
    sys.exit(main())
