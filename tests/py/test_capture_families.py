"""The capture helper reads Gemma 3 and OLMo 3 off a live Hugging Face model, as `nanreplay import` reads
them off config.json, and refuses GPT-OSS and Llama 4 by model_type.

The models are the eager transcriptions of transformers' modeling code in test_family_gemma3.py
(Gemma3ForCausalLM: sandwich norms, per-head QK-norm, the local rotary, linear scaling on full layers)
and test_family_olmo3.py (Olmo3ForCausalLM: post-norm, QK-norm over the whole projection, YaRN on full
layers only), under Hugging Face's parameter names, each carrying model.config as transformers would
(a plain object with the config class's attributes: no transformers here), in transformers 4's spelling
(rope_theta, rope_scaling, rope_local_base_freq) and in transformers 5's (rope_parameters per layer type).

1. Each: a Recorder over three AdamW steps of a plain training loop (its self-check on), the window
   dumped, `nanreplay run`: a clean window (exit 0, nothing reproduced, no error and no system finding),
   each replayed step's loss and gradient norm within 1e-5 relative of what the live model computed, and
   the manifest holding the family's keys with the config's values.
2. A live model whose config says model_type gpt_oss, llama4 or llama4_text: the Recorder refuses it by
   model_type, saying why, in one line.

    /usr/bin/python3 tests/py/test_capture_families.py --cli build/nanreplay --work DIR
"""
import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import family_support as fs  # noqa: E402
import test_family_gemma3 as gemma3  # noqa: E402
import test_family_olmo3 as olmo3  # noqa: E402
import torch_models  # noqa: E402

nanreplay_capture = fs.nanreplay_capture
SEQ_LEN, MICRO_BATCH, STEPS = 12, 2, 3


class Gemma3Live(torch.nn.Module):
    """Gemma3ForCausalLM under its Hugging Face names (model.*, the head tied), with model.config."""

    def __init__(self, cfg, config):
        super().__init__()
        self.model = gemma3.Gemma3ForCausalLM(cfg)
        self.config = config

    def forward(self, input_ids, labels):
        return self.model(input_ids, labels)


def gemma3_configs():
    """Gemma3TextConfig's attributes (live, as transformers fills them), in the two spellings."""
    cfg = gemma3.CONFIG
    t4 = SimpleNamespace(model_type="gemma3_text", **cfg, sliding_window_pattern=2, hidden_activation="gelu_pytorch_tanh",
                         hidden_act="gelu_pytorch_tanh", final_logit_softcapping=None, attn_logit_softcapping=None,
                         attention_bias=False, _attn_implementation="eager")
    t5 = dict(vars(t4))
    for key in ("rope_theta", "rope_scaling", "rope_local_base_freq"):
        del t5[key]
    t5["rope_parameters"] = {"full_attention": dict(cfg["rope_scaling"], rope_theta=cfg["rope_theta"]),
                             "sliding_attention": {"rope_type": "default", "rope_theta": cfg["rope_local_base_freq"]}}
    want = {"norm_layout": "sandwich", "qk_norm": "head", "rms_norm_offset": True, "scale_embeddings": True,
            "hidden_act": "gelu_pytorch_tanh", "query_pre_attn_scalar": float(cfg["query_pre_attn_scalar"]),
            "rope_theta": cfg["rope_theta"], "rope_local_base_freq": cfg["rope_local_base_freq"],
            "rope_scaling": cfg["rope_scaling"], "layer_types": cfg["layer_types"],
            "sliding_window": cfg["sliding_window"], "head_dim": cfg["head_dim"], "tie_embeddings": True,
            "attention_mask": "additive_finfo_min"}
    return t4, SimpleNamespace(**t5), want


def olmo3_configs():
    """Olmo3Config's attributes, live (layer_types filled by the config's __init__), in the two spellings."""
    cfg = olmo3.CONFIG
    t4 = SimpleNamespace(model_type="olmo3", **cfg, attention_dropout=0.0, _attn_implementation="eager")
    t5 = dict(vars(t4))
    del t5["rope_theta"], t5["rope_scaling"]
    t5["rope_parameters"] = {"full_attention": dict(cfg["rope_scaling"], rope_theta=cfg["rope_theta"]),
                             "sliding_attention": {"rope_type": "default", "rope_theta": cfg["rope_theta"]}}
    want = {"norm_layout": "post", "qk_norm": "full", "attention_mask": "additive_finfo_min",
            "layer_types": cfg["layer_types"], "sliding_window": cfg["sliding_window"], "rope_theta": cfg["rope_theta"],
            "rope_local_base_freq": cfg["rope_theta"], "tie_embeddings": False,
            "rope_scaling": dict(cfg["rope_scaling"], beta_fast=32.0, beta_slow=1.0, truncate=True, factor=4.0)}
    return t4, SimpleNamespace(**t5), want


def write_tokens(work, vocab):
    tokens = fs.token_stream(vocab, STEPS * MICRO_BATCH, SEQ_LEN, seed=7)
    path = work / "tokens.bin"
    path.write_bytes(tokens.to(torch.int32).numpy().astype("<u2").tobytes())
    return path, tokens


def train_and_capture(work, label, model, shard, tokens):
    """Three AdamW steps of a plain loop with the recorder's calls; the window dumped. Returns the
    bundle and {step: (loss, grad norm)} as the live model computed them."""
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    recorder = nanreplay_capture.Recorder(model, opt, work / (label + "-incidents"), arch="llama", window=STEPS,
                                          data=dict(shards=[str(shard)], seq_len=SEQ_LEN, micro_batch_size=MICRO_BATCH))
    live = {}
    for step in range(STEPS):
        samples = [MICRO_BATCH * step + i for i in range(MICRO_BATCH)]
        window = torch.stack([tokens[i * SEQ_LEN:i * SEQ_LEN + SEQ_LEN + 1] for i in samples])
        recorder.begin_step(step, samples=samples)
        loss = model(window[:, :-1], window[:, 1:])
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
        live[step] = (float(loss), float(norm))
        recorder.end_step(loss=float(loss), grad_norm=float(norm))
        opt.step()
        opt.zero_grad(set_to_none=True)
    bundle = work / (label + "-bundle")
    shutil.rmtree(bundle, ignore_errors=True)
    return recorder.dump(bundle), live


def check_family(cli, work, label, model, want):
    """1. for one live model: captured, replayed clean, its steps and manifest keys checked."""
    shard, tokens = write_tokens(work, model.config.vocab_size)
    try:
        bundle, live = train_and_capture(work, label, model, shard, tokens)
    except nanreplay_capture.CaptureError as e:
        fs.check(False, f"{label}: the recorder captures the live model ({e})")
        return
    m = json.loads((bundle / "manifest.json").read_text())["model"]
    wrong = {k: m.get(k) for k, v in want.items() if m.get(k) != v}
    fs.check(not wrong, f"{label}: the manifest carries the family's keys (differing: {wrong})")
    out = work / (label + "-out")
    shutil.rmtree(out, ignore_errors=True)
    run = subprocess.run([cli, "run", str(bundle), "--out", str(out)], capture_output=True, text=True)
    path = out / "report.json"
    report = json.loads(path.read_text()) if path.exists() else None
    if not fs.check(run.returncode == 0 and report is not None,
                    f"{label}: nanreplay run exits 0 (got {run.returncode}; {run.stderr.strip()[-300:]})"):
        return
    flagged = [f["code"] for f in report["findings"] if f["severity"] == "error" or f["layer"] == "system"]
    fs.check(not report["reproduced"] and report["first_nonfinite"] is None and not flagged,
             f"{label}: a clean window (reproduced {report['reproduced']}, findings {flagged})")
    replayed = {row["step"]: row for row in report["steps"]}
    fs.check(sorted(replayed) == sorted(live), f"{label}: every captured step replayed ({sorted(replayed)})")
    for step, (loss, norm) in live.items():
        row = replayed.get(step)
        if row is None:
            continue
        fs.check(fs.rel_err(row["loss"], loss) <= fs.TOLERANCE and fs.rel_err(row["grad_norm"], norm) <= fs.TOLERANCE,
                 f"{label} step {step}: replayed loss {row['loss']:.9g} / grad norm {row['grad_norm']:.9g}, the live "
                 f"model's {loss:.9g} / {norm:.9g}")


def check_refusals(work):
    """2. GPT-OSS and Llama 4 (mixtures of experts bundle v1's moe cannot express) refused by model_type."""
    shard, _ = write_tokens(work, 64)
    for model_type in ("gpt_oss", "llama4", "llama4_text"):
        torch.manual_seed(0)
        model = torch_models.LlamaForCausalLM(dict(vocab_size=64, hidden_size=32, num_layers=1, num_heads=4,
                                                   num_kv_heads=4, intermediate_size=48, norm_eps=1e-5,
                                                   rope_theta=10000.0))
        model.config = SimpleNamespace(model_type=model_type, num_attention_heads=4, rope_theta=10000.0,
                                       num_local_experts=4, num_experts_per_tok=1)
        opt = torch.optim.AdamW(model.parameters())
        try:
            nanreplay_capture.Recorder(model, opt, work / "refused", arch="llama",
                                       data=dict(shards=[str(shard)], seq_len=SEQ_LEN, micro_batch_size=MICRO_BATCH))
            fs.check(False, f"a live {model_type} model is refused")
        except nanreplay_capture.CaptureError as e:
            said = str(e)
            fs.check(f"model_type {model_type!r}" in said and "experts" in said and "\n" not in said,
                     f"a live {model_type} model is refused by model_type, saying why in one line: {said}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cli", required=True)
    ap.add_argument("--work", required=True)
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    g4, g5, gemma_want = gemma3_configs()
    for label, config in (("gemma3-t4", g4), ("gemma3-t5", g5)):
        torch.manual_seed(0)
        model = Gemma3Live(gemma3.CONFIG, config)
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(0.3 * torch.randn(p.shape) if "norm" in name else 0.4 * torch.randn(p.shape))
        check_family(args.cli, work, label, model, gemma_want)
    o4, o5, olmo_want = olmo3_configs()
    for label, config in (("olmo3-t4", o4), ("olmo3-t5", o5)):
        model = olmo3.init(olmo3.Olmo3ForCausalLM(olmo3.CONFIG), 1)
        model.config = config
        check_family(args.cli, work, label, model, olmo_want)
    check_refusals(work)
    fs.finish()


if __name__ == "__main__":
    main()
