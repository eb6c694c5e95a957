"""End to end: a plain PyTorch training loop really goes NaN, capture/nanreplay_capture.py
captures it, and `nanreplay run` names the origin PyTorch's own forward hooks saw.

The run: a tiny llama (HF naming, GQA, norm_eps = 0, token 0 the padding index, so
its embedding row is zero and never trained) learns from uint16 shards read through
DistributedSampler + DataLoader. One document carries a stray token 0; the step that
reads it divides zero by zero in layers.0.input_layernorm. Checked: the automatic
bundle (shards copied whole, randperm sampler kept), an on-demand "window" bundle
(compact shard, rewritten sample indices), and a nanoGPT-style gpt2 captured on demand
from arbitrary token offsets. Also prints the recorder's per-step cost on a healthy
step. Deterministic (one thread); ~15 s with Debian's /usr/bin/python3, ~25 s on a busy 2-core machine.
"""
import argparse
import json
import math
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[1] / "capture"))
import nanreplay_capture  # noqa: E402
import torch_models  # noqa: E402

LLAMA = dict(vocab_size=96, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
             intermediate_size=128, norm_eps=0.0, rope_theta=10000.0)
GPT2 = dict(vocab_size=96, hidden_size=48, num_layers=2, num_heads=4, max_seq_len=40, norm_eps=1e-5)
SEQ_LEN, MICRO_BATCH, ACCUM = 32, 2, 2
NUM_SAMPLES = 128
PAD = 0
SAMPLER_SEED = 1234
FAULT_STEP, FAULT_MICRO, FAULT_POSITION = 13, 1, 7
WINDOW = 10
TOLERANCE = 1e-5

# Module whose output is a probe site (docs/probe-sites.md). q/k projections are probed after rotary,
# which maps finite to finite and non-finite to non-finite, so their outputs stand for the sites.
MODULE_SITES = [
    (r"model\.embed_tokens", "embed"),
    (r"model\.layers\.(\d+)\.input_layernorm", "layers.{}.attn_norm"),
    (r"model\.layers\.(\d+)\.self_attn\.q_proj", "layers.{}.attn.q"),
    (r"model\.layers\.(\d+)\.self_attn\.k_proj", "layers.{}.attn.k"),
    (r"model\.layers\.(\d+)\.self_attn\.v_proj", "layers.{}.attn.v"),
    (r"model\.layers\.(\d+)\.self_attn\.o_proj", "layers.{}.attn.out"),
    (r"model\.layers\.(\d+)\.post_attention_layernorm", "layers.{}.mlp_norm"),
    (r"model\.layers\.(\d+)\.mlp\.gate_proj", "layers.{}.mlp.gate"),
    (r"model\.layers\.(\d+)\.mlp\.up_proj", "layers.{}.mlp.up"),
    (r"model\.layers\.(\d+)\.mlp\.down_proj", "layers.{}.mlp.down"),
    (r"model\.norm", "final_norm"),
    (r"lm_head", "logits"),
]

failures = []


def check(ok, what):
    print(("ok   " if ok else "FAIL ") + what)
    if not ok:
        failures.append(what)


def site_of_module(name):
    for pattern, site in MODULE_SITES:
        m = re.fullmatch(pattern, name)
        if m:
            return site.format(*m.groups())
    return None


class FirstNonfiniteHook:
    """Forward hooks on every module: the first module output (in completion order) that holds a
    non-finite value, decoded as docs/probe-sites.md says ([batch, position, features], row-major first element)."""

    def __init__(self, model):
        self.where = None  # (step, micro_batch, sample ids of the batch rows)
        self.found = None
        for name, module in model.named_modules():
            module.register_forward_hook(self._hook(name))

    def _hook(self, name):
        def hook(module, inputs, output):
            if self.found is not None or not isinstance(output, torch.Tensor):
                return
            bad = ~torch.isfinite(output.detach())
            if not bad.any():
                return
            flat = int(bad.reshape(-1).nonzero()[0])
            value = float(output.detach().reshape(-1)[flat])
            step, micro, ids = self.where
            found = {"module": name, "step": step, "micro_batch": micro,
                     "kind": "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")}
            if output.dim() == 3:
                B, T, C = output.shape
                found["sample"], found["position"] = ids[flat // (T * C)], (flat // C) % T
            self.found = found
        return hook


class TokenWindows(Dataset):
    """Sample i: tokens [i*L, i*L + L + 1) of the concatenated uint16 shards (as bundle v1 reads them, docs/bundle-format.md)."""

    def __init__(self, shard_paths, seq_len):
        parts = [torch.frombuffer(bytearray(Path(p).read_bytes()), dtype=torch.int16).to(torch.int64) & 0xFFFF
                 for p in shard_paths]
        self.tokens, self.seq_len = torch.cat(parts), seq_len

    def __len__(self):
        return (len(self.tokens) - 1) // self.seq_len

    def __getitem__(self, i):
        return i, self.tokens[i * self.seq_len:i * self.seq_len + self.seq_len + 1]


def write_shards(work):
    """Random tokens in [1, vocab) over two uint16 shards, with one stray PAD in the sample
    that step FAULT_STEP reads as micro-batch FAULT_MICRO, row 0."""
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(1, LLAMA["vocab_size"], (NUM_SAMPLES * SEQ_LEN + 1,), generator=g)
    perm = torch.randperm(NUM_SAMPLES, generator=torch.Generator().manual_seed(SAMPLER_SEED)).tolist()
    bad_sample = perm[FAULT_STEP * MICRO_BATCH * ACCUM + FAULT_MICRO * MICRO_BATCH]
    tokens[bad_sample * SEQ_LEN + FAULT_POSITION] = PAD
    paths = [work / "shard_000.bin", work / "shard_001.bin"]
    half = len(tokens) // 2
    for path, part in zip(paths, (tokens[:half], tokens[half:])):
        path.write_bytes(bytes(part.to(torch.int16).contiguous().view(torch.uint8).tolist()))
    return paths, bad_sample


def make_llama():
    torch.manual_seed(0)
    model = torch_models.LlamaForCausalLM(LLAMA, padding_idx=PAD)
    decay = [p for n, p in model.named_parameters() if p.dim() == 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=3e-3, betas=(0.9, 0.95), eps=1e-8)
    warmup = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 8))
    return model, opt, warmup


def llama_data(shards):
    return dict(shards=[str(p) for p in shards], token_dtype="uint16", seq_len=SEQ_LEN,
                micro_batch_size=MICRO_BATCH, grad_accum_steps=ACCUM, world_size=1,
                sampler=dict(kind="randperm", seed=SAMPLER_SEED, epoch=0, epoch_start_step=0))


def train_until_nan(work, shards, **recorder_options):
    """The training loop a user writes, plus the recorder's two calls. Returns what it saw."""
    model, opt, sched = make_llama()
    hooks = FirstNonfiniteHook(model)
    recorder = nanreplay_capture.Recorder(model, opt, work / "incidents", arch="llama",
                                          model_config=dict(num_heads=LLAMA["num_heads"],
                                                            rope_theta=LLAMA["rope_theta"]),
                                          data=llama_data(shards), grad_clip=1.0,
                                          **dict(dict(window=WINDOW), **recorder_options))
    dataset = TokenWindows(shards, SEQ_LEN)
    sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=SAMPLER_SEED, drop_last=True)
    sampler.set_epoch(0)
    batches = iter(DataLoader(dataset, batch_size=MICRO_BATCH, sampler=sampler))
    logged = {}
    for step in range(40):
        micro_batches = [next(batches) for _ in range(ACCUM)]
        recorder.begin_step(step, samples=[int(i) for ids, _ in micro_batches for i in ids])
        total = 0.0
        for micro, (ids, window) in enumerate(micro_batches):
            hooks.where = (step, micro, ids.tolist())
            loss = model(window[:, :-1], window[:, 1:])
            (loss / ACCUM).backward()
            total += loss.item()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        logged[step] = (total / ACCUM, float(norm))
        bundle = recorder.end_step(loss=total / ACCUM, grad_norm=norm)
        if bundle is not None:
            return recorder, hooks.found, bundle, logged
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
    raise AssertionError("the training run never went NaN")


def run_nanreplay(cli, bundle, out):
    shutil.rmtree(out, ignore_errors=True)
    proc = subprocess.run([cli, "run", str(bundle), "--out", str(out)], capture_output=True, text=True)
    report_path = Path(out) / "report.json"
    report = json.loads(report_path.read_text()) if report_path.exists() else None
    return proc, report


def rel_err(a, b):
    return abs(a - b) / max(abs(b), 1e-12)


def check_healthy_steps(label, report, logged):
    for row in report["steps"]:
        if row["step"] not in logged or not all(map(math.isfinite, logged[row["step"]])):
            continue
        loss, norm = logged[row["step"]]
        check(rel_err(row["loss"], loss) <= TOLERANCE and rel_err(row["grad_norm"], norm) <= TOLERANCE,
              f"{label} step {row['step']}: replayed loss {row['loss']:.9g} / grad norm {row['grad_norm']:.9g} "
              f"match the run's {loss:.9g} / {norm:.9g}")


def check_no_capture_findings(label, report):
    # These would mean the bundle misstates the run (checksums, samples, parameters between steps).
    bad = [f["code"] for f in report["findings"]
           if f["code"] in ("BUNDLE_CHECKSUM_MISMATCH", "DATA_SAMPLER_MISMATCH") or f["code"].startswith("SYSTEM_")]
    check(not bad, f"{label}: no finding that says the capture misstates the run {bad}")


def check_origin(label, first, seen, sample):
    check(first is not None, f"{label}: reproduced")
    if first is None:
        return
    expect = {"step": seen["step"], "phase": "forward", "site": site_of_module(seen["module"]),
              "kind": seen["kind"], "rank": 0, "micro_batch": seen["micro_batch"], "position": seen["position"]}
    for key, value in expect.items():
        check(first[key] == value, f"{label}: first_nonfinite.{key} = {first[key]!r}, PyTorch hooks saw {value!r}")
    check(sample == seen["sample"], f"{label}: sample {sample} (in the run's dataset), PyTorch hooks saw {seen['sample']}")


def llama_incident(cli, work):
    shards, bad_sample = write_shards(work)
    recorder, seen, bundle, logged = train_until_nan(work, shards)
    print(f"PyTorch hooks: first non-finite output {seen}")
    check(seen["module"] == "model.layers.0.input_layernorm" and seen["step"] == FAULT_STEP
          and seen["sample"] == bad_sample and seen["position"] == FAULT_POSITION,
          "the run went NaN where the stray padding token is")
    manifest = json.loads((bundle / "manifest.json").read_text())
    steps = [e["step"] for e in manifest["steps"]]
    check(steps == list(range(FAULT_STEP - WINDOW + 1, FAULT_STEP + 1)), f"the bundle holds the last {WINDOW} steps {steps}")
    check(manifest["incident"] == {"step": FAULT_STEP, "symptom": "loss=nan"}, f"incident {manifest['incident']}")
    check(manifest["data"]["sampler"]["kind"] == "randperm", "small shards are copied whole and randperm is kept")
    check(len(recorder._ring) + len(recorder._free) <= WINDOW, "the ring holds at most `window` steps")

    proc, report = run_nanreplay(cli, bundle, work / "out-whole")
    check(proc.returncode == 1 and report is not None, f"nanreplay run exits 1 (got {proc.returncode}) {proc.stderr.strip()}")
    if report:
        first = report["first_nonfinite"]
        print("nanreplay: first_nonfinite", json.dumps(first))
        check_origin("whole", first, seen, first and first["sample"])
        check_healthy_steps("whole", report, logged)
        check_no_capture_findings("whole", report)

    compact = recorder.dump(work / "window-bundle", data_copy="window", symptom="loss=nan", incident_step=FAULT_STEP)
    manifest = json.loads((compact / "manifest.json").read_text())
    whole_bytes = sum(p.stat().st_size for p in (bundle / "data").iterdir())
    compact_bytes = (compact / "data" / "window.bin").stat().st_size
    check(manifest["data"]["sampler"]["kind"] == "explicit" and compact_bytes < whole_bytes,
          f"window mode: explicit samples, {compact_bytes} bytes of tokens instead of {whole_bytes}")
    proc, report = run_nanreplay(cli, compact, work / "out-window")
    check(proc.returncode == 1 and report is not None, f"nanreplay run (window bundle) exits 1 (got {proc.returncode})")
    if report and report["first_nonfinite"]:
        first = report["first_nonfinite"]
        entry = next(e for e in manifest["steps"] if e["step"] == first["step"])
        row = entry["samples"][first["rank"]].index(first["sample"])
        check_origin("window", first, seen, entry["original_samples"][first["rank"]][row])
        check_healthy_steps("window", report, logged)
        check_no_capture_findings("window", report)


def llama_incident_rolled(cli, work):
    """The same run captured in snapshot mode: a full snapshot every 4 steps, the last two kept,
    light records between; nanreplay rolls the window forward from the older snapshot."""
    every = 4
    (work / "rolled").mkdir()
    shards, _ = write_shards(work / "rolled")
    recorder, seen, bundle, logged = train_until_nan(work / "rolled", shards, snapshot_every=every)
    manifest = json.loads((bundle / "manifest.json").read_text())
    steps = [e["step"] for e in manifest["steps"]]
    older = (FAULT_STEP // every - 1) * every
    check(steps == list(range(older, FAULT_STEP + 1)), f"snapshot mode: the bundle starts at the older snapshot {steps}")
    with_checkpoint = [s for s in steps if (bundle / "steps" / str(s) / "model.safetensors").exists()]
    check(with_checkpoint == [older, older + every], f"snapshot mode: checkpoints only at the snapshots {with_checkpoint}")
    full_slots = sum(s.full for s in recorder._ring) + len(recorder._free)
    check(full_slots <= 2, f"snapshot mode holds two snapshots ({full_slots} full slots)")
    one_step = sum(3 * p.numel() * p.element_size() for p in recorder.params)
    check(recorder.host_bytes_bound == 2 * one_step, "snapshot mode's host bound is two snapshots")
    proc, report = run_nanreplay(cli, bundle, work / "out-rolled")
    check(proc.returncode == 1 and report is not None,
          f"nanreplay run (rolled bundle) exits 1 (got {proc.returncode}) {proc.stderr.strip()}")
    if report:
        first = report["first_nonfinite"]
        check_origin("rolled", first, seen, first and first["sample"])
        check_healthy_steps("rolled", report, logged)
        check_no_capture_findings("rolled", report)
        params = {row["step"]: row["params"] for row in report["steps"]}
        expected = {s: "checkpoint" if s in with_checkpoint else "derived" for s in steps}
        check(params == expected, f"rolled: steps[].params {params}")


def gpt2_on_demand(cli, work):
    """nanoGPT style: random token offsets (not sample boundaries), no sampler, dumped on demand."""
    g = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, GPT2["vocab_size"], (5000,), generator=g)
    shard = work / "gpt2.bin"
    shard.write_bytes(bytes(tokens.to(torch.int16).contiguous().view(torch.uint8).tolist()))
    torch.manual_seed(1)
    model = torch_models.GPT2(GPT2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    recorder = nanreplay_capture.Recorder(
        model, opt, work / "incidents", arch="gpt2", window=2, model_config=dict(num_heads=GPT2["num_heads"]),
        data=dict(shards=[str(shard)], seq_len=SEQ_LEN, micro_batch_size=MICRO_BATCH, grad_accum_steps=1),
        grad_clip=1.0)
    logged = {}
    last = len(tokens) - SEQ_LEN - 1
    for step in range(3):
        offsets = torch.randint(0, last, (MICRO_BATCH,), generator=g).tolist()
        if step == 2:  # the stream's last window and one overlapping it: the compaction's edge cases
            offsets = [last - 5, last]
        window = torch.stack([tokens[o:o + SEQ_LEN + 1] for o in offsets])
        recorder.begin_step(step, offsets=offsets)
        loss = model(window[:, :-1], window[:, 1:])
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        logged[step] = (loss.item(), float(norm))
        recorder.end_step(loss=loss, grad_norm=norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
    bundle = recorder.dump(work / "gpt2-bundle")
    manifest = json.loads((bundle / "manifest.json").read_text())
    check([e["step"] for e in manifest["steps"]] == [1, 2] and "original_offsets" in manifest["steps"][0],
          "gpt2: on-demand bundle of the last 2 steps, offsets kept beside the rewritten samples")
    compact = torch.frombuffer(bytearray((bundle / "data" / "window.bin").read_bytes()), dtype=torch.int16).long()
    same = all(torch.equal(compact[i * SEQ_LEN:i * SEQ_LEN + SEQ_LEN + 1], tokens[o:o + SEQ_LEN + 1])
               for e in manifest["steps"] for i, o in zip(e["samples"][0], e["original_offsets"][0]))
    check(same, "gpt2: every rewritten sample reads exactly the tokens the run read")
    proc, report = run_nanreplay(cli, bundle, work / "out-gpt2")
    check(proc.returncode == 0 and report is not None and not report["reproduced"],
          f"gpt2: nanreplay run exits 0 and finds nothing (got {proc.returncode}) {proc.stderr.strip()}")
    if report:
        check_healthy_steps("gpt2", report, logged)
        check_no_capture_findings("gpt2", report)


def healthy_step_cost(work):
    """Median time of a healthy training step with and without the recorder (two identical runs,
    steps interleaved so machine load hits both alike), and of the recorder's own calls."""
    shards = [work / "shard_000.bin", work / "shard_001.bin"]
    g = torch.Generator().manual_seed(3)  # no padding token: every step stays healthy
    windows = [torch.randint(1, LLAMA["vocab_size"], (MICRO_BATCH, SEQ_LEN + 1), generator=g) for _ in range(8)]
    runs = {}
    for label in ("without", "with"):
        model, opt, _ = make_llama()
        recorder = None
        if label == "with":
            recorder = nanreplay_capture.Recorder(model, opt, work / "overhead", arch="llama", window=WINDOW,
                                                  model_config=dict(num_heads=4, rope_theta=10000.0),
                                                  data=llama_data(shards), grad_clip=1.0)
            recorder.self_check = False  # it records samples other than the batches it times
        runs[label] = {"model": model, "opt": opt, "recorder": recorder, "steps": [], "calls": []}

    def one_step(run, step):
        model, opt, recorder = run["model"], run["opt"], run["recorder"]
        t0 = time.perf_counter()
        if recorder:
            recorder.begin_step(step, samples=[(step * 4 + r) % 120 for r in range(MICRO_BATCH * ACCUM)])
        t1 = time.perf_counter()
        total = 0.0
        for micro in range(ACCUM):
            w = windows[(step + micro) % len(windows)]
            loss = model(w[:, :-1], w[:, 1:])
            (loss / ACCUM).backward()
            total += loss.item()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        t2 = time.perf_counter()
        if recorder:
            recorder.end_step(loss=total / ACCUM, grad_norm=norm)
        t3 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step >= 2 * WINDOW:  # the ring is full (its buffers exist) and the allocator warm
            run["steps"].append(time.perf_counter() - t0)
            run["calls"].append((t1 - t0) + (t3 - t2))

    for step in range(80):
        for run in (runs["without"], runs["with"]) if step % 2 else (runs["with"], runs["without"]):
            one_step(run, step)
    base = statistics.median(runs["without"]["steps"])
    with_time = statistics.median(runs["with"]["steps"])
    call_time = statistics.median(runs["with"]["calls"])
    recorder = runs["with"]["recorder"]
    params = sum(p.numel() for p in recorder.params)
    print(f"healthy step ({params} parameters, window {WINDOW}, host bound {recorder.host_bytes_bound / 2**20:.2f} MiB): "
          f"median {base * 1e3:.3f} ms without the recorder, {with_time * 1e3:.3f} ms with; "
          f"begin_step + end_step take {call_time * 1e3:.3f} ms ({100 * call_time / base:.1f}% of the step)")
    check(call_time < 0.5 * base, "the recorder's calls cost well under half a tiny healthy step")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cli", required=True)
    ap.add_argument("--work", required=True)
    args = ap.parse_args()
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    # One thread: deterministic, and a tiny model gains nothing from more while other jobs share
    # the cores (two spinning OpenMP threads on a busy 2-core machine make each step ~15x slower).
    torch.set_num_threads(1)
    started = time.perf_counter()
    llama_incident(args.cli, work)
    llama_incident_rolled(args.cli, work)
    gpt2_on_demand(args.cli, work)
    healthy_step_cost(work)
    print(f"{len(failures)} failed; {time.perf_counter() - started:.1f} s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
