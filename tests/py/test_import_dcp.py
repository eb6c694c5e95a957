"""`nanreplay import` of a torch.distributed.checkpoint directory written by PyTorch 2.6 itself
(tests/fixtures/dcp/, made by scripts/make_dcp_fixture.py: a torchtitan-layout llama saved by two
ranks as DTensors sharded on dim 0, the optimizer keyed by name in the same checkpoint), replayed by
`nanreplay run` to the losses that PyTorch run logged, and to the first non-finite value its forward
hooks saw (norm_eps 0 and a zero embedding row read at the last step).

On Debian 12's torch 1.13 there is no torch.distributed.checkpoint, so this also checks the
import's own parser of the format: .metadata's chunks from both ranks assembled into whole tensors.
"""
import argparse
import json
import shutil
import sys
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parent))
import import_support as s  # noqa: E402

FIXTURE = s.ROOT / "tests" / "fixtures" / "dcp"
SITES = [(r"tok_embeddings", "embed"), (r"layers\.(\d+)\.attention_norm", "layers.{}.attn_norm"),
         (r"layers\.(\d+)\.ffn_norm", "layers.{}.mlp_norm"), (r"norm", "final_norm"), (r"output", "logits")]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cli", required=True)
    ap.add_argument("--work", required=True)
    args = ap.parse_args()
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    expected = json.loads((FIXTURE / "expected.json").read_text())
    first, last = expected["first"], expected["last"]
    ckpt = FIXTURE / "checkpoint" / f"step-{first}"
    log = {e["step"]: {k: (float(v) if k != "step" else v) for k, v in e.items()}
           for e in map(json.loads, (FIXTURE / "log.jsonl").read_text().splitlines())}

    import nanreplay_import as ni
    md = ni.read_dcp_metadata(ckpt)
    chunked = [k for k, v in md.state_dict_metadata.items() if len(getattr(v, "chunks", [])) > 1]
    s.check(len(chunked) > 20, f"the fixture's tensors come in chunks from {expected['world_size_at_save']} ranks "
                               f"({len(chunked)} tensors, e.g. {chunked[:2]}), written by torch {expected['torch']}")

    (work / "params.json").write_text(json.dumps({"n_heads": expected["model"]["n_heads"],
                                                  "norm_eps": expected["model"]["norm_eps"],
                                                  "rope_theta": expected["model"]["rope_theta"]}))
    flags = ["--checkpoint", ckpt, "--config", work / "params.json", "--data", FIXTURE / "tokens.bin",
             "--seq-len", expected["seq_len"], "--micro-batch-size", expected["micro_batch_size"],
             "--grad-accum", expected["grad_accum"], "--sampler-seed", expected["sampler_seed"],
             "--log", FIXTURE / "log.jsonl", "--steps", f"{first}:{last}", "--grad-clip", expected["grad_clip"],
             "--log-numbering", "zero"]  # the fixture's log counts from 0; torchtitan's own would call FIRST 4
    proc = s.run_import(args.cli, flags, work / "bundle")
    s.check(proc.returncode == 0, f"import exits 0 {proc.stderr.strip()}")
    s.check("format: dcp (detected: .metadata" in proc.stdout, "auto-detected a DCP directory")
    s.check("naming: meta (detected: layers.0.attention.wq.weight)" in proc.stdout, "auto-detected torchtitan's Meta names")
    s.check("keyed by parameter name" in proc.stdout and "step count 3" in proc.stdout,
            "the optimizer state found in the same checkpoint, keyed by name")
    if proc.returncode != 0:
        return s.finish()
    manifest = json.loads((work / "bundle" / "manifest.json").read_text())
    m = manifest["model"]
    s.check(m["rope_style"] == "interleaved" and not m["tie_embeddings"] and m["num_kv_heads"] == 1
            and m["intermediate_size"] == 32 and m["norm_eps"] == 0.0,
            f"model: interleaved, untied, GQA, w1 rows, params.json's norm_eps {m}")
    s.check(manifest["optimizer"]["betas"] == [0.9, 0.95] and manifest["optimizer"]["weight_decay"] == 0.1
            and "no_decay" not in manifest["optimizer"], f"optimizer from param_groups {manifest['optimizer']}")
    s.inspect_ok(args.cli, work / "bundle")
    rproc, report = s.run_replay(args.cli, work / "bundle", work / "out")
    s.check(rproc.returncode == 1 and report is not None, f"nanreplay run exits 1 (got {rproc.returncode}) {rproc.stderr.strip()}")
    if report:
        s.check_replay("dcp", report, log, first, last)
        seen = dict(expected["hooks_first_nonfinite"])
        seen["site"] = s.FirstNonfinite.site(type("H", (), {"sites": SITES})(), seen["module"])
        print("PyTorch 2.6 hooks:", seen)
        print("nanreplay:", json.dumps(report["first_nonfinite"]))
        s.check_origin("dcp incident", report, seen)
        s.check(seen["sample"] == expected["pad_sample"], "the NaN starts at the zero embedding row's token")
    return s.finish()


if __name__ == "__main__":
    sys.exit(main())
