## Part of capture/nanreplay_capture.py: llama's model options and MoE, from a model and its transformers config.
## scripts/gen_capture.py joins capture/capture_src/*.py in name order into that one file (these '##'
## lines dropped); edit here, then run it. Names used here may be defined in the other parts.
# ---------------------------------------------------------------------------
# llama's model options (docs/bundle-format.md, "Model options"): what the model computes beyond
# plain llama. Read off a Hugging Face style `model.config` where it says, or given in model_config;
# a parameter only an option explains, with that option off, is an error: never a guess.

LLAMA_OPTION_DEFAULTS = {"rope_style": "rotate_half", "rope_scaling": None, "attention_bias": False,
                         "o_proj_bias": False, "attention_sinks": False, "no_rope_layers": None,
                         "attn_temperature_tuning": None, "attention_chunk_size": None,
                         "qk_norm": None, "attn_logit_softcap": None, "final_logit_softcap": None,
                         "sliding_window": None, "head_dim": None, "partial_rotary_factor": 1.0,
                         "attention_mask": "exclude", "norm_layout": "pre", "layer_types": None,
                         "rope_local_base_freq": None, "rms_norm_offset": False, "scale_embeddings": False,
                         "query_pre_attn_scalar": None, "hidden_act": "silu"}
# model.layer_types: each layer's attention kind, as Hugging Face's config.layer_types names them.
ATTENTION_KINDS = ("full_attention", "sliding_attention")
# Gemma 3's text model: norms before and after both sublayers, each scaling by (1 + weight) in fp32,
# embeddings times sqrt(hidden_size), a per-head QK-norm (Gemma3Attention's q_norm / k_norm).
_GEMMA3_TYPES = ("gemma3_text", "gemma3")
# Gemma 2's text model: Gemma 3's block without the QK-norm and with one rotary for every layer.
# Gemma2Config's class defaults, which a save_pretrained config.json leaves out when they hold
# (transformers writes only the values that differ from them).
_GEMMA2_DEFAULTS = {"sliding_window": 4096, "query_pre_attn_scalar": 256, "attn_logit_softcapping": 50.0,
                    "final_logit_softcapping": 30.0}
# Hugging Face's class defaults for layer_types, where a config leaves it out (Gemma3TextConfig:
# every sliding_window_pattern-th layer full, the pattern 6 by default; Olmo3Config: every 4th).
# Olmo3Config's class default sliding_window, where a config (written by hand or converted) leaves it out.
_OLMO3_DEFAULT_WINDOW = 4096
_LAYER_PATTERN_BY_MODEL_TYPE = {"gemma3_text": ("sliding_window_pattern", 6), "gemma3": ("sliding_window_pattern", 6),
                                "olmo3": (None, 4), "gemma2": (None, 2)}
# model.attention_mask: how the causal mask reaches the softmax (they differ where a masked score is not finite).
ATTENTION_MASKS = ("exclude", "additive_neg_inf", "additive_finfo_min", "fill_finfo_min")
# Every llama option key of the manifest's model object, in the order of nanreplay's option table
# (loaders/arch/llama_options.cpp): those above, then the mixture of experts (MOE_KEYS below).
# tests/test_arch_model_options.cpp checks this list against that table.
# latent_attention (DeepSeek-V3's MLA) and mtp (its multi-token prediction, as Megatron-LM trains it) are known by
# name only: their capture is not written (_model_options refuses latent_attention; nothing here writes mtp).
LLAMA_OPTION_KEYS = (*LLAMA_OPTION_DEFAULTS, "moe", "latent_attention", "mtp")
_QK_NORM_BY_MODEL_TYPE = {"qwen3": "head", "qwen3_moe": "head", "olmo2": "full", "olmo3": "full",
                          "gemma3_text": "head", "gemma3": "head"}
# OLMo 2 normalises each sublayer's output (post_attention_layernorm, post_feedforward_layernorm).
# GLM-4-0414 (Glm4DecoderLayer): norms before and after both sublayers, plain RMSNorm (renamed by the import).
_NORM_LAYOUT_BY_MODEL_TYPE = {"olmo2": "post", "olmo3": "post", "gemma3_text": "sandwich", "gemma3": "sandwich",
                              "gemma2": "sandwich", "glm4": "sandwich"}
# Qwen2Config has no attention_bias: Qwen2's q, k and v projections always carry one.
_BIAS_BY_MODEL_TYPE = {"qwen2": True}
# Models whose window applies to every other layer only, which bundle v1 cannot express.
_ALTERNATING_WINDOW_TYPES = ("cohere2",)
# Families whose whole models are mixtures of experts the recorder cannot take, refused by their config's
# model_type before anything else is read (the capture helper here, `nanreplay import` in
# nanreplay_import/model_settle.py, which reads those in naming.HF_EXPERT_NAMES): {model_type: (why, the
# attention options bundle v1 does replay)}. None today: GPT-OSS's and Llama 4's fused experts are captured
# live (25_fused_experts: copied whole each step, split per expert when a bundle is written).
UNSUPPORTED_MODEL_TYPES = {}
# Families whose blocks are not bundle v1's llama at all, refused by model_type the same way: {model_type: why}.
REFUSED_MODEL_TYPES = {
    "phi": "Phi-1/Phi-2 run attention and the MLP in parallel off one LayerNorm with biases (dense, fc1, fc2, a "
           "biased lm_head); bundle v1's llama is sequential, with RMSNorm and a SwiGLU MLP",
    "stablelm": "StableLM normalises with LayerNorm (mean subtracted, with biases); bundle v1's llama with RMSNorm",
}
# GLM (GLM-4) and GLM-4-0414 rotate adjacent pairs (rotate_half over x[0::2], x[1::2] with cos/sin
# repeat_interleave'd) on the first int(head_dim * partial_rotary_factor) dims: bundle v1's interleaved style.
_ROPE_STYLE_BY_MODEL_TYPE = {"glm": "interleaved", "glm4": "interleaved"}
# GlmConfig's / Glm4Config's class defaults (transformers' configuration_glm.py, configuration_glm4.py),
# which a config written by hand may leave out; transformers then computes with them, and so does the replay.
_GLM_DEFAULTS = {"attention_bias": True, "partial_rotary_factor": 0.5, "head_dim": 128}
GLM_CONFIG_CLASSES = {"glm": "GlmConfig", "glm4": "Glm4Config"}
# Training dropout draws masks the replay cannot reproduce: a config with any of these nonzero is refused.
_DROPOUT_KEYS = ("attention_dropout", "attn_pdrop", "resid_pdrop", "embd_pdrop", "hidden_dropout")
_LLAMA3_SCALING_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
# YaRN's optional keys and Hugging Face's _compute_yarn_parameters defaults (None: absent, as HF reads them).
_YARN_DEFAULTS = {"beta_fast": 32.0, "beta_slow": 1.0, "truncate": True}
_YARN_OPTIONAL = ("mscale", "mscale_all_dim", "attention_factor")
_SINKS_PARAM = re.compile(r"model\.layers\.\d+\.self_attn\.sinks")
_BIAS_PARAM = re.compile(r"model\.layers\.\d+\.self_attn\.[qkv]_proj\.bias")
_QK_NORM_PARAM = re.compile(r"model\.layers\.\d+\.self_attn\.[qk]_(?:norm|layernorm)\.weight")
_O_BIAS_PARAM = re.compile(r"model\.layers\.\d+\.self_attn\.o_proj\.bias")
_MISSING = object()


def glm_default(model_type, key):
    """(GlmConfig's / Glm4Config's default for `key`, where that is said) for a config of model_type
    glm / glm4 that leaves `key` out; None for other model types."""
    if not isinstance(model_type, str) or model_type not in GLM_CONFIG_CLASSES:  # hostile configs: any JSON
        return None
    value = _GLM_DEFAULTS[key]
    return value, f"{GLM_CONFIG_CLASSES[model_type]}'s default {key} ({value}), which the config leaves out"


def _is_number(x):
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _yarn_scaling(value, where, max_position_embeddings=None):
    """YaRN's rope_scaling in the manifest's form: HF's defaults written out (beta_fast 32, beta_slow 1,
    truncate True); original_max_position_embeddings, when the config leaves it out, is the config's
    max_position_embeddings, as transformers reads it. factor is taken as given (transformers >= 5)."""
    out = {"rope_type": "yarn"}
    factor = value.get("factor")
    if not _is_number(factor) or factor <= 0:
        raise CaptureError(f"{where}['factor'] must be a number > 0, got {factor!r}")
    out["factor"] = float(factor)
    original = value.get("original_max_position_embeddings", max_position_embeddings)
    if not isinstance(original, int) or isinstance(original, bool) or original < 1:
        if not (_is_number(original) and original == int(original) and original >= 1):
            raise CaptureError(f"{where}['original_max_position_embeddings'] must be an integer >= 1 (or the "
                               f"config's max_position_embeddings), got {original!r}")
    out["original_max_position_embeddings"] = int(original)
    for key, default in _YARN_DEFAULTS.items():
        v = value.get(key)
        if key == "truncate":
            if v is not None and not isinstance(v, bool):
                raise CaptureError(f"{where}['truncate'] must be True or False, got {v!r}")
            out[key] = default if v is None else v
        elif v is None or v == 0:  # HF: `get(key) or default`
            out[key] = default
        elif not _is_number(v) or v < 0:
            raise CaptureError(f"{where}[{key!r}] must be a number > 0, got {v!r}")
        else:
            out[key] = float(v)
    for key in _YARN_OPTIONAL:
        v = value.get(key)
        if v is None or (v == 0 and key != "attention_factor"):  # HF tests `mscale and mscale_all_dim`
            continue
        if not _is_number(v) or v <= 0:
            raise CaptureError(f"{where}[{key!r}] must be a number > 0, got {v!r}")
        out[key] = float(v)
    return out


def _rope_scaling(value, where, max_position_embeddings=None):
    """A rope_scaling dict (Hugging Face's, or model_config's) in the manifest's form: None, Llama
    3.1's llama3 scaling (Llama 4's with equal low and high frequency factors too) or YaRN. Any other
    scaling would be replayed wrong, so it is refused."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise CaptureError(f"{where} must be None or a dict, got {value!r}")
    kind = value.get("rope_type", value.get("type"))
    if kind == "default":  # transformers' spelling of "no scaling"
        return None
    if kind == "yarn":
        return _yarn_scaling(value, where, max_position_embeddings)
    if kind == "linear":  # HF's _compute_linear_scaling_rope_parameters: inv_freq / factor
        factor = value.get("factor")
        if not _is_number(factor) or factor <= 0:
            raise CaptureError(f"{where}['factor'] must be a number > 0, got {factor!r}")
        return {"rope_type": "linear", "factor": float(factor)}
    if kind != "llama3":
        raise CaptureError(f"{where} has rope_type {kind!r}; bundle v1 replays 'llama3' (Llama 3.1, "
                           "Llama 4), 'yarn' and 'linear' frequency scaling only")
    out = {"rope_type": "llama3"}
    for key in _LLAMA3_SCALING_KEYS:
        v = value.get(key)
        if not _is_number(v) or v <= 0:
            raise CaptureError(f"{where}[{key!r}] must be a number > 0, got {v!r}")
        out[key] = float(v)
    if out["original_max_position_embeddings"] != int(out["original_max_position_embeddings"]):
        raise CaptureError(f"{where}['original_max_position_embeddings'] must be an integer")
    out["original_max_position_embeddings"] = int(out["original_max_position_embeddings"])
    if out["high_freq_factor"] < out["low_freq_factor"]:
        raise CaptureError(f"{where}: high_freq_factor must be at least low_freq_factor "
                           "(equal: Llama 4, no blended band)")
    return out


def _option_value(key, value, where):
    """`value` of option `key` in the manifest's form, or CaptureError naming `where` it came from."""
    if key == "rope_scaling":
        return _rope_scaling(value, where)
    if key == "rope_style" and value in ("rotate_half", "interleaved"):
        return value
    if key in ("attention_bias", "o_proj_bias", "attention_sinks") and isinstance(value, bool):
        return value
    if key == "qk_norm" and (value is None or value in ("head", "full", "l2")):
        return value
    if key == "no_rope_layers" and (value is None or (isinstance(value, (list, tuple)) and value
                                                      and all(v in (0, 1) and not isinstance(v, bool) for v in value))):
        return None if value is None else [int(v) for v in value]
    if key == "attn_temperature_tuning" and (value is None or (
            isinstance(value, dict) and set(value) == {"floor_scale", "attn_scale"}
            and _is_number(value["floor_scale"]) and value["floor_scale"] > 0
            and _is_number(value["attn_scale"]) and value["attn_scale"] >= 0)):
        return None if value is None else {k: float(v) for k, v in value.items()}
    if key == "attention_chunk_size" and (value is None or (isinstance(value, int) and not isinstance(value, bool)
                                                            and value >= 1)):
        return value
    if key.endswith("_softcap") and (value is None or (_is_number(value) and value > 0)):
        return None if value is None else float(value)
    if key == "sliding_window" and (value is None or (isinstance(value, int) and not isinstance(value, bool)
                                                      and value >= 1)):
        return value
    if key == "head_dim" and (value is None or (isinstance(value, int) and not isinstance(value, bool)
                                                and value >= 1)):
        return value
    if key == "partial_rotary_factor" and _is_number(value) and 0 < value <= 1:
        return float(value)
    if key == "attention_mask" and value in ATTENTION_MASKS:
        return value
    if key == "norm_layout" and value in ("pre", "post", "sandwich"):
        return value
    if key == "layer_types" and (value is None or (isinstance(value, (list, tuple)) and value
                                                   and all(v in ATTENTION_KINDS for v in value))):
        return None if value is None else list(value)
    if key in ("rope_local_base_freq", "query_pre_attn_scalar") and (value is None or (_is_number(value) and value > 0)):
        return None if value is None else float(value)
    if key in ("rms_norm_offset", "scale_embeddings") and isinstance(value, bool):
        return value
    if key == "hidden_act" and value in ("silu", "gelu_pytorch_tanh"):
        return value
    allowed = {"rope_style": "'rotate_half' or 'interleaved'", "attention_bias": "True or False",
               "o_proj_bias": "True or False", "attention_sinks": "True or False",
               "no_rope_layers": "None or a list of 1 (rotary) and 0 (NoPE), one per layer",
               "attn_temperature_tuning": "None or {'floor_scale': > 0, 'attn_scale': >= 0}",
               "attention_chunk_size": "None or an integer >= 1",
               "head_dim": "None or an integer >= 1", "partial_rotary_factor": "a number in (0, 1]",
               "attention_mask": " or ".join(repr(m) for m in ATTENTION_MASKS), "norm_layout": "'pre', 'post' or 'sandwich'",
               "layer_types": "None or a list of 'full_attention' / 'sliding_attention', one per layer",
               "rope_local_base_freq": "None or a number > 0", "query_pre_attn_scalar": "None or a number > 0",
               "rms_norm_offset": "True or False", "scale_embeddings": "True or False",
               "hidden_act": "'silu' or 'gelu_pytorch_tanh'",
               "qk_norm": "None, 'head', 'full' or 'l2'", "attn_logit_softcap": "None or a number > 0",
               "final_logit_softcap": "None or a number > 0", "sliding_window": "None or an integer >= 1"}
    raise CaptureError(f"{where} must be {allowed[key]}, got {value!r}")


def _config_attr(config, name):
    if isinstance(config, dict):
        return config.get(name, _MISSING)
    return getattr(config, name, _MISSING)


def _refuse_model_type(config):
    """CaptureError naming model.config.model_type when bundle v1 cannot replay that family's models."""
    kind = _config_attr(config, "model_type") if config is not None else _MISSING
    if isinstance(kind, str) and kind in UNSUPPORTED_MODEL_TYPES:
        why, attention = UNSUPPORTED_MODEL_TYPES[kind]
        raise CaptureError(f"model.config.model_type {kind!r} cannot be captured: {why} (its attention, {attention}, "
                           "is: a dense model with it is captured from model_config, without this model.config)")
    if isinstance(kind, str) and kind in REFUSED_MODEL_TYPES:
        raise CaptureError(f"model.config.model_type {kind!r} cannot be captured: {REFUSED_MODEL_TYPES[kind]}")


def _config_window(config, model_type, num_layers):
    """The sliding window every layer of a Hugging Face style config uses (None: none, _MISSING:
    the config does not say). A window on only some layers cannot be replayed: CaptureError."""
    window = _config_attr(config, "sliding_window")
    if window is _MISSING and model_type == "gemma2":
        window = _GEMMA2_DEFAULTS["sliding_window"]  # the class's, which save_pretrained leaves out
    if window is _MISSING and model_type == "olmo3":
        window = _OLMO3_DEFAULT_WINDOW
    if window is _MISSING:
        return _MISSING
    mixed = ("model.config gives a sliding window to only some layers ({}) without a layer_types list saying "
             "which: give model.layer_types")
    layer_types = _config_attr(config, "layer_types")  # newer transformers spell it out per layer
    if isinstance(layer_types, (list, tuple)) and layer_types:
        # model.layer_types (_layer_options) says which layers slide: the window is theirs.
        return None if set(layer_types) == {"full_attention"} else window
    if model_type in _ALTERNATING_WINDOW_TYPES and window is not None:
        raise CaptureError(mixed.format(f"{model_type} alternates, sliding_window={window}"))
    use = _config_attr(config, "use_sliding_window")  # Qwen2: sliding_window is inert unless this is set
    if use is not _MISSING:
        if not use:
            return None
        first = _config_attr(config, "max_window_layers")  # Qwen2: layers from this index on slide
        if isinstance(first, int) and first >= num_layers:
            return None
        if isinstance(first, int) and first > 0:
            raise CaptureError(mixed.format(f"max_window_layers={first} of {num_layers}"))
    return window


def _layered_rope(config):
    """(full-attention layers' rope dict, sliding layers' or None) where a config keeps rope_parameters
    per layer type (transformers >= 5: {"full_attention": {...}, "sliding_attention": {...}}); else None."""
    params = _config_attr(config, "rope_parameters")
    if not isinstance(params, dict) or not params or not set(params) <= set(ATTENTION_KINDS):
        return None
    if not all(isinstance(v, dict) for v in params.values()):
        raise CaptureError(f"model.config.rope_parameters per layer type must hold dicts, got {params!r}")
    return params.get("full_attention", {}), params.get("sliding_attention")


def _ordinal(n):
    """2 -> '2nd', 4 -> '4th', 6 -> '6th' (how the provenance line counts layers)."""
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def _layer_options(config, model_type, num_layers, layered):
    """{option: (value, where)}: layer_types (the config's, or its class's documented pattern), Gemma 3's
    local rotary base, norms, embedding scale, score scale and activation."""
    said = {}
    types, window = _config_attr(config, "layer_types"), _config_attr(config, "sliding_window")
    if isinstance(types, (list, tuple)) and types:
        if len(types) != num_layers:
            raise CaptureError(f"model.config.layer_types has {len(types)} entries for {num_layers} layers")
        odd = [t for t in types if t not in ATTENTION_KINDS]
        if odd:
            raise CaptureError(f"model.config.layer_types has {odd[0]!r}; bundle v1 replays "
                               f"{' and '.join(map(repr, ATTENTION_KINDS))} layers")
        said["layer_types"] = (list(types), "model.config.layer_types")
    elif model_type in _LAYER_PATTERN_BY_MODEL_TYPE and (model_type == "gemma2" or window not in (_MISSING, None) or
                                                         (model_type == "olmo3" and window is _MISSING)):  # its default
        attr, default = _LAYER_PATTERN_BY_MODEL_TYPE[model_type]
        every = _config_attr(config, attr) if attr else _MISSING
        why = (f"model.config.{attr}" if every is not _MISSING else
               f"{model_type}'s class default: every {_ordinal(default)} layer full, the others sliding")
        every = default if every is _MISSING else every
        if not isinstance(every, int) or isinstance(every, bool) or every < 1:
            raise CaptureError(f"model.config.{attr} must be an integer >= 1, got {every!r}")
        said["layer_types"] = (["sliding_attention" if (i + 1) % every else "full_attention" for i in range(num_layers)],
                               why)
    for attr in ("hidden_activation", "hidden_act"):  # Gemma's name first: its hidden_act is a legacy alias
        act = _config_attr(config, attr)
        if act == "gelu_pytorch_tanh":
            said["hidden_act"] = (act, f"model.config.{attr}")
        if act is not _MISSING and act is not None:
            break
    if model_type == "olmo3":
        return dict(said, **_olmo3_local_rotary(config, said.get("layer_types", (None,))[0], layered))
    if model_type not in _GEMMA3_TYPES + ("gemma2", "gemma"):
        return said
    why = f"model.config.model_type {model_type!r}"
    said["rms_norm_offset"] = (True, why + " (Gemma's RMSNorm scales by 1 + weight, in fp32)")
    said["scale_embeddings"] = (True, why + " (Gemma scales the embeddings by sqrt(hidden_size))")
    if model_type == "gemma2":
        return dict(said, **_gemma2_options(config))
    if model_type == "gemma":  # Gemma 1: llama's pre-norm block with Gemma's norms, embeddings and GeGLU
        return dict(said, **_gemma1_activation(config, said))
    local = _MISSING
    if layered is not None and layered[1] is not None:
        sliding = layered[1]
        if sliding.get("rope_type", "default") != "default":
            raise CaptureError("model.config.rope_parameters['sliding_attention'] has rope_type "
                               f"{sliding.get('rope_type')!r}; bundle v1's sliding layers take an unscaled rotary")
        local, where = sliding.get("rope_theta", _MISSING), "model.config.rope_parameters['sliding_attention']['rope_theta']"
    else:
        local, where = _config_attr(config, "rope_local_base_freq"), "model.config.rope_local_base_freq"
    if local is _MISSING or local is None:
        local, where = 10000.0, "Gemma3TextConfig's default rope_local_base_freq (10000), which the config leaves out"
    said["rope_local_base_freq"] = (_option_value("rope_local_base_freq", local, where), where)
    scalar = _config_attr(config, "query_pre_attn_scalar")
    where = "model.config.query_pre_attn_scalar"
    if scalar is _MISSING or scalar is None:
        scalar, where = 256, "Gemma3TextConfig's default query_pre_attn_scalar (256), which the config leaves out"
    said["query_pre_attn_scalar"] = (_option_value("query_pre_attn_scalar", scalar, where), where)
    act = _config_attr(config, "hidden_activation")
    if act not in (_MISSING, None, "gelu_pytorch_tanh"):
        raise CaptureError(f"model.config.hidden_activation is {act!r}; bundle v1's Gemma 3 MLP computes "
                           "'gelu_pytorch_tanh' (GeGLU) only")
    if "hidden_act" not in said and act in (_MISSING, None):
        said["hidden_act"] = ("gelu_pytorch_tanh", "Gemma3TextConfig's default hidden_activation, which the config "
                                                   "leaves out")
    return said


def _is_scaled(rope):
    """Whether a rope dict (rope_scaling, or one layer type's rope_parameters) scales the rotary."""
    return isinstance(rope, dict) and rope.get("rope_type", rope.get("type", "default")) != "default"


def _olmo3_local_rotary(config, layer_types, layered):
    """OLMo 3's sliding layers take the unscaled rotary where its full layers' is scaled (OLMo-core, and
    transformers 4's Olmo3Model.rotary_embs: rope_type "default" for sliding_attention): bundle v1's
    rope_local_base_freq, said only where it changes the math. A config with rope_parameters per layer
    type gives the sliding layers' own; a flat rope_parameters (the transformers 5 releases that write it
    compute one rotary for every layer) says nothing here, so every layer takes its scaling."""
    if not layer_types or "sliding_attention" not in layer_types:
        return {}
    if layered is not None:
        full, sliding = layered[0], layered[1] or {"rope_type": "default"}
        if _is_scaled(sliding):
            raise CaptureError("model.config.rope_parameters['sliding_attention'] has rope_type "
                               f"{sliding.get('rope_type')!r}; bundle v1's sliding layers take an unscaled rotary")
        theta, where = sliding.get("rope_theta", full.get("rope_theta", _MISSING)), \
            "model.config.rope_parameters['sliding_attention']['rope_theta']"
        if not _is_scaled(full) and theta == full.get("rope_theta", _MISSING):
            return {}
    else:
        if _config_attr(config, "rope_parameters") is not _MISSING or not _is_scaled(_config_attr(config, "rope_scaling")):
            return {}
        theta, where = _config_attr(config, "rope_theta"), ("model.config.rope_theta (OLMo 3's sliding layers take it "
                                                            "unscaled: transformers 4's Olmo3Model.rotary_embs, OLMo-core)")
    if theta is _MISSING or theta is None:
        raise CaptureError("model.config.rope_theta is missing: OLMo 3's sliding layers take the unscaled rotary at "
                           "that base, beside the full layers' scaled one")
    return {"rope_local_base_freq": (_option_value("rope_local_base_freq", theta, where), where)}


def _gemma1_activation(config, said):
    """Gemma 1's MLP activation: GemmaMLP applies ACT2FN[config.hidden_act], gelu_pytorch_tanh by
    GemmaConfig's default. Early configs say "gelu", which transformers 4.38-4.4x computed as
    gelu_pytorch_tanh (hidden_activation unset) and later ones as the erf GELU: the run's version
    decides, and the erf form is not replayed, so it is refused rather than guessed."""
    if "hidden_act" in said:
        return {}
    for attr in ("hidden_activation", "hidden_act"):
        act = _config_attr(config, attr)
        if act not in (_MISSING, None):
            raise CaptureError(f"model.config.{attr} is {act!r}; bundle v1's Gemma MLP computes "
                               "'gelu_pytorch_tanh' (GeGLU) only (early transformers computed that for 'gelu' "
                               "too; set hidden_activation 'gelu_pytorch_tanh' in the config if the run did)")
    return {"hidden_act": ("gelu_pytorch_tanh", "GemmaConfig's default hidden_act")}


def _gemma2_options(config):
    """Gemma 2's score scale and activation, its config's or Gemma2Config's defaults (save_pretrained
    leaves out what equals them); one rotary base for every layer, so no local one."""
    said = {}
    scalar, where = _config_attr(config, "query_pre_attn_scalar"), "model.config.query_pre_attn_scalar"
    if scalar is _MISSING:
        scalar, where = _GEMMA2_DEFAULTS["query_pre_attn_scalar"], "Gemma2Config's default query_pre_attn_scalar (256)"
    said["query_pre_attn_scalar"] = (_option_value("query_pre_attn_scalar", scalar, where), where)
    act = _config_attr(config, "hidden_activation")
    if act not in (_MISSING, None, "gelu_pytorch_tanh"):
        raise CaptureError(f"model.config.hidden_activation is {act!r}; bundle v1's Gemma 2 MLP computes "
                           "'gelu_pytorch_tanh' (GeGLU) only")
    if act in (_MISSING, None):
        said["hidden_act"] = ("gelu_pytorch_tanh", "Gemma2Config's default hidden_activation")
    return said


def _options_from_config(config, num_layers):
    """{option: (value, where it was read)} for what a Hugging Face style config object says;
    options it is silent on are left out (model_config, or the default, then decides)."""
    said = {}
    model_type = _config_attr(config, "model_type")
    for attr in _DROPOUT_KEYS:
        p = _config_attr(config, attr)
        if _is_number(p) and p != 0:
            raise CaptureError(f"model.config.{attr} is {p!r}: training dropout draws random masks bundle v1 cannot "
                               "replay (its models have no dropout); a run without it has 0 here")
    if model_type in _ROPE_STYLE_BY_MODEL_TYPE:
        said["rope_style"] = (_ROPE_STYLE_BY_MODEL_TYPE[model_type],
                              f"model.config.model_type {model_type!r} (GLM's rotary turns adjacent pairs: "
                              "rotate_half over x[0::2], x[1::2], cos/sin repeat_interleave'd)")
    elif isinstance(model_type, str):  # every transformers PretrainedConfig has one
        said["rope_style"] = ("rotate_half", f"model.config (Hugging Face {model_type or 'model'}, "
                                             "whose rotary embeddings rotate halves)")
    layered = _layered_rope(config)  # transformers >= 5, Gemma 3: rope_parameters per layer type
    for attr in ("rope_scaling", "rope_parameters"):  # transformers >= 5 names it rope_parameters
        value = _config_attr(config, attr)
        if attr == "rope_parameters" and layered is not None:
            value = layered[0]  # the full-attention layers'; the sliding ones' is rope_local_base_freq below
            attr = "rope_parameters['full_attention']"
        if value is not _MISSING:
            max_positions = _config_attr(config, "max_position_embeddings")
            said["rope_scaling"] = (_rope_scaling(value, f"model.config.{attr}",
                                                  None if max_positions is _MISSING else max_positions),
                                    f"model.config.{attr}")
            break
    if model_type in _BIAS_BY_MODEL_TYPE:
        said["attention_bias"] = (_BIAS_BY_MODEL_TYPE[model_type], f"model.config.model_type {model_type!r}")
    elif _config_attr(config, "attention_bias") is not _MISSING:
        said["attention_bias"] = (bool(_config_attr(config, "attention_bias")), "model.config.attention_bias")
    elif glm_default(model_type, "attention_bias"):
        said["attention_bias"] = glm_default(model_type, "attention_bias")
    if model_type in _NORM_LAYOUT_BY_MODEL_TYPE:
        said["norm_layout"] = (_NORM_LAYOUT_BY_MODEL_TYPE[model_type], f"model.config.model_type {model_type!r}")
    if model_type in _QK_NORM_BY_MODEL_TYPE:
        said["qk_norm"] = (_QK_NORM_BY_MODEL_TYPE[model_type], f"model.config.model_type {model_type!r}")
    for key, attr in (("attn_logit_softcap", "attn_logit_softcapping"),
                      ("final_logit_softcap", "final_logit_softcapping")):  # Gemma 2's names
        value = _config_attr(config, attr)
        if value is _MISSING and model_type == "gemma2":  # Gemma2Config's default: capped unless it says null
            value = _GEMMA2_DEFAULTS[attr]
            said[key] = (_option_value(key, value, attr), f"Gemma2Config's default {attr} ({value})")
        elif value is not _MISSING:
            said[key] = (_option_value(key, value, f"model.config.{attr}"), f"model.config.{attr}")
    head_dim, where = _config_attr(config, "head_dim"), "model.config.head_dim"  # Qwen3, Gemma 3: a width of its own
    if head_dim is _MISSING and glm_default(model_type, "head_dim"):
        head_dim, where = glm_default(model_type, "head_dim")
    hidden, heads = _config_attr(config, "hidden_size"), _config_attr(config, "num_attention_heads")
    if isinstance(hidden, int) and isinstance(heads, int) and heads > 0 and head_dim == hidden / heads:
        head_dim = _MISSING  # bundle v1's own hidden_size / num_heads: nothing to say
    if head_dim is not _MISSING and head_dim is not None:
        said["head_dim"] = (_option_value("head_dim", head_dim, where), where)
    factor = _config_attr(config, "partial_rotary_factor")  # Phi, GLM, StableLM; transformers 5: in rope_parameters
    params = _config_attr(config, "rope_parameters")
    if factor is _MISSING and isinstance(params, dict) and "partial_rotary_factor" in params:
        factor = params["partial_rotary_factor"]
    where = "model.config.partial_rotary_factor"
    if factor is _MISSING and glm_default(model_type, "partial_rotary_factor"):
        factor, where = glm_default(model_type, "partial_rotary_factor")
    if factor is not _MISSING and factor is not None:
        said["partial_rotary_factor"] = (_option_value("partial_rotary_factor", factor, where), where)
    if _config_attr(config, "_attn_implementation") == "eager":  # a live model: its own code path
        said["attention_mask"] = ("additive_finfo_min", "model.config._attn_implementation 'eager' (Hugging Face's "
                                                        "eager attention adds finfo.min at masked keys)")
    said.update(_layer_options(config, model_type, num_layers, layered))
    window = _config_window(config, model_type, num_layers)
    if window is not _MISSING:
        where = "model.config.sliding_window"
        if _config_attr(config, "sliding_window") is _MISSING:
            where = f"{model_type}'s class default sliding_window ({window}), which the config leaves out"
        said["sliding_window"] = (_option_value("sliding_window", window, where), where)
    return said


def _model_options(arch, model, named, given, cfg):
    """The model options that differ from their defaults, for the manifest's model section:
    model.config's word where it has one, model_config's otherwise; the two must agree."""
    if given.get("latent_attention") is not None:
        raise CaptureError("model_config['latent_attention']: capturing DeepSeek-V3's multi-head latent attention "
                           "is not supported yet (nanreplay replays such bundles; write the manifest's "
                           "model.latent_attention and the q_a/kv_a/kv_b parameters yourself)")
    given = {k: given[k] for k in LLAMA_OPTION_DEFAULTS if k in given}
    if arch != "llama":
        on = [k for k, v in given.items() if _option_value(k, v, f"model_config[{k!r}]") != LLAMA_OPTION_DEFAULTS[k]]
        if on:
            raise CaptureError(f"model options {on} apply to arch 'llama' only")
        return {}
    config = getattr(model, "config", None)
    said = {}
    if config is not None:
        said = _options_from_config(generic_config(config), cfg["num_layers"])
        said.update(family_options(config, cfg["num_layers"]))  # GPT-OSS's, Llama 4's implicit options
    out = {}
    for key, default in LLAMA_OPTION_DEFAULTS.items():
        value, where = said.get(key, (default, None))
        if key in given:
            mine = _option_value(key, given[key], f"model_config[{key!r}]")
            if where is not None and mine != value:
                raise CaptureError(f"model_config[{key!r}] = {mine!r} contradicts {where}, which says {value!r}")
            value = mine
        if value != default:
            out[key] = value
    _check_option_parameters(named, out)
    return out


def _check_option_parameters(named, options):
    """Parameters that only an option explains must not be there with that option off: the replay
    would not read them, and the bundle would describe a different model."""
    for name in named:
        if _BIAS_PARAM.fullmatch(name) and not options.get("attention_bias"):
            raise CaptureError(f"the model has {name}, but attention_bias is off: if q, k and v carry biases "
                               "(Qwen2's layout), pass model_config=dict(attention_bias=True, ...)")
        if _QK_NORM_PARAM.fullmatch(name) and not options.get("qk_norm"):
            raise CaptureError(f"the model has {name}, but qk_norm is not set: pass model_config=dict(qk_norm="
                               "'head', ...) for a norm over each head (Qwen3) or qk_norm='full' for one over "
                               "the whole projection (OLMo 2)")
        if _O_BIAS_PARAM.fullmatch(name) and not options.get("o_proj_bias"):
            raise CaptureError(f"the model has {name}: bundle v1's attention_bias puts biases on q, k and v only, "
                               "as Qwen2 does (Hugging Face Llama's and GPT-OSS's attention_bias=True also biases "
                               "o_proj: pass model_config=dict(o_proj_bias=True, ...) as well)")
        if _SINKS_PARAM.fullmatch(name) and not options.get("attention_sinks"):
            raise CaptureError(f"the model has {name}: GPT-OSS's attention sinks, pass "
                               "model_config=dict(attention_sinks=True, ...)")


# ---------------------------------------------------------------------------
# llama's model.moe (docs/bundle-format.md): Hugging Face Qwen3-MoE's sparse MLP in every layer. Read off
# a Hugging Face MoE config (the same reading `nanreplay import` uses), or given as model_config["moe"];
# the experts' count and width are read off the parameters. What bundle v1's moe cannot express (shared
# experts, dense layers among the MoE ones) is refused.

MOE_KEYS = ("num_experts", "top_k", "intermediate_size", "norm_topk_prob", "router_aux_loss_coef",
            "router_z_loss_coef")
_EXPERT_PARAM = re.compile(r"model\.layers\.\d+\.mlp\.(?:gate\.weight|experts\.\d+\.(?:gate|up|down)_proj\.weight)")
_DENSE_MLP_PARAM = re.compile(r"model\.layers\.\d+\.mlp\.(?:gate|up|down)_proj\.weight")
_SHARED_EXPERT_PARAM = re.compile(r"model\.layers\.\d+\.mlp\.shared_expert(?:_gate)?\.")


class MoeConfigRefusal(CaptureError):
    """A Hugging Face MoE config that bundle v1's moe cannot express: `key` is the config entry."""

    def __init__(self, key, what):
        super().__init__(f"{key}: {what}")
        self.key, self.what = key, what


def moe_from_config(config):
    """model.moe from a Hugging Face MoE config (a dict or a config object; Qwen3-MoE / Qwen2-MoE /
    Mixtral names), with only the keys the config gives; None when it is dense (no expert count).
    MoeConfigRefusal for what bundle v1's moe cannot express."""
    def get(name, default=None):
        value = _config_attr(config, name)
        return default if value is _MISSING else value

    experts = get("num_experts", get("num_local_experts"))
    if not experts:
        return None
    top_k = get("num_experts_per_tok", get("moe_router_topk"))
    if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1:
        raise MoeConfigRefusal("num_experts_per_tok", f"an MoE config needs an integer top_k, got {top_k!r}")
    if get("mlp_only_layers"):
        raise MoeConfigRefusal("mlp_only_layers", "some layers dense: bundle v1's moe replaces every layer's MLP")
    if get("decoder_sparse_step", 1) != 1:
        raise MoeConfigRefusal("decoder_sparse_step", "MoE on only some layers: bundle v1's moe replaces every layer's MLP")
    if get("shared_expert_intermediate_size"):
        raise MoeConfigRefusal("shared_expert_intermediate_size", "shared experts are not part of bundle v1's moe")
    moe = {"num_experts": int(experts), "top_k": int(top_k)}
    if get("moe_intermediate_size"):
        moe["intermediate_size"] = int(get("moe_intermediate_size"))
    if _config_attr(config, "norm_topk_prob") is not _MISSING:
        moe["norm_topk_prob"] = bool(get("norm_topk_prob"))
    elif get("model_type") == "mixtral":
        moe["norm_topk_prob"] = True  # Mixtral always renormalises its top-k
    if get("output_router_logits") and get("router_aux_loss_coef"):
        moe["router_aux_loss_coef"] = float(get("router_aux_loss_coef"))
    return moe


def _moe_value(value, where):
    """A given moe (model_config["moe"]): None, or a dict of MOE_KEYS with valid values (the keys given)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise CaptureError(f"{where} must be None or a dict of {list(MOE_KEYS)}, got {value!r}")
    unknown = sorted(set(value) - set(MOE_KEYS))
    if unknown:
        raise CaptureError(f"{where} has {unknown}: bundle v1's moe knows {list(MOE_KEYS)} only (shared experts "
                           "and other routers are not part of it)")
    out = {}
    for key, v in value.items():
        if key in ("num_experts", "top_k", "intermediate_size"):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise CaptureError(f"{where}[{key!r}] must be an integer >= 1, got {v!r}")
            out[key] = v
        elif key == "norm_topk_prob":
            if not isinstance(v, bool):
                raise CaptureError(f"{where}['norm_topk_prob'] must be True or False, got {v!r}")
            out[key] = v
        else:
            if not _is_number(v) or v < 0:
                raise CaptureError(f"{where}[{key!r}] must be a number >= 0, got {v!r}")
            out[key] = float(v)
    return out


def _model_moe(model, named, given, num_layers, hidden):
    """The manifest's model.moe (every key written) or None for a dense model: model.config's word
    where it says, model_config["moe"]'s otherwise (keys both give must agree), the experts' count and
    width from the parameters."""
    shared = sorted(n for n in named if _SHARED_EXPERT_PARAM.match(n))
    if shared:
        raise CaptureError(f"the model has {shared[0]}: shared experts (Qwen2-MoE's) are not part of bundle v1's "
                           "moe, which routes every token to its top_k experts only")
    experts = sorted(n for n in named if _EXPERT_PARAM.fullmatch(n))
    config = getattr(model, "config", None)
    said = None
    if config is not None:
        try:
            said = moe_from_config(config)
        except MoeConfigRefusal as e:
            raise CaptureError(f"model.config.{e.key}: {e.what}") from None
    if "moe" in given:
        mine = _moe_value(given["moe"], "model_config['moe']")
        if mine is None and said is not None:
            raise CaptureError(f"model_config['moe'] = None contradicts model.config, which says {said!r}")
        for key in (mine or {}):
            if said is not None and key in said and said[key] != mine[key]:
                raise CaptureError(f"model_config['moe'][{key!r}] = {mine[key]!r} contradicts model.config, which "
                                   f"says {said[key]!r}")
        moe = None if mine is None else dict(said or {}, **mine)
    else:
        moe = said
    if moe is None:
        if experts:
            raise CaptureError(f"the model has {experts[0]} (a mixture of experts), but moe is not set: pass "
                               "model_config=dict(moe=dict(num_experts=..., top_k=..., norm_topk_prob=..., "
                               "router_aux_loss_coef=..., router_z_loss_coef=...)), or a Hugging Face MoE "
                               "model.config")
        return None
    router = named.get("model.layers.0.mlp.gate.weight")
    if router is None or router.dim() != 2:
        raise CaptureError("moe is set, but the model has no router model.layers.0.mlp.gate.weight (bundle v1's moe "
                           "is Hugging Face Qwen3-MoE's layout: mlp.gate, mlp.experts.{e}.gate_proj/up_proj/down_proj)")
    E = int(router.shape[0])
    if moe.get("num_experts", E) != E:
        raise CaptureError(f"moe num_experts = {moe['num_experts']} but model.layers.0.mlp.gate.weight has {E} rows")
    if "top_k" not in moe:
        raise CaptureError("moe needs 'top_k' (the experts each token is routed to): pass model_config=dict("
                           "moe=dict(top_k=..., ...))")
    if moe["top_k"] > E:
        raise CaptureError(f"moe top_k = {moe['top_k']} exceeds num_experts = {E}")
    first = named.get("model.layers.0.mlp.experts.0.gate_proj.weight")
    if first is None:
        raise CaptureError("moe is set, but the model has no model.layers.0.mlp.experts.0.gate_proj.weight")
    width = int(first.shape[0])
    if moe.get("intermediate_size", width) != width:
        raise CaptureError(f"moe intermediate_size = {moe['intermediate_size']} but the experts' gate_proj has "
                           f"{width} rows")
    for i in range(num_layers):
        dense = [n for n in named if _DENSE_MLP_PARAM.fullmatch(n) and n.startswith(f"model.layers.{i}.")]
        if dense or f"model.layers.{i}.mlp.gate.weight" not in named:
            raise CaptureError(f"layer {i} has a dense MLP ({dense[0] if dense else 'no mlp.gate.weight'}) among MoE "
                               "layers: bundle v1's moe replaces every layer's MLP (dense layers mixed in, as "
                               "mlp_only_layers or decoder_sparse_step make them, are not supported)")
    return {"num_experts": E, "top_k": moe["top_k"], "intermediate_size": width,
            "norm_topk_prob": bool(moe.get("norm_topk_prob", False)),
            "router_aux_loss_coef": float(moe.get("router_aux_loss_coef", 0.0)),
            "router_z_loss_coef": float(moe.get("router_z_loss_coef", 0.0))}


def _option_needing(name, cfg):
    """For error messages: the option that asks for parameter `name`, when one does."""
    if _EXPERT_PARAM.fullmatch(name):
        return f", with moe={cfg.get('moe')!r}"
    if _BIAS_PARAM.fullmatch(name):
        return ", with attention_bias=True"
    if _QK_NORM_PARAM.fullmatch(name):
        return f", with qk_norm={cfg.get('qk_norm')!r}"
    if cfg.get("head_dim") and re.fullmatch(r"model\.layers\.\d+\.self_attn\.[qkvo]_proj\.weight", name):
        return f", with head_dim={cfg['head_dim']!r}"
    if cfg.get("norm_layout") == "post" and re.fullmatch(r"model\.layers\.\d+\.post_\w+layernorm\.weight", name):
        return ", with norm_layout='post' (OLMo 2's norms of each sublayer's output)"
    return ""


