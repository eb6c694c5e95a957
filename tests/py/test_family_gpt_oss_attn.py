"""GPT-OSS's attention and YaRN rotary scaling against eager PyTorch written from transformers' own code.

The reference transcribes modeling_rope_utils._compute_yarn_parameters (transformers 5: the ramp between
the correction range's bounds, `truncate`, get_mscale and the attention factor on cos and sin), and from
modeling_gpt_oss.py: GptOssRMSNorm, GptOssRotaryEmbedding (cos and sin times attention_scaling),
_apply_rotary_emb (the two halves), eager_attention_forward (scores * head_dim**-0.5 plus the finfo.min
mask, each head's sink logit concatenated as one more key column, the row's max subtracted, softmax, the
sink column dropped), GptOssAttention (q/k/v/o biases, head_dim of its own, sliding_window on the
"sliding_attention" layers of layer_types) and the decoder layer's pre-norm residuals. GPT-OSS's MLP is a
mixture of experts (test_family_gpt_oss_moe.py, which imports model_type gpt_oss): the reference's MLP is
llama's dense SwiGLU, so what is checked is the attention. The classes take their shape from `cfg`
(GptOssConfig's names; CONFIG, the constants below, when left out).

1. YaRN alone (a llama with rope_scaling yarn, two parameter sets: HF's defaults, and beta_fast/beta_slow,
   mscale/mscale_all_dim and truncate false as DeepSeek-V3 writes them): loss and gradient norm within 1e-5.
2. GPT-OSS's attention (attention_sinks, attention_bias, o_proj_bias, head_dim, yarn, layer_types
   alternating sliding and full): loss and gradient norm within 1e-5; the same bundle without
   attention_sinks departs from the reference (the sinks are read). The same model from a one-step bf16
   bundle (precision.compute "bf16"): the reference rounds where the bundle format does
   (docs/bundle-format.md, "Precision as replayed": every linear's input, weight and bias, q k^T and the
   scaled scores, every probe site as it is produced; the sink logits never, they stay fp32); loss and
   gradient norm within 1e-4 relative, and that loss departs from the fp32 one.
3. `nanreplay import` of a llama save_pretrained directory whose config.json has rope_scaling yarn with only
   factor and original_max_position_embeddings: HF's defaults are written out, and it replays to the loss;
   a config with model_type phi is refused naming model_type and saying why (llama4 imports:
   test_import_llama4.py).
4. `nanreplay synth clean-gpt-oss-attn`: its manifest says only what the reference implements (sinks,
   attention_bias with o_proj_bias, as GptOssConfig's one attention_bias, yarn, layer_types sliding and full,
   head_dim, an untied head, fp32); the reference built from the model section (config_of_manifest) on each
   of the first two steps' model.safetensors and own batches (micro_batch_size by grad_accum_steps, the
   loss the micro-batches' mean): the replayed loss and gradient norm within 1e-5 relative.

    /usr/bin/python3 tests/py/test_family_gpt_oss_attn.py --cli build/nanreplay --work DIR
"""
import argparse
import json
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import family_support as fs  # noqa: E402
import reference_model  # noqa: E402  (a bundle's batches and safetensors only)

V, C, H, G, D, LAYERS, FF, T, SAMPLES, EPS, THETA = 64, 32, 4, 2, 12, 2, 40, 16, 2, 1e-5, 10000.0
WINDOW = 5
# The reference's shape and options under GptOssConfig's names, defaulting to the constants above (the
# classes below take a `cfg` like it; config_of_manifest gives a bundle's).
CONFIG = {"vocab_size": V, "hidden_size": C, "num_attention_heads": H, "num_key_value_heads": G, "head_dim": D,
          "num_hidden_layers": LAYERS, "intermediate_size": FF, "rms_norm_eps": EPS, "rope_theta": THETA,
          "sliding_window": WINDOW, "max_position_embeddings": T}
YARN = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64}
# DeepSeek-V3's spelling: mscale and mscale_all_dim (the attention factor is their ratio), no truncation.
YARN_DEEPSEEK = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 48, "beta_fast": 16.0,
                 "beta_slow": 2.0, "mscale": 0.707, "mscale_all_dim": 1.0, "truncate": False}


def compute_yarn_parameters(dim, base, rope_parameters, max_position_embeddings):
    """transformers' _compute_yarn_parameters, line for line (the config's values passed in)."""
    factor = rope_parameters["factor"]
    attention_factor = rope_parameters.get("attention_factor")
    mscale = rope_parameters.get("mscale")
    mscale_all_dim = rope_parameters.get("mscale_all_dim")
    original_max_position_embeddings = rope_parameters["original_max_position_embeddings"]
    if factor is None:
        factor = max_position_embeddings / original_max_position_embeddings

    def get_mscale(scale, mscale=1):
        if scale <= 1:
            return 1.0
        return 0.1 * mscale * math.log(scale) + 1.0

    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim))
        else:
            attention_factor = get_mscale(factor)
    beta_fast = rope_parameters.get("beta_fast") or 32
    beta_slow = rope_parameters.get("beta_slow") or 1

    def find_correction_dim(num_rotations, dim, base, max_position_embeddings):
        return (dim * math.log(max_position_embeddings / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    def find_correction_range(low_rot, high_rot, dim, base, max_position_embeddings, truncate):
        low = find_correction_dim(low_rot, dim, base, max_position_embeddings)
        high = find_correction_dim(high_rot, dim, base, max_position_embeddings)
        if truncate:
            low = math.floor(low)
            high = math.ceil(high)
        return max(low, 0), min(high, dim - 1)

    def linear_ramp_factor(min, max, dim):
        if min == max:
            max += 0.001  # Prevent singularity
        linear_func = (torch.arange(dim, dtype=torch.float32) - min) / (max - min)
        return torch.clamp(linear_func, 0, 1)

    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    inv_freq_extrapolation = 1.0 / pos_freqs
    inv_freq_interpolation = 1.0 / (factor * pos_freqs)
    truncate = rope_parameters.get("truncate", True)
    low, high = find_correction_range(beta_fast, beta_slow, dim, base, original_max_position_embeddings, truncate)
    inv_freq_extrapolation_factor = 1 - linear_ramp_factor(low, high, dim // 2).to(dtype=torch.float)
    inv_freq = (inv_freq_interpolation * (1 - inv_freq_extrapolation_factor)
                + inv_freq_extrapolation * inv_freq_extrapolation_factor)
    return inv_freq, attention_factor


class GptOssRMSNorm(fs.Rounding, torch.nn.Module):
    def __init__(self, hidden_size, eps=EPS):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.rnd((self.weight * hidden_states).to(input_dtype))  # every norm's output is a site


def apply_rotary_emb(x, cos, sin):
    first_half, second_half = torch.chunk(x, 2, dim=-1)
    first_ = first_half * cos - second_half * sin
    second_ = second_half * cos + first_half * sin
    return torch.cat((first_, second_), dim=-1)


def eager_attention_forward(module, query, key, value, attention_mask, scaling):
    n_rep = module.num_key_value_groups
    key_states = key.repeat_interleave(n_rep, dim=1)  # repeat_kv
    value_states = value.repeat_interleave(n_rep, dim=1)
    rnd = module.rnd
    # q k^T rounded, then the scaled scores (the attn.scores site)
    attn_weights = rnd(rnd(torch.matmul(query, key_states.transpose(2, 3))) * scaling)
    attn_weights = attn_weights + attention_mask
    if module.sinks is None:  # the same attention without sinks (the what-if's model): Llama's softmax
        probs = rnd(F.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query.dtype))
        return rnd(torch.matmul(probs, value_states)).transpose(1, 2).contiguous()
    # The sink logits stay fp32 (autocast's cat promotes them with the fp32 mask): never rounded.
    sinks = module.sinks.reshape(1, -1, 1, 1).expand(query.shape[0], -1, query.shape[-2], -1)
    combined_logits = torch.cat([attn_weights, sinks], dim=-1)
    combined_logits = combined_logits - combined_logits.max(dim=-1, keepdim=True).values
    probs = F.softmax(combined_logits, dim=-1, dtype=combined_logits.dtype)
    scores = rnd(probs[..., :-1])  # we drop the sink here; the keys' columns are the attn.probs site
    return rnd(torch.matmul(scores, value_states)).transpose(1, 2).contiguous()  # attn.context


class GptOssAttention(fs.Rounding, torch.nn.Module):
    def __init__(self, bias, sinks, cfg=None):
        super().__init__()
        cfg = cfg or CONFIG
        C, H, G, D = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
        self.head_dim, self.num_key_value_groups = D, H // G
        self.scaling = D ** -0.5
        self.q_proj = fs.Linear(C, H * D, bias=bias)
        self.k_proj = fs.Linear(C, G * D, bias=bias)
        self.v_proj = fs.Linear(C, G * D, bias=bias)
        self.o_proj = fs.Linear(H * D, C, bias=bias)
        self.sinks = torch.nn.Parameter(torch.empty(H)) if sinks else None

    def forward(self, hidden_states, position_embeddings, attention_mask):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        value_states = self.rnd(self.v_proj(hidden_states)).view(hidden_shape).transpose(1, 2)  # attn.v
        cos, sin = position_embeddings
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        # rotary in fp32 from the projections, rounded as the attn.q / attn.k sites
        query_states = self.rnd(apply_rotary_emb(query_states, cos, sin))
        key_states = self.rnd(apply_rotary_emb(key_states, cos, sin))
        attn_output = eager_attention_forward(self, query_states, key_states, value_states, attention_mask,
                                              self.scaling)
        return self.rnd(self.o_proj(attn_output.reshape(*input_shape, -1).contiguous()))  # attn.out


class DenseMLP(fs.Rounding, torch.nn.Module):  # llama's SwiGLU in place of GptOssMLP's experts
    def __init__(self, cfg=None):
        super().__init__()
        cfg = cfg or CONFIG
        C, FF = cfg["hidden_size"], cfg["intermediate_size"]
        self.gate_proj = fs.Linear(C, FF, bias=False)
        self.up_proj = fs.Linear(C, FF, bias=False)
        self.down_proj = fs.Linear(FF, C, bias=False)

    def forward(self, x):
        gate, up = self.rnd(self.gate_proj(x)), self.rnd(self.up_proj(x))  # mlp.gate, mlp.up
        return self.rnd(self.down_proj(self.rnd(F.silu(gate) * up)))  # mlp.act, mlp.down


class GptOssDecoderLayer(fs.Rounding, torch.nn.Module):
    def __init__(self, bias, sinks, attention_type, cfg=None):
        super().__init__()
        cfg = cfg or CONFIG
        self.self_attn = GptOssAttention(bias, sinks, cfg)
        self.mlp = DenseMLP(cfg)
        self.input_layernorm = GptOssRMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])
        self.post_attention_layernorm = GptOssRMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])
        self.attention_type = attention_type

    def forward(self, hidden_states, attention_mask, position_embeddings):
        residual = hidden_states
        hidden_states = self.self_attn(self.input_layernorm(hidden_states), position_embeddings, attention_mask)
        hidden_states = self.rnd(residual + hidden_states)  # attn_residual
        residual = hidden_states
        return self.rnd(residual + self.mlp(self.post_attention_layernorm(hidden_states)))  # output


class Model(fs.Rounding, torch.nn.Module):
    """GptOssForCausalLM (untied lm_head) with DenseMLP; `cfg` its shape (CONFIG when left out)."""

    def __init__(self, rope_scaling, bias=False, sinks=False, layer_types=None, cfg=None):
        super().__init__()
        cfg = cfg or CONFIG
        C, V = cfg["hidden_size"], cfg["vocab_size"]
        self.layer_types = layer_types or ["full_attention"] * cfg["num_hidden_layers"]
        self.sliding_window = cfg["sliding_window"]
        self.embed_tokens = torch.nn.Embedding(V, C)
        self.layers = torch.nn.ModuleList([GptOssDecoderLayer(bias, sinks, t, cfg) for t in self.layer_types])
        self.norm = GptOssRMSNorm(C, cfg["rms_norm_eps"])
        self.lm_head = fs.Linear(C, V, bias=False)
        self.inv_freq, self.attention_scaling = compute_yarn_parameters(
            cfg["head_dim"], cfg["rope_theta"], rope_scaling, cfg["max_position_embeddings"])

    def forward(self, input_ids, labels):
        seq = input_ids.shape[1]
        position_ids = torch.arange(seq)[None, :].float()
        freqs = (self.inv_freq[None, :, None].float() @ position_ids[:, None, :]).transpose(1, 2)
        cos, sin = freqs.cos() * self.attention_scaling, freqs.sin() * self.attention_scaling
        q_idx, kv_idx = torch.arange(seq)[:, None], torch.arange(seq)[None, :]
        masks = {"full_attention": kv_idx > q_idx,  # masked: future keys, and beyond the window when sliding
                 "sliding_attention": (kv_idx > q_idx) | (kv_idx <= q_idx - self.sliding_window)}
        additive = {k: torch.zeros(seq, seq).masked_fill(m, torch.finfo(torch.float32).min)[None, None]
                    for k, m in masks.items()}
        hidden_states = self.rnd(self.embed_tokens(input_ids))  # embed
        for layer in self.layers:
            hidden_states = layer(hidden_states, additive[layer.attention_type], (cos, sin))
        return fs.cross_entropy(self.rnd(self.lm_head(self.norm(hidden_states))), labels)  # logits


def named_as_hf(model):
    """(key, tensor) in bundle v1's parameter order (GptOssAttention's own sinks before its projections)."""
    return [("model." + k if not k.startswith("lm_head") else k, v) for k, v in model.named_parameters()]


def base_model(rope_scaling):
    return {"arch": "llama", "vocab_size": V, "hidden_size": C, "num_layers": LAYERS, "num_heads": H,
            "num_kv_heads": G, "head_dim": D, "intermediate_size": FF, "max_seq_len": T, "norm_eps": EPS,
            "rope_theta": THETA, "tie_embeddings": False, "rope_scaling": rope_scaling,
            "attention_mask": "additive_finfo_min"}


def init(model, seed):
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.3 * torch.randn(p.shape) if "norm" in name else
                    torch.randn(p.shape) if name.endswith("sinks") else 0.4 * torch.randn(p.shape))
    return model


def replay_against(cli, work, name, manifest_model, model, what):
    stream = fs.token_stream(V, SAMPLES, T, seed=4)
    inputs, targets = fs.batch_of(stream, SAMPLES, T)
    loss, norm = fs.loss_and_grad_norm(model(inputs, targets), list(model.parameters()))
    bundle = fs.write_bundle(work / name, manifest_model, named_as_hf(model), stream, SAMPLES, T, loss, norm)
    rc, report, err = fs.replay(cli, bundle, work / f"out-{name}")
    if fs.check(report is not None, f"{what}: nanreplay run gave a report (exit {rc}; {err.strip()[-300:]})"):
        fs.compare_step(report, loss, norm, what)
    return bundle, loss, report


def check_yarn(cli, work):
    for name, scaling in (("yarn", YARN), ("yarn-deepseek", YARN_DEEPSEEK)):
        model = init(Model(scaling), seed=1)
        replay_against(cli, work, name, base_model(scaling), model, f"{name} {scaling}")


def check_gpt_oss_attention(cli, work):
    layer_types = ["sliding_attention", "full_attention"]
    model = init(Model(YARN, bias=True, sinks=True, layer_types=layer_types), seed=2)
    manifest_model = dict(base_model(YARN), attention_sinks=True, attention_bias=True, o_proj_bias=True,
                          sliding_window=WINDOW, layer_types=layer_types)
    bundle, loss, _ = replay_against(cli, work, "gpt-oss-attn", manifest_model, model,
                                     "GPT-OSS attention (sinks, q/k/v/o biases, head_dim, yarn, sliding+full)")
    fs.check_bf16_step(cli, work, "gpt-oss-attn-bf16", manifest_model, model, named_as_hf,
                       fs.token_stream(V, SAMPLES, T, seed=4), SAMPLES, T,
                       "GPT-OSS attention in bf16 (sinks fp32, biases rounded)")
    # The same weights without attention_sinks: the reference without sinks, and not the reference.
    without = {k: v for k, v in manifest_model.items() if k != "attention_sinks"}
    params = [(k, v) for k, v in named_as_hf(model) if not k.endswith("sinks")]
    stream = fs.token_stream(V, SAMPLES, T, seed=4)
    bundle = fs.write_bundle(work / "no-sinks", without, params, stream, SAMPLES, T, loss, 1.0)
    rc, report, err = fs.replay(cli, bundle, work / "out-no-sinks")
    if fs.check(report is not None, f"without sinks: a report (exit {rc}; {err.strip()[-300:]})"):
        replayed = report["steps"][0]["loss"]
        fs.check(fs.rel_err(replayed, loss) > 1e-3, f"without attention_sinks the loss departs ({replayed} vs {loss})")
        sinkless = model.layers
        saved = [layer.self_attn.sinks for layer in sinkless]
        for layer in sinkless:
            layer.self_attn.sinks = None
        inputs, targets = fs.batch_of(stream, SAMPLES, T)
        ref = float(model(inputs, targets))
        for layer, s in zip(sinkless, saved):
            layer.self_attn.sinks = s
        fs.check(fs.rel_err(replayed, ref) <= fs.TOLERANCE,
                 f"without attention_sinks: the reference without its sink column ({replayed} vs {ref})")


# The model section's keys the reference reads (config_of_manifest); a preset saying anything else fails check 4.
UNDERSTOOD = {"arch", "vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
              "intermediate_size", "max_seq_len", "norm_eps", "rope_theta", "tie_embeddings", "rope_scaling",
              "attention_sinks", "attention_bias", "o_proj_bias", "sliding_window", "layer_types", "attention_mask"}


def config_of_manifest(m):
    """GptOssConfig's values of a bundle's model section (the reference's inputs; nanreplay never reads it)."""
    return {"vocab_size": m["vocab_size"], "hidden_size": m["hidden_size"], "num_attention_heads": m["num_heads"],
            "num_key_value_heads": m.get("num_kv_heads", m["num_heads"]),
            "head_dim": m.get("head_dim") or m["hidden_size"] // m["num_heads"], "num_hidden_layers": m["num_layers"],
            "intermediate_size": m["intermediate_size"], "rms_norm_eps": m["norm_eps"], "rope_theta": m["rope_theta"],
            "sliding_window": m.get("sliding_window"), "max_position_embeddings": m["max_seq_len"]}


def check_preset(cli, work, preset="clean-gpt-oss-attn"):
    """4. the first two steps of the preset against the reference on the bundle's weights and batches."""
    started = fs.replay_preset_start(cli, work, preset)
    if started is None:
        return
    bundle, report, first_two = started
    m = bundle.manifest["model"]
    # What Hugging Face's GptOssAttention can say: one attention_bias for q, k, v and o; an untied head; the
    # mask as an additive finfo.min (or -inf, the default: the same probabilities, every causal row having
    # an unmasked key); yarn; the reference's compute type.
    fs.check(set(m) <= UNDERSTOOD and m.get("attention_sinks") is True and m.get("tie_embeddings") is False
             and m.get("attention_bias", False) == m.get("o_proj_bias", False)
             and m.get("attention_mask", "additive_neg_inf") in ("additive_neg_inf", "additive_finfo_min")
             and (m.get("rope_scaling") or {}).get("rope_type") == "yarn"
             and bundle.manifest["precision"]["compute"] == "fp32"
             and set(m.get("layer_types", [])) == {"sliding_attention", "full_attention"},
             f"{preset}'s manifest says only what the reference implements, sinks, yarn and both layer kinds "
             f"(not understood: {sorted(set(m) - UNDERSTOOD)}; {m})")
    cfg = config_of_manifest(m)
    dirs = {e["step"]: e["dir"] for e in bundle.manifest["steps"]}
    for row in report["steps"]:
        model = Model(m["rope_scaling"], bias=m.get("attention_bias", False), sinks=True,
                      layer_types=m["layer_types"], cfg=cfg)
        weights = reference_model.read_safetensors(bundle.root / dirs[row["step"]] / "model.safetensors")
        with torch.no_grad():
            for k, p in named_as_hf(model):
                p.copy_(weights.pop(k))
        fs.check(not weights, f"{preset} step {row['step']}: every tensor is a reference parameter ({sorted(weights)})")
        fs.compare_bundle_step(bundle, row, model, f"{preset} step {row['step']}")


LLAMA_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": V, "hidden_size": C,
                "intermediate_size": FF, "num_hidden_layers": LAYERS, "num_attention_heads": H,
                "num_key_value_heads": G, "head_dim": D, "max_position_embeddings": 512, "rms_norm_eps": EPS,
                "rope_theta": THETA, "rope_scaling": {"rope_type": "yarn", "factor": 8.0,
                                                      "original_max_position_embeddings": 64},
                "attention_bias": False, "tie_word_embeddings": False, "hidden_act": "silu",
                "torch_dtype": "float32"}


def check_import(cli, work):
    import import_support as imp  # noqa: E402  (its token data and import runner)
    model = init(Model(YARN), seed=3)
    data = imp.Data(work, V, T, 2, 1, num_samples=16, seed=3)
    loss0 = float(model(*data.batch(data.rows(0))))
    (work / "log.jsonl").write_text(json.dumps({"step": 0, "loss": loss0, "lr": 1e-3}) + "\n")
    for model_type, config in (("llama", LLAMA_CONFIG),):
        directory = work / f"{model_type}-hf"
        directory.mkdir(parents=True, exist_ok=True)
        fs.nanreplay_capture.write_safetensors(directory / "model.safetensors",
                                               [(k, v.detach()) for k, v in named_as_hf(model)])
        (directory / "config.json").write_text(json.dumps(config, indent=2))
        imported = work / f"{model_type}-imported"
        proc = imp.run_import(cli, ["--checkpoint", directory, *data.flags(), "--log", work / "log.jsonl",
                                    "--steps", "0:0"], imported)
        if fs.check(proc.returncode == 0, f"import with yarn: exit {proc.returncode} {proc.stderr.strip()[-300:]}"):
            m = json.loads((imported / "manifest.json").read_text())["model"]
            want = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64, "beta_fast": 32.0,
                    "beta_slow": 1.0, "truncate": True}
            fs.check(m.get("rope_scaling") == want, f"import: yarn with HF's defaults written out ({m.get('rope_scaling')})")
            rc, report, err = fs.replay(cli, imported, work / "out-imported")
            if fs.check(report is not None, f"imported yarn llama replays (exit {rc}; {err.strip()[-200:]})"):
                fs.check(fs.rel_err(report["steps"][0]["loss"], loss0) <= fs.TOLERANCE,
                         f"imported yarn llama: loss {report['steps'][0]['loss']} vs reference {loss0}")


def check_refused_model_types():
    """The importer's refusal by model_type (the function `nanreplay import` calls before it reads a
    tensor; called here without a process): Llama 4 is no longer refused (it imports:
    test_import_llama4.py; gpt_oss: test_family_gpt_oss_moe.py), a Phi-2 still is."""
    from nanreplay_import import model_settle
    from nanreplay_import.outcome import BadInput
    for model_type in ("llama4", "llama4_text"):
        model_settle.refuse_model_type([(dict(LLAMA_CONFIG, model_type=model_type), "config.json")])
    try:
        model_settle.refuse_model_type([(dict(LLAMA_CONFIG, model_type="phi"), "config.json")])
        fs.check(False, "model_type phi is refused")
    except BadInput as e:
        fs.check("model_type" in str(e) and "phi" in str(e), f"model_type phi is refused by name, saying why: {e}")
    model_settle.refuse_model_type([(LLAMA_CONFIG, "config.json")])  # llama: nothing to refuse


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cli", required=True)
    ap.add_argument("--work", required=True)
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    check_yarn(args.cli, work)
    check_gpt_oss_attention(args.cli, work)
    check_import(args.cli, work)
    check_refused_model_types()
    check_preset(args.cli, work)
    fs.finish()


if __name__ == "__main__":
    main()
