"""Mixture of experts (llama's model.moe, Hugging Face Qwen3-MoE's routing) through the capture helper.

1. The suite's two readings of the MoE model agree in fp32: tests/py/reference_model.py's functional
   llama_loss (the cross-check's reference) and the capture self-check's reference_loss, against
   tests/py/torch_models.py's module model (Qwen3MoeSparseMoeBlock as Hugging Face writes it), loss and
   every gradient within 1e-6, with norm_topk_prob on and off and both router losses on.
2. expected_parameters' MoE layout: the router mlp.gate.weight, then expert 0's gate/up/down_proj, ...
   in place of the dense MLP, as Hugging Face's module order has them.
3. The module model trains for a few steps (2 micro-batches a step, clip_grad_norm_) under the Recorder,
   moe given in model_config; the bundle's manifest says model.moe in full, its model.safetensors holds
   expected_parameters() in order with the AdamW moments, and the self-check passed on step 0 (so the
   bundle's model, router losses included, computes the logged loss).
4. model.moe read off a Hugging Face Qwen3-MoE style config (and merged with a router_z_loss_coef given
   in model_config); router_aux_loss_coef only with output_router_logits.
5. Refusals: expert parameters with moe unset, shared experts, a dense layer among MoE layers, HF
   configs with mlp_only_layers / decoder_sparse_step / shared_expert_intermediate_size, model_config
   contradicting model.config, top_k beyond the experts, an unknown moe key, moe on gpt2.
6. The cross-check's reference (reference_model.replay_step, train_window rolled forward from step 0) on
   the bundle of 3 computes the logged losses (and grad norms) within 1e-5.
7. `nanreplay run BUNDLE --json` on the bundle of 3: nothing reproduced, every step's replayed loss and
   gradient norm within 1e-5 of what the training loop logged.
~5 s with Debian's /usr/bin/python3.
"""
import argparse
import json
import math
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[1] / "capture"))
import nanreplay_capture  # noqa: E402
import reference_model  # noqa: E402
import torch_models  # noqa: E402
from nanreplay_capture import CaptureError  # noqa: E402

MOE = dict(num_experts=4, top_k=2, intermediate_size=24, norm_topk_prob=True, router_aux_loss_coef=0.01,
           router_z_loss_coef=0.001)
LLAMA = dict(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=48,
             norm_eps=1e-5, rope_theta=10000.0)
SEQ_LEN, MICRO_BATCH, ACCUM, STEPS = 8, 2, 2, 4
TOLERANCE = 1e-5

failures = []


def check(ok, what):
    print(("ok   " if ok else "FAIL ") + what)
    if not ok:
        failures.append(what)


def rel_err(a, b):
    return abs(a - b) / max(abs(b), 1e-12)


def make_model(moe=MOE, config=None, **options):
    """The MoE llama; routers drawn wider than the other weights (std 0.5), so that routing is decided
    by clear margins rather than near-ties."""
    torch.manual_seed(0)
    model = torch_models.LlamaForCausalLM(dict(LLAMA, moe=dict(moe), **options))
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(std=0.5)
    if config is not None:
        model.config = config
    return model


def raises(what, fn, *needles):
    try:
        fn()
    except CaptureError as e:
        missing = [n for n in needles if n not in str(e)]
        check(not missing, f"{what}: CaptureError names {list(needles)}" + (f" (got: {e})" if missing else ""))
        return
    check(False, f"{what}: raises CaptureError (it did not)")


def references_agree():
    g = torch.Generator().manual_seed(3)
    inputs = torch.randint(0, LLAMA["vocab_size"], (3, SEQ_LEN), generator=g)
    targets = torch.randint(0, LLAMA["vocab_size"], (3, SEQ_LEN), generator=g)
    for norm in (True, False):
        moe = dict(MOE, norm_topk_prob=norm)
        cfg = dict(LLAMA, arch="llama", tie_embeddings=False, max_seq_len=SEQ_LEN, moe=moe)
        model = make_model(moe)
        loss = model(inputs, targets)
        loss.backward()
        params = {k: v.detach().clone().requires_grad_(True) for k, v in model.named_parameters()}
        ref = reference_model.llama_loss(cfg, params, inputs, targets)
        ref.backward()
        worst = max((params[k].grad - v.grad).abs().max().item() / max(v.grad.abs().max().item(), 1e-12)
                    for k, v in model.named_parameters())
        check(rel_err(ref.item(), loss.item()) <= 1e-6 and worst <= 1e-6,
              f"norm_topk_prob={norm}: reference_model.llama_loss {ref.item():.9g} vs the module model "
              f"{loss.item():.9g} (rel {rel_err(ref.item(), loss.item()):.1e}), worst gradient rel {worst:.1e}")
        dense = torch.nn.functional.cross_entropy(
            model.lm_head(model.model(inputs)).reshape(-1, LLAMA["vocab_size"]), targets.reshape(-1))
        check(loss.item() - dense.item() > 1e-4, f"norm_topk_prob={norm}: the router losses add "
                                                 f"{loss.item() - dense.item():.3g} to the cross-entropy")
        with torch.no_grad():
            capture_ref = nanreplay_capture.reference_loss(cfg, dict(model.named_parameters()), inputs, targets)
        check(rel_err(capture_ref.item(), loss.item()) <= 1e-6,
              f"norm_topk_prob={norm}: the capture self-check's reference_loss {capture_ref.item():.9g} agrees")
    bf16 = reference_model.llama_loss(cfg, params, inputs, targets, reference_model.rounding("bf16"))
    check(math.isfinite(bf16.item()) and rel_err(bf16.item(), ref.item()) < 1e-2,
          f"bf16 reference runs ({bf16.item():.6g} against fp32 {ref.item():.6g})")


def parameter_order():
    cfg = dict(LLAMA, max_seq_len=SEQ_LEN, tie_embeddings=True, moe=dict(num_experts=3, top_k=1))
    spec = nanreplay_capture.expected_parameters("llama", cfg)
    layer = [(n[len("model.layers.1."):], s) for n, s in spec if n.startswith("model.layers.1.")]
    C, F = LLAMA["hidden_size"], LLAMA["intermediate_size"]
    want = [("input_layernorm.weight", (C,)), ("self_attn.q_proj.weight", (C, C)), ("self_attn.k_proj.weight", (16, C)),
            ("self_attn.v_proj.weight", (16, C)), ("self_attn.o_proj.weight", (C, C)),
            ("post_attention_layernorm.weight", (C,)), ("mlp.gate.weight", (3, C))]
    for e in range(3):
        want += [(f"mlp.experts.{e}.gate_proj.weight", (F, C)), (f"mlp.experts.{e}.up_proj.weight", (F, C)),
                 (f"mlp.experts.{e}.down_proj.weight", (C, F))]
    check(layer == want, "expected_parameters with moe: router, then each expert's gate/up/down_proj in place of the "
                         "dense MLP (experts' width defaulting to intermediate_size)")
    wide = dict(nanreplay_capture.expected_parameters("llama", dict(cfg, moe=dict(num_experts=3, top_k=1,
                                                                                   intermediate_size=20))))
    check(wide["model.layers.0.mlp.experts.2.down_proj.weight"] == (C, 20), "moe.intermediate_size sizes the experts")
    dense = [n for n, _ in nanreplay_capture.expected_parameters("llama", dict(cfg, moe=None))]
    check("model.layers.0.mlp.gate_proj.weight" in dense and not any("experts" in n for n in dense),
          "moe None: the dense MLP")


class Data:
    def __init__(self, root):
        g = torch.Generator().manual_seed(5)
        self.tokens = torch.randint(0, LLAMA["vocab_size"], (32 * SEQ_LEN + 1,), generator=g)
        self.shard = root / "tokens.bin"
        self.shard.write_bytes(bytes(self.tokens.to(torch.int16).contiguous().view(torch.uint8).tolist()))

    def spec(self):
        return dict(shards=[str(self.shard)], seq_len=SEQ_LEN, micro_batch_size=MICRO_BATCH, grad_accum_steps=ACCUM)

    def batch(self, ids):
        w = torch.stack([self.tokens[i * SEQ_LEN:i * SEQ_LEN + SEQ_LEN + 1] for i in ids])
        return w[:, :-1], w[:, 1:]


def recorder_for(model, data, root, model_config=None, arch="llama"):
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    rec = nanreplay_capture.Recorder(model, opt, root / "incidents", arch=arch, window=STEPS,
                                     model_config=dict(num_heads=LLAMA["num_heads"], **(model_config or {})),
                                     data=data.spec(), grad_clip=1.0)
    return rec, opt


def train(model, data, root, model_config):
    """STEPS steps of 2 micro-batches; returns (bundle, {step: (loss, grad norm)}, recorder)."""
    rec, opt = recorder_for(model, data, root, model_config)
    logged = {}
    per_step = MICRO_BATCH * ACCUM
    for step in range(STEPS):
        samples = list(range(step * per_step, (step + 1) * per_step))
        rec.begin_step(step, samples=samples)
        total = 0.0
        for m in range(ACCUM):
            loss = model(*data.batch(samples[m * MICRO_BATCH:(m + 1) * MICRO_BATCH]))
            (loss / ACCUM).backward()
            total += loss.item()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        logged[step] = (total / ACCUM, float(norm))
        rec.end_step(loss=total / ACCUM, grad_norm=norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return rec.dump(root / "bundle"), logged, rec


def safetensors_header(path):
    raw = Path(path).read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    header.pop("__metadata__", None)
    return header


def captured(root, data):
    model = make_model()
    bundle, logged, rec = train(model, data, root, dict(moe=dict(MOE)))
    manifest = json.loads((bundle / "manifest.json").read_text())
    check(manifest["model"].get("moe") == MOE, f"manifest model.moe {manifest['model'].get('moe')}")
    check(manifest["model"]["intermediate_size"] == MOE["intermediate_size"],
          "no model.config: the model's intermediate_size is the experts' width")
    expected = [(n, list(s)) for n, s in nanreplay_capture.expected_parameters("llama", manifest["model"])]
    check(any(n == "model.layers.1.mlp.experts.3.down_proj.weight" for n, _ in expected)
          and not any(n.endswith("mlp.gate_proj.weight") for n, _ in expected), "expected_parameters lists the experts")
    for entry in manifest["steps"]:
        header = safetensors_header(bundle / entry["dir"] / "model.safetensors")
        check([(n, v["shape"]) for n, v in header.items()] == expected,
              f"step {entry['step']}: model.safetensors is expected_parameters() in order")
        opt = bundle / entry["dir"] / "optimizer.safetensors"
        if opt.exists():
            moments = safetensors_header(opt)
            check(all(f"{n}.exp_avg" in moments and f"{n}.exp_avg_sq" in moments for n, _ in expected),
                  f"step {entry['step']}: optimizer.safetensors has every expert's AdamW moments")
    r = rec.self_check_result
    check(r is not None and r["step"] == 0 and r["relative"] <= r["tolerance"],
          f"the self-check passed on step 0 (bundle model, router losses included, vs logged loss: {r})")
    return bundle, logged


def from_config(root, data):
    qwen3_moe = SimpleNamespace(model_type="qwen3_moe", attention_bias=False, rope_scaling=None, sliding_window=None,
                                use_sliding_window=False, num_experts=4, num_experts_per_tok=2,
                                moe_intermediate_size=24, norm_topk_prob=True, output_router_logits=True,
                                router_aux_loss_coef=0.01, intermediate_size=40, mlp_only_layers=[],
                                decoder_sparse_step=1)
    model = make_model(config=qwen3_moe, qk_norm="head")
    rec, _ = recorder_for(model, data, root / "hf", dict(moe=dict(router_z_loss_coef=0.001)))
    check(rec.model_config.get("moe") == MOE and rec.model_config["intermediate_size"] == 40
          and rec.model_config.get("qk_norm") == "head",
          f"a Qwen3-MoE config: model.moe read off it, z loss from model_config {rec.model_config.get('moe')}, "
          f"intermediate_size {rec.model_config['intermediate_size']} from the config")
    quiet = SimpleNamespace(**dict(vars(qwen3_moe), output_router_logits=False))
    rec, _ = recorder_for(make_model(dict(MOE, router_aux_loss_coef=0.0, router_z_loss_coef=0.0), config=quiet,
                                     qk_norm="head"), data, root / "hf2")
    got = rec.model_config["moe"]
    check(got["router_aux_loss_coef"] == 0.0 and got["router_z_loss_coef"] == 0.0,
          "output_router_logits False: no aux loss (HF adds it only then)")


def refusals(root, data):
    def rec(model, model_config=None, arch="llama"):
        return lambda: recorder_for(model, data, root / "refused", model_config, arch)

    raises("expert parameters, moe unset", rec(make_model()), "model.layers.0.mlp.experts.0", "moe")
    shared = make_model()
    shared.model.layers[0].mlp.shared_expert = torch_models.LlamaMLP(LLAMA["hidden_size"], 16)
    raises("a shared expert", rec(shared, dict(moe=dict(MOE))), "shared_expert", "shared experts")
    mixed = make_model()
    mixed.model.layers[1].mlp = torch_models.LlamaMLP(LLAMA["hidden_size"], LLAMA["intermediate_size"])
    raises("a dense layer among MoE layers", rec(mixed, dict(moe=dict(MOE))), "layer 1", "every layer")
    base = dict(model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                norm_topk_prob=True)
    for key, value in (("mlp_only_layers", [1]), ("decoder_sparse_step", 2), ("shared_expert_intermediate_size", 64)):
        config = SimpleNamespace(**base, **{key: value})
        raises(f"an HF config with {key}", rec(make_model(config=config, qk_norm="head")), f"model.config.{key}")
    raises("model_config moe contradicting model.config",
           rec(make_model(config=SimpleNamespace(**base), qk_norm="head"), dict(moe=dict(top_k=1))),
           "model_config['moe']['top_k']", "contradicts model.config")
    raises("top_k beyond the experts", rec(make_model(), dict(moe=dict(MOE, top_k=5))), "top_k", "exceeds")
    raises("num_experts against the router's rows", rec(make_model(), dict(moe=dict(MOE, num_experts=8))),
           "num_experts", "rows")
    raises("an unknown moe key", rec(make_model(), dict(moe=dict(MOE, shared_expert_intermediate_size=8))),
           "shared_expert_intermediate_size")
    raises("moe without top_k", rec(make_model(), dict(moe=dict(num_experts=4))), "top_k")
    dense = torch_models.LlamaForCausalLM(dict(LLAMA))
    raises("moe given for a dense model", rec(dense, dict(moe=dict(MOE))), "mlp.gate.weight")
    gpt2 = torch_models.GPT2(dict(vocab_size=64, hidden_size=32, num_layers=1, num_heads=4, max_seq_len=SEQ_LEN,
                                  norm_eps=1e-5))
    raises("moe on gpt2", rec(gpt2, dict(moe=dict(MOE)), arch="gpt2"), "moe", "llama")


def reference_replays(root, bundle, logged):
    """The cross-check's reference (reference_model.replay_step, and train_window rolled forward from
    step 0's checkpoint with torch.optim.AdamW) on the captured bundle, its explicit samples read off the
    manifest: the logged losses and grad norms within 1e-5."""
    ref = reference_model.Bundle(bundle)
    samples = {e["step"]: e["samples"] for e in ref.manifest["steps"]}
    ref.samples = samples.__getitem__
    for entry in ref.manifest["steps"]:
        loss, norm, _, _ = reference_model.replay_step(ref, entry["dir"], entry["step"])
        want_loss, want_norm = logged[entry["step"]]
        check(rel_err(loss, want_loss) <= TOLERANCE and rel_err(norm, want_norm) <= TOLERANCE,
              f"reference_model.replay_step step {entry['step']}: loss {loss:.9g} / grad norm {norm:.9g}, logged "
              f"{want_loss:.9g} / {want_norm:.9g}")
    rolled = root / "rolled"
    shutil.copytree(bundle, rolled)
    for entry in ref.manifest["steps"][1:]:
        (rolled / entry["dir"] / "model.safetensors").unlink()
    ref = reference_model.Bundle(rolled)
    ref.samples = samples.__getitem__
    losses = reference_model.train_window(ref)
    check(all(rel_err(losses[s], logged[s][0]) <= TOLERANCE for s in logged),
          f"reference_model.train_window rolled from step 0: losses {losses} match the logged ones")


def replayed(cli, bundle, logged, out):
    shutil.rmtree(out, ignore_errors=True)
    try:
        proc = subprocess.run([cli, "run", str(bundle), "--out", str(out), "--json"], capture_output=True, text=True)
    except OSError as e:
        check(False, f"nanreplay run on the MoE bundle: cannot start {cli}: {e}")
        return
    if proc.returncode != 0:
        check(False, f"nanreplay run on the MoE bundle exits 0 (got {proc.returncode}: {proc.stderr.strip()[-400:]})")
        return
    report = json.loads(proc.stdout)
    check(not report["reproduced"], "nanreplay run: nothing reproduced on the healthy MoE bundle")
    check(sorted(row["step"] for row in report["steps"]) == sorted(logged), "every captured step replayed")
    for row in report["steps"]:
        loss, norm = logged[row["step"]]
        check(rel_err(row["loss"], loss) <= TOLERANCE and rel_err(row["grad_norm"], norm) <= TOLERANCE,
              f"step {row['step']}: replayed loss {row['loss']:.9g} / grad norm {row['grad_norm']:.9g}, logged "
              f"{loss:.9g} / {norm:.9g} (rel {rel_err(row['loss'], loss):.1e} / {rel_err(row['grad_norm'], norm):.1e})")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cli", required=True, help="nanreplay (runs the captured MoE bundle)")
    ap.add_argument("--work", required=True)
    args = ap.parse_args()
    root = Path(args.work)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    torch.set_num_threads(1)
    started = time.perf_counter()
    data = Data(root)
    references_agree()
    parameter_order()
    bundle, logged = captured(root, data)
    from_config(root, data)
    refusals(root, data)
    reference_replays(root, bundle, logged)
    replayed(args.cli, bundle, logged, root / "out")
    print(f"{len(failures)} failed; {time.perf_counter() - started:.1f} s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
