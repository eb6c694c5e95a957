"""Writing the bundle: the checkpoint through its format's reader, the model section, the optimizer,
the steps' window, and manifest.json last."""

import math
from pathlib import Path

import torch

import nanreplay_capture as _capture

from . import families, safe_pickle
from .checkpoint_state import find_optimizer_state
from .formats import detect_format, format_module
from .formats.dcp import read_dcp
from .formats.torchtitan_numerics import logged_site_stats
from .inputs import _read_json
from .model_settle import (FLAGS_WHERE, _FLOAT_TYPES, _kind_of, _moe_config, check_parameters, expected_parameters,
                           flag_config, model_options,
                           normalize_config, required_values, settle_activation, settle_model,
                           text_model)
from .naming import HF_EXPERT_NAMES, HF_EXPERT_SPLITS, Mapper, detect_naming, refuse_quantized, strip_prefix, unstack_megatron_layers
from .optimizer import _unflatten_optimizer, aux_optimizer_state, infer_kind, merge_aux, optimizer_kind, read_optimizer, read_optimizer_general, step_entries
from .outcome import BadInput, say, warn
from .provenance import (_hyper_provenance, _provenance_entry, check_first, check_incident_window, checkpoint_counters,
                         hf_trainer_file)
from .safe_pickle import _torch_load
from .window import copy_shards, copy_windows, read_log, read_samples

IMPORT_VERSION = 1


def load_checkpoint(args):
    """(source state dict, whole loaded object, format, why, configs [(dict, where)], label): read by the
    format --format names, or the first of formats.REGISTRY that recognises the checkpoint."""
    fmt, why = args.format, "--format"
    if fmt == "auto":
        fmt, why = detect_format(args.checkpoint)
        why = f"detected: {why}"
    path = Path(args.checkpoint)
    if not path.exists():
        raise BadInput(path, "--checkpoint", "does not exist")
    configs = []
    if args.config:
        configs.append((_read_json(args.config), args.config))
    sd, obj, found, reader = format_module(fmt).read(path)
    return sd, obj, fmt, why, configs + found, reader


def settle_model_section(args, arch, naming, sd, configs):
    """The manifest's model section from the renamed tensors, flags and configs, each value with its
    source, printed (defaults loudly). Returns (mapper, model, parameters, provenance entries, score_bias):
    score_bias is DeepSeek-V3's e_score_correction_bias per MoE layer ({state.json router_score_bias key:
    [numbers]}, {} for other models), taken out of the parameters for the checkpoint step's state.json."""
    # num_heads etc. come from flags and configs; the tensors settle every shape.
    flags = flag_config(args)
    if flags:
        configs.insert(0, (flags, FLAGS_WHERE))
    required_values(arch, configs, naming, args.config or next((w for _, w in configs if w != FLAGS_WHERE),
                                                                str(args.checkpoint)))
    heads_cfg = {}
    for raw, where in configs:
        for k, (v, _) in normalize_config(raw, where).items():
            heads_cfg.setdefault(k, v)
    if naming == "megatron":
        sd = unstack_megatron_layers(sd, heads_cfg.get("num_layers"))
    if naming == "megatron" and "num_heads" in heads_cfg:
        C = next((t.shape[1] for k, t in sd.items() if k.endswith("word_embeddings.weight")), None)
        if C is not None:
            H = heads_cfg["num_heads"]
            qkv = next((t for k, t in sd.items() if k.endswith("linear_qkv.weight")), None)
            G = heads_cfg.get("num_kv_heads")
            if G is None and qkv is not None:
                G = (qkv.shape[0] // (C // H) - H) // 2  # rows = (H + 2G) * D
            heads_cfg["num_kv_heads"] = G
            heads_cfg["hidden_size"] = C
    model_type = next((raw["model_type"] for raw, _ in configs if isinstance(raw.get("model_type"), str)), None)
    mapper = Mapper(naming, {"num_heads": heads_cfg["num_heads"], "num_kv_heads": heads_cfg.get("num_kv_heads", heads_cfg["num_heads"]),
                             "hidden_size": heads_cfg.get("hidden_size", 0) or 1, "head_dim": heads_cfg.get("head_dim"),
                             "model_type": model_type})
    if mapper.hf_table and model_type in HF_EXPERT_NAMES:
        say(f"{'experts' if model_type in families.LATENT_TYPES else 'fused experts'}: {model_type}'s "
            f"{HF_EXPERT_SPLITS[model_type]}")
    elif mapper.hf_table:
        say(f"fused parameters: {model_type}'s qkv_proj / gate_up_proj split into llama's q/k/v_proj and gate/up_proj"
            if model_type == "phi3" else f"fused parameters: {model_type}'s gate_up_proj split into gate_proj and up_proj"
            + (", its post_self_attn / post_attention / post_mlp norms read as the sandwich layout's" if
               model_type == "glm4" else ""))
    if naming == "deepseek" and families.latent_config(configs)[0] is None:
        raise BadInput(args.config or args.checkpoint, "model_type", "DeepSeek's own naming needs the Hugging Face "
                       "config.json it was converted from (model_type deepseek_v3), given as --config")
    mapped = mapper.map(sd, args.checkpoint)
    mapped, mtp_tensors, mtp_layers, mtp_line = families.split_mtp_layers(mapped, configs, args.mtp_loss_scale)
    if mtp_line:
        say(mtp_line)
    model, notes = settle_model(arch, mapped, naming, configs, args)
    opts, opt_notes = model_options(naming, configs, model, args)
    model.update(opts)
    notes.update(opt_notes)
    activation, notes["activation"] = settle_activation(arch, naming, configs, args)
    moe_config = None  # the config the mixture of experts was read from
    for raw, where in configs:
        moe = _moe_config(raw, where, model["num_layers"], len(mapped)) if arch == "llama" else None
        if moe:
            model["moe"] = moe
            notes["moe"] = (_kind_of(where, args), f"{where}: " + ("num_experts" if raw.get("num_experts") else
                                                                   "num_local_experts"))
            moe_config = (raw, where)
            break
    model["moe"], family_notes = families.gpt_oss_moe(configs, model.get("moe"))
    latent, latent_notes = families.latent_attention(configs, model["num_heads"])
    if latent is not None:
        model["latent_attention"] = latent
        notes.pop("head_dim", None)  # the config's head_dim is the rotary width there (qk_rope_head_dim)
        deepseek_moe, moe_notes = families.deepseek_moe(configs, model["num_layers"])
        if deepseek_moe is not None:
            model["moe"] = deepseek_moe
            family_notes.update(moe_notes)
    family_notes.update(latent_notes)
    family_notes.update(_router_aux_loss(model.get("moe"), moe_config, family_notes, args.router_aux_loss_coef))
    mapped, score_bias = families.take_score_bias(mapped, model.get("moe"), args.checkpoint)
    if model["moe"] is None:
        del model["moe"]
    decoder_head = {k: mapped[k] for k in ("lm_head.weight", "model.embed_tokens.weight") if k in mapped}
    if model["tie_embeddings"]:
        mapped.pop("lm_head.weight", None)
        decoder_head.pop("lm_head.weight", None)
    params = check_parameters(mapped, model, args.checkpoint)
    if mtp_layers:  # DeepSeek-V3's multi-token prediction layers: replayed or left out, as --mtp-loss-scale says
        if args.mtp_loss_scale:  # an MTP block with experts: listed in model.moe.layers, its bias to state.json
            mtp_tensors, mtp_bias, mtp_moe = families.mtp_experts(mtp_tensors, mtp_layers, model, args.checkpoint)
            score_bias.update(mtp_bias)
            if mtp_moe and "moe.layers" in family_notes:
                kind, detail, _ = family_notes["moe.layers"]
                family_notes["moe.layers"] = (kind, f"{detail}; the multi-token prediction layers {mtp_moe} hold "
                                                    "experts in the checkpoint", model["moe"]["layers"])
        with_blocks = expected_parameters(dict(model, num_layers=model["num_layers"] + len(mtp_layers)))
        mtp_model, mtp_params, family_notes["mtp"] = families.mtp_section(
            mtp_tensors, mtp_layers, args.mtp_loss_scale, model, decoder_head, with_blocks, args.checkpoint)
        if mtp_model:
            model["mtp"] = mtp_model
            params += mtp_params

    say("model: " + ", ".join(f"{k} {v}" for k, v in model.items() if k != "arch") + f" ({model['arch']})")
    for key in dict.fromkeys(("num_heads", "num_kv_heads", "norm_eps", "rope_theta", "rope_style", "tie_embeddings",
                              "activation", "moe", *_capture.LLAMA_OPTION_DEFAULTS)):
        if key in notes and (key in model or key in ("rope_style", "activation")):
            kind, detail = notes[key]
            if kind == "default":  # a value no checkpoint or config gave: the user should confirm it
                warn(f"{key}: DEFAULTED, {detail}")
            else:
                say(f"  {key}: {detail}")
    provenance = {f"model.{k}": _provenance_entry(kind, detail, activation if k == "activation" else
                                                  model.get(k, "rotate_half" if k == "rope_style" else None))
                  for k, (kind, detail) in notes.items()}
    for key, (kind, detail, value) in family_notes.items():  # GPT-OSS's experts, DeepSeek-V3's latent attention
        kind = _kind_of(detail.split(": ")[0], args) if kind == "checkpoint" else kind
        (warn if kind == "default" else say)(f"  {key}: " + ("DEFAULTED, " if kind == "default" else "") + detail)
        provenance[f"model.{key}"] = _provenance_entry(kind, detail, value)
    return mapper, model, params, provenance, score_bias


def _router_aux_loss(moe, moe_config, family_notes, flag):
    """The provenance of model.moe.router_aux_loss_coef, the coefficient set in `moe` as the run added the
    router's load-balancing loss: --router-aux-loss-coef when given (0: the run added none), else the family's
    rule (Hugging Face adds it only when the config's output_router_logits is on)."""
    if flag is None:
        if moe is None or moe_config is None or "moe.router_aux_loss_coef" in family_notes:
            return {}
        return {"moe.router_aux_loss_coef": families.aux_loss_note(*moe_config, moe)}
    if moe is None:
        raise BadInput("--router-aux-loss-coef", "router_aux_loss_coef", "given, but the checkpoint has no mixture "
                                                                          "of experts")
    if not math.isfinite(flag) or flag < 0:
        raise BadInput("--router-aux-loss-coef", "router_aux_loss_coef", f"{flag!r}: a coefficient >= 0")
    moe["router_aux_loss_coef"] = flag
    said = "added the router's load-balancing loss times" if flag > 0 else "added no router load-balancing loss"
    return {"moe.router_aux_loss_coef": ("flag", f"--router-aux-loss-coef {flag!r}: the run {said}"
                                         + (f" {flag!r}" if flag > 0 else ""), flag)}


def _decays(opt):
    """Whether any param group has a nonzero weight_decay: then Adam (L2) and AdamW differ."""
    groups = opt.get("param_groups") if isinstance(opt, dict) else None
    return any(isinstance(g, dict) and float(g.get("weight_decay") or 0) != 0 for g in groups or [])


def _training_script_adamw(obj):
    """nanoGPT's and llama2.c's train.py save model_args and iter_num beside an optimizer their
    configure_optimizers always builds as torch.optim.AdamW."""
    return isinstance(obj, dict) and "model_args" in obj and "iter_num" in obj


def _optimizer_kind(opt, cls, flag, where, script_adamw=False):
    """(the manifest's kind, its provenance entry): the class flag's, checked against what the state's names
    say; else those names. exp_avg/exp_avg_sq are Adam's and AdamW's alike: AdamW is then the importer's
    default, recorded as one (and said loudly where a weight decay makes the two differ)."""
    kind = optimizer_kind(cls, where, flag) if cls is not None else None
    if kind is not None:
        entry = _provenance_entry("flag", flag, cls)
    if isinstance(opt, dict) and "state" not in opt and any(isinstance(k, str) and k.startswith("state.") for k in opt):
        opt = _unflatten_optimizer(opt)  # flatten_optimizer_state_dict's layout: its names say the class too
    if not (isinstance(opt, dict) and isinstance(opt.get("state"), dict) and isinstance(opt.get("param_groups"), list)):
        if kind is not None:
            return kind, entry
        return "adamw", _assumed_adamw(opt)  # a flattened (DCP) layout: AdamW's reader names what it lacks
    inferred, why = infer_kind(opt["state"], opt["param_groups"], where)
    if kind is None:
        say(f"optimizer class: {why}")
        if inferred == "adamw" and "default" in why:
            if script_adamw:
                return inferred, _provenance_entry("naming", "nanoGPT's and llama2.c's train.py build "
                                                   "torch.optim.AdamW (configure_optimizers)", inferred)
            return inferred, _assumed_adamw(opt)
        return inferred, _provenance_entry("checkpoint", why, inferred)
    if inferred != kind and not (kind == "adam" and inferred == "adamw"):  # Adam's names are AdamW's
        raise BadInput(where, "param_groups", f"the state's names say {why}, not {flag} {cls}")
    return kind, entry


def _assumed_adamw(opt):
    """AdamW taken for an Adam-family state that does not name its class: a default only where it matters
    (a weight decay, or param_groups this layout does not show)."""
    if isinstance(opt, dict) and isinstance(opt.get("param_groups"), list) and not _decays(opt):
        return _provenance_entry("checkpoint", "exp_avg/exp_avg_sq and no weight decay: Adam and AdamW compute "
                                 "the same update", "adamw")
    warn("optimizer class: the state does not say Adam or AdamW and a weight decay makes them differ; "
         "AdamW assumed (recorded as a default): name the class with --optimizer-class torch.optim.Adam "
         "if the run used Adam's L2 decay")
    return _provenance_entry("default", "AdamW assumed: exp_avg/exp_avg_sq are Adam's and AdamW's alike "
                             "(--optimizer-class names the class)", "adamw")


def build(args):
    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise BadInput(out, "--out", "exists and is not an empty directory")

    safe_pickle._trust_pickle = args.trust_pickle
    if args.trust_pickle:
        warn("--trust-pickle: pickles are loaded with Python's full unpickler, which runs any code a crafted file "
             "names; recorded in the manifest")
    site_stats = logged_site_stats(args.torchtitan_numerics)  # read first: a bad log is refused before the checkpoint
    source_sd, obj, fmt, why, configs, reader = load_checkpoint(args)
    say(f"format: {fmt} ({why}; {reader})")
    source_sd, configs, text_note = text_model(source_sd, configs)  # Gemma 3's multimodal: its text model
    if text_note:
        say(text_note)
    refuse_quantized(source_sd, args.checkpoint)  # before the naming: a released model's quantized weights
    naming = args.naming
    if naming == "auto":
        naming, key = detect_naming(list(source_sd))
        say(f"naming: {naming} (detected: {key})")
    else:
        say(f"naming: {naming} (--naming)")
    arch = "gpt2" if naming == "nanogpt" else "llama"
    sd = strip_prefix(source_sd, naming)

    mapper, model, params, provenance, score_bias = settle_model_section(args, arch, naming, sd, configs)
    if score_bias:  # a buffer, not a parameter: the optimizer state's names and ids do not count it
        bias_names = {k for k in source_sd
                      if families.SCORE_BIAS.fullmatch(mapper.target(next(iter(strip_prefix({k: 0}, naming)))) or "")}
        source_sd = {k: v for k, v in source_sd.items() if k not in bias_names}

    # The optimizer state: --optimizer, else HF Trainer's optimizer.pt beside the weights, else the
    # checkpoint's own when it has one.
    opt, opt_where = None, None
    optimizer_path = args.optimizer or hf_trainer_file(args.checkpoint, fmt, "optimizer.pt")
    if optimizer_path:
        p = Path(optimizer_path)
        if not p.exists():
            raise BadInput(p, "--optimizer", "does not exist")
        if p.is_dir():
            if not (p / ".metadata").is_file():
                raise BadInput(p, ".metadata", "missing: --optimizer directory is not a torch.distributed.checkpoint")
            loaded = obj if Path(args.checkpoint).resolve() == p.resolve() and fmt == "dcp" else read_dcp(p)[0]
        else:
            loaded = obj if Path(args.checkpoint).resolve() == p.resolve() and fmt == "torch" else _torch_load(p, p)
        opt, key = find_optimizer_state(loaded, p)
        if opt is None:
            raise BadInput(p, "optimizer", "no AdamW state ('state' and 'param_groups') in it")
        opt_where = f"{p}" + (f" ({key})" if key else "")
    elif obj is not None:
        opt, key = find_optimizer_state(obj, args.checkpoint)
        if opt is not None:
            opt_where = f"{args.checkpoint} ({key or 'top level'})"
    first, last = args.first, args.last
    if score_bias and last > first:
        raise BadInput("command line", "--steps", f"{first}:{last}: DeepSeek-V3's e_score_correction_bias is known "
                                                  f"only at the checkpoint's step ({first}); later steps' biases are "
                                                  f"not derived yet (import --steps {first}:{first})")
    opt_kind, opt_tensors, section = "adamw", None, None
    lr_by_optimizer = None  # two optimizers with their own learning rates (_optimizers_lrs)
    if opt is not None:
        opt_kind, provenance["optimizer.kind"] = _optimizer_kind(
            opt, args.optimizer_class, "--optimizer-class", optimizer_path or args.checkpoint,
            script_adamw=opt_where is not None and _training_script_adamw(obj) and not optimizer_path)
    elif args.optimizer_class is not None:
        optimizer_kind(args.optimizer_class, args.checkpoint)  # an unknown class is refused even without state
    if args.aux_optimizer is not None and opt is None:
        raise BadInput("command line", "--aux-optimizer", "needs the run's first optimizer state (--optimizer)")
    aux, aux_path = aux_optimizer_state(opt, optimizer_path or args.checkpoint, args)  # or a chained one's
    by_name = isinstance(opt, dict) and (opt_kind != "adamw" or aux is not None or any(
        isinstance(g, dict) and (g.get("amsgrad") or g.get("maximize")) for g in opt.get("param_groups") or []))
    if by_name:  # AdamW with amsgrad or maximize too: the manifest says them
        opt_tensors, step_values, section, every, opt_notes = read_optimizer_general(
            opt, opt_kind, optimizer_path or args.checkpoint, source_sd, mapper, model, args)
        if aux is not None:
            aux_kind, provenance["optimizer.aux_kind"] = _optimizer_kind(
                aux, args.aux_optimizer_class, "--aux-optimizer-class", aux_path)
            aux_tensors, aux_steps, _, aux_every, aux_notes = read_optimizer_general(
                aux, aux_kind, aux_path, source_sd, mapper, model, args)
            section = merge_aux(section, every, aux_kind, aux_every, aux_path)
            opt_tensors += aux_tensors
            step_values = dict(step_values, **aux_steps)
            opt_where += f" and {aux_path} ({aux_kind})"
            opt_notes += [f"second optimizer {aux_kind}: " + "; ".join(aux_notes)]
        lr_by_optimizer = _optimizers_lrs(opt, optimizer_path or args.checkpoint, aux, aux_path)
        adam_step, per_param_steps = step_entries(step_values)
        opt_tensors += per_param_steps
        moments, hyper = None, {}
        say(f"optimizer: {opt_kind} state from {opt_where}, {opt_notes[0]}; "
            f"step count {adam_step}; " + "; ".join(opt_notes[1:]))
    elif opt is not None:
        moments, adam_step, hyper, opt_notes = read_optimizer(opt, optimizer_path or args.checkpoint, source_sd,
                                                              mapper, model, args)
        say(f"optimizer: AdamW state of {len(moments or params)} parameters from {opt_where}, {opt_notes[0]}; "
            f"step count {adam_step}; " + "; ".join(opt_notes[1:]))
        provenance.update(_hyper_provenance(opt_notes, hyper))
    else:
        moments, adam_step = None, None
        hyper = {"betas": args.betas or [0.9, 0.999], "eps": args.eps or 1e-8,
                 "weight_decay": args.weight_decay if args.weight_decay is not None else 0.01}
        if last > first:
            say(f"optimizer: none given (--optimizer) and none in the checkpoint: only step {first} is replayed "
                f"(steps {first + 1}..{last} need AdamW state to roll forward)")
            last = first
    counters = checkpoint_counters(obj, args.checkpoint, fmt)
    numbering = check_first(args, counters, adam_step)
    say(f"first step: {first} (" + ("; ".join(f"{name} {n}" for name, n, _ in counters) or "no step counter in the "
        "checkpoint") + (f"; AdamW step count {adam_step}" if adam_step is not None else "")
        + f"; log numbered from {0 if numbering == 'zero' else 1})")

    log = read_log(args.log, first, last)
    if section is not None and lr_by_optimizer is not None:
        _require_aux_lr(log, first, last, args.log, lr_by_optimizer)
    check_incident_window(args, first, last, opt is not None)
    world, per_rank = args.world_size, args.micro_batch_size * args.grad_accum
    samples, sample_kind = read_samples(args.samples, first, last, world, per_rank) if args.samples else (None, None)

    out.mkdir(parents=True, exist_ok=True)
    (out / "data").mkdir()
    extra = {}
    if sample_kind == "offsets":
        shards, total, samples, extra = copy_windows(args, samples, out)
    else:
        shards, total = copy_shards(args.data, args.token_dtypes, out)
    num_samples = (total - 1) // args.seq_len
    if num_samples < 1:
        raise BadInput(args.data[0], "--data", f"{total} tokens hold no sample of seq_len {args.seq_len} + 1")
    sampler = {"kind": "explicit"}
    if args.sampler_seed is not None:
        sampler = {"kind": "randperm", "seed": args.sampler_seed, "epoch": args.epoch,
                   "epoch_start_step": args.epoch_start_step}
        per_rank_samples = num_samples // world
        steps_in_epoch = per_rank_samples // per_rank
        if first < args.epoch_start_step:
            raise BadInput("command line", "--epoch-start-step", f"{args.epoch_start_step} is after step {first}")
        if last - args.epoch_start_step >= steps_in_epoch:
            raise BadInput("command line", "--steps", f"step {last} lies past the epoch: {num_samples} samples make "
                                                      f"{steps_in_epoch} steps of {per_rank} per rank from step "
                                                      f"{args.epoch_start_step}")
    else:
        for step, rows in samples.items():
            bad = [i for r in rows for i in r if i >= num_samples]
            if bad:
                raise BadInput(args.samples, str(step), f"sample {bad[0]} is past the data's {num_samples} samples")

    steps = []
    for step in range(first, last + 1):
        rel = f"steps/{step}"
        d = out / rel
        d.mkdir(parents=True)
        if step == first:
            _capture.write_safetensors(d / "model.safetensors", params)
            if opt_tensors is not None:
                tensors = []
                for name, t in opt_tensors:
                    t = t.float() if t.dtype == torch.float64 else t
                    if t.dtype not in _FLOAT_TYPES and not name.endswith(".step"):
                        raise BadInput(optimizer_path or args.checkpoint, f"state.{name}", f"is {t.dtype}")
                    tensors.append((name, t.contiguous()))
                tensors.append(("step", torch.tensor(adam_step or 0, dtype=torch.int64)))
                _capture.write_safetensors(d / "optimizer.safetensors", tensors)
            elif opt is not None:
                tensors = []
                for key, p in params:
                    m, v = moments[key] if moments is not None else (torch.zeros_like(p), torch.zeros_like(p))
                    for which, t in (("exp_avg", m), ("exp_avg_sq", v)):
                        if tuple(t.shape) != tuple(p.shape):
                            raise BadInput(optimizer_path or args.checkpoint, f"state.{key}.{which}",
                                           f"shape {list(t.shape)} differs from the parameter's {list(p.shape)}")
                        t = t.float() if t.dtype == torch.float64 else t
                        if t.dtype not in _FLOAT_TYPES:
                            raise BadInput(optimizer_path or args.checkpoint, f"state.{key}.{which}", f"is {t.dtype}")
                        tensors.append((f"{key}.{which}", t.contiguous()))
                tensors.append(("step", torch.tensor(adam_step, dtype=torch.int64)))
                _capture.write_safetensors(d / "optimizer.safetensors", tensors)
        e = log[step]
        state = {"step": step}
        if "lr" in e:
            state["lr"] = _lr_of_groups(e, section) if "aux_lr" in e and aux is not None else e["lr"]
        if "loss_scale" in e:
            state["loss_scale"] = _capture._json_number(e["loss_scale"])
        if "skipped" in e:
            state["skipped"] = e["skipped"]
        state["logged"] = {k: _capture._json_number(e[k]) for k in ("loss", "grad_norm") if k in e}
        if score_bias and step == first:  # DeepSeek-V3's correction bias (docs/bundle-format.md, "Mixture of experts")
            state["router_score_bias"] = score_bias
        if step in site_stats:
            state["logged"]["site_stats"] = site_stats[step]
        _capture._write_json(d / "state.json", state)
        entry = {"step": step, "dir": rel}
        if samples is not None:
            entry["samples"] = samples[step]
        if step in extra:
            entry["original_offsets"] = extra[step]
        steps.append(entry)

    optimizer = section if section is not None else dict({"kind": "adamw"}, **hyper)
    if args.grad_clip is not None:
        optimizer["grad_clip"] = args.grad_clip
    manifest = {
        "format": "nanreplay.bundle",
        "version": 1,
        "model": model,
        "precision": {"compute": args.precision},
        "optimizer": optimizer,
        "data": {"shards": shards, "seq_len": args.seq_len, "micro_batch_size": args.micro_batch_size,
                 "grad_accum_steps": args.grad_accum, "world_size": world, "sampler": sampler},
        "steps": steps,
    }
    bad = next((s for s in range(first, last + 1) if not math.isfinite(log[s]["loss"])), None)
    if bad is not None:
        manifest["incident"] = {"step": bad, "symptom": f"loss={_capture._json_number(log[bad]['loss'])}"}
    manifest["import"] = {"writer": "nanreplay_import", "version": IMPORT_VERSION, "torch": torch.__version__,
                          "checkpoint": str(args.checkpoint), "format": fmt, "naming": naming,
                          "optimizer": opt_where, "config_sources": {k[len("model."):]: e["detail"] for k, e in provenance.items()
                                                                 if k.startswith("model.")}}
    manifest["provenance"] = provenance
    if args.trust_pickle:
        manifest["import"]["trust_pickle"] = True
    _capture._write_json(out / "manifest.json", manifest)
    derived = last - first
    say(f"steps: {first} to {last} (checkpoint at {first}" + (f", {derived} derived by the replay's own update)" if derived else ")"))
    say(f"data: {len(shards)} shard(s), {total} tokens, {num_samples} samples; sampler "
        + (f"randperm seed {args.sampler_seed} epoch {args.epoch} epoch_start_step {args.epoch_start_step}"
           if args.sampler_seed is not None else f"explicit ({args.samples})"))
    say("bundle written (manifest.json last)")


def _group_lrs(o, where):
    """{lr: where} of one optimizer's param groups."""
    lrs = {}
    for g in (o or {}).get("param_groups", []):
        if isinstance(g, dict) and isinstance(g.get("lr"), (int, float, torch.Tensor)):
            lrs.setdefault(float(g["lr"]), where)
    return lrs


def _optimizers_lrs(opt, where, aux, aux_where):
    """None when every param group of both optimizers has one lr (--log's lr is each step's lr of all);
    else (the first optimizer's lr, the second's) as their checkpoints hold them: two optimizers of one
    run with their own learning rates (Muon's and AdamW's), which --log's aux_lr gives per step. Groups
    of one optimizer whose lrs differ are refused: their ratio under the schedule is not guessed."""
    first, second = _group_lrs(opt, where), _group_lrs(aux, aux_where)
    for lrs in (first, second):
        if len(lrs) > 1:
            raise BadInput(list(lrs.values())[-1], "param_groups.lr",
                           f"the param groups' learning rates differ ({sorted(lrs)}); --log gives one lr per step "
                           "for all of them, and their ratio under the schedule is not guessed")
    if not first or not second or set(first) == set(second):
        return None
    return next(iter(first)), next(iter(second))


def _require_aux_lr(log, first, last, log_path, lrs):
    """Two optimizers with their own learning rates: every step the replay updates needs the second's
    lr (`aux_lr`) beside the first's (`lr`) in the log."""
    for step in range(first, last + 1):
        e = log[step]
        if "lr" in e and "aux_lr" not in e:
            raise BadInput(log_path, f"step {step}.aux_lr",
                           f"missing: the two optimizers' learning rates differ ({lrs[0]} and {lrs[1]} in their "
                           "param_groups.lr), and the second's (--aux-optimizer) is not guessed from the first's")


def _lr_of_groups(e, section):
    """state.json's lr keyed by optimizer group: the first optimizer's groups ("default" and its own)
    take the log's lr, the second's (the groups --aux-optimizer added, "aux_*") its aux_lr."""
    lr = {"default": e["lr"]}
    for g in section.get("groups", []):
        lr[g["name"]] = e["aux_lr"] if g["name"].startswith("aux_") else e["lr"]
    return lr
