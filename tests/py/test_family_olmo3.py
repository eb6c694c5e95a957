"""OLMo 3 through `nanreplay import`, against eager PyTorch written from transformers' modeling_olmo3.py.

Olmo3Model is OLMo 2's model (Olmo3DecoderLayer, Olmo3Attention, Olmo3RMSNorm, Olmo3MLP are Olmo2's:
post-norm residuals, q_norm / k_norm over the whole projection; the classes of test_family_olmo2.py)
with two changes the reference here transcribes:
- each layer's attention kind is config.layer_types[i] (Olmo3Config's default: every fourth layer full,
  the others sliding); a sliding layer's mask is create_sliding_window_causal_mask's (query q sees key k
  when q - sliding_window < k <= q), added as finfo.min at masked keys (eager attention);
- transformers 4's Olmo3Model.rotary_embs: sliding layers take the unscaled rotary (rope_type "default",
  the same rope_theta), full layers the configured one, here YaRN (_compute_yarn_parameters, transcribed
  in test_family_gpt_oss_attn.py, its attention factor on cos and sin). transformers 5 writes the same
  as rope_parameters per layer type.

1. The model as save_pretrained writes it (model.safetensors, config.json with model_type "olmo3"), in
   transformers 4's spelling (rope_theta, rope_scaling) with explicit layer_types that differ from the
   default pattern, and in transformers 5's (rope_parameters per layer type) with no layer_types, so
   Olmo3Config's default pattern decides: `nanreplay import` writes a manifest whose layer kinds,
   window and rotaries are the model's, and its replay gives the reference's loss and gradient norm
   within 1e-5 relative.
2. Controls: at this seq_len the window, the layer kinds and the sliding layers' unscaled rotary each
   change the reference's loss, so the comparisons above can fail.
3. Config readings: a flat rope_parameters (transformers 5 releases with one rotary for every layer) is
   YaRN on every layer; a scaled sliding_attention rotary is refused by name; no sliding_window is
   Olmo3Config's default 4096 with its pattern (recorded as such); sliding_window null is no window.
4. `nanreplay synth clean-olmo3` (post-norm, qk_norm full, layers sliding, sliding, sliding, full with a
   window of 8 over 32 positions, one unscaled rotary): every step's replayed loss and gradient norm
   against the reference on the bundle's own weights and batches, within 1e-5 relative.
5. The model of 1. (YaRN on the full layers) from a one-step bf16 bundle: the reference rounds where the
   bundle format does (docs/bundle-format.md, "Precision as replayed": every linear's input, weight and
   bias, q k^T and the scaled scores, every probe site as it is produced, the QK-norm's input); loss and
   gradient norm within 1e-4 relative, and that loss departs from the fp32 one.

    /usr/bin/python3 tests/py/test_family_olmo3.py --cli build/nanreplay --work DIR
"""
import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import family_support as fs  # noqa: E402
import import_support  # noqa: E402  (its token data and import runner)
import reference_model  # noqa: E402  (a bundle's batches and safetensors only)
import synth_cache  # noqa: E402
import test_family_olmo2 as olmo2  # noqa: E402  (Olmo2's layer, norm: Olmo3's)
from test_family_gpt_oss_attn import compute_yarn_parameters  # noqa: E402

LAYERS, T, WINDOW = 4, 12, 4
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8}
DEFAULT_PATTERN = ["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"]
EXPLICIT_PATTERN = ["full_attention", "sliding_attention", "full_attention", "sliding_attention"]
# Olmo3Config's attributes for the test's sizes (olmo2's V, C, H, FF, EPS, THETA).
CONFIG = {"vocab_size": olmo2.V, "hidden_size": olmo2.C, "intermediate_size": olmo2.FF, "num_hidden_layers": LAYERS,
          "num_attention_heads": olmo2.H, "num_key_value_heads": olmo2.H, "max_position_embeddings": 64,
          "rms_norm_eps": olmo2.EPS, "rope_theta": olmo2.THETA, "rope_scaling": YARN, "attention_bias": False,
          "tie_word_embeddings": False, "hidden_act": "silu", "sliding_window": WINDOW,
          "layer_types": EXPLICIT_PATTERN}


def default_inv_freq(base, dim):
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


class Olmo3Model(torch.nn.Module):
    def __init__(self, cfg):
        super().__init__()
        dims = olmo2.Dims(cfg["hidden_size"], cfg["num_attention_heads"], cfg["intermediate_size"], cfg["rms_norm_eps"])
        self.embed_tokens = torch.nn.Embedding(cfg["vocab_size"], cfg["hidden_size"])
        self.layers = torch.nn.ModuleList([olmo2.Olmo2DecoderLayer(dims) for _ in range(cfg["num_hidden_layers"])])
        self.norm = olmo2.Olmo2RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])


class Olmo3ForCausalLM(fs.Rounding, torch.nn.Module):
    """`cfg`: Olmo3Config's attributes (layer_types given: the config's __init__ fills the default)."""

    def __init__(self, cfg, sliding_rotary="default"):
        super().__init__()
        self.cfg = cfg
        self.model = Olmo3Model(cfg)
        self.lm_head = fs.Linear(cfg["hidden_size"], cfg["vocab_size"], bias=False)
        D = cfg["hidden_size"] // cfg["num_attention_heads"]
        scaling = cfg.get("rope_scaling")
        full = (compute_yarn_parameters(D, cfg["rope_theta"], scaling, cfg["max_position_embeddings"]) if scaling
                else (default_inv_freq(cfg["rope_theta"], D), 1.0))
        # rotary_embs: {"sliding_attention": rope_type "default", "full_attention": the config's}
        self.rotary = {"full_attention": full,
                       "sliding_attention": (default_inv_freq(cfg["rope_theta"], D), 1.0)
                       if sliding_rotary == "default" else full}

    def forward(self, input_ids, labels):
        seq = input_ids.shape[1]
        position_ids = torch.arange(seq)[None, :].float()
        position_embeddings = {}
        for kind, (inv_freq, attention_scaling) in self.rotary.items():
            freqs = (inv_freq[None, :, None].float() @ position_ids[:, None, :]).transpose(1, 2)
            emb = torch.cat((freqs, freqs), dim=-1)
            position_embeddings[kind] = (emb.cos() * attention_scaling, emb.sin() * attention_scaling)
        q, k = torch.arange(seq)[:, None], torch.arange(seq)[None, :]
        lowest = torch.finfo(torch.float32).min
        masks = {"full_attention": torch.zeros(seq, seq).masked_fill(k > q, lowest)[None, None],
                 "sliding_attention": torch.zeros(seq, seq).masked_fill((k > q) | (k <= q - self.cfg["sliding_window"]),
                                                                        lowest)[None, None]}
        hidden_states = self.rnd(self.model.embed_tokens(input_ids))  # embed
        for layer, kind in zip(self.model.layers, self.cfg["layer_types"]):
            hidden_states = layer(hidden_states, masks[kind], position_embeddings[kind])
        return fs.cross_entropy(self.rnd(self.lm_head(self.model.norm(hidden_states))), labels)  # logits


def init(model, seed):
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.3 * torch.randn(p.shape) if "norm" in name else 0.4 * torch.randn(p.shape))
    return model


def transformers4(cfg):
    """config.json as transformers 4.57 writes Olmo3ForCausalLM's."""
    return {"architectures": ["Olmo3ForCausalLM"], "model_type": "olmo3", **cfg, "torch_dtype": "float32"}


def transformers5(cfg):
    """config.json as transformers 5 writes it: rope_parameters per layer type (the sliding layers'
    rope_type "default"); layer_types left out here, so Olmo3Config's default pattern applies."""
    out = {k: v for k, v in cfg.items() if k not in ("rope_theta", "rope_scaling", "layer_types")}
    full = dict(cfg["rope_scaling"] or {"rope_type": "default"}, rope_theta=cfg["rope_theta"])
    out["rope_parameters"] = {"full_attention": full,
                              "sliding_attention": {"rope_type": "default", "rope_theta": cfg["rope_theta"]}}
    return {"architectures": ["Olmo3ForCausalLM"], "model_type": "olmo3", **out, "dtype": "float32"}


def import_and_replay(cli, work, data, label, model, config_json):
    """`model` saved as save_pretrained would with `config_json`, imported and replayed: the manifest's
    OLMo 3 keys and the replayed step against the reference."""
    loss0, norm0 = fs.loss_and_grad_norm(model(*data.batch(data.rows(0))), list(model.parameters()))
    directory = work / label
    directory.mkdir(parents=True, exist_ok=True)
    fs.nanreplay_capture.write_safetensors(directory / "model.safetensors",
                                           [(k, v.detach()) for k, v in model.named_parameters()])
    (directory / "config.json").write_text(json.dumps(config_json, indent=2))
    log = work / (label + "-log.jsonl")
    log.write_text(json.dumps({"step": 0, "loss": loss0, "lr": 1e-3}) + "\n")
    imported = work / (label + "-imported")
    proc = import_support.run_import(cli, ["--checkpoint", directory, *data.flags(), "--log", log, "--steps", "0:0"],
                                     imported)
    if not fs.check(proc.returncode == 0, f"import of {label}: exit {proc.returncode} {proc.stderr.strip()[-400:]}"):
        return
    m = json.loads((imported / "manifest.json").read_text())["model"]
    fs.check(m.get("layer_types") == model.cfg["layer_types"],
             f"import of {label}: the manifest's layer kinds {m.get('layer_types')} are the model's "
             f"{model.cfg['layer_types']}")
    want = {"norm_layout": "post", "qk_norm": "full", "attention_mask": "additive_finfo_min", "sliding_window": WINDOW,
            "rope_theta": olmo2.THETA, "rope_local_base_freq": olmo2.THETA, "num_layers": LAYERS,
            "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8,
                             "beta_fast": 32.0, "beta_slow": 1.0, "truncate": True}}
    wrong = {k: m.get(k) for k, v in want.items() if m.get(k) != v}
    fs.check(not wrong, f"import of {label}: OLMo 3's options in the manifest (differing: {wrong})")
    rc, report, err = fs.replay(cli, imported, work / (label + "-out"))
    if fs.check(report is not None, f"imported {label} replays (exit {rc}; {err.strip()[-300:]})"):
        fs.compare_step(report, loss0, norm0, f"imported {label}")


def check_controls(data):
    """2. What the imports are checked against depends on the window, the kinds and the local rotary."""
    batch = data.batch(data.rows(0))
    base = float(init(Olmo3ForCausalLM(CONFIG), 1)(*batch))
    variants = {"no window (every layer full)": dict(CONFIG, layer_types=["full_attention"] * LAYERS),
                "the default pattern": dict(CONFIG, layer_types=DEFAULT_PATTERN)}
    for what, cfg in variants.items():
        loss = float(init(Olmo3ForCausalLM(cfg), 1)(*batch))
        fs.check(fs.rel_err(loss, base) > 1e-3, f"control: {what} changes the loss ({loss} vs {base})")
    loss = float(init(Olmo3ForCausalLM(CONFIG, sliding_rotary="scaled"), 1)(*batch))
    fs.check(fs.rel_err(loss, base) > 1e-3, f"control: sliding layers scaled too changes the loss ({loss} vs {base})")


def check_config_readings():
    """3. The config reading the import and the capture helper share: a flat rope_parameters (the
    transformers 5 releases whose Olmo3Model computes one rotary for every layer) scales every layer, no
    local rotary; a scaled sliding_attention rotary is refused by name; a config without sliding_window
    takes Olmo3Config's (4096) and pattern, recorded as defaults; sliding_window null: no window."""
    flat = {k: v for k, v in transformers4(CONFIG).items() if k not in ("rope_theta", "rope_scaling")}
    flat["rope_parameters"] = dict(YARN, rope_theta=olmo2.THETA)
    said = fs.nanreplay_capture._options_from_config(flat, LAYERS)
    fs.check("rope_local_base_freq" not in said and said["rope_scaling"][0]["rope_type"] == "yarn",
             f"flat rope_parameters: yarn on every layer, no local rotary ({said.get('rope_local_base_freq')})")
    scaled = transformers5(CONFIG)
    scaled["rope_parameters"]["sliding_attention"] = dict(YARN, rope_theta=olmo2.THETA)
    try:
        fs.nanreplay_capture._options_from_config(scaled, LAYERS)
        said = "accepted"
    except fs.nanreplay_capture.CaptureError as e:
        said = str(e)
    fs.check("rope_parameters['sliding_attention']" in said, f"a scaled sliding rotary is refused by name ({said})")
    bare = {k: v for k, v in transformers4(CONFIG).items() if k not in ("sliding_window", "layer_types")}
    said = fs.nanreplay_capture._options_from_config(bare, LAYERS)
    fs.check(said.get("sliding_window", (None, ""))[0] == 4096 and "default" in said["sliding_window"][1]
             and said.get("layer_types", (None,))[0] == DEFAULT_PATTERN,
             f"no sliding_window: Olmo3Config's 4096 and pattern, recorded as its defaults ({said.get('sliding_window')})")
    said = fs.nanreplay_capture._options_from_config(dict(bare, sliding_window=None), LAYERS)
    fs.check("layer_types" not in said and said.get("sliding_window", (None,))[0] is None,
             f"sliding_window null: every layer full ({said.get('layer_types')})")


def config_of_manifest(m):
    """Olmo3Config's attributes for a bundle's model section (the reference's inputs; nanreplay never reads it)."""
    return {"vocab_size": m["vocab_size"], "hidden_size": m["hidden_size"], "intermediate_size": m["intermediate_size"],
            "num_hidden_layers": m["num_layers"], "num_attention_heads": m["num_heads"],
            "num_key_value_heads": m.get("num_kv_heads", m["num_heads"]), "max_position_embeddings": m["max_seq_len"],
            "rms_norm_eps": m["norm_eps"], "rope_theta": m["rope_theta"], "rope_scaling": m.get("rope_scaling"),
            "sliding_window": m["sliding_window"], "layer_types": m["layer_types"]}


def check_preset(cli, work):
    """4. every step of clean-olmo3 against the reference on the bundle's weights and batches."""
    bundle_dir = work / "clean-olmo3"
    synth_cache.synth(cli, "clean-olmo3", bundle_dir)
    rc, report, err = fs.replay(cli, bundle_dir, work / "out-clean-olmo3")
    if not fs.check(report is not None and rc == 0, f"clean-olmo3 replays (exit {rc}; {err.strip()[-300:]})"):
        return
    bundle = reference_model.Bundle(bundle_dir)
    m = bundle.manifest["model"]
    fs.check(m.get("layer_types") == DEFAULT_PATTERN and m.get("norm_layout") == "post" and m.get("qk_norm") == "full"
             and m["sliding_window"] < bundle.seq_len,
             f"clean-olmo3's manifest: post-norm, the full QK-norm, 3 sliding to 1 full, a window under seq_len ({m})")
    dirs = {e["step"]: e["dir"] for e in bundle.manifest["steps"]}
    for row in report["steps"]:
        model = Olmo3ForCausalLM(config_of_manifest(m))
        weights = reference_model.read_safetensors(bundle.root / dirs[row["step"]] / "model.safetensors")
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(weights[name])
        fs.compare_bundle_step(bundle, row, model, f"clean-olmo3 step {row['step']}")


# Bundle v1's model section of CONFIG (the options `nanreplay import` writes for it).
MODEL = {"arch": "llama", "vocab_size": olmo2.V, "hidden_size": olmo2.C, "num_layers": LAYERS, "num_heads": olmo2.H,
         "intermediate_size": olmo2.FF, "max_seq_len": CONFIG["max_position_embeddings"], "norm_eps": olmo2.EPS,
         "rope_theta": olmo2.THETA, "rope_local_base_freq": olmo2.THETA, "tie_embeddings": False,
         "rope_scaling": dict(YARN, beta_fast=32.0, beta_slow=1.0, truncate=True), "qk_norm": "full",
         "norm_layout": "post", "attention_mask": "additive_finfo_min", "sliding_window": WINDOW,
         "layer_types": EXPLICIT_PATTERN}


def check_bf16(cli, work):
    """5. CONFIG's model from a one-step bf16 bundle, against the reference with its rounding points on."""
    model = init(Olmo3ForCausalLM(CONFIG), 6)
    stream = fs.token_stream(olmo2.V, 2, T, seed=6)
    fs.check_bf16_step(cli, work, "olmo3-bf16", MODEL, model, lambda m: list(m.named_parameters()), stream, 2, T,
                       "OLMo 3 in bf16 (post-norm, the full QK-norm, sliding and YaRN full layers)")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cli", required=True)
    ap.add_argument("--work", required=True)
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    data = import_support.Data(work, olmo2.V, T, 2, 1, num_samples=16, seed=3)
    check_controls(data)
    check_config_readings()
    check_preset(args.cli, work)
    check_bf16(args.cli, work)
    import_and_replay(args.cli, work, data, "olmo3-t4-explicit", init(Olmo3ForCausalLM(CONFIG), 1),
                      transformers4(CONFIG))
    defaulted = dict(CONFIG, layer_types=DEFAULT_PATTERN)
    import_and_replay(args.cli, work, data, "olmo3-t5-default-pattern", init(Olmo3ForCausalLM(defaulted), 2),
                      transformers5(defaulted))
    fs.finish()


if __name__ == "__main__":
    main()
