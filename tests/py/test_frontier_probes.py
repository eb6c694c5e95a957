"""report.json's per-step attn_logit_max, expert_activation_max and router_logit_max against eager PyTorch.

The reference is test_family_gpt_oss_moe.py's GPT-OSS (attention with sinks and biases, a mixture of
experts in every layer), transcribed from transformers' modeling_gpt_oss.py, on the weights and batch of the
first step of `nanreplay synth clean-gpt-oss-moe` (fp32). Recorded beside its forward, without changing it:

- per layer and query head, the largest scaled pre-softmax score (eager_attention_forward's attn_weights
  after the attention mask is added, so over the keys the softmax reads: causal and sliding masks);
- per layer and expert, the largest |x| of the hidden states routed to the expert, and of the expert's output
  before the routing weight: the reference's own GptOssExperts called on those rows with a weight of 1.

- per layer and expert, the largest router logit (GptOssTopKRouter.forward's router_logits: the linear with its
  bias, before the top-k and softmax).

All within 1e-5 relative of the replay's. The check can fail: the scores' maximum over every key (the masked
ones too), the experts' outputs after the routing weight and the router's scores after its softmax depart by
more than ten times the tolerance.

    /usr/bin/python3 tests/py/test_frontier_probes.py --cli build/nanreplay --work DIR
"""
import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import family_support as fs  # noqa: E402
import reference_model  # noqa: E402
import synth_cache  # noqa: E402
import test_family_gpt_oss_attn as attn  # noqa: E402
import test_family_gpt_oss_moe as moe_ref  # noqa: E402

PRESET = "clean-gpt-oss-moe"


def record_reference(model, inputs, targets):
    """(per-head maxima over visible keys, the same over every key, per-expert {input, output, weighted})."""
    layer_of = {id(layer.self_attn): i for i, layer in enumerate(model.model.layers)}
    visible, every = {}, {}
    original = attn.eager_attention_forward

    def recording(module, query, key, value, attention_mask, scaling):
        with torch.no_grad():
            key_states = key.repeat_interleave(module.num_key_value_groups, dim=1)
            scores = module.rnd(module.rnd(torch.matmul(query, key_states.transpose(2, 3))) * scaling)
            i = layer_of[id(module)]
            visible[i] = (scores + attention_mask).amax(dim=(0, 2, 3))
            every[i] = scores.amax(dim=(0, 2, 3))
        return original(module, query, key, value, attention_mask, scaling)

    captured, router_max, router_after = {}, {}, {}
    originals = []
    for i, mlp in enumerate(model.experts()):
        forward = mlp.experts.forward

        def capture(hidden_states, router_indices=None, routing_weights=None, i=i, forward=forward):
            captured[i] = (hidden_states.detach(), router_indices, routing_weights.detach())
            return forward(hidden_states, router_indices=router_indices, routing_weights=routing_weights)
        originals.append((mlp.experts, forward))
        mlp.experts.forward = capture
        router_forward = mlp.router.forward

        def capture_router(hidden_states, i=i, router=mlp.router, forward=router_forward):
            scores, indices = forward(hidden_states)
            with torch.no_grad():  # GptOssTopKRouter.forward's router_logits, then its scores
                h = hidden_states.reshape(-1, router.hidden_dim)
                logits = router.rnd(F.linear(router.rnd(h), router.rnd(router.weight), router.rnd(router.bias)))
                router_max[i] = logits.amax(0)
                router_after[i] = scores.amax(0)
            return scores, indices
        originals.append((mlp.router, router_forward))
        mlp.router.forward = capture_router
    attn.eager_attention_forward = recording
    try:
        with torch.no_grad():
            model(inputs, targets)
    finally:
        attn.eager_attention_forward = original
        for module, forward in originals:
            module.forward = forward
    experts = {}
    with torch.no_grad():
        for i, mlp in enumerate(model.experts()):
            hidden, indices, weights = captured[i]
            hidden = hidden.reshape(-1, hidden.shape[-1])
            row = []
            for e in range(mlp.experts.num_experts):
                tokens = (indices == e).any(dim=-1).nonzero().flatten()
                if tokens.numel() == 0:
                    row.append(None)
                    continue
                rows = hidden[tokens]
                one = torch.zeros(rows.shape[0], mlp.experts.num_experts)
                one[:, e] = 1.0
                out = mlp.experts(rows.unsqueeze(0), router_indices=torch.full((rows.shape[0], 1), e),
                                  routing_weights=one).reshape(rows.shape[0], -1)
                weighted = out * weights[tokens, e, None]
                row.append({"input": float(rows.abs().max()), "output": float(out.abs().max()),
                            "weighted": float(weighted.abs().max())})
            experts[i] = row
    return visible, every, experts, router_max, router_after


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cli", required=True)
    ap.add_argument("--work", required=True)
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    bundle_dir = work / PRESET
    synth_cache.synth(args.cli, PRESET, bundle_dir)
    bundle = reference_model.Bundle(bundle_dir)
    first = bundle.manifest["steps"][0]
    rc, report, err = fs.replay(args.cli, bundle_dir, work / "out", ["--steps", str(first["step"])])
    if not fs.check(report is not None and rc == 0, f"{PRESET} replays (exit {rc}; {err.strip()[-300:]})"):
        fs.finish()
        return
    row = report["steps"][0]
    m = bundle.manifest["model"]
    model = moe_ref.GptOssForCausalLM(m["rope_scaling"], m["layer_types"], m["moe"], cfg=attn.config_of_manifest(m))
    left = moe_ref.load(model, reference_model.read_safetensors(bundle.root / first["dir"] / "model.safetensors"))
    fs.check(not left, f"every tensor is a reference parameter ({left})")
    d = bundle.manifest["data"]
    fs.check(d.get("world_size", 1) == 1, "one rank")
    ids = bundle.samples(first["step"])[0]
    mbs = d["micro_batch_size"]
    visible, every, experts, router, router_after = {}, {}, {}, {}, {}
    for micro in range(d.get("grad_accum_steps", 1)):  # the step's maxima: over its micro-batches
        v, a, x, r, ra = record_reference(model, *bundle.batch(ids[micro * mbs:(micro + 1) * mbs]))
        for layer in r:
            router[layer] = torch.maximum(router[layer], r[layer]) if layer in router else r[layer]
            router_after[layer] = torch.maximum(router_after[layer], ra[layer]) if layer in router_after else ra[layer]
        for layer in v:
            visible[layer] = torch.maximum(visible[layer], v[layer]) if layer in visible else v[layer]
            every[layer] = torch.maximum(every[layer], a[layer]) if layer in every else a[layer]
            if layer not in experts:
                experts[layer] = x[layer]
                continue
            for e, ref in enumerate(x[layer]):
                if ref is None:
                    continue
                if experts[layer][e] is None:
                    experts[layer][e] = ref
                    continue
                experts[layer][e] = {k: max(experts[layer][e][k], ref[k]) for k in ref}

    got = row["attn_logit_max"]
    worst, worst_every = 0.0, 0.0
    for layer in range(m["num_layers"]):
        for h in range(m["num_heads"]):
            worst = max(worst, fs.rel_err(got[layer][h], float(visible[layer][h])))
            worst_every = max(worst_every, fs.rel_err(got[layer][h], float(every[layer][h])))
    fs.check(worst <= fs.TOLERANCE, f"attn_logit_max within {fs.TOLERANCE} of the reference (worst {worst:.3g})")
    fs.check(worst_every > 10 * fs.TOLERANCE,
             f"the check can fail: the maxima over every key, masked ones too, depart (worst {worst_every:.3g})")

    got = row["expert_activation_max"]
    worst, worst_weighted, compared = 0.0, 0.0, 0
    for layer in range(m["num_layers"]):
        for e, ref in enumerate(experts[layer]):
            mine = got[layer][e]
            if ref is None:
                fs.check(mine["input"] is None and mine["output"] is None, f"layer {layer} expert {e}: nothing routed")
                continue
            compared += 1
            worst = max(worst, fs.rel_err(mine["input"], ref["input"]), fs.rel_err(mine["output"], ref["output"]))
            worst_weighted = max(worst_weighted, fs.rel_err(mine["output"], ref["weighted"]))
    fs.check(compared >= 4, f"experts compared: {compared}")
    fs.check(worst <= fs.TOLERANCE, f"expert_activation_max within {fs.TOLERANCE} of the reference (worst {worst:.3g})")
    fs.check(worst_weighted > 10 * fs.TOLERANCE,
             f"the check can fail: the outputs after the routing weight depart (worst {worst_weighted:.3g})")

    got = row["router_logit_max"]
    worst, worst_after = 0.0, 0.0
    for layer in range(m["num_layers"]):
        for e in range(m["moe"]["num_experts"]):
            worst = max(worst, fs.rel_err(got[layer][e], float(router[layer][e])))
            worst_after = max(worst_after, fs.rel_err(got[layer][e], float(router_after[layer][e])))
    fs.check(worst <= fs.TOLERANCE, f"router_logit_max within {fs.TOLERANCE} of the reference (worst {worst:.3g})")
    fs.check(worst_after > 10 * fs.TOLERANCE,
             f"the check can fail: the router's scores after its softmax depart (worst {worst_after:.3g})")
    print(f"attn_logit_max, expert_activation_max and router_logit_max match ({compared} experts)")
    fs.finish()


if __name__ == "__main__":
    main()
