"""`nanreplay import` on bad input: exit 2 with exactly one line `nanreplay: error: <file>: <key>: <what>`
naming the file and the key, never a traceback; plus the layouts no other test writes (Megatron's
layer-stacked torch_dist tensors, torchtitan's flattened optimizer state, a Hugging Face MoE config),
checked in process. Cheap: no replay.
"""
import argparse
import contextlib
import io
import json
import shutil
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import import_support as s  # noqa: E402
import nanreplay_import as ni  # noqa: E402
import test_import_llama2c as l2c  # noqa: E402

FIXTURE = s.ROOT / "tests" / "fixtures" / "dcp"


def bad(cli, label, args, out, file_part, key_part, subprocess_run=False):
    """Bad input: exit 2, one stderr line naming the file and the key. In process (the script's main())
    unless subprocess_run, which goes through the real command (`nanreplay import` or the script)."""
    argv = [str(a) for a in args] + (["--out", str(out)] if out is not None else [])
    if subprocess_run:
        proc = subprocess.run(s.import_command(cli) + argv, capture_output=True, text=True)
        rc, err = proc.returncode, proc.stderr
    else:
        buf_out, buf_err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(buf_out), contextlib.redirect_stderr(buf_err):
            rc = ni.main(argv)
        err = buf_err.getvalue()
    # Warnings (a DEFAULTED value) share stderr with the error: one error line among them.
    lines = [x for x in err.strip().splitlines() if not x.startswith("nanreplay: warning: ")]
    line = lines[-1] if lines else ""
    # One prefix for every error, the script's own and the command's: the script's line names file and key;
    # `nanreplay import` itself refuses some input (an --out that exists) before running it, naming the file.
    ok = rc == 2 and len(lines) == 1 and file_part in line and line.startswith("nanreplay: error: ") and (
        f": {key_part}: " in line or subprocess_run)
    s.check(ok, f"{label}: exit {rc}, {len(lines)} line(s): {line!r}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cli", required=True)
    ap.add_argument("--work", required=True)
    args = ap.parse_args()
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    torch.set_num_threads(1)
    cli = args.cli

    help_proc = subprocess.run(s.import_command(cli) + ["--help"], capture_output=True, text=True)
    s.check(help_proc.returncode == 0 and "--checkpoint" in help_proc.stdout and "--samples" in help_proc.stdout,
            "--help lists the flags")

    # A llama2.c checkpoint and its data, as the llama2.c test writes them (no training: step 0).
    data = s.Data(work, 64, 16, 2, 1, num_samples=32, seed=1)
    torch.manual_seed(0)
    model = l2c.Transformer(l2c.ARGS)
    opt = model.configure_optimizers(0.1, 1e-3, (0.9, 0.95))
    ckpt = work / "ckpt.pt"
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "model_args": l2c.ARGS}, ckpt)
    log = s.write_log(work / "log.jsonl", {i: {"step": i, "lr": 1e-3, "loss": 4.0} for i in range(4)})
    base = ["--checkpoint", ckpt, *data.flags(), "--log", log, "--steps", "0:2"]
    good = s.run_import(cli, base, work / "good")
    s.check(good.returncode == 0 and "zero moments" in good.stdout,
            f"the unchanged input imports (AdamW state before the first update: zero moments) {good.stderr.strip()}")

    (work / "full").mkdir()
    (work / "full" / "x").write_text("x")
    bad(cli, "--out not empty", base, work / "full", str(work / "full"), "--out", subprocess_run=True)
    bad(cli, "--steps backwards", base[:-1] + ["2:0"], work / "o1", "command line", "--steps")
    bad(cli, "a required flag missing", [a for a in base if a != "--checkpoint" and a != ckpt], work / "o2",
        "command line", "--checkpoint")
    bad(cli, "both samplers", base + ["--samples", work / "none.json"], work / "o3", "command line", "--sampler-seed")

    nolr = s.write_log(work / "nolr.jsonl", {0: {"step": 0, "lr": 1e-3, "loss": 4.0}, 1: {"step": 1, "loss": 4.0},
                                             2: {"step": 2, "loss": 4.0}})
    bad(cli, "log without a step's lr", base[:-4] + ["--log", nolr, "--steps", "0:2"], work / "o4", "nolr.jsonl", "step 1.lr",
        subprocess_run=True)
    short = s.write_log(work / "short.jsonl", {0: {"step": 0, "lr": 1e-3, "loss": 4.0}})
    bad(cli, "log without a step", base[:-4] + ["--log", short, "--steps", "0:2"], work / "o5", "short.jsonl", "step 1")

    no_args = work / "noargs.pt"
    torch.save({"model": model.state_dict()}, no_args)
    bad(cli, "no num_heads anywhere: every missing value in one line", ["--checkpoint", no_args] + base[2:],
        work / "o6", "noargs.pt", "num_heads, norm_eps, rope_theta")
    cfg = work / "wrong.json"
    cfg.write_text(json.dumps({"n_heads": 4, "dim": 48}))
    bad(cli, "a config contradicting the tensors", base + ["--config", cfg], work / "o7", "wrong.json", "dim")

    sd = dict(model.state_dict())
    sd["layers.0.attention.wq.bias"] = torch.zeros(32)
    extra = work / "extra.pt"
    torch.save({"model": sd, "model_args": l2c.ARGS}, extra)
    bad(cli, "a parameter bundle v1 has no place for", ["--checkpoint", extra] + base[2:], work / "o8", "extra.pt",
        "model.layers.0.self_attn.q_proj.bias")

    osd = opt.state_dict()
    for p in model.parameters():  # make AdamW state exist, then break the group layout
        opt.state[p] = {"step": torch.tensor(1.0), "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
    osd = opt.state_dict()
    osd["param_groups"] = [dict(osd["param_groups"][0], params=osd["param_groups"][0]["params"] + osd["param_groups"][1]["params"][:2]),
                           dict(osd["param_groups"][1], params=osd["param_groups"][1]["params"][2:])]
    mixed = work / "mixed.pt"
    torch.save({"model": model.state_dict(), "optimizer": osd, "model_args": l2c.ARGS}, mixed)
    bad(cli, "integer ids in an order that cannot be recovered", ["--checkpoint", mixed] + base[2:], work / "o9",
        "mixed.pt", "param_groups")

    no_opt = work / "noopt.pt"  # no optimizer state, no step counter: nothing to check FIRST against
    torch.save({"model": model.state_dict(), "model_args": l2c.ARGS}, no_opt)
    bad(cli, "steps past the log", ["--checkpoint", no_opt] + base[2:-1] + ["10:12"], work / "o10", "", "step 10")

    # A Hugging Face index naming a shard that is not there.
    hf = work / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"model_type": "llama", "num_attention_heads": 4}))
    (hf / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"model.embed_tokens.weight": "a.safetensors"}}))
    bad(cli, "an index naming a missing shard", ["--checkpoint", hf] + base[2:], work / "o11",
        "model.safetensors.index.json", "weight_map")

    # A DCP directory with one rank's file missing.
    dcp = work / "dcp"
    shutil.copytree(FIXTURE / "checkpoint" / "step-3", dcp)
    (dcp / "__1_0.distcp").unlink()
    bad(cli, "a DCP checkpoint without one rank's file", ["--checkpoint", dcp, "--config", cfg] + base[2:], work / "o12",
        "__1_0.distcp", "tok_embeddings.weight")

    s.check(not any((work / f"o{i}").exists() for i in range(1, 13)), "a failed import leaves no --out behind")

    # In process: Megatron's layer-stacked tensors (torch_dist), torchtitan's flattened optimizer, an MoE config.
    stacked = {"decoder.layers.self_attention.linear_qkv.weight": torch.arange(2 * 3 * 2.0).reshape(2, 3, 2)}
    out = ni.unstack_megatron_layers(stacked, 2)
    s.check(sorted(out) == ["decoder.layers.0.self_attention.linear_qkv.weight",
                            "decoder.layers.1.self_attention.linear_qkv.weight"]
            and torch.equal(out["decoder.layers.1.self_attention.linear_qkv.weight"], stacked[
                "decoder.layers.self_attention.linear_qkv.weight"][1]), "Megatron's layer-stacked tensors are split per layer")
    H, G, D, C = 4, 2, 2, 8
    rows = torch.arange((H + 2 * G) * D, dtype=torch.float32)[:, None].expand(-1, C)
    q, k, v = ni.Mapper("megatron", {"num_heads": H, "num_kv_heads": G, "hidden_size": C}).split_qkv(rows, "qkv", "x")
    # group g's rows: [q heads 2g, 2g+1 (4 rows), k head g (2 rows), v head g (2 rows)] = 8 rows per group
    s.check(q[:, 0].tolist() == [0, 1, 2, 3, 8, 9, 10, 11] and k[:, 0].tolist() == [4, 5, 12, 13]
            and v[:, 0].tolist() == [6, 7, 14, 15], "linear_qkv split per query group into q, k, v")
    flat = {"state.w.exp_avg": torch.ones(2), "state.w.exp_avg_sq": torch.ones(2), "state.w.step": torch.tensor(5.0),
            "param_groups.w.lr": 0.1, "param_groups.w.betas": (0.9, 0.95), "param_groups.w.weight_decay": 0.1}
    nested = ni._unflatten_optimizer(flat)
    s.check(set(nested["state"]["w"]) == {"exp_avg", "exp_avg_sq", "step"} and nested["param_groups"][0]["params"] == ["w"],
            "torchtitan's flattened optimizer state is nested back")
    moe = ni._moe_config({"model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2,
                          "moe_intermediate_size": 16, "norm_topk_prob": True}, "config.json", 2)
    spec = dict(ni.expected_parameters({"arch": "llama", "vocab_size": 8, "hidden_size": 8, "num_layers": 1,
                                        "num_heads": 2, "num_kv_heads": 2, "intermediate_size": 32,
                                        "tie_embeddings": True, "moe": moe}))
    s.check(moe == {"num_experts": 4, "top_k": 2, "intermediate_size": 16, "norm_topk_prob": True}
            and spec.get("model.layers.0.mlp.gate.weight") == (4, 8)
            and spec.get("model.layers.0.mlp.experts.3.down_proj.weight") == (8, 16)
            and "model.layers.0.mlp.gate_proj.weight" not in spec, f"a Qwen3-MoE config becomes model.moe {moe}")
    titan = ni.Mapper("torchtitan", {})
    s.check(ni.detect_naming(["tok_embeddings.weight", "layers.0.attention.qkv_linear.wq.weight"])[0] == "torchtitan"
            and titan.target("layers.3.attention.qkv_linear.wk.weight") == "model.layers.3.self_attn.k_proj.weight"
            and titan.target("lm_head.weight") == "lm_head.weight"
            and titan.target("layers.0.feed_forward.w2.weight") == "model.layers.0.mlp.down_proj.weight",
            "torchtitan's 2026 names (attention.qkv_linear.wq, lm_head) detected and mapped")
    return s.finish()


if __name__ == "__main__":
    sys.exit(main())
