## Part of capture/nanreplay_capture.py: GPT-OSS's and Llama 4's fused experts, captured live: the split into
## bundle v1's per-expert parameters, their model.moe and attention options, and the parameter list they need.
## scripts/gen_capture.py joins capture/capture_src/*.py in name order into that one file (these '##'
## lines dropped); edit here, then run it. Names used here may be defined in the other parts.
# ---------------------------------------------------------------------------
# Fused experts. transformers keeps each layer's experts as 3-D tensors multiplied from the right:
# GptOssExperts (models/gpt_oss/modeling_gpt_oss.py): gate_up_proj [E, C, 2M] with gate the EVEN columns
# and up the ODD ones (gate_up[..., ::2], gate_up[..., 1::2]), gate_up_proj_bias [E, 2M], down_proj [E, M, C],
# down_proj_bias [E, C]; Llama4TextExperts (models/llama4/modeling_llama4.py): gate_up_proj [E, C, 2M] with
# gate the FIRST half of the last axis and up the second (gate_up.chunk(2, dim=-1)), down_proj [E, M, C].
# Bundle v1 holds one nn.Linear layout per expert ([out, in]), so expert e's gate_proj.weight is a column
# selection of gate_up_proj[e], transposed: a strided view, not a block of rows. The recorder therefore
# copies each fused tensor (and its AdamW moments) WHOLE into one host buffer per step (one contiguous copy,
# as for any parameter) and takes the per-expert tensors as views of that host buffer, made contiguous only
# when a bundle is written. The split is `nanreplay import`'s (nanreplay_import/naming.py: HF_EXPERT_NAMES and
# Mapper.split_experts; copied here because this file stands alone), so a live capture and an import of the
# same run write the same keys and bit-identical values.

# {model_type: [(the live model's name, the bundle's template, split kind)]}; kind None: a plain rename.
_LLAMA4_LIVE_NAMES = [
    (r"model\.layers\.(\d+)\.feed_forward\.router\.weight", "model.layers.{0}.mlp.gate.weight", None),
    (r"model\.layers\.(\d+)\.feed_forward\.experts\.gate_up_proj",
     "model.layers.{0}.mlp.experts.{{e}}.{{part}}_proj.weight", "gate_up_halves"),
    (r"model\.layers\.(\d+)\.feed_forward\.experts\.down_proj",
     "model.layers.{0}.mlp.experts.{{e}}.down_proj.weight", "per_expert"),
    (r"model\.layers\.(\d+)\.feed_forward\.shared_expert\.(gate|up|down)_proj\.weight",
     "model.layers.{0}.mlp.shared_expert.{1}_proj.weight", None),
    (r"model\.layers\.(\d+)\.feed_forward\.(gate|up|down)_proj\.weight", "model.layers.{0}.mlp.{1}_proj.weight", None),
]
FUSED_EXPERT_NAMES = {
    "gpt_oss": [
        (r"model\.layers\.(\d+)\.mlp\.router\.(weight|bias)", "model.layers.{0}.mlp.gate.{1}", None),
        (r"model\.layers\.(\d+)\.mlp\.experts\.gate_up_proj", "model.layers.{0}.mlp.experts.{{e}}.{{part}}_proj.weight",
         "gate_up"),
        (r"model\.layers\.(\d+)\.mlp\.experts\.gate_up_proj_bias", "model.layers.{0}.mlp.experts.{{e}}.{{part}}_proj.bias",
         "gate_up"),
        (r"model\.layers\.(\d+)\.mlp\.experts\.down_proj", "model.layers.{0}.mlp.experts.{{e}}.down_proj.weight",
         "per_expert"),
        (r"model\.layers\.(\d+)\.mlp\.experts\.down_proj_bias", "model.layers.{0}.mlp.experts.{{e}}.down_proj.bias",
         "per_expert"),
    ],
    "llama4_text": _LLAMA4_LIVE_NAMES, "llama4": _LLAMA4_LIVE_NAMES,
}
_LLAMA4_TYPES = ("llama4_text", "llama4")


def expert_parts(kind, t):
    """[(part, columns of the last axis)] of an expert-stacked tensor `t` (naming.py's _EXPERT_PARTS):
    'gate_up' GPT-OSS's interleaved columns, 'gate_up_halves' Llama 4's halves, 'per_expert' all of it."""
    if kind == "gate_up":
        return [("gate", slice(0, None, 2)), ("up", slice(1, None, 2))]
    if kind == "gate_up_halves":
        half = t.shape[-1] // 2
        return [("gate", slice(0, half)), ("up", slice(half, None))]
    return [(None, slice(None))]


def expert_view(t, e, columns):
    """Expert e's part of a tensor stacked over experts: its columns of the last axis, a [in, out] matrix
    transposed to the bundle's [out, in] (a bias stays 1-D). A view of `t`, as Mapper.split_experts takes it
    before .contiguous()."""
    piece = t[e][..., columns]
    return piece.t() if piece.dim() == 2 else piece


def _check_stacked(name, kind, t, experts):
    """CaptureError when an expert-stacked parameter is not [E, in, out] (a bias [E, out]) as its family's."""
    if t.dim() not in (2, 3) or (experts is not None and t.shape[0] != experts):
        raise CaptureError(f"{name} is {list(t.shape)}: experts stacked as [E, in, out] (a bias [E, out]) with E "
                           f"the router's {experts} rows")
    if kind in ("gate_up", "gate_up_halves") and t.shape[-1] % 2:
        raise CaptureError(f"{name} is {list(t.shape)}: gate and up share its last axis ("
                           + ("interleaved" if kind == "gate_up" else "its halves") + "), an even length")


def _split_experts(named, model):
    """`named` with model.config.model_type's fused experts (FUSED_EXPERT_NAMES) as per-expert views under
    bundle v1's names, and its routers, shared experts and dense MLPs renamed. Returns (named,
    {bundle name: (the model's name, the fused parameter, expert, columns)}): the optimizer holds the fused
    parameter, whose moments are split the same way."""
    kind = _config_attr(getattr(model, "config", None) or {}, "model_type")
    table = FUSED_EXPERT_NAMES.get(kind) if isinstance(kind, str) else None
    if not table:
        return named, {}
    table = [(re.compile(p), t, k) for p, t, k in table]
    routers = {m.group(1): p for n, p in named.items() for rx, t, k in table[:1] for m in [rx.fullmatch(n)] if m}
    out, experts = {}, {}
    for name, p in named.items():
        hit = next(((m, t, k) for rx, t, k in table for m in [rx.fullmatch(name)] if m), None)
        if hit is None:
            out.setdefault(name, p)
            continue
        m, template, split = hit
        target = template.format(*m.groups())
        if split is None:
            out.setdefault(target, p)
            continue
        router = routers.get(m.group(1))
        _check_stacked(name, split, p, None if router is None else router.shape[0])
        for e in range(p.shape[0]):
            for part, columns in expert_parts(split, p):
                key = target.format(e=e, part=part)
                out[key] = expert_view(p.detach(), e, columns)
                experts[key] = (name, p, e, columns)
    return out, experts


# ---------------------------------------------------------------------------
# model.moe and the attention options of these families, read off model.config as `nanreplay import` reads
# config.json (nanreplay_import/families/: gpt_oss_moe, gpt_oss_options, llama4_moe, llama4_options;
# copied here because this file stands alone, and checked equal by tests/py/test_capture_fused_experts.py).

# GptOssConfig's defaults where a config leaves a key out; swiglu_alpha is modeling_gpt_oss.py's constant
# (GptOssExperts: self.alpha = 1.702), which no config key sets.
_GPT_OSS_DEFAULTS = {"attention_bias": True, "sliding_window": 128, "swiglu_limit": 7.0}
_GPT_OSS_ALPHA = 1.702
_GPT_OSS_MOE = {"router": "top_k_softmax", "router_bias": True, "expert_bias": True, "fused_gate_up": True,
                "expert_activation": "gpt_oss"}
# Llama4TextMoe: Llama4Router's top-k of the logits, sigmoid over them, each expert's INPUT scaled by its
# score, the shared expert a Llama4TextMLP of intermediate_size; Llama4ForCausalLM adds no router loss.
_LLAMA4_MOE = {"router": "sigmoid_top_k", "scale_expert_input": True, "fused_gate_up": True}
_LLAMA4_DEFAULTS = {"interleave_moe_layer_step": 1, "no_rope_layer_interval": 4, "use_qk_norm": True,
                    "attn_temperature_tuning": True, "floor_scale": 8192, "attn_scale": 0.1,
                    "attention_chunk_size": 8192}


def fused_family(config):
    """'gpt_oss', 'llama4' or None: the family of model.config whose experts this part reads."""
    kind = _config_attr(config, "model_type") if config is not None else _MISSING
    if kind == "gpt_oss":
        return "gpt_oss"
    return "llama4" if kind in _LLAMA4_TYPES else None


def _said(config, key, defaults):
    value = _config_attr(config, key)
    return defaults[key] if value is _MISSING or value is None else value


def _positive_int(config, key, value, low=1):
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise CaptureError(f"model.config.{key} must be an integer >= {low}, got "
                           + ("nothing (the config lacks it)" if value is _MISSING else repr(value)))
    return value


def _llama4_moe_layers(config, num_layers):
    """moe_layers, else Llama4TextConfig's range(step - 1, num_hidden_layers, step) (interleave_moe_layer_step)."""
    listed = _config_attr(config, "moe_layers")
    if listed is not _MISSING and listed is not None:
        if not isinstance(listed, (list, tuple)) or not listed or len(set(listed)) != len(listed) or any(
                isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < num_layers for i in listed):
            raise CaptureError(f"model.config.moe_layers must be distinct layer indices in [0, {num_layers}), "
                               f"got {listed!r}")
        return sorted(listed)
    step = _positive_int(config, "interleave_moe_layer_step", _said(config, "interleave_moe_layer_step",
                                                                    _LLAMA4_DEFAULTS))
    return list(range(step - 1, num_layers, step))


def family_moe(config, num_layers):
    """model.moe of a GPT-OSS or Llama 4 model.config, as `nanreplay import` writes it: the Hugging Face MoE
    reading (moe_from_config: expert count, top_k, the aux loss when output_router_logits) and the family's keys."""
    family = fused_family(config)
    try:
        moe = moe_from_config(config)
    except MoeConfigRefusal as e:
        raise CaptureError(f"model.config.{e.key}: {e.what}") from None
    if moe is None:
        raise CaptureError(f"model.config.num_local_experts: {family}'s MoE layers need their expert count")
    if family == "gpt_oss":
        limit = _said(config, "swiglu_limit", _GPT_OSS_DEFAULTS)
        if not _is_number(limit) or limit <= 0:
            raise CaptureError(f"model.config.swiglu_limit must be a finite number > 0, got {limit!r}")
        return dict(moe, **_GPT_OSS_MOE, swiglu_alpha=_GPT_OSS_ALPHA, swiglu_limit=float(limit))
    width = _positive_int(config, "intermediate_size", _config_attr(config, "intermediate_size"))
    moe = {k: v for k, v in moe.items() if k not in ("router_aux_loss_coef", "norm_topk_prob")}
    return dict(moe, **_LLAMA4_MOE, intermediate_size=width, shared_expert_intermediate_size=width,
                layers=_llama4_moe_layers(config, num_layers))


def family_options(config, num_layers):
    """{option: (value, where)} GPT-OSS's and Llama 4's configs leave implicit (families.gpt_oss_options,
    families.llama4_options), over the generic reading _options_from_config."""
    family = fused_family(config)
    said = _gpt_oss_options(config, num_layers) if family == "gpt_oss" else \
        _llama4_options(config, num_layers) if family == "llama4" else {}
    return {k: (_option_value(k, v, w), w) for k, (v, w) in said.items()}


def _gpt_oss_options(config, num_layers):
    """GptOssAttention's: sinks always, o_proj biased with attention_bias, GptOssConfig's defaults."""
    said = {"attention_sinks": (True, "model.config.model_type 'gpt_oss' (GptOssAttention always has sinks)")}
    where = "model.config.attention_bias" if _config_attr(config, "attention_bias") is not _MISSING else \
        "GptOssConfig's default attention_bias (True)"
    bias = bool(_said(config, "attention_bias", _GPT_OSS_DEFAULTS))
    said["attention_bias"] = (bias, where)
    said["o_proj_bias"] = (bias, where + " (GptOssAttention biases o_proj with it too)")
    if _config_attr(config, "sliding_window") is _MISSING:
        said["sliding_window"] = (_GPT_OSS_DEFAULTS["sliding_window"], "GptOssConfig's default sliding_window (128)")
    if _config_attr(config, "layer_types") in (_MISSING, None):
        said["layer_types"] = (["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(num_layers)],
                               "GptOssConfig's default layer_types (sliding, full, alternating)")
    return said


def _llama4_options(config, num_layers):
    """Llama4TextAttention's: interleaved rotary, NoPE layers, the L2 QK-norm, temperature tuning, chunks."""
    if _config_attr(config, "attention_bias") is True:
        raise CaptureError("model.config.attention_bias is true: Llama 4's attention has no biases in the replay")
    said = {"rope_style": ("interleaved", "modeling_llama4.py: apply_rotary_emb turns adjacent pairs")}
    rope = _config_attr(config, "no_rope_layers")
    if rope not in (_MISSING, None) and rope:
        if not isinstance(rope, (list, tuple)) or len(rope) != num_layers or any(
                isinstance(r, bool) or r not in (0, 1) for r in rope):
            raise CaptureError(f"model.config.no_rope_layers must be {num_layers} entries 1 (rotary) or 0 (NoPE), "
                               f"got {rope!r}")
        rope = [int(r) for r in rope]
    else:
        every = _positive_int(config, "no_rope_layer_interval", _said(config, "no_rope_layer_interval", _LLAMA4_DEFAULTS))
        rope = [int((i + 1) % every != 0) for i in range(num_layers)]
    said["no_rope_layers"] = (rope, "model.config.no_rope_layers")
    if _said(config, "use_qk_norm", _LLAMA4_DEFAULTS):
        said["qk_norm"] = ("l2", "model.config.use_qk_norm (Llama4TextL2Norm on the rotary layers' q and k)")
    if _said(config, "attn_temperature_tuning", _LLAMA4_DEFAULTS) and 0 in rope:
        said["attn_temperature_tuning"] = ({"floor_scale": _said(config, "floor_scale", _LLAMA4_DEFAULTS),
                                            "attn_scale": _said(config, "attn_scale", _LLAMA4_DEFAULTS)},
                                           "model.config.attn_temperature_tuning, floor_scale, attn_scale")
    chunk = _config_attr(config, "attention_chunk_size")
    chunk = _LLAMA4_DEFAULTS["attention_chunk_size"] if chunk is _MISSING else chunk
    if chunk is not None:
        said["attention_chunk_size"] = (chunk, "model.config.attention_chunk_size (the rotary layers' chunks)")
    types = _config_attr(config, "layer_types")
    chunked = ["chunked_attention" if r else "full_attention" for r in rope]
    if types not in (_MISSING, None) and list(types) != chunked:
        raise CaptureError(f"model.config.layer_types {list(types)!r} differ from Llama4TextConfig's own (chunked "
                           f"exactly on the rotary layers: {chunked!r}); capture such a run by saving a checkpoint "
                           "and running `nanreplay import` on it (docs/import.md, \"Llama 4\")")
    return said


class _ConfigWithout:
    """model.config with some attributes hidden from the generic reading (Llama 4's chunked layer_types,
    which family_options reads instead)."""

    def __init__(self, config, hidden):
        self._config, self._hidden = config, set(hidden)

    def __getattr__(self, name):
        value = _MISSING if name in self._hidden else _config_attr(self._config, name)
        if value is _MISSING:
            raise AttributeError(name)
        return value


def generic_config(config):
    """What _options_from_config reads of `config`: all of it, but Llama 4's layer_types."""
    return _ConfigWithout(config, ("layer_types",)) if fused_family(config) == "llama4" else config


# ---------------------------------------------------------------------------
# The parameters these families add to expected_parameters' list, in docs/bundle-format.md's order
# (nanreplay_import/families/parameters.py: adjust_parameters and _expert_layers, without latent attention).

_ROUTER_OR_EXPERT = re.compile(r"model\.layers\.\d+\.mlp\.(gate|experts\.\d+\.\w+_proj)\.weight")
_LAYER_MLP_KEY = re.compile(r"model\.layers\.(\d+)\.mlp\.(?:gate\.weight|experts\.\d+\.\w+_proj\.weight)")


def family_parameters(spec, cfg):
    """[(key, shape)] of expected_parameters' list for `cfg` with model.moe.layers' dense layers given back their
    gate/up/down_proj, the shared expert after each expert layer's experts, and the router's and experts'
    biases right after their weights (router_bias, expert_bias)."""
    moe = cfg.get("moe") or {}
    if not moe:
        return spec
    layers, shared = moe.get("layers"), moe.get("shared_expert_intermediate_size")
    C, ffn = cfg["hidden_size"], cfg["intermediate_size"]
    out = []
    for key, shape in spec:
        m = _LAYER_MLP_KEY.fullmatch(key)
        if m is None:
            out.append((key, shape))
            continue
        prefix = f"model.layers.{m.group(1)}.mlp."
        if layers and int(m.group(1)) not in layers:
            if key == prefix + "gate.weight":
                out += [(prefix + "gate_proj.weight", (ffn, C)), (prefix + "up_proj.weight", (ffn, C)),
                        (prefix + "down_proj.weight", (C, ffn))]
            continue
        out.append((key, shape))
        router = _ROUTER_OR_EXPERT.fullmatch(key).group(1) == "gate"
        if moe.get("router_bias") if router else moe.get("expert_bias"):
            out.append((key[:-len("weight")] + "bias", (shape[0],)))
        if shared and key == f"{prefix}experts.{moe['num_experts'] - 1}.down_proj.weight":
            out += [(prefix + "shared_expert.gate_proj.weight", (shared, C)),
                    (prefix + "shared_expert.up_proj.weight", (shared, C)),
                    (prefix + "shared_expert.down_proj.weight", (C, shared))]
    return out


# Where each family keeps its fused experts, for the refusal of a model that says the family but has none.
_FUSED_EXPERT_WHERE = {"gpt_oss": "model.layers.{i}.mlp.experts.gate_up_proj, down_proj and their biases",
                       "llama4": "model.layers.{i}.feed_forward.experts.gate_up_proj and down_proj"}


def family_model_moe(model, named, given, num_layers):
    """The manifest's model.moe of a GPT-OSS or Llama 4 model (family_moe), model_config['moe'] agreeing with
    it where it says a key; the experts' count and widths are checked against the parameters' shapes by the
    recorder's parameter list (family_parameters)."""
    family = fused_family(model.config)
    if not any(_EXPERT_PARAM.fullmatch(n) for n in named):
        raise CaptureError(f"model.config.model_type {_config_attr(model.config, 'model_type')!r} has fused experts "
                           f"({_FUSED_EXPERT_WHERE[family]}), but the model has none under those names (pass "
                           "param_names= mapping its names onto Hugging Face's)")
    moe = family_moe(model.config, num_layers)
    mine = given.get("moe")
    if "moe" in given and not isinstance(mine, dict):
        raise CaptureError(f"model_config['moe'] = {mine!r} contradicts model.config, whose experts make it {moe!r}")
    for key, value in (mine or {}).items():
        if moe.get(key) != value:
            raise CaptureError(f"model_config['moe'][{key!r}] = {value!r} contradicts model.config, which makes it "
                               f"{moe.get(key)!r}")
    if moe["top_k"] > moe["num_experts"]:
        raise CaptureError(f"model.config.num_experts_per_tok = {moe['top_k']} exceeds num_local_experts = "
                           f"{moe['num_experts']}")
    return moe


def family_intermediate_size(model, named, moe, num_layers):
    """The manifest's intermediate_size: GPT-OSS's experts' width (config.intermediate_size); Llama 4's dense
    layers' (intermediate_size_mlp, else a dense layer's gate_proj rows), its config.intermediate_size being
    the experts' width."""
    config = model.config
    if fused_family(config) == "llama4":
        width = _config_attr(config, "intermediate_size_mlp")
        dense = next((named[k] for i in range(num_layers) if i not in moe["layers"]
                      for k in [f"model.layers.{i}.mlp.gate_proj.weight"] if k in named), None)
        if isinstance(width, int) and not isinstance(width, bool) and width >= 1:
            return width
        return int(dense.shape[0]) if dense is not None else moe["intermediate_size"]
    return _positive_int(config, "intermediate_size", _config_attr(config, "intermediate_size"))


def _expert_layout(names, experts):
    """(the fused tensors, {bundle index: (index among them, expert, columns)}) of the bundle's parameters that
    are parts of fused experts (_split_experts): the slots keep one host buffer per fused tensor."""
    groups, index, layout = [], {}, {}
    for i, name in enumerate(names):
        if name in experts:
            _, p, e, columns = experts[name]
            if id(p) not in index:
                index[id(p)] = len(groups)
                groups.append(p)
            layout[i] = (index[id(p)], e, columns)
    return groups, layout
