"""DeepSeek-V3's multi-token prediction (model.mtp) against eager PyTorch written from Megatron-LM's
megatron/core/transformer/multi_token_prediction.py, over the DeepSeek-V3 reference of test_family_deepseek_mla.py
(transformers' modeling_deepseek_v3.py).

The reference transcribes, for one depth (D = 1): roll_tensor (torch.roll(t, -1, -1), the position rolled in set
to 0) of the input ids in MultiTokenPredictionLayer._get_embeddings and of the labels and loss mask in
process_mtp_loss; _concat_embeddings: eh_proj(cat((enorm(embedding), hnorm(hidden)), -1)) with the model's own
embedding and the decoder's output after its final norm as GPTModel hands it over; the MTP block (a dense
DeepseekV3DecoderLayer here); _postprocess's final_layernorm (shared_head.norm in the Hugging Face checkpoint);
the model's own output head; the depth's loss sum(loss_mask * cross_entropy) / max(sum(loss_mask), 1); and
MTPLossAutoScaler: the LM loss's value unchanged, its gradient plus mtp_loss_scaling_factor / D times the depths'.

1. A tiny DeepSeek-V3 checkpoint (2 decoder layers, latent attention, YaRN) with one MTP layer at model.layers.2
   (enorm, hnorm, eh_proj, shared_head.norm, a decoder block, and the per-depth copies of embed_tokens and
   shared_head.head equal to the model's) through `nanreplay import --mtp-loss-scale 0.3`: the manifest has
   model.mtp {num_layers 1, loss_scale 0.3}; the replay's loss (the LM loss), grad norm (LM + MTP) and
   steps[].mtp_loss within 1e-5 relative of the reference; report.json's multi_token_prediction says replayed.
   The same with two depths written as a bundle (depth 2 reads depth 1's output, the scale divided by D = 2).
   The same in bf16 (the reference rounding where docs/bundle-format.md "Multi-token prediction" says the
   replay does): within 1e-4, the reference departing from its fp32 gradient norm.
2. The check fails when a mechanism is changed: the reference with the concat order reversed (hidden first), with
   the input ids not rolled, with the MTP term left out, with Megatron's default scale 0.1 in place of the run's
   0.3, and (two depths) the scale not divided by D: each moves the grad norm or the depth's loss by more than
   1e-4 from the replay.
3. The same checkpoint imported with --mtp-loss-scale 0 against a log of the run with MTP: the report says the
   MTP layers were left out, and its BUNDLE_DOES_NOT_REPRODUCE names them as the likely cause.
4. A copy of embed_tokens that differs from the model's is refused by key (exit 2).
5. manifest.json's model.mtp refused by file and key: loss_scale -0.3, an unknown key, and num_layers 2 over a
   checkpoint holding one MTP layer (the missing layer's enorm named).
   (MuonClip and score_bias_update with MTP blocks: test_family_deepseek_mtp_optim.py.)
6. An MTP block with experts (DeepSeek-V3's released MTP layer, DeepseekV3MoE from test_family_deepseek_moe.py):
   a checkpoint with layer 0 dense and layer 1 and the MTP layer 2 MoE (first_k_dense_replace 1), each with its
   e_score_correction_bias, imported with --mtp-loss-scale 0.3: model.moe.layers [1, 2], both biases in
   state.json and in report.json's steps[].router_score_bias; loss, grad norm and mtp_loss within 1e-5. The check
   fails with the MTP block's bias ignored in the reference, and the replay moves with it zeroed in state.json
   (each > 1e-4); refused by name: the step without the MTP layer's bias, moe.layers past the MTP block,
   router_aux_loss_coef with MTP experts. `nanreplay minimize` of it with an inf planted in
   layer 1 keeps every layer, so model.mtp, the MTP layer in moe.layers and its bias; the result replays.
7. The MTP depth's probe sites (docs/probe-sites.md "Multi-token prediction"): the clean bundle of 1's trace holds
   layers.2.mtp.embed, mtp.enorm, mtp.hnorm, mtp.eh_proj, the block's sites, mtp.final_norm, mtp.logits and
   mtp.loss, forward after `loss` in that order and backward, mtp.loss's value being steps[].mtp_loss exactly.
   An inf planted in the MTP layer's eh_proj weight is report.json's first_nonfinite at the forward site
   layers.2.mtp.eh_proj (not at a backward final_norm); one in its attention's o_proj at layers.2.attn.out; each
   origin's origin_tokens names the sample's token one position on (what depth 1 read there).
8. Streamed and across processes (docs/performance.md): the two-depth bundle of 1 with two data-parallel ranks
   and the MoE MTP bundle of 6, each replayed `--stream`, `--nproc 2 --split layers` (and streamed) and, with
   ranks, `--nproc 2 --split ranks` (and streamed), give the one-process in-memory replay's report.json
   (steps[].mtp_loss included) and trace.h5 bit for bit, with the same exit status.

    /usr/bin/python3 tests/py/test_family_deepseek_mtp.py --cli build/nanreplay --work DIR
"""
import argparse
import contextlib
import io
import json
import shutil
import subprocess
import sys
from pathlib import Path

import h5py
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import family_support as fs  # noqa: E402
import import_support as imp  # noqa: E402
import reference_model  # noqa: E402  (safetensors only)
import replay_compare as rc  # noqa: E402  (report.json and trace.h5 compared bit for bit)
import test_family_deepseek_mla as mla  # noqa: E402  (the DeepSeek-V3 reference, transformers' modeling)
import test_family_deepseek_moe as dsmoe  # noqa: E402  (DeepseekV3MoE and its router, the same file's)

SCALE = 0.3  # the run's mtp_loss_scaling_factor
# What a perturbed reference changes (check 2); empty: multi_token_prediction.py as written.
PERTURB = set()


def roll_tensor(t):
    """roll_tensor(t, shifts=-1, dims=-1) with no context parallelism."""
    rolled = torch.roll(t, shifts=-1, dims=-1)
    rolled.select(-1, -1).fill_(0)
    return rolled


class MultiTokenPredictionLayer(torch.nn.Module):
    """One depth: enorm, hnorm, eh_proj (Linear(2C, C), no bias), the block, final_layernorm."""

    def __init__(self, cfg):
        super().__init__()
        C, eps = cfg["hidden_size"], cfg["rms_norm_eps"]
        self.enorm = mla.DeepseekV3RMSNorm(C, eps=eps)
        self.hnorm = mla.DeepseekV3RMSNorm(C, eps=eps)
        self.eh_proj = fs.Linear(2 * C, C, bias=False)
        self.transformer_layer = mla.DeepseekV3DecoderLayer(cfg)
        self.final_layernorm = mla.DeepseekV3RMSNorm(C, eps=eps)


class DeepseekV3WithMtp(fs.Rounding, torch.nn.Module):
    def __init__(self, cfg, depths):
        super().__init__()
        self.main = mla.DeepseekV3ForCausalLM(mla.LAYERS, cfg)
        self.mtp = torch.nn.ModuleList([MultiTokenPredictionLayer(cfg) for _ in range(depths)])

    def forward(self, input_ids, labels):
        """(LM loss, the MTP term its gradient gains, each depth's loss)."""
        hidden, mask, rotary = self.main.decoder(input_ids)
        lm_loss = fs.cross_entropy(self.rnd(self.main.lm_head(hidden)), labels)  # logits
        ids, mtp_labels, loss_mask = input_ids, labels.clone(), torch.ones_like(labels)
        depth_losses = []
        for layer in self.mtp:
            if "no_roll" not in PERTURB:
                ids = roll_tensor(ids)  # _get_embeddings
            parts = (layer.enorm(self.rnd(self.main.embed_tokens(ids))), layer.hnorm(hidden))  # _concat_embeddings
            if "hidden_first" in PERTURB:
                parts = parts[::-1]
            x = self.rnd(layer.eh_proj(torch.cat(parts, -1)))
            hidden = layer.final_layernorm(layer.transformer_layer(x, mask, rotary))  # _postprocess
            logits = self.rnd(self.main.lm_head(hidden))  # the output layer shared with the model
            mtp_labels, loss_mask = roll_tensor(mtp_labels), roll_tensor(loss_mask)  # process_mtp_loss
            per_token = F.cross_entropy(logits.reshape(-1, logits.size(-1)), mtp_labels.reshape(-1), reduction="none")
            depth_losses.append((loss_mask.reshape(-1) * per_token).sum() / loss_mask.sum().clamp(min=1))
        scale = 0.0 if "no_mtp" in PERTURB else (0.1 if "default_scale" in PERTURB else SCALE)
        depths = 1 if "scale_not_divided" in PERTURB else len(self.mtp)
        mtp = scale / depths * sum(depth_losses)  # mtp_loss_scaling_factor / mtp_num_layers
        return lm_loss, mtp, depth_losses


def random_model(depths=1):
    torch.manual_seed(0)
    model = DeepseekV3WithMtp(mla.CONFIG, depths)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.3 * torch.randn(p.shape) if "norm" in name else 0.4 * torch.randn(p.shape))
    return model


def reference(model, inputs, targets):
    """(LM loss, grad norm of LM + MTP over every parameter, each depth's loss)."""
    lm_loss, mtp, depths = model(inputs, targets)
    _, norm = fs.loss_and_grad_norm(lm_loss + mtp, list(model.parameters()))
    return float(lm_loss), norm, [float(d) for d in depths]


def checkpoint_tensors(model, head_copy=None):
    """The Hugging Face checkpoint: the decoder's tensors, then MTP layer model.layers.{LAYERS} as DeepSeek-V3's
    checkpoints hold it, with its copies of embed_tokens and shared_head.head."""
    prefix = f"model.layers.{mla.LAYERS}."
    depth = model.mtp[0]
    tensors = [(k, v.detach()) for k, v in mla.named(model.main)]
    tensors += [(prefix + n, getattr(depth, n.split(".")[0]).weight.detach()) for n in
                ("enorm.weight", "hnorm.weight", "eh_proj.weight")]
    tensors += [(prefix + k, v.detach()) for k, v in depth.transformer_layer.named_parameters()]
    tensors += [(prefix + "shared_head.norm.weight", depth.final_layernorm.weight.detach()),
                (prefix + "embed_tokens.weight", model.main.embed_tokens.weight.detach().clone()
                 if head_copy is None else head_copy),
                (prefix + "shared_head.head.weight", model.main.lm_head.weight.detach().clone())]
    return tensors


def write_checkpoint(hf, tensors):
    hf.mkdir(parents=True, exist_ok=True)
    fs.nanreplay_capture.write_safetensors(hf / "model.safetensors", tensors)
    (hf / "config.json").write_text(json.dumps(mla.hf_config(mla.CONFIG, first_k_dense_replace=mla.LAYERS + 1)))


def check_replayed(cli, work, model, data, flags):
    """1 and 2: imported with --mtp-loss-scale 0.3, replayed, against the reference and its perturbations."""
    inputs, targets = data.batch(data.rows(0))
    loss, norm, depths = reference(model, inputs, targets)
    (work / "log.jsonl").write_text(json.dumps({"step": 0, "loss": loss, "grad_norm": norm, "lr": 1e-3}) + "\n")
    proc = imp.run_import(cli, [*flags, "--log", work / "log.jsonl", "--mtp-loss-scale", SCALE], work / "bundle")
    if not fs.check(proc.returncode == 0, f"import with --mtp-loss-scale {SCALE}: exit 0 ({proc.stderr.strip()[-300:]})"):
        return
    m = json.loads((work / "bundle" / "manifest.json").read_text())
    fs.check(m["model"].get("mtp") == {"num_layers": 1, "loss_scale": SCALE}
             and m["provenance"].get("model.mtp", {}).get("from") == "flag",
             f"the manifest has model.mtp and its provenance ({m['model'].get('mtp')}, {m['provenance'].get('model.mtp')})")
    rproc, report = imp.run_replay(cli, work / "bundle", work / "out")
    if not fs.check(report is not None, f"the MTP bundle replays ({rproc.stderr.strip()[-300:]})"):
        return
    fs.compare_step(report, loss, norm, "DeepSeek-V3 with one MTP layer, scale 0.3 (LM loss; LM + MTP gradients)")
    step = report["steps"][0]
    replayed_depths = step.get("mtp_loss", [])
    fs.check(len(replayed_depths) == 1 and fs.rel_err(replayed_depths[0], depths[0]) <= fs.TOLERANCES["fp32"],
             f"steps[].mtp_loss {replayed_depths} vs the reference's depth loss {depths}")
    fs.check(report.get("multi_token_prediction") == {"replayed": True, "num_layers": 1, "loss_scale": SCALE,
                                                      "detail": m["provenance"]["model.mtp"]["detail"]},
             f"report.json says the MTP loss was replayed ({report.get('multi_token_prediction')})")
    for perturbation, what in (("hidden_first", "the concat order reversed (hidden first)"),
                               ("no_roll", "the input ids not rolled"),
                               ("no_mtp", "the MTP term left out"),
                               ("default_scale", "Megatron's default scale 0.1 in place of 0.3")):
        PERTURB.clear()
        PERTURB.add(perturbation)
        _, other_norm, other_depths = reference(model, inputs, targets)
        moved = max(fs.rel_err(step["grad_norm"], other_norm), fs.rel_err(replayed_depths[0], other_depths[0]))
        fs.check(moved > 1e-4, f"reference with {what}: departs from the replay by {moved:.2e} "
                               f"(grad norm {other_norm!r} vs {step['grad_norm']!r})")
    PERTURB.clear()


MTP_LAYER_SITES = [f"layers.{mla.LAYERS}.{site}" for site in ("mtp.embed", "mtp.enorm", "mtp.hnorm", "mtp.eh_proj")]
MTP_HEAD_SITES = [f"layers.{mla.LAYERS}.{site}" for site in ("mtp.final_norm", "mtp.logits", "mtp.loss")]


def forward_site_order(trace):
    """The trace's forward site names in execution order (once each), the names with backward records, and
    mtp.loss's forward value."""
    def text(v):
        return v.decode() if isinstance(v, bytes) else str(v)

    with h5py.File(trace, "r") as f:
        probes = f["probes"]
        rows = zip(probes["order"][()], probes["phase"][()], probes["site"][()], probes["mean"][()])
        named = [(int(o), text(p), text(n), float(m)) for o, p, n, m in rows]
    forward = sorted({(o, n) for o, p, n, _ in named if p == "forward"})
    backward = {n for _, p, n, _ in named if p == "backward"}
    loss = [m for _, p, n, m in named if p == "forward" and n == MTP_HEAD_SITES[-1]]
    return [n for _, n in forward], backward, loss


def plant_inf(bundle, copy, key):
    """A copy of `bundle` whose step-0 checkpoint holds one inf in `key`."""
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(bundle, copy)
    weights_file = copy / "steps" / "0" / "model.safetensors"
    weights = reference_model.read_safetensors(weights_file)
    planted = weights[key].clone()
    planted.view(-1)[0] = float("inf")
    weights[key] = planted
    fs.nanreplay_capture.write_safetensors(weights_file, list(weights.items()))
    return copy


def check_mtp_sites(cli, work):
    """7. The MTP depth's sites in the trace, and an inf planted in the MTP layer named where it starts."""
    out = work / "out"
    if not fs.check((out / "trace.h5").exists(), "check 1's replay left its trace"):
        return
    report = json.loads((out / "report.json").read_text())
    names, backward, loss = forward_site_order(out / "trace.h5")
    block = [n for n in names if n.startswith(f"layers.{mla.LAYERS}.")]
    after_loss = names[names.index("loss") + 1:] if "loss" in names else []
    fs.check(block[:4] == MTP_LAYER_SITES and block[4] == f"layers.{mla.LAYERS}.input" and block[-3:] == MTP_HEAD_SITES
             and after_loss == block,
             f"the trace's forward sites of the MTP block follow `loss` in order ({block[:5]} ... {block[-3:]})")
    fs.check(all(n in backward for n in MTP_LAYER_SITES + MTP_HEAD_SITES),
             f"the MTP sites have backward records ({sorted(n for n in backward if '.mtp.' in n)})")
    mtp_loss = report["steps"][0].get("mtp_loss", [])
    fs.check(len(loss) == 1 and mtp_loss == loss,
             f"the trace's {MTP_HEAD_SITES[-1]} is steps[].mtp_loss exactly ({loss} vs {mtp_loss})")
    for key, site in ((f"model.layers.{mla.LAYERS}.eh_proj.weight", f"layers.{mla.LAYERS}.mtp.eh_proj"),
                      (f"model.layers.{mla.LAYERS}.self_attn.o_proj.weight", f"layers.{mla.LAYERS}.attn.out")):
        planted = plant_inf(work / "bundle", work / ("planted-" + key.split(".")[-2]), key)
        rc, bad, err = fs.replay(cli, planted, work / ("out-planted-" + key.split(".")[-2]))
        first = {k: ((bad or {}).get("first_nonfinite") or {}).get(k) for k in ("phase", "site", "layer")}
        fs.check(rc == 1 and first == {"phase": "forward", "site": site, "layer": mla.LAYERS},
                 f"an inf in {key}: first_nonfinite is the forward {site} (exit {rc}; {first}; {err.strip()[-200:]})")
        # Depth 1 reads its row rolled one left: the origin's input token is the sample's next one.
        position = ((bad or {}).get("first_nonfinite") or {}).get("position")
        tokens = (bad or {}).get("origin_tokens") or [{}]
        fs.check(position is not None and tokens[0].get("position") == position + 1,
                 f"an inf in {key}: origin_tokens names the token depth 1 read, at position {position} + 1 "
                 f"({tokens[0]})")


def bundle_parameters(model):
    """The bundle's parameters in its order: the model's, then per depth enorm, hnorm, eh_proj, block, head norm."""
    params = [(k, v.detach()) for k, v in mla.named(model.main)]
    for depth, layer in enumerate(model.mtp):
        prefix = f"model.layers.{mla.LAYERS + depth}."
        params += [(prefix + n + ".weight", getattr(layer, n).weight.detach()) for n in ("enorm", "hnorm", "eh_proj")]
        params += [(prefix + k, v.detach()) for k, v in layer.transformer_layer.named_parameters()]
        params.append((prefix + "shared_head.norm.weight", layer.final_layernorm.weight.detach()))
    return params


def check_two_depths(cli, work):
    """1 with D = 2, written as a bundle: depth 2 reads depth 1's output, the scale is divided by D."""
    model = random_model(depths=2)
    section = json.loads((work / "bundle" / "manifest.json").read_text())["model"]
    section["mtp"] = {"num_layers": 2, "loss_scale": SCALE}
    stream = fs.token_stream(mla.V, mla.SAMPLES, mla.T, seed=4)
    inputs, targets = fs.batch_of(stream, mla.SAMPLES, mla.T)
    loss, norm, depths = reference(model, inputs, targets)
    bundle = fs.write_bundle(work / "two-depths", section, bundle_parameters(model), stream, mla.SAMPLES, mla.T,
                             loss, norm)
    rc, report, err = fs.replay(cli, bundle, work / "out-two-depths")
    if not fs.check(report is not None and rc in (0, 1), f"two MTP depths replay (exit {rc}; {err.strip()[-300:]})"):
        return
    fs.compare_step(report, loss, norm, "DeepSeek-V3 with two MTP depths, scale 0.3")
    replayed = report["steps"][0].get("mtp_loss", [])
    fs.check(len(replayed) == 2 and all(fs.rel_err(a, b) <= fs.TOLERANCES["fp32"] for a, b in zip(replayed, depths)),
             f"two depths: steps[].mtp_loss {replayed} vs the reference's {depths}")
    PERTURB.add("scale_not_divided")
    _, other_norm, _ = reference(model, inputs, targets)
    PERTURB.clear()
    fs.check(fs.rel_err(report["steps"][0]["grad_norm"], other_norm) > 1e-4,
             f"reference with the scale not divided by D: departs from the replay "
             f"({other_norm!r} vs {report['steps'][0]['grad_norm']!r})")


def check_bf16(cli, work, model):
    """1 in bf16, written as a bundle: the reference rounds where the replay does (the embedding, enorm's and
    hnorm's outputs, eh_proj's output, the block's sites, shared_head.norm's output, the logits); within 1e-4,
    departing from fp32."""
    section = json.loads((work / "bundle" / "manifest.json").read_text())["model"]
    stream = fs.token_stream(mla.V, mla.SAMPLES, mla.T, seed=4)
    inputs, targets = fs.batch_of(stream, mla.SAMPLES, mla.T)
    fp32_loss, fp32_norm, _ = reference(model, inputs, targets)
    fs.set_compute(model, "bf16")
    try:
        loss, norm, depths = reference(model, inputs, targets)
    finally:
        fs.set_compute(model, "fp32")
    fs.check(fs.rel_err(norm, fp32_norm) > fs.TOLERANCES["bf16"],
             f"bf16: the reference's grad norm {norm!r} departs from its fp32 one {fp32_norm!r}")
    bundle = fs.write_bundle(work / "bf16", section, bundle_parameters(model), stream, mla.SAMPLES, mla.T, loss, norm,
                             precision="bf16")
    rc, report, err = fs.replay(cli, bundle, work / "out-bf16")
    if not fs.check(report is not None and rc in (0, 1), f"bf16 MTP replays (exit {rc}; {err.strip()[-300:]})"):
        return
    fs.compare_step(report, loss, norm, "DeepSeek-V3 with one MTP layer in bf16", "bf16")
    replayed = report["steps"][0].get("mtp_loss", [])
    fs.check(len(replayed) == 1 and fs.rel_err(replayed[0], depths[0]) <= fs.TOLERANCES["bf16"],
             f"bf16: steps[].mtp_loss {replayed} vs the reference's {depths}")


def check_fp32_mtp_block(cli, work, model):
    """An fp16 overflow inside the MTP block (its o_proj scaled up) is named there, and --what-if fp32-layers=L
    (the block's layer, as its sites name it) resolves it; a layer past the last block is refused."""
    section = json.loads((work / "bundle" / "manifest.json").read_text())["model"]
    stream = fs.token_stream(mla.V, mla.SAMPLES, mla.T, seed=4)
    o_proj = f"model.layers.{mla.LAYERS}.self_attn.o_proj.weight"
    params = [(k, v * 1e6 if k == o_proj else v) for k, v in bundle_parameters(model)]
    bundle = fs.write_bundle(work / "fp16-mtp-overflow", section, params, stream, mla.SAMPLES, mla.T, 1.0, 1.0,
                             precision="fp16")
    rc, report, err = fs.replay(cli, bundle, work / "out-fp16-fp32", ["--what-if", f"fp32-layers={mla.LAYERS}"])
    first = (report or {}).get("first_nonfinite") or {}
    fs.check(rc == 1 and first.get("layer") == mla.LAYERS and first.get("phase") == "forward",
             f"fp16: an overflow from the MTP block's o_proj is named in layer {mla.LAYERS} "
             f"(exit {rc}; {first.get('phase')} {first.get('site')}; {err.strip()[-200:]})")
    outcome = ((report or {}).get("what_if") or [{}])[0]
    fs.check(outcome.get("resolved") is True and f"layer {mla.LAYERS} computed in fp32" in outcome.get("change", ""),
             f"--what-if fp32-layers={mla.LAYERS} takes the MTP block and resolves it ({outcome.get('change')!r}, "
             f"resolved {outcome.get('resolved')})")
    rc, _, err = fs.replay(cli, bundle, work / "out-fp16-past", ["--what-if", f"fp32-layers={mla.LAYERS + 1}"])
    fs.check_refused(rc, err, f"--what-if fp32-layers={mla.LAYERS + 1} past the MTP block",
                     f"fp32-layers={mla.LAYERS + 1}", "model.mtp's blocks")


def check_left_out(cli, work, flags):
    """3. --mtp-loss-scale 0 against the run's log (which had the MTP term): said, and named as the cause."""
    proc = imp.run_import(cli, [*flags, "--log", work / "log.jsonl", "--mtp-loss-scale", 0], work / "left-out")
    if not fs.check(proc.returncode == 0 and "left out of the replayed loss" in proc.stdout,
                    f"import with --mtp-loss-scale 0: exit 0, the MTP layers named as left out ({proc.stderr[-300:]})"):
        return
    m = json.loads((work / "left-out" / "manifest.json").read_text())
    fs.check("mtp" not in m["model"] and m["provenance"]["model.mtp"].get("value") == [mla.LAYERS],
             f"the manifest records the layers left out ({m['provenance'].get('model.mtp')})")
    _, report = imp.run_replay(cli, work / "left-out", work / "out-left-out")
    if not fs.check(report is not None, "the bundle without MTP replays"):
        return
    fs.check((report.get("multi_token_prediction") or {}).get("replayed") is False,
             f"report.json says the MTP layers were left out ({report.get('multi_token_prediction')})")
    gap = [f for f in report["findings"] if f["code"] == "BUNDLE_DOES_NOT_REPRODUCE"]
    fs.check(bool(gap) and "multi-token prediction (MTP) layers were left out" in gap[0]["message"]
             and "--mtp-loss-scale" in gap[0]["message"],
             f"BUNDLE_DOES_NOT_REPRODUCE names the left-out MTP layers ({[f['message'] for f in gap]})")
    fs.check("multi-token prediction (MTP) layers were left out" in (work / "out-left-out" / "report.md").read_text(),
             "report.md says the MTP layers were left out")


def check_refusals(cli, work, model, flags):
    """4 and 5."""
    import nanreplay_import
    write_checkpoint(work / "hf-copy", checkpoint_tensors(model, head_copy=torch.zeros_like(model.main.embed_tokens.weight)))
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = nanreplay_import.main([str(a) for a in ["--checkpoint", work / "hf-copy", *flags[2:], "--log",
                                                     work / "log.jsonl", "--mtp-loss-scale", SCALE, "--out",
                                                     work / "copy"]])
    said = err.getvalue().strip()
    fs.check(rc == 2 and f"model.layers.{mla.LAYERS}.embed_tokens.weight" in said and "shares" in said,
             f"an embed_tokens copy that differs from the model's is refused by key (exit {rc}): {said}")
    bundle = work / "bundle"
    original = (bundle / "manifest.json").read_text()
    for change, names in (({"num_layers": 1, "loss_scale": -0.3}, ("manifest.json", "model.mtp.loss_scale")),
                          ({"num_layers": 1, "loss_scale": 0.3, "factor": 1}, ("manifest.json", "model.mtp.factor")),
                          ({"num_layers": 2, "loss_scale": 0.3}, (f"model.layers.{mla.LAYERS + 1}.enorm.weight",))):
        m = json.loads(original)
        m["model"]["mtp"] = change
        (bundle / "manifest.json").write_text(json.dumps(m))
        proc = subprocess.run([cli, "run", str(bundle), "--out", str(work / "out-bad")], capture_output=True, text=True)
        fs.check_refused(proc.returncode, proc.stderr, f"model.mtp {change}", *names)
    (bundle / "manifest.json").write_text(original)


# Check 6's model: layer 0 dense, layer 1 and the MTP block (layer 2) DeepseekV3MoE, as first_k_dense_replace 1
# makes DeepSeek-V3's released checkpoint's MTP layer (layer_idx >= first_k_dense_replace).
MOE_LAYERS = [1, mla.LAYERS]


def random_moe_model():
    """(model with one MoE MTP depth, {state.json key: bias} for layers 1 and 2)."""
    torch.manual_seed(21)
    model = DeepseekV3WithMtp(mla.CONFIG, 1)
    model.main.layers[1].mlp = dsmoe.DeepseekV3MoE(mla.CONFIG, dsmoe.MOE)
    model.mtp[0].transformer_layer.mlp = dsmoe.DeepseekV3MoE(mla.CONFIG, dsmoe.MOE)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.3 * torch.randn(p.shape) if "norm" in name else 0.4 * torch.randn(p.shape))
    g = torch.Generator().manual_seed(22)
    biases = {dsmoe.bias_key(layer): (0.3 * torch.randn(dsmoe.E, generator=g)).tolist() for layer in MOE_LAYERS}
    set_moe_bias(model, biases)
    return model, biases


def set_moe_bias(model, biases):
    for layer, mlp in ((1, model.main.layers[1].mlp), (mla.LAYERS, model.mtp[0].transformer_layer.mlp)):
        mlp.gate.e_score_correction_bias.copy_(torch.tensor(biases[dsmoe.bias_key(layer)], dtype=torch.float64).float())


def write_moe_checkpoint(hf, model, biases):
    """DeepSeek-V3's checkpoint as save_pretrained writes it (the buffers too), the MTP layer's experts included."""
    tensors = checkpoint_tensors(model) + [(k, torch.tensor(v, dtype=torch.float32)) for k, v in biases.items()]
    hf.mkdir(parents=True, exist_ok=True)
    fs.nanreplay_capture.write_safetensors(hf / "model.safetensors", tensors)
    (hf / "config.json").write_text(json.dumps(mla.hf_config(
        mla.CONFIG, first_k_dense_replace=1, n_routed_experts=dsmoe.E, num_experts_per_tok=dsmoe.TOP_K,
        moe_intermediate_size=dsmoe.M, n_shared_experts=1, n_group=dsmoe.N_GROUP, topk_group=dsmoe.TOPK_GROUP,
        norm_topk_prob=True, routed_scaling_factor=dsmoe.SCALING, scoring_func="sigmoid", topk_method="noaux_tc",
        moe_layer_freq=1)))


def check_moe_block(cli, work):
    """6. An MTP block with experts (DeepSeek-V3's released MTP layer): imported with --mtp-loss-scale 0.3, its
    layer in model.moe.layers and its correction bias in state.json; replayed to the reference; the check fails
    with the MTP block's bias ignored (in the reference, and zeroed in state.json); refusals."""
    work.mkdir(parents=True, exist_ok=True)
    model, biases = random_moe_model()
    write_moe_checkpoint(work / "hf", model, biases)
    data = imp.Data(work, mla.V, mla.T, mla.SAMPLES, 1, num_samples=8, seed=3)
    inputs, targets = data.batch(data.rows(0))
    loss, norm, depths = reference(model, inputs, targets)
    (work / "log.jsonl").write_text(json.dumps({"step": 0, "loss": loss, "grad_norm": norm, "lr": 1e-3}) + "\n")
    what = "DeepSeek-V3 with an MoE MTP block (layers 1 and 2 with experts)"
    proc = imp.run_import(cli, ["--checkpoint", work / "hf", *data.flags(), "--steps", "0:0", "--log",
                                work / "log.jsonl", "--mtp-loss-scale", SCALE], work / "bundle")
    if not fs.check(proc.returncode == 0, f"{what}: import exit 0 ({proc.stderr.strip()[-300:]})"):
        return
    bundle = work / "bundle"
    m = json.loads((bundle / "manifest.json").read_text())
    fs.check(m["model"].get("moe", {}).get("layers") == MOE_LAYERS and m["model"].get("mtp", {}).get("num_layers") == 1,
             f"{what}: model.moe.layers lists the MTP layer ({m['model'].get('moe', {}).get('layers')})")
    state_file = bundle / "steps" / "0" / "state.json"
    state = json.loads(state_file.read_text())
    fs.check(sorted(state.get("router_score_bias", {})) == sorted(biases),
             f"{what}: state.json router_score_bias holds the MTP layer's bias too ({sorted(state.get('router_score_bias', {}))})")
    rproc, report = imp.run_replay(cli, bundle, work / "out")
    if not fs.check(report is not None, f"{what}: replays ({rproc.stderr.strip()[-300:]})"):
        return
    fs.compare_step(report, loss, norm, what)
    step = report["steps"][0]
    fs.check(len(step.get("mtp_loss", [])) == 1 and fs.rel_err(step["mtp_loss"][0], depths[0]) <= fs.TOLERANCES["fp32"],
             f"{what}: steps[].mtp_loss {step.get('mtp_loss')} vs the reference's {depths}")
    said = step.get("router_score_bias") or {}
    fs.check(sorted(said) == ["1", "2"] and max(abs(a - b) for a, b in zip(said["2"], biases[dsmoe.bias_key(mla.LAYERS)])) < 1e-7,
             f"{what}: report.json's steps[].router_score_bias lists the MTP layer's too ({sorted(said)})")
    # The check can fail: the MTP block's correction bias ignored, in the reference and in the replay.
    ignored = dict(biases, **{dsmoe.bias_key(mla.LAYERS): [0.0] * dsmoe.E})
    set_moe_bias(model, ignored)
    _, other_norm, other_depths = reference(model, inputs, targets)
    set_moe_bias(model, biases)
    moved = max(fs.rel_err(step["grad_norm"], other_norm), fs.rel_err(step["mtp_loss"][0], other_depths[0]))
    fs.check(moved > 1e-4, f"{what}: the reference with the MTP block's correction bias ignored departs by {moved:.2e}")
    state["router_score_bias"] = ignored
    state_file.write_text(json.dumps(state))
    _, zeroed = imp.run_replay(cli, bundle, work / "out-zeroed")
    other = zeroed["steps"][0] if zeroed else {"grad_norm": float("nan"), "mtp_loss": [float("nan")]}
    moved = max(fs.rel_err(step["grad_norm"], other["grad_norm"]), fs.rel_err(step["mtp_loss"][0], other["mtp_loss"][0]))
    fs.check(moved > 1e-4, f"{what}: the MTP layer's bias zeroed in state.json moves the replay by {moved:.2e}")
    del state["router_score_bias"][dsmoe.bias_key(mla.LAYERS)]
    state_file.write_text(json.dumps(state))
    proc = subprocess.run([cli, "run", str(bundle), "--out", str(work / "out-bad")], capture_output=True, text=True)
    fs.check_refused(proc.returncode, proc.stderr, f"{what}: a step without the MTP layer's bias", "state.json",
                     dsmoe.bias_key(mla.LAYERS))
    state["router_score_bias"] = biases
    state_file.write_text(json.dumps(state))
    original = (bundle / "manifest.json").read_text()
    for change, key in ((lambda moe: moe.update(layers=[1, mla.LAYERS + 1]), "model.moe.layers"),
                        (lambda moe: moe.update(router_aux_loss_coef=1e-3), "model.moe.router_aux_loss_coef")):
        bad = json.loads(original)
        change(bad["model"]["moe"])
        (bundle / "manifest.json").write_text(json.dumps(bad))
        proc = subprocess.run([cli, "run", str(bundle), "--out", str(work / "out-bad")], capture_output=True, text=True)
        fs.check_refused(proc.returncode, proc.stderr, f"{what}: {key} {bad['model']['moe'].get(key.split('.')[-1])}",
                         "manifest.json", key)
    (bundle / "manifest.json").write_text(original)
    check_moe_block_minimized(cli, work, bundle)


def check_moe_block_minimized(cli, work, bundle):
    """`nanreplay minimize` of the MoE MTP bundle with an inf planted in layer 1 (the last decoder layer): every
    layer is kept, so model.mtp, the MTP block's place in moe.layers and its correction bias are kept too."""
    incident = work / "incident"
    shutil.rmtree(incident, ignore_errors=True)
    shutil.copytree(bundle, incident)
    weights_file = incident / "steps" / "0" / "model.safetensors"
    weights = reference_model.read_safetensors(weights_file)
    planted = weights["model.layers.1.mlp.shared_expert.down_proj.weight"].clone()
    planted.view(-1)[0] = float("inf")
    weights["model.layers.1.mlp.shared_expert.down_proj.weight"] = planted
    fs.nanreplay_capture.write_safetensors(weights_file, list(weights.items()))
    out = work / "incident-min"
    shutil.rmtree(out, ignore_errors=True)
    proc = subprocess.run([cli, "minimize", str(incident), "--out", str(out)], capture_output=True, text=True)
    if not fs.check((out / "manifest.json").exists(), f"minimize of the MoE MTP incident writes a bundle (exit "
                                                       f"{proc.returncode}; {proc.stderr.strip()[-300:]})"):
        return
    m = json.loads((out / "manifest.json").read_text())["model"]
    states = [json.loads(f.read_text()) for f in sorted((out / "steps").glob("*/state.json"))]
    fs.check(m.get("mtp") is not None and m.get("moe", {}).get("layers") == MOE_LAYERS
             and all(dsmoe.bias_key(mla.LAYERS) in s.get("router_score_bias", {}) for s in states),
             f"minimize keeps model.mtp, the MTP layer in moe.layers and its bias ({m.get('moe', {}).get('layers')}, "
             f"{[sorted(s.get('router_score_bias', {})) for s in states]})")
    proc = subprocess.run([cli, "run", str(out), "--out", str(work / "out-min")], capture_output=True, text=True)
    fs.check(proc.returncode in (0, 1), f"the minimized bundle replays (exit {proc.returncode}; "
                                        f"{proc.stderr.strip()[-300:]})")


def data_parallel_copy(bundle, copy):
    """`bundle` (one rank, one micro-batch of mla.SAMPLES rows) as mla.SAMPLES data-parallel ranks of one row."""
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(bundle, copy)
    m = json.loads((copy / "manifest.json").read_text())
    m["data"].update(world_size=mla.SAMPLES, micro_batch_size=1)
    for step in m["steps"]:
        step["samples"] = [[sample] for sample in step["samples"][0]]
    (copy / "manifest.json").write_text(json.dumps(m))
    return copy


def check_streamed_and_split(cli, work):
    """8. Each way of spreading the replay gives the one-process in-memory replay's report and trace."""
    cases = [("two MTP depths, two ranks", data_parallel_copy(work / "two-depths", work / "two-depths-dp"), True),
             ("an MoE MTP block", work / "moe" / "bundle", False)]
    for label, bundle, ranks in cases:
        name = bundle.parent.name + "-" + bundle.name
        plain = rc.cli_run(cli, "run", bundle, "--out", work / f"split-{name}", "--json")
        report = json.loads(plain.stdout) if plain.stdout.strip() else {}
        depths = len(report.get("steps", [{}])[0].get("mtp_loss", []))
        if not fs.check(plain.returncode in (0, 1) and depths >= 1,
                        f"{label}: replays in one process with steps[].mtp_loss (exit {plain.returncode}, {depths} "
                        f"depths; {plain.stderr.strip()[-300:]})"):
            continue
        modes = [["--stream"], ["--nproc", "2", "--split", "layers"], ["--nproc", "2", "--split", "layers", "--stream"]]
        if ranks:
            modes += [["--nproc", "2", "--split", "ranks"], ["--nproc", "2", "--split", "ranks", "--stream"]]
        check_same_as_one_process(cli, plain, bundle, work / f"split-{name}", label, modes,
                                  trace=work / f"split-{name}" / "trace.h5")


def check_same_as_one_process(cli, plain, bundle, out_prefix, label, ways, both=(), trace=None):
    """`bundle` replayed each of `ways` (flag lists, with `both` too) to `plain`'s (the one-process run's) exit
    status and report.json bit for bit, and, given the one-process run's `trace`, to its trace.h5. Outputs and
    scratch directories go to `out_prefix`-<flags>."""
    for flags in ways:
        tag = "".join(flags).replace("-", "")
        out, scratch = Path(f"{out_prefix}-{tag}"), Path(f"{out_prefix}-{tag}-scratch")
        scratch.mkdir()
        got = rc.cli_run(cli, "run", bundle, "--out", out, "--json", "--scratch", scratch, *both, *flags)
        what = f"{label}, {' '.join([*both, *flags])}"
        if not fs.check(got.returncode == plain.returncode and bool(got.stdout.strip()),
                        f"{what}: exits {got.returncode} as one process does ({got.stderr.strip()[-300:]})"):
            continue
        differ = rc.report_difference(json.loads(plain.stdout), json.loads(got.stdout))
        fs.check(not differ, f"{what}: report.json the same{' but ' + str(differ) if differ else ''}")
        if trace is not None:
            differ = rc.trace_difference(trace, out / "trace.h5")
            fs.check(not differ, f"{what}: trace.h5 the same{' but ' + str(differ[:5]) if differ else ''}")

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cli", required=True)
    ap.add_argument("--work", required=True)
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    model = random_model()
    write_checkpoint(work / "hf", checkpoint_tensors(model))
    data = imp.Data(work, mla.V, mla.T, mla.SAMPLES, 1, num_samples=8, seed=3)
    flags = ["--checkpoint", work / "hf", *data.flags(), "--steps", "0:0"]
    check_replayed(args.cli, work, model, data, flags)
    check_mtp_sites(args.cli, work)
    check_two_depths(args.cli, work)
    check_bf16(args.cli, work, model)
    check_fp32_mtp_block(args.cli, work, model)
    check_left_out(args.cli, work, flags)
    check_refusals(args.cli, work, model, flags)
    check_moe_block(args.cli, work / "moe")
    check_streamed_and_split(args.cli, work)
    fs.finish()


if __name__ == "__main__":
    main()
