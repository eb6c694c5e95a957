"""torchtitan's numerics capture, read as the bundle's logged site statistics (docs/import.md, "torchtitan
numerics logs").

torchtitan's numerics debugging (agent_tooling/numerics_debugging/activation_tracer.py, wired into its
Profiler by `--profiler.dump_numerics`) captures one training step, the one `--profiler.profile_freq`
names, and writes `{dump_folder}/numerics/rank_{R}_activations.log` per rank: a header, then one block
per captured ATen op, keyed `[module_fqn/op_N_opname]` (N counts that module's captures in dispatch
order), with `Shape: torch.Size([...]), Dtype: ...`, `L2 norm`, `Min`, `Max`, `Mean` (each `%.6e`),
hashes, `Location`, and `Phase: backward` where the op ran in the backward. The file does not say
which step it holds: the user does (STEP=PATH).

Each module's output is the last op of each of its forward calls (every call dispatches the same ops,
so the forward captures repeat with a period; an RMSNorm's pow, mul, mul repeat per micro-batch); its
`max_abs` is max(|Min|, |Max|) and its `rms` sqrt(L2^2 / numel), pooled over calls and ranks as the
bundle's site statistics are (bundle-format.md). This is not a checkpoint format: it is not in
REGISTRY, and `nanreplay import --torchtitan-numerics` reads it beside the checkpoint.
"""

import math
import os
import re
from pathlib import Path

from ..inputs import bounded_lines
from ..outcome import BadInput, say, warn

_MAX_FILE_BYTES = 2**30  # one step's captures: a few hundred bytes per op
_MAX_LINE = 2**20
_MAX_RANK_FILES = 4096
_MAX_CALL_OPS = 100_000  # forward captures of one module in one step: a few per micro-batch

# torchtitan module FQN -> nanreplay site (docs/probe-sites.md). wq and wk are left out: nanreplay's
# attn.q and attn.k are after rotary, which keeps their rms but moves their largest |x|.
_SITES = (
    (r"tok_embeddings", "embed"),
    (r"layers\.(\d+)\.attention_norm", "layers.{}.attn_norm"),
    (r"layers\.(\d+)\.attention(?:\.qkv_linear)?\.wv", "layers.{}.attn.v"),
    (r"layers\.(\d+)\.attention\.wo", "layers.{}.attn.out"),
    (r"layers\.(\d+)\.ffn_norm", "layers.{}.mlp_norm"),
    (r"layers\.(\d+)\.feed_forward\.w1", "layers.{}.mlp.gate"),
    (r"layers\.(\d+)\.feed_forward\.w3", "layers.{}.mlp.up"),
    (r"layers\.(\d+)\.feed_forward\.w2", "layers.{}.mlp.down"),
    (r"norm", "final_norm"),
    (r"output|lm_head", "logits"),
)
_NOT_MAPPED = ("attention.wq", "attention.wk")
_KEY = re.compile(r"\[([A-Za-z0-9_.<>\-]{1,512})/op_(\d{1,9})_([A-Za-z0-9_.]{1,128})\]")
_SHAPE = re.compile(r"torch\.Size\(\[([0-9, ]{0,200})\]\), Dtype: torch\.[a-z0-9_]{1,32}")
_STAT_KEYS = ("Shape", "L2 norm", "Min", "Max")


def site_of(fqn):
    """nanreplay's site for a torchtitan module FQN, or None."""
    for pattern, site in _SITES:
        m = re.fullmatch(pattern, fqn)
        if m:
            return site.format(*m.groups())
    return None


def rank_files(path, flag):
    """The rank_R_activations.log files PATH names: the file itself, or every one in the directory."""
    p = Path(path)
    if not p.exists():
        raise BadInput(p, flag, "does not exist")
    if p.is_file():
        return [p]
    if not p.is_dir():
        raise BadInput(p, flag, "is neither a file nor a directory")
    files = sorted(f for f in p.iterdir() if re.fullmatch(r"rank_\d{1,6}_activations\.log", f.name))
    if not files:
        raise BadInput(p, flag, "holds no rank_<R>_activations.log (torchtitan's numerics/ directory)")
    if len(files) > _MAX_RANK_FILES:
        raise BadInput(p, flag, f"holds {len(files)} rank files, more than {_MAX_RANK_FILES}")
    return files


def _lines(path):
    """(line number, text) of one log, streamed, the file and each line bounded."""
    if not os.path.isfile(path):
        raise BadInput(path, "file", "is not a regular file")
    lines = bounded_lines(
        path, _MAX_FILE_BYTES, _MAX_LINE,
        lambda size: f"{size} bytes, more than the {_MAX_FILE_BYTES >> 30} GiB one step's captures take; refused before reading",
        f"longer than {_MAX_LINE >> 20} MiB: not a numerics log line")
    for n, text in lines:
        yield n, text.rstrip("\r\n")


def _number(text, path, where):
    try:
        value = float(text)
    except ValueError:
        raise BadInput(path, where, "is not a number") from None
    return value


def _blocks(path):
    """Each capture block: (line, fqn, op index, op name, {stat: text}, phase)."""
    lines = _lines(path)
    first = next(lines, (1, ""))
    if not re.fullmatch(r"Total captured activations: \d{1,12}", first[1]):
        raise BadInput(path, "line 1", "is not 'Total captured activations: N': not a torchtitan numerics log "
                                       "(numerics/rank_<R>_activations.log)")
    block = None
    for n, text in lines:
        if text.startswith("["):
            if block:
                yield block
            m = _KEY.fullmatch(text)
            if not m:
                raise BadInput(path, f"line {n}", "is not a capture key [module_fqn/op_N_opname]")
            block = (n, m.group(1), int(m.group(2)), m.group(3), {}, "forward")
        elif block and text.startswith("  ") and ": " in text:
            key, value = text[2:].split(": ", 1)
            if key == "Phase":
                block = block[:5] + (value,)
            elif key in ("Shape", "L2 norm", "Min", "Max", "Mean"):
                block[4][key] = value
    if block:
        yield block


def _output_ops(ops):
    """The last op of each forward call: the captures repeat with the period of one call."""
    names = [o[1] for o in ops]
    period = next(p for p in range(1, len(names) + 1)
                  if len(names) % p == 0 and all(names[i] == names[i % p] for i in range(len(names))))
    return ops[period - 1::period]


def _stat(path, block):
    """(max_abs, sum of squares, numel) of one capture, or None where a value is not finite."""
    n, fqn, index, _, stats, _ = block
    where = f"[{fqn}/op_{index}]"
    for key in _STAT_KEYS:
        if key not in stats:
            raise BadInput(path, f"{where}.{key}", "missing: a forward capture of a mapped module needs it")
    m = _SHAPE.fullmatch(stats["Shape"])
    if not m:
        raise BadInput(path, f"{where}.Shape", "is not 'torch.Size([...]), Dtype: torch.<dtype>'")
    dims = [int(d) for d in m.group(1).replace(" ", "").split(",") if d]
    if len(dims) > 8 or any(d > 2**40 for d in dims) or math.prod(dims) >= 2**50:
        raise BadInput(path, f"{where}.Shape", "is not a tensor's shape (at most 8 dimensions, fewer than 2^50 elements)")
    numel = math.prod(dims)
    l2, lo, hi = (_number(stats[k], path, f"{where}.{k}") for k in ("L2 norm", "Min", "Max"))
    if not all(math.isfinite(v) for v in (l2, lo, hi)):
        return None
    if l2 < 0 or lo > hi or numel == 0:
        raise BadInput(path, f"{where}.L2 norm", "a negative norm, Min above Max or an empty tensor: not a capture")
    return max(abs(lo), abs(hi)), l2 * l2, numel


def read_site_stats(path, flag):
    """({site: {"max_abs", "rms"}} pooled over the rank files PATH names, [sites left out: a non-finite
    capture, whose finite elements' statistics the log cannot give], [modules not mapped])."""
    pooled, nonfinite, unmapped = {}, set(), set()
    for f in rank_files(path, flag):
        per_module = {}
        for block in _blocks(f):
            n, fqn, index, op, stats, phase = block
            count = per_module.setdefault(fqn, [0, []])
            if index != count[0]:
                raise BadInput(f, f"line {n}", f"op index {index} where the log's order gives {count[0]}")
            count[0] += 1
            if phase == "forward" and stats and site_of(fqn):
                if len(count[1]) >= _MAX_CALL_OPS:
                    raise BadInput(f, f"line {n}", f"more than {_MAX_CALL_OPS} forward captures of one module")
                count[1].append((block, op))
            elif fqn.endswith(_NOT_MAPPED):
                unmapped.add(fqn)
        for fqn, (_, ops) in per_module.items():
            site = site_of(fqn)
            if not ops or site in nonfinite:
                continue
            values = [_stat(f, block) for block, _ in _output_ops(ops)]
            if any(v is None for v in values):
                nonfinite.add(site)
                pooled.pop(site, None)
                continue
            acc = pooled.setdefault(site, [0.0, 0.0, 0])
            for max_abs, sum_sq, numel in values:
                acc[0], acc[1], acc[2] = max(acc[0], max_abs), acc[1] + sum_sq, acc[2] + numel
    stats = {site: {"max_abs": a[0], "rms": math.sqrt(a[1] / a[2])} for site, a in pooled.items()}
    return stats, sorted(nonfinite), sorted(unmapped)


def numerics_steps(values, first, last):
    """--torchtitan-numerics STEP=PATH, each given once: {step: path}, every step in FIRST..LAST."""
    steps = {}
    for value in values:
        m = re.fullmatch(r"(\d{1,18})=(.+)", value)
        if not m:
            raise BadInput("command line", "--torchtitan-numerics", "expected STEP=PATH (the bundle step the capture holds)")
        step = int(m.group(1))
        if not first <= step <= last:
            raise BadInput("command line", "--torchtitan-numerics", f"step {step} is outside --steps {first}:{last}")
        if step in steps:
            raise BadInput("command line", "--torchtitan-numerics", f"step {step} given twice")
        steps[step] = m.group(2)
    return steps


def logged_site_stats(steps):
    """{step: site_stats} for the bundle's state.json, each step's captures read and pooled."""
    out = {}
    for step, path in sorted(steps.items()):
        stats, nonfinite, unmapped = read_site_stats(path, "--torchtitan-numerics")
        if not stats:
            raise BadInput(path, "--torchtitan-numerics", "holds no forward capture of a module nanreplay has a site "
                                                          "for (tok_embeddings, layers.N.attention.wv/wo, ...)")
        say(f"torchtitan numerics: step {step}: {len(stats)} sites' max |x| and rms ({', '.join(sorted(stats))})")
        if nonfinite:
            warn(f"torchtitan numerics: step {step}: left out {', '.join(nonfinite)}: a capture holds a non-finite "
                 "value, so its finite elements' max |x| and rms are not in the log")
        if unmapped:
            say(f"torchtitan numerics: not compared: {len(unmapped)} wq/wk captures (nanreplay's attn.q and attn.k "
                "are after rotary, which moves their largest |x|)")
        out[step] = stats
    return out
