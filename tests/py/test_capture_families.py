"""The capture helper reads Gemma 3, OLMo 3, Phi-3, GLM and GLM-4-0414 off a live Hugging Face model, as
`nanreplay import` reads them off config.json, and refuses GPT-OSS and Llama 4 by model_type.

The models are the eager transcriptions of transformers' modeling code in test_family_gemma3.py
(Gemma3ForCausalLM: sandwich norms, per-head QK-norm, the local rotary, linear scaling on full layers)
and test_family_olmo3.py (Olmo3ForCausalLM: post-norm, QK-norm over the whole projection, YaRN on full
layers only), under Hugging Face's parameter names, each carrying model.config as transformers would
(a plain object with the config class's attributes: no transformers here), in transformers 4's spelling
(rope_theta, rope_scaling, rope_local_base_freq) and in transformers 5's (rope_parameters per layer type).
Phi-3, GLM and GLM-4-0414 are test_family_phi3_glm.py's transcriptions of modeling_phi3.py, modeling_glm.py
and modeling_glm4.py (Phi3ForCausalLM: fused qkv_proj and gate_up_proj, rotary on the first 0.75 of each
head, a tied head, sliding_window on every layer; GlmForCausalLM: fused gate_up_proj, q/k/v biases, adjacent
pairs rotated on half of each head; Glm4ForCausalLM: GLM's block between post_self_attn_layernorm and
post_mlp_layernorm), each with its config class's attributes (Phi3Config, GlmConfig, Glm4Config).

1. Each: a Recorder over three AdamW steps of a plain training loop (its self-check on), the window
   dumped, `nanreplay run`: a clean window (exit 0, nothing reproduced, no error and no system finding),
   each replayed step's loss and gradient norm within 1e-5 relative of what the live model computed, and
   the manifest holding the family's keys with the config's values. A transformers 5 spelling is not
   replayed again: its bundle's model section and weights must equal the transformers 4 one's, which was.
   Phi-3's AdamW moments of qkv_proj and gate_up_proj are written in the rows its attention and MLP slice.
2. A live model whose config says model_type gpt_oss, llama4 or llama4_text: the Recorder refuses it by
   model_type, saying why, in one line.
3. Controls: Phi-3, GLM and GLM-4-0414 captured through a split with two blocks exchanged (k and v of
   qkv_proj, gate and up of gate_up_proj): the self-check refuses each at its first step, and with the
   self-check off GLM-4-0414's bundle replays away from the live model, so 1.'s comparisons can fail.
4. `nanreplay import` of GLM / GLM-4-0414 config.json files without head_dim: the config class's default,
   128 (transformers' src/transformers/models/glm/configuration_glm.py and glm4/configuration_glm4.py:
   `head_dim: int | None = 128` in GlmConfig and Glm4Config), as transformers computes with it. The config
   reading (normalize_config, and the capture helper's _options_from_config) says 128 naming the class, and
   nothing for `head_dim: null` (GlmAttention then takes hidden_size / num_attention_heads), another
   model_type or a config that gives it. A GLM checkpoint with 2 query heads and 1 key/value head of 128
   (hidden 32), its config.json without head_dim, is imported (in this process: the import's main) with
   model.head_dim 128 and a provenance naming GlmConfig's default, and replays within 1e-5 of the eager
   reference's loss and gradient norm.

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
import test_family_phi3_glm as phi3_glm  # noqa: E402
import torch_models  # noqa: E402
from reference_model import read_safetensors  # noqa: E402
import import_support  # noqa: E402  (its token data)
from nanreplay_import import model_settle  # noqa: E402  (family_support put capture/ on sys.path)
from nanreplay_import.cli import main as import_main  # noqa: E402

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


def fused_family(family):
    """(live model, what the manifest must say) of Phi-3 (Phi-4-mini's partial rotary and tied head, a window
    of 5), GLM or GLM-4-0414, model.config with the attributes its config class fills."""
    if family == "phi3":
        model = phi3_glm.ForCausalLM("phi3", 0.75, window=5, tied=True)
        config = phi3_glm.phi3_config(factor=0.75, window=5, tied=True)
        want = {"partial_rotary_factor": 0.75, "sliding_window": 5, "tie_embeddings": True, "num_kv_heads": phi3_glm.G}
    else:
        model, config = phi3_glm.ForCausalLM(family, 0.5), phi3_glm.glm_config(family)
        want = {"rope_style": "interleaved", "partial_rotary_factor": 0.5, "attention_bias": True}
        if family == "glm4":
            want["norm_layout"] = "sandwich"
    model = phi3_glm.init(model, 1)
    model.config = SimpleNamespace(**config, _attn_implementation="eager")
    return model, dict(want, attention_mask="additive_finfo_min", intermediate_size=phi3_glm.FF)


SPLIT = nanreplay_capture.fused_row_blocks


def swapped_split(kind, rows, heads=None):
    """The recorder's split with its last two blocks' rows exchanged: k and v of qkv_proj, gate and up of
    gate_up_proj (same shapes, so only the values can tell)."""
    blocks = SPLIT(kind, rows, heads)
    (a, first_a, n_a), (b, first_b, n_b) = blocks[-2:]
    return blocks[:-2] + [(a, first_b, n_b), (b, first_a, n_a)]


def check_fused_moments(bundle, model):
    """1. Phi-3: the last step's AdamW moments are the live optimizer's of qkv_proj and gate_up_proj, in the
    row blocks Phi3Attention and Phi3MLP slice (test_family_phi3_glm's H, G, D, FF)."""
    H, G, D, FF = phi3_glm.H, phi3_glm.G, phi3_glm.D, phi3_glm.FF
    written = read_safetensors(bundle / "steps" / str(STEPS - 1) / "optimizer.safetensors")
    live = model.live_moments
    p, qkv, gate_up = "model.layers.1.", "self_attn.qkv_proj", "mlp.gate_up_proj"
    rows = {"self_attn.q_proj": (qkv, 0, H * D), "self_attn.k_proj": (qkv, H * D, G * D),
            "self_attn.v_proj": (qkv, (H + G) * D, G * D), "mlp.gate_proj": (gate_up, 0, FF),
            "mlp.up_proj": (gate_up, FF, FF)}
    wrong = [f"{part}.{which}" for part, (fused, first, n) in rows.items() for which in ("exp_avg", "exp_avg_sq")
             if not torch.equal(written[f"{p}{part}.weight.{which}"],
                                live[f"{p}{fused}.weight"][which][first:first + n])]
    fs.check(not wrong, f"phi3: the moments of qkv_proj / gate_up_proj written split as the parameters "
                        f"(differing: {wrong})")


def check_swapped_split(cli, work, family):
    """3. The split with two blocks exchanged: the self-check refuses it; GLM-4-0414's bundle, written with the
    self-check off, replays away from the live model."""
    nanreplay_capture.fused_row_blocks = swapped_split
    try:
        model, _ = fused_family(family)
        shard, tokens = write_tokens(work, model.config.vocab_size)
        try:
            train_and_capture(work, family + "-swapped", model, shard, tokens)
            said = "captured"
        except nanreplay_capture.CaptureError as e:
            said = str(e)
        fs.check("self-check" in said, f"{family}, its split exchanged: the self-check refuses it ({said[:160]})")
        if family != "glm4":
            return
        model, _ = fused_family(family)
        bundle, live = train_and_capture(work, family + "-swapped-unchecked", model, shard, tokens, self_check=False)
    finally:
        nanreplay_capture.fused_row_blocks = SPLIT
    out = work / (family + "-swapped-out")
    shutil.rmtree(out, ignore_errors=True)
    subprocess.run([cli, "run", str(bundle), "--out", str(out), "--threads", "1"], capture_output=True, text=True)
    path = out / "report.json"
    steps = json.loads(path.read_text())["steps"] if path.exists() else []
    loss = next((row["loss"] for row in steps if row["step"] == 0), None)
    fs.check(loss is not None and fs.rel_err(loss, live[0][0]) > 1e-3,
             f"{family}, gate and up exchanged, self-check off: the replay departs from the live model "
             f"({loss} vs {live[0][0]:.9g})")


def write_tokens(work, vocab):
    tokens = fs.token_stream(vocab, STEPS * MICRO_BATCH, SEQ_LEN, seed=7)
    path = work / "tokens.bin"
    path.write_bytes(tokens.to(torch.int32).numpy().astype("<u2").tobytes())
    return path, tokens


def train_and_capture(work, label, model, shard, tokens, self_check=True):
    """Three AdamW steps of a plain loop with the recorder's calls; the window dumped. Returns the
    bundle and {step: (loss, grad norm)} as the live model computed them; model.live_moments holds the
    optimizer's state, by the model's names, as the last step began."""
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    recorder = nanreplay_capture.Recorder(model, opt, work / (label + "-incidents"), arch="llama", window=STEPS,
                                          data=dict(shards=[str(shard)], seq_len=SEQ_LEN, micro_batch_size=MICRO_BATCH))
    recorder.self_check = self_check
    live = {}
    for step in range(STEPS):
        samples = [MICRO_BATCH * step + i for i in range(MICRO_BATCH)]
        window = torch.stack([tokens[i * SEQ_LEN:i * SEQ_LEN + SEQ_LEN + 1] for i in samples])
        recorder.begin_step(step, samples=samples)
        model.live_moments = {n: {k: v.clone() for k, v in opt.state[p].items() if k != "step"}
                              for n, p in model.named_parameters() if p in opt.state}
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


def check_family(cli, work, label, model, want, replayed_twin=None):
    """1. for one live model: captured, replayed clean, its steps and manifest keys checked. Returns the
    bundle. With `replayed_twin` (the same model's bundle under the other spelling of its config, replayed
    already) the model section and weights must equal the twin's, which makes a replay of its own redundant."""
    shard, tokens = write_tokens(work, model.config.vocab_size)
    try:
        bundle, live = train_and_capture(work, label, model, shard, tokens)
    except nanreplay_capture.CaptureError as e:
        fs.check(False, f"{label}: the recorder captures the live model ({e})")
        return None
    m = json.loads((bundle / "manifest.json").read_text())["model"]
    wrong = {k: m.get(k) for k, v in want.items() if m.get(k) != v}
    fs.check(not wrong, f"{label}: the manifest carries the family's keys (differing: {wrong})")
    if replayed_twin is not None:
        twin = json.loads((replayed_twin / "manifest.json").read_text())["model"]
        weights = [Path(b, "steps", "0", "model.safetensors").read_bytes() for b in (bundle, replayed_twin)]
        fs.check(m == twin and weights[0] == weights[1],
                 f"{label}: the same model section and weights as {replayed_twin.name}'s, which replayed")
        return bundle
    if label == "phi3":
        check_fused_moments(bundle, model)
    out = work / (label + "-out")
    shutil.rmtree(out, ignore_errors=True)
    run = subprocess.run([cli, "run", str(bundle), "--out", str(out), "--threads", "1"], capture_output=True, text=True)
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
    return bundle


def check_refusals(work):
    """2. A dense model whose config says GPT-OSS or Llama 4 (whose fused experts the recorder splits:
    test_capture_fused_experts.py) refused by model_type, naming where those experts should be."""
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
            fs.check(f"model_type {model_type!r}" in said and "experts.gate_up_proj" in said and "\n" not in said,
                     f"a live {model_type} model without its experts is refused by model_type, saying why in one "
                     f"line: {said}")


GLM_WIDE_HEADS = phi3_glm.DIMS._replace(H=2, G=1, D=128)  # head_dim 128 with hidden 32: not hidden / heads


def glm_without_head_dim(family, **change):
    """test_family_phi3_glm's config.json of `family` (glm, glm4), `change`d, without head_dim."""
    cfg = dict(phi3_glm.glm_config(family), **change)
    del cfg["head_dim"]
    return cfg


def check_glm_head_dim_reading():
    """4. The config reading of a GLM config without head_dim: the class's 128, said; nothing otherwise."""
    for family, cls in (("glm", "GlmConfig"), ("glm4", "Glm4Config")):
        value, name = model_settle.normalize_config(glm_without_head_dim(family), "config.json").get("head_dim",
                                                                                                     (None, ""))
        fs.check(value == 128 and f"{cls}'s default head_dim (128)" in name,
                 f"{family} without head_dim: the import reads {cls}'s 128, saying so ({value}, {name!r})")
        said = nanreplay_capture._options_from_config(glm_without_head_dim(family), phi3_glm.LAYERS).get("head_dim")
        fs.check(said is not None and said[0] == 128 and cls in said[1],
                 f"{family} without head_dim: the capture helper's reading says 128, from {cls} ({said})")
    for label, cfg in (("head_dim null", dict(phi3_glm.glm_config("glm"), head_dim=None)),
                       ("model_type llama", glm_without_head_dim("glm", model_type="llama")),
                       ("head_dim given", phi3_glm.glm_config("glm"))):
        got = model_settle.normalize_config(cfg, "config.json").get("head_dim")
        fs.check(got in (None, (phi3_glm.D, "head_dim")), f"{label}: no GLM default taken ({got})")


def check_glm_head_dim_import(cli, work):
    """4. A GLM checkpoint with heads of 128 whose config.json leaves head_dim out: imported, replayed."""
    dims = GLM_WIDE_HEADS
    model = phi3_glm.init(phi3_glm.ForCausalLM("glm", 0.5, dims=dims), 5)
    data = import_support.Data(work, dims.V, phi3_glm.T, 2, 1, num_samples=16, seed=3)
    loss, norm = fs.loss_and_grad_norm(model(*data.batch(data.rows(0))), list(model.parameters()))
    checkpoint, log, bundle = work / "glm-wide-heads", work / "glm-wide-heads-log.jsonl", work / "glm-wide-heads-bundle"
    phi3_glm.save(checkpoint, model, glm_without_head_dim("glm", num_attention_heads=dims.H,
                                                          num_key_value_heads=dims.G))
    log.write_text(json.dumps({"step": 0, "loss": loss, "lr": 1e-3}) + "\n")
    shutil.rmtree(bundle, ignore_errors=True)
    rc = import_main([str(a) for a in ("--checkpoint", checkpoint, *data.flags(), "--log", log, "--steps", "0:0",
                                       "--out", bundle)])
    if not fs.check(rc == 0, f"GLM without head_dim: the import exits 0 (got {rc})"):
        return
    manifest = json.loads((bundle / "manifest.json").read_text())
    entry = manifest.get("provenance", {}).get("model.head_dim", {})
    fs.check(manifest["model"].get("head_dim") == 128 and manifest["model"].get("num_kv_heads") == 1
             and "GlmConfig's default head_dim (128)" in entry.get("detail", ""),
             f"GLM without head_dim: model.head_dim 128, 1 key/value head, the provenance naming GlmConfig's "
             f"default ({entry})")
    rc, report, err = fs.replay(cli, bundle, work / "glm-wide-heads-out", ["--threads", "1"])
    if fs.check(report is not None, f"GLM without head_dim: the import replays (exit {rc}; {err.strip()[-300:]})"):
        fs.compare_step(report, loss, norm, "GLM without head_dim")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cli", required=True)
    ap.add_argument("--work", required=True)
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    g4, g5, gemma_want = gemma3_configs()
    twin = None
    for label, config in (("gemma3-t4", g4), ("gemma3-t5", g5)):
        torch.manual_seed(0)
        model = Gemma3Live(gemma3.CONFIG, config)
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(0.3 * torch.randn(p.shape) if "norm" in name else 0.4 * torch.randn(p.shape))
        twin = check_family(args.cli, work, label, model, gemma_want, twin)
    o4, o5, olmo_want = olmo3_configs()
    twin = None
    for label, config in (("olmo3-t4", o4), ("olmo3-t5", o5)):
        model = olmo3.init(olmo3.Olmo3ForCausalLM(olmo3.CONFIG), 1)
        model.config = config
        twin = check_family(args.cli, work, label, model, olmo_want, twin)
    for family in ("phi3", "glm", "glm4"):
        model, want = fused_family(family)
        check_family(args.cli, work, family, model, want)
        check_swapped_split(args.cli, work, family)
    check_refusals(work)
    check_glm_head_dim_reading()
    check_glm_head_dim_import(args.cli, work)
    fs.finish()


if __name__ == "__main__":
    main()
