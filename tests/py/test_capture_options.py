"""capture/nanreplay_capture.py and llama's model options (docs/capture.md, "Model options"):
what the recorder reads off a Hugging Face style `model.config`, what it takes from model_config,
what it refuses, and what it writes (the manifest's model section, the extra parameters in
steps/<s>/model.safetensors and optimizer.safetensors).

The models are tests/py/torch_models.py's tiny llama, with q/k/v biases or q/k norms where a case
needs them; the configs are plain objects carrying the attributes transformers' configs have
(no transformers needed). Only what the helper writes is checked: nanreplay is not run here.
~5 s with Debian's /usr/bin/python3.
"""
import argparse
import json
import shutil
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[1] / "capture"))
import nanreplay_capture  # noqa: E402
import torch_models  # noqa: E402
from nanreplay_capture import CaptureError  # noqa: E402

LLAMA = dict(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
             intermediate_size=48, norm_eps=1e-5, rope_theta=10000.0)
HEAD_DIM = LLAMA["hidden_size"] // LLAMA["num_heads"]
KV_WIDTH = LLAMA["num_kv_heads"] * HEAD_DIM
SEQ_LEN, MICRO_BATCH = 8, 2
OPTION_KEYS = ("rope_style", "rope_scaling", "attention_bias", "qk_norm", "attn_logit_softcap",
               "final_logit_softcap", "sliding_window", "layer_types")
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192}

failures = []


def check(ok, what):
    print(("ok   " if ok else "FAIL ") + what)
    if not ok:
        failures.append(what)


class Work:
    """A token shard and a fresh directory per bundle."""

    def __init__(self, root):
        self.root = root
        tokens = torch.randint(0, LLAMA["vocab_size"], (16 * SEQ_LEN + 1,), generator=torch.Generator().manual_seed(5))
        self.shard = root / "tokens.bin"
        self.shard.write_bytes(bytes(tokens.to(torch.int16).contiguous().view(torch.uint8).tolist()))
        self.tokens = tokens
        self.count = 0

    def next_dir(self):
        self.count += 1
        return self.root / f"bundle-{self.count}"


def make_model(config=None, **options):
    """The test's llama; `options` are torch_models' attention_bias / qk_norm; `config` becomes
    model.config, as a Hugging Face model carries it."""
    torch.manual_seed(0)
    model = torch_models.LlamaForCausalLM(dict(LLAMA, **options))
    if config is not None:
        model.config = config
    return model


def record(work, model, model_config=None, steps=2):
    """A Recorder over `model` with the given model_config, `steps` training steps, one dump.
    Returns (manifest, bundle path)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    recorder = nanreplay_capture.Recorder(
        model, opt, work.root / "incidents", arch="llama", window=steps,
        model_config=dict(dict(num_heads=LLAMA["num_heads"]), **(model_config or {})),
        data=dict(shards=[str(work.shard)], seq_len=SEQ_LEN, micro_batch_size=MICRO_BATCH))
    recorder.self_check = False  # options are given here that the test model does not compute (manifest checks only)
    for step in range(steps):
        samples = [2 * step, 2 * step + 1]
        window = torch.stack([work.tokens[i * SEQ_LEN:i * SEQ_LEN + SEQ_LEN + 1] for i in samples])
        recorder.begin_step(step, samples=samples)
        loss = model(window[:, :-1], window[:, 1:])
        loss.backward()
        recorder.end_step(loss=loss)
        opt.step()
        opt.zero_grad(set_to_none=True)
    bundle = recorder.dump(work.next_dir())
    return json.loads((bundle / "manifest.json").read_text()), bundle


def safetensors_header(path):
    """The JSON header of a safetensors file (8-byte LE length, then the header), keys in file order."""
    raw = Path(path).read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    header.pop("__metadata__", None)
    return header


def options_of(manifest):
    return {k: v for k, v in manifest["model"].items() if k in OPTION_KEYS}


def raises(what, fn, *needles):
    """fn() must raise CaptureError whose message holds every needle."""
    try:
        fn()
    except CaptureError as e:
        message = str(e)
        missing = [n for n in needles if n not in message]
        check(not missing, f"{what}: CaptureError names {list(needles)}" + (f" (got: {message})" if missing else ""))
        return
    check(False, f"{what}: raises CaptureError (it did not)")


def check_parameters_written(label, manifest, bundle, names_and_shapes):
    """steps/<s>/model.safetensors holds expected_parameters() in its order, the option's extra
    parameters among them with their shapes; optimizer.safetensors their moments."""
    expected = nanreplay_capture.expected_parameters("llama", manifest["model"])
    for entry in manifest["steps"]:
        header = safetensors_header(bundle / entry["dir"] / "model.safetensors")
        got = [(name, tuple(v["shape"])) for name, v in header.items()]
        check(got == [(n, tuple(s)) for n, s in expected],
              f"{label}: step {entry['step']} model.safetensors is expected_parameters() in order")
        check(all(header.get(n, {}).get("shape") == list(s) for n, s in names_and_shapes),
              f"{label}: step {entry['step']} holds {[n for n, _ in names_and_shapes]} with shapes "
              f"{[list(s) for _, s in names_and_shapes]}")
        opt = safetensors_header(bundle / entry["dir"] / "optimizer.safetensors")
        check(all(f"{n}.exp_avg" in opt and f"{n}.exp_avg_sq" in opt for n, _ in names_and_shapes),
              f"{label}: step {entry['step']} optimizer.safetensors has their AdamW moments")


def parameter_order():
    """expected_parameters: the extras sit in the replay's parameter-table order."""
    cfg = dict(LLAMA, max_seq_len=SEQ_LEN, tie_embeddings=False, attention_bias=True, qk_norm="head")
    names = [n for n, _ in nanreplay_capture.expected_parameters("llama", cfg)]
    layer = [n[len("model.layers.0."):] for n in names if n.startswith("model.layers.0.")]
    check(layer == ["input_layernorm.weight", "self_attn.q_proj.weight", "self_attn.q_proj.bias",
                    "self_attn.k_proj.weight", "self_attn.k_proj.bias", "self_attn.v_proj.weight",
                    "self_attn.v_proj.bias", "self_attn.o_proj.weight", "self_attn.q_norm.weight",
                    "self_attn.k_norm.weight", "post_attention_layernorm.weight", "mlp.gate_proj.weight",
                    "mlp.up_proj.weight", "mlp.down_proj.weight"], f"expected_parameters: one layer's order {layer}")
    check(names[0] == "model.embed_tokens.weight" and names[-2:] == ["model.norm.weight", "lm_head.weight"],
          "expected_parameters: embeddings first, final norm and head last")
    plain = dict(cfg, attention_bias=False, qk_norm=None)
    check(len(nanreplay_capture.expected_parameters("llama", plain)) == 2 + 9 * LLAMA["num_layers"] + 1,
          "expected_parameters: no extras with the options off")
    full = dict(nanreplay_capture.expected_parameters("llama", dict(cfg, qk_norm="full")))
    check(full["model.layers.1.self_attn.q_norm.weight"] == (LLAMA["hidden_size"],)
          and full["model.layers.1.self_attn.k_norm.weight"] == (KV_WIDTH,),
          "expected_parameters: qk_norm 'full' norms are num_heads*head_dim and num_kv_heads*head_dim wide")


def defaults(work):
    manifest, _ = record(work, make_model())
    check(options_of(manifest) == {}, f"plain llama without model.config: no option keys {options_of(manifest)}")
    given = dict(rope_style="rotate_half", rope_scaling=None, attention_bias=False, qk_norm=None,
                 attn_logit_softcap=None, final_logit_softcap=None, sliding_window=None)
    manifest, _ = record(work, make_model(), given, steps=1)
    check(options_of(manifest) == {}, "options given at their defaults are not written")
    llama = SimpleNamespace(model_type="llama", attention_bias=False, rope_scaling=None, head_dim=HEAD_DIM)
    manifest, _ = record(work, make_model(llama), steps=1)
    check(options_of(manifest) == {}, f"an HF Llama config (attention_bias False, no rope_scaling): no option keys "
                                      f"{options_of(manifest)}")


def qk_norm_from_config(work):
    qwen3 = SimpleNamespace(model_type="qwen3", attention_bias=False, rope_theta=LLAMA["rope_theta"],
                            rope_scaling=None, sliding_window=None, use_sliding_window=False)
    manifest, bundle = record(work, make_model(qwen3, qk_norm="head"))
    check(options_of(manifest) == {"qk_norm": "head"}, f"qwen3 config: qk_norm 'head' {options_of(manifest)}")
    check_parameters_written("qwen3", manifest, bundle,
                             [(f"model.layers.{i}.self_attn.{w}_norm.weight", (HEAD_DIM,))
                              for i in range(LLAMA["num_layers"]) for w in "qk"])
    # OLMo 2's config also means its post-norm layout, which this pre-norm test model lacks: refused by
    # the norm it misses (tests/py/test_family_olmo2.py imports a real one); qk_norm 'full' given instead.
    olmo2 = SimpleNamespace(model_type="olmo2", attention_bias=False, rope_scaling=None)
    raises("an olmo2 config on a pre-norm model", lambda: record(work, make_model(olmo2, qk_norm="full"), steps=1),
           "post_feedforward_layernorm")
    manifest, bundle = record(work, make_model(qk_norm="full"), dict(qk_norm="full"), steps=1)
    check(options_of(manifest) == {"qk_norm": "full"}, f"qk_norm 'full' given: {options_of(manifest)}")
    check_parameters_written("olmo2", manifest, bundle,
                             [("model.layers.0.self_attn.q_norm.weight", (LLAMA["hidden_size"],)),
                              ("model.layers.0.self_attn.k_norm.weight", (KV_WIDTH,))])


def attention_bias_from_config(work):
    qwen2 = SimpleNamespace(model_type="qwen2", rope_scaling=None, sliding_window=4096, use_sliding_window=False,
                            max_window_layers=28)
    manifest, bundle = record(work, make_model(qwen2, attention_bias=True))
    check(options_of(manifest) == {"attention_bias": True},
          f"qwen2 config (no attention_bias attribute, window off): attention_bias only {options_of(manifest)}")
    check_parameters_written("qwen2", manifest, bundle,
                             [("model.layers.0.self_attn.q_proj.bias", (LLAMA["hidden_size"],)),
                              ("model.layers.0.self_attn.k_proj.bias", (KV_WIDTH,)),
                              ("model.layers.1.self_attn.v_proj.bias", (KV_WIDTH,))])
    llama = SimpleNamespace(model_type="llama", attention_bias=True, rope_scaling=dict(LLAMA3_SCALING))
    manifest, _ = record(work, make_model(llama, attention_bias=True), steps=1)
    check(options_of(manifest) == {"attention_bias": True, "rope_scaling": LLAMA3_SCALING},
          f"config attention_bias True and llama3 rope_scaling {options_of(manifest)}")
    with_type = dict(LLAMA3_SCALING, type="llama3")
    del with_type["rope_type"]
    manifest, _ = record(work, make_model(SimpleNamespace(model_type="llama", rope_scaling=with_type)), steps=1)
    check(manifest["model"].get("rope_scaling") == LLAMA3_SCALING, "rope_scaling spelled with 'type' is normalised")


def softcaps_and_windows(work):
    # Gemma 2's softcapping attributes, read under their names whatever the family (a llama given them here:
    # a real gemma2 config brings Gemma 2's whole block, tests/py/test_family_gemma3.py).
    capped = SimpleNamespace(model_type="llama", attn_logit_softcapping=50.0, final_logit_softcapping=30,
                             sliding_window=None, attention_bias=False)
    manifest, _ = record(work, make_model(capped), steps=1)
    check(options_of(manifest) == {"attn_logit_softcap": 50.0, "final_logit_softcap": 30.0},
          f"Gemma 2's softcapping attributes {options_of(manifest)}")
    raises("Cohere 2 config with its alternating sliding window and no layer_types",
           lambda: record(work, make_model(SimpleNamespace(model_type="cohere2", sliding_window=4096)), steps=1),
           "sliding_window", "cohere2")
    mistral = SimpleNamespace(model_type="mistral", sliding_window=16, rope_scaling=None)
    manifest, _ = record(work, make_model(mistral), steps=1)
    check(options_of(manifest) == {"sliding_window": 16}, f"Mistral sliding_window {options_of(manifest)}")
    qwen2 = SimpleNamespace(model_type="qwen2", sliding_window=16, use_sliding_window=True, max_window_layers=0)
    manifest, _ = record(work, make_model(qwen2, attention_bias=True), steps=1)
    check(options_of(manifest) == {"attention_bias": True, "sliding_window": 16},
          f"Qwen2 use_sliding_window with every layer sliding {options_of(manifest)}")
    raises("Qwen2 window on only some layers",
           lambda: record(work, make_model(SimpleNamespace(model_type="qwen2", sliding_window=16,
                                                           use_sliding_window=True, max_window_layers=1),
                                           attention_bias=True), steps=1),
           "max_window_layers", "layer_types")
    kinds = ["full_attention", "sliding_attention"]  # model.layer_types: the window is the sliding layers'
    manifest, _ = record(work, make_model(SimpleNamespace(model_type="mistral", sliding_window=16, layer_types=kinds)),
                         steps=1)
    check(options_of(manifest) == {"sliding_window": 16, "layer_types": kinds},
          f"layer_types mixing full and sliding layers {options_of(manifest)}")


def by_hand(work):
    given = dict(rope_style="interleaved", rope_scaling=dict(LLAMA3_SCALING), attn_logit_softcap=20,
                 final_logit_softcap=15.0, sliding_window=4)
    manifest, _ = record(work, make_model(), given, steps=1)
    check(options_of(manifest) == dict(given, attn_logit_softcap=20.0),
          f"without model.config, model_config's options are written {options_of(manifest)}")
    manifest, bundle = record(work, make_model(attention_bias=True, qk_norm="head"),
                              dict(attention_bias=True, qk_norm="head"), steps=1)
    check(options_of(manifest) == {"attention_bias": True, "qk_norm": "head"},
          "attention_bias and qk_norm given by hand")
    check_parameters_written("by hand", manifest, bundle, [("model.layers.1.self_attn.q_proj.bias", (32,)),
                                                           ("model.layers.1.self_attn.k_norm.weight", (HEAD_DIM,))])
    for key, bad in (("sliding_window", 0), ("attn_logit_softcap", -1.0), ("qk_norm", "per_head"),
                     ("rope_style", "neox"), ("attention_bias", "yes")):
        raises(f"model_config {key}={bad!r}", lambda: record(work, make_model(), {key: bad}, steps=1), key)


def refusals(work):
    raises("q/k/v biases without attention_bias", lambda: record(work, make_model(attention_bias=True), steps=1),
           "model.layers.0.self_attn.q_proj.bias", "attention_bias")
    raises("q/k norms without qk_norm", lambda: record(work, make_model(qk_norm="head"), steps=1),
           "model.layers.0.self_attn.q_norm.weight", "qk_norm")
    raises("HF llama config (no qk_norm word) with q/k norms and none given",
           lambda: record(work, make_model(SimpleNamespace(model_type="llama"), qk_norm="full"), steps=1),
           "q_norm.weight", "qk_norm")
    raises("qk_norm 'full' given for per-head norms",
           lambda: record(work, make_model(qk_norm="head"), dict(qk_norm="full"), steps=1),
           "q_norm.weight", f"({HEAD_DIM},)", "qk_norm='full'")
    raises("attention_bias given, model without biases", lambda: record(work, make_model(), dict(attention_bias=True),
                                                                        steps=1),
           "q_proj.bias", "attention_bias")

    def o_bias():
        model = make_model(attention_bias=True)
        model.model.layers[0].self_attn.o_proj.bias = torch.nn.Parameter(torch.zeros(LLAMA["hidden_size"]))
        record(work, model, dict(attention_bias=True), steps=1)
    raises("a bias on o_proj", o_bias, "model.layers.0.self_attn.o_proj.bias")

    qwen3 = SimpleNamespace(model_type="qwen3", attention_bias=False)
    raises("model_config qk_norm contradicting model.config",
           lambda: record(work, make_model(qwen3, qk_norm="head"), dict(qk_norm="full"), steps=1),
           "model_config['qk_norm']", "'full'", "model_type 'qwen3'", "'head'")
    raises("model_config attention_bias contradicting model.config",
           lambda: record(work, make_model(qwen3, attention_bias=True, qk_norm="head"), dict(attention_bias=True),
                          steps=1),
           "model_config['attention_bias']", "model.config.attention_bias")
    raises("rope_style 'interleaved' for a Hugging Face model",
           lambda: record(work, make_model(qwen3, qk_norm="head"), dict(rope_style="interleaved"), steps=1),
           "rope_style", "interleaved", "rotate_half")
    raises("model_config sliding_window contradicting Mistral's",
           lambda: record(work, make_model(SimpleNamespace(model_type="mistral", sliding_window=16)),
                          dict(sliding_window=8), steps=1),
           "sliding_window", "16", "8")
    raises("an unsupported rope_scaling type",
           lambda: record(work, make_model(SimpleNamespace(model_type="llama", rope_scaling={
               "rope_type": "longrope", "factor": 4.0, "original_max_position_embeddings": 32768})), steps=1),
           "longrope", "llama3", "yarn")
    raises("yarn rope_scaling with a bad beta_fast",
           lambda: record(work, make_model(), dict(rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                                 "original_max_position_embeddings": 32,
                                                                 "beta_fast": -1.0}), steps=1),
           "beta_fast")
    raises("dynamic rope_scaling given by hand",
           lambda: record(work, make_model(), dict(rope_scaling={"type": "dynamic", "factor": 2.0}), steps=1),
           "dynamic")
    raises("llama3 rope_scaling missing a key",
           lambda: record(work, make_model(), dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}), steps=1),
           "low_freq_factor")
    raises("a config head_dim the model's projections do not have",
           lambda: record(work, make_model(SimpleNamespace(model_type="qwen3", head_dim=16), qk_norm="head"), steps=1),
           "q_proj", "head_dim=16")

    def gpt2_option():
        model = torch_models.GPT2(dict(vocab_size=64, hidden_size=32, num_layers=1, num_heads=4,
                                       max_seq_len=SEQ_LEN, norm_eps=1e-5))
        opt = torch.optim.AdamW(model.parameters())
        nanreplay_capture.Recorder(model, opt, work.root, arch="gpt2", model_config=dict(num_heads=4, sliding_window=4),
                                   data=dict(shards=[str(work.shard)], seq_len=SEQ_LEN, micro_batch_size=1))
    raises("an option on gpt2", gpt2_option, "sliding_window", "llama")

    def two_decays():  # refused when the Recorder is made, not when an incident is being written
        model = make_model()
        params = list(model.parameters())
        opt = torch.optim.AdamW([{"params": params[:2], "weight_decay": 0.1}, {"params": params[2:], "weight_decay": 0.05}])
        nanreplay_capture.Recorder(model, opt, work.root, arch="llama", model_config=dict(num_heads=LLAMA["num_heads"]),
                                   data=dict(shards=[str(work.shard)], seq_len=SEQ_LEN, micro_batch_size=MICRO_BATCH))
    raises("two non-zero weight decays, at construction", two_decays, "one weight decay", "0.05", "0.1")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cli", required=True, help="nanreplay (not run here: only the helper's output is checked)")
    ap.add_argument("--work", required=True)
    args = ap.parse_args()
    root = Path(args.work)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    torch.set_num_threads(1)
    started = time.perf_counter()
    work = Work(root)
    parameter_order()
    defaults(work)
    qk_norm_from_config(work)
    attention_bias_from_config(work)
    softcaps_and_windows(work)
    by_hand(work)
    refusals(work)
    print(f"{len(failures)} failed; {time.perf_counter() - started:.1f} s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
