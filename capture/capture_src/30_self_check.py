## Part of capture/nanreplay_capture.py: the capture self-check: a reference forward of the bundle's model, compared with the job's loss.
## scripts/gen_capture.py joins capture/capture_src/*.py in name order into that one file (these '##'
## lines dropped); edit here, then run it. Names used here may be defined in the other parts.
# ---------------------------------------------------------------------------
# The capture self-check. On the first captured step whose logged loss is finite, the bundle's model
# (a small fp32 reference of docs/bundle-format.md's model, torch only, run on the live parameters
# under no_grad) computes that step's loss on the step's real batch and compares it with the loss
# the user's model logged. A gap means the bundle would describe another model than the run's: a
# CaptureError says so, and names the likely cause (the rotary convention, norm_eps, rope_theta, the
# GELU variant, an option) when changing that one setting closes the gap, before any incident
# depends on the bundle. Recorder.self_check = False turns it off.

_SELF_CHECK_TOLERANCE = {"fp32": 1e-4, "bf16": 1e-2, "fp16": 1e-2, "fp8": 1e-2}  # the replay's own (README)
# A gap this small is the same model up to fp32 rounding. A near match within the tolerance loses to a
# variant that matches to rounding: the wrong convention can sit under 1e-4 at step 0 and drift later.
_SELF_CHECK_ROUNDING = {"fp32": 1e-6}


def _ref_yarn_inv_freq(D, theta, s, device):
    """YaRN (HF _compute_yarn_parameters): interpolated and extrapolated frequencies blended by a ramp."""
    def dim_of(rotations):
        return D * math.log(s["original_max_position_embeddings"] / (rotations * 2 * math.pi)) / (2 * math.log(theta))
    low, high = dim_of(s.get("beta_fast", 32)), dim_of(s.get("beta_slow", 1))
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, D - 1)
    high = high + 0.001 if low == high else high
    ramp = torch.clamp((torch.arange(D // 2, dtype=torch.float32, device=device) - low) / (high - low), 0, 1)
    pos = theta ** (torch.arange(0, D, 2, device=device).float() / D)
    return (1.0 / (s["factor"] * pos)) * ramp + (1.0 / pos) * (1 - ramp)


def _ref_rope_factor(scaling):
    """YaRN's attention factor on cos and sin (1 for anything else)."""
    if not scaling or scaling.get("rope_type") != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return scaling["attention_factor"]
    def get_mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0
    f, m, m_all = scaling["factor"], scaling.get("mscale"), scaling.get("mscale_all_dim")
    return get_mscale(f, m) / get_mscale(f, m_all) if m and m_all else get_mscale(f)


def _ref_inv_freq(D, theta, scaling, device):
    inv = 1.0 / (theta ** (torch.arange(0, D, 2, device=device).float() / D))
    if not scaling:
        return inv
    if scaling.get("rope_type") == "yarn":
        return _ref_yarn_inv_freq(D, theta, scaling, device)
    if scaling.get("rope_type") == "linear":  # Gemma 3's full-attention layers
        return inv / scaling["factor"]
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old / low, inv / factor, inv)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old / high) * ~(wavelen > old / low)
    return torch.where(medium, smoothed, scaled)


def _ref_rope(x, inv_freq, style):
    """x: (B, heads, T, D); rotate_half pairs (j, j + D/2), interleaved (2j, 2j + 1)."""
    T, D = x.shape[-2], x.shape[-1]
    ang = torch.outer(torch.arange(T, device=x.device).float(), inv_freq)
    if style == "interleaved":
        x1, x2, cos, sin = x[..., 0::2], x[..., 1::2], ang.cos(), ang.sin()
        return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1).flatten(-2)
    ang = torch.cat([ang, ang], -1)
    x1, x2 = x[..., :D // 2], x[..., D // 2:]
    return x * ang.cos() + torch.cat([-x2, x1], -1) * ang.sin()


def _ref_attention(q, k, v, H, G, softcap=None, window=None, sinks=None, scalar=None, chunk=None):
    B, T, _ = q.shape
    D = q.shape[-1] // H
    q = q.view(B, T, H, D).transpose(1, 2)
    k = k.reshape(B, T, G, D).transpose(1, 2).repeat_interleave(H // G, dim=1)
    v = v.reshape(B, T, G, D).transpose(1, 2).repeat_interleave(H // G, dim=1)
    s = (q @ k.transpose(-2, -1)) / math.sqrt(D) if scalar is None else (q @ k.transpose(-2, -1)) * scalar ** -0.5
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    mask = torch.triu(torch.ones(T, T, dtype=torch.bool, device=q.device), 1)
    if window is not None:
        mask |= torch.tril(torch.ones(T, T, dtype=torch.bool, device=q.device), -window)
    if chunk is not None:  # Llama 4's chunked layers: keys of the query's own chunk only
        pos = torch.arange(T, device=q.device) // chunk
        mask |= pos[:, None] != pos[None, :]
    s = s.masked_fill(mask, float("-inf"))
    if sinks is not None:  # GPT-OSS: each head's sink logit is one more key column, dropped after the softmax
        s = torch.cat([s, sinks.reshape(1, -1, 1, 1).expand(B, -1, T, -1)], -1)
    p = torch.softmax(s, -1)[..., :T]
    return (p @ v).transpose(1, 2).reshape(B, T, H * D)


def reference_loss(cfg, p, inputs, targets, gelu="tanh"):
    """The mean next-token cross-entropy bundle v1's model (manifest model section `cfg`, parameters
    `p` by bundle key) computes on inputs/targets (B, T), in fp32, with the llama options."""
    F = torch.nn.functional
    w = {k: v.detach().float() for k, v in p.items()}
    B, T = inputs.shape
    H, eps = cfg["num_heads"], cfg.get("norm_eps", 1e-5)
    if cfg["arch"] == "gpt2":
        C = cfg["hidden_size"]

        def ln(x, pre):
            return F.layer_norm(x, (C,), w[pre + ".weight"], w[pre + ".bias"], eps)

        def lin(x, pre):
            return F.linear(x, w[pre + ".weight"], w[pre + ".bias"])

        x = w["transformer.wte.weight"][inputs] + w["transformer.wpe.weight"][torch.arange(T, device=inputs.device)]
        for i in range(cfg["num_layers"]):
            pre = f"transformer.h.{i}."
            q, k, v = lin(ln(x, pre + "ln_1"), pre + "attn.c_attn").split(C, -1)
            x = x + lin(_ref_attention(q, k, v, H, H), pre + "attn.c_proj")
            x = x + lin(F.gelu(lin(ln(x, pre + "ln_2"), pre + "mlp.c_fc"), approximate=gelu), pre + "mlp.c_proj")
        logits = F.linear(ln(x, "transformer.ln_f"), w["transformer.wte.weight"])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    G, D = cfg.get("num_kv_heads", H), cfg.get("head_dim") or cfg["hidden_size"] // H
    R = int(D * cfg.get("partial_rotary_factor", 1.0))  # the rotary width (Phi, GLM: part of each head)
    style, qk_norm = cfg.get("rope_style") or "rotate_half", cfg.get("qk_norm")
    bias = bool(cfg.get("attention_bias"))
    post = cfg.get("norm_layout") == "post"  # OLMo 2: each sublayer's output normalised before the residual add
    sandwich = cfg.get("norm_layout") == "sandwich"  # Gemma 3: before and after both sublayers
    kinds = cfg.get("layer_types") or ["full_attention"] * cfg["num_layers"]
    inv = _ref_inv_freq(R, cfg.get("rope_theta", 10000.0), cfg.get("rope_scaling"), inputs.device)
    local = cfg.get("rope_local_base_freq")  # Gemma 3: sliding layers' unscaled rotary base
    inv_local = _ref_inv_freq(R, local, None, inputs.device) if local else inv
    rope_factor = _ref_rope_factor(cfg.get("rope_scaling"))
    moe, router = cfg.get("moe"), []

    def norm(x, weight):
        if cfg.get("rms_norm_offset"):  # Gemma3RMSNorm
            return x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight.float())
        return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight

    def q_or_k(h, pre, name, heads, layer):
        t = F.linear(h, w[pre + f"self_attn.{name}_proj.weight"], w[pre + f"self_attn.{name}_proj.bias"] if bias else None)
        rotary = not cfg.get("no_rope_layers") or cfg["no_rope_layers"][layer]  # Llama 4: 0 is a NoPE layer
        if not rotary:
            t = t.view(B, T, heads, D)
            tuning = cfg.get("attn_temperature_tuning")
            if tuning and name == "q":  # Llama 4's temperature tuning of NoPE layers' queries
                pos = torch.arange(T, device=t.device).float()
                t = t * (torch.log(torch.floor((pos + 1.0) / tuning["floor_scale"]) + 1.0)
                         * tuning["attn_scale"] + 1.0).view(1, T, 1, 1)
            return t.reshape(B, T, heads * D)
        if qk_norm == "head":
            t = norm(t.view(B, T, heads, D), w[pre + f"self_attn.{name}_norm.weight"]).reshape(B, T, heads * D)
        elif qk_norm == "full":
            t = norm(t, w[pre + f"self_attn.{name}_norm.weight"])
        t = t.view(B, T, heads, D).transpose(1, 2)
        sliding_local = local and kinds[layer] == "sliding_attention"
        t = torch.cat((_ref_rope(t[..., :R], inv_local if sliding_local else inv, style)
                       * (1.0 if sliding_local else rope_factor), t[..., R:]), -1)
        if qk_norm == "l2":  # Llama 4: after rotary, no weight
            t = t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + eps)
        return t.transpose(1, 2).reshape(B, T, heads * D)

    x = w["model.embed_tokens.weight"][inputs]
    if cfg.get("scale_embeddings"):  # Gemma3TextScaledWordEmbedding
        x = x * torch.tensor(cfg["hidden_size"] ** 0.5).to(x.dtype)
    act = (lambda g: F.gelu(g, approximate="tanh")) if cfg.get("hidden_act") == "gelu_pytorch_tanh" else F.silu
    for i in range(cfg["num_layers"]):
        pre = f"model.layers.{i}."
        window = cfg.get("sliding_window") if kinds[i] == "sliding_attention" or not cfg.get("layer_types") else None
        h = x if post else norm(x, w[pre + "input_layernorm.weight"])
        v = F.linear(h, w[pre + "self_attn.v_proj.weight"], w[pre + "self_attn.v_proj.bias"] if bias else None)
        # Llama 4: attention_chunk_size chunks its rotary layers (Llama4TextConfig's layer_types)
        chunk = cfg.get("attention_chunk_size") if (cfg.get("no_rope_layers") or [1] * (i + 1))[i] else None
        att = _ref_attention(q_or_k(h, pre, "q", H, i), q_or_k(h, pre, "k", G, i), v, H, G,
                             cfg.get("attn_logit_softcap"), window,
                             w[pre + "self_attn.sinks"] if cfg.get("attention_sinks") else None,
                             cfg.get("query_pre_attn_scalar"), chunk)
        out = F.linear(att, w[pre + "self_attn.o_proj.weight"],
                       w[pre + "self_attn.o_proj.bias"] if cfg.get("o_proj_bias") else None)
        x = x + (norm(out, w[pre + "post_attention_layernorm.weight"]) if post or sandwich else out)
        h = x if post else norm(x, w[pre + ("pre_feedforward" if sandwich else "post_attention") + "_layernorm.weight"])
        if moe and i in moe.get("layers", range(cfg["num_layers"])):
            out, logits = _ref_moe(moe, w, pre, h)
            router.append(logits)
        else:
            out = F.linear(act(F.linear(h, w[pre + "mlp.gate_proj.weight"])) * F.linear(h, w[pre + "mlp.up_proj.weight"]),
                           w[pre + "mlp.down_proj.weight"])
        x = x + (norm(out, w[pre + "post_feedforward_layernorm.weight"]) if post or sandwich else out)
    x = norm(x, w["model.norm.weight"])
    logits = F.linear(x, w["model.embed_tokens.weight"] if cfg.get("tie_embeddings") else w["lm_head.weight"])
    if cfg.get("final_logit_softcap") is not None:
        logits = torch.tanh(logits / cfg["final_logit_softcap"]) * cfg["final_logit_softcap"]
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    if moe and moe.get("router_aux_loss_coef"):
        loss = loss + moe["router_aux_loss_coef"] * _ref_load_balancing(router, moe["num_experts"], moe["top_k"])
    if moe and moe.get("router_z_loss_coef"):
        loss = loss + moe["router_z_loss_coef"] * torch.logsumexp(torch.cat(router), -1).pow(2).mean()
    return loss


def _ref_top_k(probs, k):
    """Top k per row, ties to the lower expert index (a stable descending sort)."""
    values, experts = torch.sort(probs, dim=-1, descending=True, stable=True)
    return values[:, :k], experts[:, :k]


def _ref_moe(moe, w, pre, h):
    """Hugging Face Qwen3MoeSparseMoeBlock.forward (modeling_qwen3_moe.py): (output, router logits);
    GPT-OSS's and Llama 4's routers: _ref_gpt_oss_moe, _ref_llama4_moe."""
    F = torch.nn.functional
    C = h.shape[-1]
    x = h.reshape(-1, C)
    if moe.get("router") == "top_k_softmax":
        return _ref_gpt_oss_moe(moe, w, pre, x, h.shape)
    if moe.get("router") == "sigmoid_top_k":
        return _ref_llama4_moe(moe, w, pre, x, h.shape)
    logits = F.linear(x, w[pre + "mlp.gate.weight"])
    weights, experts = _ref_top_k(torch.softmax(logits, -1), moe["top_k"])
    if moe.get("norm_topk_prob"):
        weights = weights / weights.sum(-1, keepdim=True)
    out = torch.zeros_like(x)
    for e in range(moe["num_experts"]):
        token, slot = torch.where(experts == e)
        if token.numel():
            ex, xe = pre + f"mlp.experts.{e}.", x[token]
            y = F.linear(F.silu(F.linear(xe, w[ex + "gate_proj.weight"])) * F.linear(xe, w[ex + "up_proj.weight"]),
                         w[ex + "down_proj.weight"])
            out.index_add_(0, token, y * weights[token, slot, None])
    return out.view(h.shape), logits


def _ref_gpt_oss_moe(moe, w, pre, x, shape):
    """GptOssMLP (modeling_gpt_oss.py): GptOssTopKRouter's softmax over the top-k biased logits, scattered over
    zeros; GptOssExperts: gate clamped above, up both ways at swiglu_limit, (up + 1) * gate * sigmoid(alpha *
    gate), biases on every projection. Returns (output, the scattered scores, which its aux loss softmaxes)."""
    F = torch.nn.functional
    logits = F.linear(x, w[pre + "mlp.gate.weight"], w[pre + "mlp.gate.bias"])
    top, experts = torch.topk(logits, moe["top_k"], dim=-1)
    scores = torch.zeros_like(logits).scatter_(1, experts, torch.softmax(top, dim=-1))
    limit, alpha = moe.get("swiglu_limit"), moe["swiglu_alpha"]
    out = torch.zeros_like(x)
    for e in range(moe["num_experts"]):
        token = torch.where((experts == e).any(-1))[0]
        if token.numel():
            ex, xe = pre + f"mlp.experts.{e}.", x[token]
            gate = F.linear(xe, w[ex + "gate_proj.weight"], w[ex + "gate_proj.bias"])
            up = F.linear(xe, w[ex + "up_proj.weight"], w[ex + "up_proj.bias"])
            if limit is not None:
                gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
            y = F.linear((up + 1) * gate * torch.sigmoid(gate * alpha), w[ex + "down_proj.weight"],
                         w[ex + "down_proj.bias"])
            out.index_add_(0, token, y * scores[token, e, None])
    return out.view(shape), scores


def _ref_llama4_moe(moe, w, pre, x, shape):
    """Llama4TextMoe (modeling_llama4.py): Llama4Router's top-k logits through a sigmoid (the others 0), each
    expert's INPUT scaled by its score, the experts' outputs summed, plus the shared expert of every token."""
    F = torch.nn.functional
    logits = F.linear(x, w[pre + "mlp.gate.weight"])
    top, experts = torch.topk(logits, moe["top_k"], dim=-1)
    scores = torch.sigmoid(torch.full_like(logits, float("-inf")).scatter_(1, experts, top))

    def mlp(h, prefix):
        return F.linear(F.silu(F.linear(h, w[prefix + "gate_proj.weight"])) * F.linear(h, w[prefix + "up_proj.weight"]),
                        w[prefix + "down_proj.weight"])
    out = mlp(x, pre + "mlp.shared_expert.")
    for e in range(moe["num_experts"]):
        out = out + mlp(x * scores[:, e, None], pre + f"mlp.experts.{e}.")
    return out.view(shape), logits


def _ref_load_balancing(router, num_experts, top_k):
    """Hugging Face's load_balancing_loss_func (modeling_qwen3_moe.py), no attention mask."""
    probs = torch.softmax(torch.cat(router), -1)
    mask = torch.nn.functional.one_hot(_ref_top_k(probs, top_k)[1], num_experts).float()
    return torch.sum(mask.mean(0) * probs.mean(0).unsqueeze(0)) * num_experts


def _self_check_variants(cfg):
    """(label, manifest change or gelu, what it would mean): single changes tried when the check fails."""
    out = []
    if cfg["arch"] == "llama":
        other = "interleaved" if (cfg.get("rope_style") or "rotate_half") == "rotate_half" else "rotate_half"
        out.append((f"rope_style={other!r}", {"rope_style": other},
                    "the rotary convention (Meta's reference llama, torchtitan and llama2.c rotate adjacent pairs: "
                    "'interleaved'; Hugging Face rotates halves: 'rotate_half')"))
        for theta in (10000.0, 500000.0, 1000000.0, 100000.0, 5000000.0):
            if theta != cfg.get("rope_theta"):
                out.append((f"rope_theta={theta!r}", {"rope_theta": theta}, "rope_theta"))
    else:
        out.append(("GELU's erf form", "none", "the GELU variant: bundle v1's gpt2 uses GELU's tanh approximation "
                    "(F.gelu(x, approximate='tanh')), nanoGPT's nn.GELU() is the erf form"))
    for eps in (1e-5, 1e-6, 1e-8, 1e-12, 0.0):
        if eps != cfg.get("norm_eps"):
            out.append((f"norm_eps={eps!r}", {"norm_eps": eps}, "norm_eps"))
    for heads in _head_count_variants(cfg):
        label = f"num_heads={heads['num_heads']}" + (f", num_kv_heads={heads['num_kv_heads']}"
                                                       if cfg["arch"] == "llama" else "")
        out.append((label, heads, "the head count (num_heads"
                    + (", and num_kv_heads with it: the k projection's rows stay the same)" if cfg["arch"] == "llama"
                       else ")")))
    return out


def _head_count_variants(cfg):
    """Other head counts the same tensors allow: half, double, and head_dim 64 or 128 (llama keeps the
    k projection's rows, num_kv_heads * head_dim, so num_kv_heads follows). None with a head_dim of
    the model's own (Gemma, Qwen3): the projections' rows are heads * head_dim, not hidden_size."""
    if cfg.get("head_dim"):
        return []
    C, H = cfg["hidden_size"], cfg["num_heads"]
    G = cfg.get("num_kv_heads") or H
    kv_rows = G * (C // H)
    out = []
    factor = cfg.get("partial_rotary_factor", 1.0)
    for h in (H // 2, H * 2, C // 64, C // 128):
        if h < 1 or h == H or C % h or any(v["num_heads"] == h for v in out):
            continue
        if int(C // h * factor) % 2:  # no rotary turns an odd width (Phi-3's 0.75 of a head of 4)
            continue
        if cfg["arch"] != "llama":
            out.append({"num_heads": h, "num_kv_heads": h})
            continue
        g, rest = divmod(kv_rows, C // h)
        if rest == 0 and g >= 1 and h % g == 0:
            out.append({"num_heads": h, "num_kv_heads": g})
    return out


def _self_check_params(recorder, slot):
    """The parameters the check computes with: the live ones (on their device, fast) when they are
    plain tensors, else (sharded or wrapped tensors) the slot's host copies, which the bundle writes."""
    live = list(recorder.params)
    if all(type(p) in (torch.Tensor, torch.nn.Parameter) for p in live):
        return dict(zip(recorder.names, live))
    if slot.event is not None:
        slot.event.synchronize()
    return dict(zip(recorder.names, slot.params))


def _self_check_batches(recorder, slot, device):
    """Per rank, the step's micro-batches as (inputs, targets) on `device`."""
    L, mbs = recorder.data["seq_len"], recorder.data["micro_batch_size"]
    dtype = recorder.source.shards[0]["dtype"]
    ranks = []
    for rows in slot.rows:
        windows = []
        for start in rows:
            raw = bytearray(recorder.source.read(start, L + 1))
            t = torch.frombuffer(raw, dtype=torch.int16 if dtype == "uint16" else torch.int32).to(torch.int64)
            windows.append(t & (0xFFFF if dtype == "uint16" else 0xFFFFFFFF))
        w = torch.stack(windows).to(device)
        ranks.append([(w[m:m + mbs, :-1], w[m:m + mbs, 1:]) for m in range(0, len(rows), mbs)])
    return ranks


def run_self_check(recorder, slot):
    """The check itself (see the section's comment). Returns {step, logged, reference, relative};
    raises CaptureError on a gap beyond the replay's tolerance."""
    cfg = recorder.model_config
    params = _self_check_params(recorder, slot)
    ranks = _self_check_batches(recorder, slot, next(iter(params.values())).device)
    logged = slot.logged["loss"]
    rank_losses = slot.logged.get("rank_losses")
    tol = _SELF_CHECK_TOLERANCE[recorder.precision]

    def losses(c, gelu="tanh"):
        with torch.no_grad():
            per_rank = [sum(float(reference_loss(c, params, x, y, gelu)) for x, y in mbs) / len(mbs) for mbs in ranks]
        return per_rank

    def gap(per_rank):
        """The smallest relative gap among the readings of the logged loss: the mean over ranks, rank 0's
        own (a job that logs its local loss), or rank 0 against rank_losses[0]."""
        cands = [(sum(per_rank) / len(per_rank), logged), (per_rank[0], logged)]
        if rank_losses:
            cands.append((per_rank[0], rank_losses[0]))
        return min((abs(a - b) / max(abs(b), 1e-12), a, b) for a, b in cands)

    def best_variant(accept):
        """The single change whose gap is smallest, if it is at most `accept`: (label, change, what, value, gap)."""
        best = None
        for label, change, what in _self_check_variants(cfg):
            per_rank_trial = losses(cfg, gelu="none") if change == "none" else losses(dict(cfg, **change))
            r, value, _ = gap(per_rank_trial)
            if r <= accept and (best is None or r < best[4]):
                best = (label, change, what, value, r)
        return best

    def blame(head, found):
        label, change, what, value, r = found
        fix = (f"pass model_config=dict({label}, ...)" if change != "none" else
               "make the model use F.gelu(x, approximate='tanh') (bundle v1 has no erf-GELU option)")
        return CaptureError(head + f"With {label} it computes {value:.7g} (gap {r:.1e}): the likely cause is {what}"
                                   f" (the recorder used {_self_check_used(cfg, label)}); {fix}")

    per_rank = losses(cfg)
    relative, reference, against = gap(per_rank)
    result = {"step": slot.step, "logged": against, "reference": reference, "relative": relative, "tolerance": tol}
    rounding = _SELF_CHECK_ROUNDING.get(recorder.precision)
    if relative <= tol:
        exact = best_variant(rounding) if rounding is not None and relative > rounding else None
        if exact is None or exact[4] * 10 > relative:
            return result
        raise blame(f"capture self-check, step {slot.step}: bundle v1's {cfg['arch']} model, as this recorder would "
                    f"write it, computes loss {reference:.7g} on the step's batch, within the replay's tolerance {tol:g} "
                    f"of the {against:.7g} your model logged but not to rounding (relative gap {relative:.2e}); a "
                    "near match drifts as the replay rolls forward. ", exact)
    head = (f"capture self-check, step {slot.step}: bundle v1's {cfg['arch']} model, as this recorder would write it, "
            f"computes loss {reference:.7g} on the step's batch, but your model logged {against:.7g} (relative gap "
            f"{relative:.2e}, the replay tolerates {tol:g}); a bundle of this run would not reproduce it. ")
    found = best_variant(tol)
    if found is not None:
        raise blame(head, found)
    raise CaptureError(head + "No single change of " + ("the rotary convention, rope_theta, norm_eps or the head count"
                       if cfg["arch"] == "llama" else "the GELU variant, norm_eps or the head count") + " explains it. Check the options your forward "
                       "applies (rope_scaling, attention_bias, qk_norm, softcaps, sliding_window: pass them in "
                       "model_config), that param_names maps every parameter to the one bundle v1 means, and that "
                       "end_step(loss=) is the step's mean over its micro-batches (and ranks). "
                       "recorder.self_check = False captures anyway.")


def _self_check_used(cfg, label):
    key = label.split("=")[0]
    if key == "num_heads":
        return f"num_heads={cfg['num_heads']}, num_kv_heads={cfg.get('num_kv_heads') or cfg['num_heads']}"
    if key in cfg or key in ("rope_style",):
        return f"{key}={cfg.get(key, 'rotate_half')!r}"
    return "GELU's tanh form"


