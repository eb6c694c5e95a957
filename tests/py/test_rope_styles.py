"""reference_model.py's llama-family model options on a tiny random llama (fp32):

1. rope_style "interleaved" on stored weights is rotate_half on weights permuted by HF's conversion
   (permute_for_rotate_half on q_proj/k_proj rows, and likewise their biases and a "full" q/k norm weight),
   so the two conventions differ exactly by that reordering and by nothing else;
2. every option changes the loss and reads all the weights it adds (none is silently a no-op);
3. llama3 rope_scaling's inverse frequencies are bit for bit a transcription of HF's formula;
4. sliding_window W >= seq is no window, and W = 1 leaves each query only itself;
5. through nanreplay itself: `synth clean-llama3` (interleaved) replays to the same losses and gradient
   norms as that bundle converted to rotate_half (q/k rows and their AdamW moments permuted, rope_style
   dropped), and the converted bundle read as interleaved does not reproduce its run.

Run by CTest with Debian's /usr/bin/python3.
"""
import argparse
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import reference_model as rm  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "capture"))
import nanreplay_capture  # noqa: E402  (its safetensors writer)

H, G, C, LAYERS, V, T, FF = 4, 2, 32, 2, 64, 12, 48
D = C // H
CFG = {"arch": "llama", "vocab_size": V, "hidden_size": C, "num_layers": LAYERS, "num_heads": H,
       "num_kv_heads": G, "max_seq_len": T, "norm_eps": 1e-5, "rope_theta": 10000.0, "tie_embeddings": False}
# original_max_position_embeddings 16 puts D = 8's wavelengths 2*pi*[1, 10, 100, 1000] in the interpolated
# band (the first) and beyond it (the rest), so the scaling shows in a 12-token sequence.
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}
failures = 0


def check(ok, what):
    global failures
    print(("ok   " if ok else "FAIL ") + what)
    failures += 0 if ok else 1


def random_params(qk_norm, seed=0):
    g = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, generator=g) * scale

    p = {"model.embed_tokens.weight": randn(V, C), "model.norm.weight": 1 + randn(C, scale=0.2),
         "lm_head.weight": randn(V, C, scale=C ** -0.5)}
    for i in range(LAYERS):
        pre = f"model.layers.{i}."
        for name, rows, cols in [("self_attn.q_proj", H * D, C), ("self_attn.k_proj", G * D, C),
                                 ("self_attn.v_proj", G * D, C), ("self_attn.o_proj", C, H * D),
                                 ("mlp.gate_proj", FF, C), ("mlp.up_proj", FF, C), ("mlp.down_proj", C, FF)]:
            p[pre + name + ".weight"] = randn(rows, cols, scale=cols ** -0.5)
        for name, rows in [("q", H * D), ("k", G * D), ("v", G * D)]:
            p[pre + f"self_attn.{name}_proj.bias"] = randn(rows, scale=0.5)
        p[pre + "input_layernorm.weight"] = 1 + randn(C, scale=0.2)
        p[pre + "post_attention_layernorm.weight"] = 1 + randn(C, scale=0.2)
    for i in range(LAYERS):  # drawn last, so every other weight is the same whatever their size
        for name, heads in [("q", H), ("k", G)]:
            size = D if qk_norm == "head" else heads * D
            p[f"model.layers.{i}.self_attn.{name}_norm.weight"] = 1 + randn(size, scale=0.3)
    return p


def to_rotate_half(p, qk_norm):
    """The interleaved checkpoint p as HF's converter writes it for rotate_half."""
    out = dict(p)
    for i in range(LAYERS):
        for name, heads in [("q", H), ("k", G)]:
            pre = f"model.layers.{i}.self_attn.{name}"
            for key in (pre + "_proj.weight", pre + "_proj.bias"):
                out[key] = rm.permute_for_rotate_half(p[key], heads)
            # A per-head norm weight is one head's rows; a full one spans all heads' rows.
            out[pre + "_norm.weight"] = rm.permute_for_rotate_half(p[pre + "_norm.weight"],
                                                                   1 if qk_norm == "head" else heads)
    return out


BATCH = torch.randint(0, V, (2, T + 1), generator=torch.Generator().manual_seed(1))


def loss_and_grad(options, p, all_grads=False):
    """Loss and the token embedding's gradient under CFG plus options (or every parameter's: None if unused)."""
    p = {k: v.clone().requires_grad_(True) for k, v in p.items()}
    loss = rm.llama_loss({**CFG, **options}, p, BATCH[:, :-1], BATCH[:, 1:])
    loss.backward()
    return loss.item(), {k: v.grad for k, v in p.items()} if all_grads else p["model.embed_tokens.weight"].grad


def rel(a, b):
    return abs(a - b) / abs(b)


def label(options):
    return ", ".join(f"{k}={'llama3' if k == 'rope_scaling' else v}" for k, v in options.items()) or "no option"


def check_rope_styles():
    for options in [{}, {"qk_norm": "full"}, {"qk_norm": "head"}, {"attention_bias": True},
                    {"attention_bias": True, "qk_norm": "full", "rope_scaling": LLAMA3, "sliding_window": 5}]:
        qk_norm = options.get("qk_norm")
        p = random_params(qk_norm)
        interleaved, g_interleaved = loss_and_grad({**options, "rope_style": "interleaved"}, p)
        halves, g_halves = loss_and_grad({**options, "rope_style": "rotate_half"}, to_rotate_half(p, qk_norm))
        grad_err = ((g_interleaved - g_halves).abs().max() / g_halves.abs().max()).item()
        check(rel(interleaved, halves) <= 1e-6 and grad_err <= 1e-5,
              f"interleaved == rotate_half on permuted weights ({label(options)}): loss {interleaved:.9g} vs "
              f"{halves:.9g} (rel {rel(interleaved, halves):.1e}), embedding grad max err / max {grad_err:.1e}")


def optional_weights(options):
    """The parameters that only the options read: q/k/v biases, q/k norm weights."""
    names = (["q_proj.bias", "k_proj.bias", "v_proj.bias"] if options.get("attention_bias") else []) + \
            (["q_norm.weight", "k_norm.weight"] if options.get("qk_norm") else [])
    return [f"model.layers.{i}.self_attn.{n}" for i in range(LAYERS) for n in names]


def check_options_matter():
    base, grads = loss_and_grad({}, random_params(None), all_grads=True)
    unused = optional_weights({"attention_bias": True, "qk_norm": "full"})
    check(all(grads[n] is None for n in unused), "no option: biases and q/k norm weights unread")
    for options in [{"rope_style": "interleaved"}, {"rope_scaling": LLAMA3}, {"attention_bias": True},
                    {"qk_norm": "head"}, {"qk_norm": "full"}, {"attn_logit_softcap": 1.0},
                    {"final_logit_softcap": 1.0}, {"sliding_window": 3}]:
        loss, grads = loss_and_grad(options, random_params(options.get("qk_norm")), all_grads=True)
        change = rel(loss, base)
        weights = optional_weights(options)
        read = all(grads[n] is not None and grads[n].abs().max() > 0 for n in weights)
        check(change > 1e-4 and read, f"{label(options)} changes the loss: {loss:.9g} vs default {base:.9g} "
                                      f"(rel {change:.1e})" + (f", its {len(weights)} weights all read" if weights else ""))


def hf_llama3_inv_freq(dim, base, rope_scaling):
    """Transcribed from huggingface/transformers src/transformers/modeling_rope_utils.py,
    _compute_default_rope_parameters and _compute_llama3_parameters, line for line."""
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    factor = rope_scaling["factor"]  # `8` in the original implementation
    low_freq_factor = rope_scaling["low_freq_factor"]  # `1` in the original implementation
    high_freq_factor = rope_scaling["high_freq_factor"]  # `4` in the original implementation
    old_context_len = rope_scaling["original_max_position_embeddings"]  # `8192` in the original implementation

    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor

    wavelen = 2 * math.pi / inv_freq
    # wavelen < high_freq_wavelen: do nothing
    # wavelen > low_freq_wavelen: divide by factor
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    # otherwise: interpolate between the two, using a smooth factor
    smooth_factor = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed_inv_freq = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
    is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    inv_freq_llama = torch.where(is_medium_freq, smoothed_inv_freq, inv_freq_llama)
    return inv_freq_llama


def check_llama3_scaling():
    # Llama 3.1, Llama 3.2, integer-valued fields, this test's small one.
    scalings = [(8.0, 1.0, 4.0, 8192), (32.0, 1.0, 4.0, 8192), (4, 2, 8, 64), (8.0, 1.0, 4.0, 16)]
    scalings = [dict(zip(["factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"], s))
                for s in scalings]
    bands = set()
    for scaling in scalings:
        scaling = {**scaling, "rope_type": "llama3"}
        for dim in (8, 16, 64, 128):
            for theta in (10000.0, 500000.0):
                ours, hf = rm.rope_inv_freq(dim, theta, scaling), hf_llama3_inv_freq(dim, theta, scaling)
                wavelen = 2 * math.pi / hf.double()
                old = scaling["original_max_position_embeddings"]
                bands |= {0 if w < old / scaling["high_freq_factor"] else 2 if w > old / scaling["low_freq_factor"]
                          else 1 for w in wavelen.tolist()}
                if not torch.equal(ours, hf):
                    check(False, f"llama3 inv_freq dim {dim} theta {theta} {scaling}: {ours} vs HF {hf}")
                    return
    check(bands == {0, 1, 2}, f"llama3 rope_scaling inverse frequencies bit-equal HF's on {len(scalings) * 8} "
                              f"(dim, theta, scaling) cases, all three bands met (kept, interpolated, divided)")


def check_sliding_window():
    p = random_params(None)
    full, g_full = loss_and_grad({}, p)
    for window in (T, T + 1, 100):
        loss, grad = loss_and_grad({"sliding_window": window}, p)
        check(loss == full and torch.equal(grad, g_full), f"sliding_window {window} >= seq {T} equals no window")
    g = torch.Generator().manual_seed(2)
    q, k = torch.randn(2, T, H * D, generator=g), torch.randn(2, T, G * D, generator=g)
    for softcap in (None, 1.0):
        probs = rm.attention_probs(q, k, H, G, softcap=softcap, window=1)
        check(torch.equal(probs, torch.eye(T).expand_as(probs)),
              f"sliding_window 1 (softcap {softcap}): attention probabilities one-hot on the diagonal")
    i = torch.arange(T)
    seen = (rm.attention_probs(q, k, H, G, window=3) > 0).all(0).all(0)
    check(torch.equal(seen, (i[:, None] - i[None, :] >= 0) & (i[:, None] - i[None, :] < 3)),
          "sliding_window 3: query i sees exactly keys i-2..i")


def converted_to_rotate_half(src, dst):
    """The interleaved bundle `src` as HF's converter would store it: q/k rows (and their moments) permuted."""
    shutil.copytree(src, dst)
    manifest = json.loads((dst / "manifest.json").read_text())
    H_, G_ = manifest["model"]["num_heads"], manifest["model"]["num_kv_heads"]
    del manifest["model"]["rope_style"]
    (dst / "manifest.json").write_text(json.dumps(manifest, indent=2))
    for entry in manifest["steps"]:
        for name in ("model.safetensors", "optimizer.safetensors"):
            path = dst / entry["dir"] / name
            if not path.exists():
                continue
            tensors = rm.read_safetensors(path)
            for key, value in tensors.items():
                heads = H_ if ".q_proj." in key else G_ if ".k_proj." in key else None
                if heads is not None and value.dim() == 2:
                    tensors[key] = rm.permute_for_rotate_half(value, heads)
            nanreplay_capture.write_safetensors(path, list(tensors.items()))
    return manifest


def replayed(cli, bundle, out):
    run = subprocess.run([cli, "run", str(bundle), "--out", str(out), "--json"], capture_output=True, text=True)
    return run.returncode, json.loads(run.stdout) if run.stdout else None


def check_through_cli(cli, work):
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    interleaved = work / "interleaved"
    subprocess.run([cli, "synth", "clean-llama3", str(interleaved)], check=True, stdout=subprocess.DEVNULL)
    converted = work / "rotate-half"
    manifest = converted_to_rotate_half(interleaved, converted)
    rc_a, a = replayed(cli, interleaved, work / "out-a")
    rc_b, b = replayed(cli, converted, work / "out-b")
    check(rc_a == 0 and rc_b == 0, f"nanreplay replays both layouts cleanly (exit {rc_a}, {rc_b})")
    if a and b:
        worst = max(max(rel(x["loss"], y["loss"]), rel(x["grad_norm"], y["grad_norm"]))
                    for x, y in zip(a["steps"], b["steps"]))
        check(worst <= 1e-5, f"nanreplay: interleaved on stored weights = rotate_half after HF's permute "
                             f"(worst relative gap over {len(a['steps'])} steps {worst:.1e})")
    manifest["model"]["rope_style"] = "interleaved"  # the converted weights read with the wrong convention
    (converted / "manifest.json").write_text(json.dumps(manifest, indent=2))
    rc_c, c = replayed(cli, converted, work / "out-c")
    check(rc_c == 1 and c and c["root_cause"]["code"] == "BUNDLE_DOES_NOT_REPRODUCE",
          f"the converted bundle read as interleaved does not reproduce its run (exit {rc_c})")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cli", required=True)
    ap.add_argument("--work", required=True)
    args = ap.parse_args()
    torch.set_num_threads(min(2, torch.get_num_threads()))
    check_rope_styles()
    check_options_matter()
    check_llama3_scaling()
    check_sliding_window()
    check_through_cli(args.cli, Path(args.work))
    print("all passed" if failures == 0 else f"{failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
