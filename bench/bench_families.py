"""A replay step of each model family against plain llama's, and (--baseline-cli) a newer CLI against an older one.

One-step fp32 bundles of one shape (default hidden 512, 8 layers, 8 heads of 64, MLP 1360, vocab 8192,
seq 256, micro-batch 2) are written once into --work: plain llama (bench/llama_bundles.py), then each family
on the same tokens and step, its manifest's model section switching the family's options on
(docs/bundle-format.md, "Model options") and its model.safetensors holding the keys they add
(scripts/make_llama_bundle.py's seeded writer; norm weights 1, everything else normal 0.02):
  gemma3       Gemma 3's text model: sandwich norms with the 1 + weight offset, scaled embeddings, per-head
               QK-norm, query_pre_attn_scalar, GeGLU, layer_types 5 sliding (window 64, local rotary base) : 1
               full (linearly scaled rotary), a tied head
  gpt-oss      GPT-OSS's attention: sinks, q/k/v/o biases, YaRN, alternating sliding (window 128) and full
  llama4       Llama 4's text attention: interleaved rotary, llama3 scaling, L2 QK-norm on rotary layers, a
               NoPE layer in 4 with temperature tuning, attention_chunk_size
  yarn         plain llama with YaRN rotary alone
  layer-types  plain llama with alternating sliding (window 64) and full layers alone
Every bundle is replayed by `nanreplay run BUNDLE -q --threads T` (OMP_NUM_THREADS=T) in a fresh child,
the bundles in turn within a repetition, the order reversed every other repetition, --reps times. Three times
per run: the child's wall time and the replay step's own seconds from report.json (timings.steps[0]:
forward, backward and every probe, without start-up, loading, checks or writing), and the child's CPU
seconds (user + system, its own rusage: less swayed than wall time by other work on a shared machine).
Printed per family: the median of each, the ratio of medians to plain llama's and its spread (min-max of
the per-repetition ratios, each against the same repetition's llama run). The loss of every run is kept: each
bundle must give the same loss on every repetition.

With --baseline-cli OLD, the plain llama bundle is also replayed by OLD and by --nanreplay, alternately
(which goes first alternating), --reps times, and the ratios new / old of the three times are printed with
their spreads; both must give the same loss.

Usage: /usr/bin/python3 bench/bench_families.py [--nanreplay build/nanreplay --work bench-work/families
       --families gemma3,gpt-oss,llama4,yarn,layer-types --reps 9 --threads 2 --hidden 512 --layers 8
       --seq 256 --micro-batch 2 --vocab 8192 --baseline-cli OLD_CLI --skip-families]
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from llama_bundles import cached_llama_bundle

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import make_llama_bundle  # noqa: E402  (its seeded, streamed safetensors writer)


def family_options(name, layers, seq):
    """The manifest model keys a family adds to plain llama's (the same widths everywhere)."""
    alternating = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    if name == "gemma3":
        return {"norm_layout": "sandwich", "rms_norm_offset": True, "scale_embeddings": True, "qk_norm": "head",
                "query_pre_attn_scalar": 64.0, "hidden_act": "gelu_pytorch_tanh", "norm_eps": 1e-6,
                "layer_types": ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)],
                "sliding_window": 64, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
                "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "tie_embeddings": True}
    if name == "gpt-oss":
        return {"attention_bias": True, "o_proj_bias": True, "attention_sinks": True, "layer_types": alternating,
                "sliding_window": 128, "rope_theta": 150000.0,
                "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096,
                                 "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False}}
    if name == "llama4":
        return {"rope_style": "interleaved", "rope_theta": 500000.0, "qk_norm": "l2",
                "rope_scaling": {"rope_type": "llama3", "factor": 16.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 1.0, "original_max_position_embeddings": 8192},
                "no_rope_layers": [0 if (i + 1) % 4 == 0 else 1 for i in range(layers)],
                "attn_temperature_tuning": {"floor_scale": 8192.0, "attn_scale": 0.1},
                "attention_chunk_size": max(8192, seq)}
    if name == "yarn":
        return {"rope_scaling": {"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096,
                                 "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False}}
    if name == "layer-types":
        return {"layer_types": alternating, "sliding_window": 64}
    sys.exit(f"bench_families: unknown family {name!r}")


def param_specs(m):
    """(key, shape) for a llama-family model section (docs/bundle-format.md, the keys and the options' keys)."""
    C, H, G, V, F = m["hidden_size"], m["num_heads"], m["num_kv_heads"], m["vocab_size"], m["intermediate_size"]
    D = m.get("head_dim") or C // H
    specs = [("model.embed_tokens.weight", [V, C])]
    for i in range(m["num_layers"]):
        p = f"model.layers.{i}."
        specs += [(p + "input_layernorm.weight", [C]),
                  (p + "self_attn.q_proj.weight", [H * D, C]),
                  (p + "self_attn.k_proj.weight", [G * D, C]),
                  (p + "self_attn.v_proj.weight", [G * D, C]),
                  (p + "self_attn.o_proj.weight", [C, H * D])]
        if m.get("attention_bias"):
            specs += [(p + "self_attn.q_proj.bias", [H * D]), (p + "self_attn.k_proj.bias", [G * D]),
                      (p + "self_attn.v_proj.bias", [G * D])]
        if m.get("o_proj_bias"):
            specs += [(p + "self_attn.o_proj.bias", [C])]
        if m.get("qk_norm") == "head":
            specs += [(p + "self_attn.q_norm.weight", [D]), (p + "self_attn.k_norm.weight", [D])]
        if m.get("attention_sinks"):
            specs += [(p + "self_attn.sinks", [H])]
        specs += [(p + "post_attention_layernorm.weight", [C])]
        if m.get("norm_layout") == "sandwich":
            specs += [(p + "pre_feedforward_layernorm.weight", [C]), (p + "post_feedforward_layernorm.weight", [C])]
        specs += [(p + "mlp.gate_proj.weight", [F, C]), (p + "mlp.up_proj.weight", [F, C]),
                  (p + "mlp.down_proj.weight", [C, F])]
    specs += [("model.norm.weight", [C])]
    return specs if m.get("tie_embeddings") else specs + [("lm_head.weight", [V, C])]


def family_bundle(a, llama, name):
    """The family's bundle beside plain llama's: its tokens and step (hard links), its model, its weights."""
    out = a.work / f"{name}-{llama.name}"
    if not (out / "manifest.json").exists():
        stage = a.work / f".{out.name}.staging-{os.getpid()}"
        shutil.rmtree(stage, ignore_errors=True)
        shutil.rmtree(out, ignore_errors=True)
        manifest = json.loads((llama / "manifest.json").read_text())
        manifest["model"].update(family_options(name, manifest["model"]["num_layers"], manifest["data"]["seq_len"]))
        manifest["generator"] = {"script": "bench/bench_families.py", "family": name, "from": llama.name, "seed": 0}
        for f in llama.rglob("*"):
            if f.is_file() and f.name not in ("manifest.json", "model.safetensors"):
                (stage / f.relative_to(llama)).parent.mkdir(parents=True, exist_ok=True)
                os.link(f, stage / f.relative_to(llama))
        for s in manifest["steps"]:
            make_llama_bundle.write_safetensors(stage / s["dir"] / "model.safetensors", param_specs(manifest["model"]),
                                                "fp32", 0)
        (stage / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
        os.rename(stage, out)
    for f in out.rglob("*.safetensors"):  # into the page cache, as cached_llama_bundle does
        with open(f, "rb") as fh:
            while fh.read(1 << 24):
                pass
    return out


def replay(a, cli, bundle, env):
    """One `nanreplay run` in a fresh child: (wall seconds, the replay step's seconds, loss, CPU seconds)."""
    out = a.work / f"out-{bundle.name[:24]}"
    shutil.rmtree(out, ignore_errors=True)
    cmd = [str(cli), "run", str(bundle), "--out", str(out), "-q", "--threads", str(a.threads)]
    t0 = time.perf_counter()
    child = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    err = child.stderr.read()  # -q: only errors, so this cannot fill the pipe while the child runs
    child.stderr.close()
    _, status, usage = os.wait4(child.pid, 0)  # this child's own rusage
    wall = time.perf_counter() - t0
    code = os.waitstatus_to_exitcode(status)
    if code != 0:  # clean bundles: a finding (1) is as wrong as a failure
        sys.exit(f"bench_families: {' '.join(cmd)} exited {code}: {err.decode(errors='replace')}")
    report = json.loads((out / "report.json").read_text())
    step = report["timings"]["steps"][0]["seconds"] if "timings" in report else float("nan")
    return wall, step, report["steps"][0]["loss"], usage.ru_utime + usage.ru_stime


def spread(xs):
    return f"{min(xs):.3f}-{max(xs):.3f}"


def compare(a, sides, env):
    """Interleaved repetitions of every (label, cli, bundle) side: {label: [(wall, step, loss)]}."""
    runs = {label: [] for label, _, _ in sides}
    for rep in range(a.reps):
        for label, cli, bundle in (sides if rep % 2 == 0 else sides[::-1]):
            runs[label].append(replay(a, cli, bundle, env))
        print(f"  repetition {rep + 1}/{a.reps}: " +
              ", ".join(f"{label} {runs[label][-1][0]:.2f} s" for label, _, _ in sides), flush=True)
    for label, r in runs.items():
        if len({x[2] for x in r}) != 1:
            sys.exit(f"bench_families: {label}: the loss changed between repetitions: {[x[2] for x in r]}")
    return runs


def table(runs, reference, labels):
    """Per label: the median step, wall and CPU seconds, each one's ratio of medians to `reference` and the
    spread (min-max) of the per-repetition ratios."""
    kinds = ((1, "step"), (0, "wall"), (3, "CPU"))
    print(f"{'':<13}" + "".join(f"{name + ' s':>8}{'ratio':>7}{'spread':>13}" for _, name in kinds) + f"{'loss':>11}")
    ref = runs[reference]
    for label in labels:
        r = runs[label]
        line = f"{label:<13}"
        for k, _ in kinds:
            per_rep = [x[k] / y[k] for x, y in zip(r, ref)]
            median = statistics.median(x[k] for x in r)
            line += f"{median:>8.3f}{median / statistics.median(y[k] for y in ref):>7.3f}{spread(per_rep):>13}"
        print(line + f"{r[0][2]:>11.6f}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nanreplay", type=Path, default=ROOT / "build" / "nanreplay")
    ap.add_argument("--work", type=Path, default=ROOT / "bench-work" / "families")
    ap.add_argument("--families", default="gemma3,gpt-oss,llama4,yarn,layer-types")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--baseline-cli", type=Path, help="an older nanreplay: plain llama, --nanreplay / this")
    ap.add_argument("--skip-families", action="store_true", help="only the --baseline-cli comparison")
    a = ap.parse_args()
    a.work = a.work.absolute()
    a.work.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads), NO_COLOR="1", NANREPLAY_PROGRESS_INTERVAL="3600")
    env.setdefault("GOMP_SPINCOUNT", "10000")
    llama = cached_llama_bundle(a.work, hidden=a.hidden, layers=a.layers, seq_len=a.seq, vocab=a.vocab,
                                micro_batch=a.micro_batch)
    families = [] if a.skip_families else [f for f in a.families.split(",") if f]
    bundles = {"llama": llama, **{f: family_bundle(a, llama, f) for f in families}}
    for b in bundles.values():  # untimed: the binaries and LibTorch into the page cache, each bundle checked
        subprocess.run([str(a.nanreplay), "inspect", str(b)], check=True, stdout=subprocess.DEVNULL, env=env)
    print(f"uptime: {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} {os.getloadavg()[2]:.2f} (load 1, 5, 15 min)")
    if families:
        print(f"== families / plain llama: `nanreplay run`, one step, hidden {a.hidden}, {a.layers} layers, "
              f"seq {a.seq}, micro-batch {a.micro_batch}, {a.threads} threads, {a.reps} repetitions", flush=True)
        runs = compare(a, [(name, a.nanreplay, b) for name, b in bundles.items()], env)
        table(runs, "llama", list(bundles))
    if a.baseline_cli:
        subprocess.run([str(a.baseline_cli), "inspect", str(llama)], check=True, stdout=subprocess.DEVNULL, env=env)
        print(f"== plain llama, {a.nanreplay} (new) / {a.baseline_cli} (old), {a.reps} repetitions", flush=True)
        runs = compare(a, [("old", a.baseline_cli, llama), ("new", a.nanreplay, llama)], env)
        if runs["old"][0][2] != runs["new"][0][2]:
            print(f"bench_families: note: the losses differ: old {runs['old'][0][2]}, new {runs['new'][0][2]}")
        table(runs, "old", ["old", "new"])
    print(f"uptime: {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} {os.getloadavg()[2]:.2f} (load 1, 5, 15 min)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
