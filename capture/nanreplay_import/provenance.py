"""Where values came from, HF Trainer's files, the checkpoint's step counters and FIRST."""

import io
import json
import math
from pathlib import Path

import torch

import nanreplay_capture as _capture

from .inputs import _log_lines, _read_json
from .outcome import BadInput
from .safe_pickle import _torch_load
from .window import _number


PROVENANCE_KINDS = ("tensors", "checkpoint", "config", "flag", "naming", "default")


def _provenance_entry(kind, detail, value):
    """One entry of the manifest's provenance block (docs/bundle-format.md, "Provenance")."""
    assert kind in PROVENANCE_KINDS, kind
    entry = {"from": kind, "detail": detail}
    if isinstance(value, (bool, int, float, str)) or (isinstance(value, list) and
                                                      all(isinstance(v, (int, float)) for v in value)):
        entry["value"] = _capture._json_number(value) if isinstance(value, float) else value
    return entry


def _hyper_provenance(opt_notes, hyper):
    """optimizer.betas / eps / weight_decay: the param groups, a flag, or PyTorch's default."""
    out = {}
    for key in ("betas", "eps", "weight_decay"):
        note = next((n for n in opt_notes if n.startswith(key + " ")), None)
        if note is None:
            continue
        kind = "checkpoint" if "(param_groups)" in note else ("flag" if "(flag)" in note else "default")
        detail = {"checkpoint": "the optimizer's param_groups", "flag": "--" + key.replace("_", "-"),
                  "default": "PyTorch's AdamW default (the param_groups do not say it)"}[kind]
        out[f"optimizer.{key}"] = _provenance_entry(kind, detail, hyper.get(key))
    return out


def hf_trainer_file(checkpoint, fmt, name):
    """HF Trainer's `name` (optimizer.pt, trainer_state.json) beside the weights of a checkpoint-N
    directory, or None."""
    p = Path(checkpoint)
    if fmt != "hf" or not p.is_dir() or not (p / name).is_file():
        return None
    return str(p / name)


def _counter_value(value):
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def checkpoint_counters(obj, checkpoint, fmt):
    """[(name, updates applied, the log numbering its framework uses)]: the checkpoint's own step
    counters. torchtitan's train_state.step and HF Trainer's global_step count the updates done (saved
    after step N's update, logged from 1); Megatron's iteration too; nanoGPT's and llama2.c's iter_num
    is the iteration about to run (saved before its update, logged from 0)."""
    out = []
    state_path = hf_trainer_file(checkpoint, fmt, "trainer_state.json")
    if state_path:
        state = _read_json(state_path)
        n = _counter_value(state.get("global_step")) if isinstance(state, dict) else None
        if n is None:
            raise BadInput(state_path, "global_step", "missing or not an integer >= 0")
        out.append(("trainer_state.json: global_step", n, "one"))
    if isinstance(obj, dict):
        train_state = obj.get("train_state")
        if isinstance(train_state, io.BytesIO):  # torchtitan pickles its TrainState into the DCP checkpoint
            train_state.seek(0)
            train_state = _torch_load(train_state, f"{checkpoint}: train_state")
        step = train_state.get("step") if isinstance(train_state, dict) else obj.get("train_state.step")
        if step is not None:
            n = _counter_value(step)
            if n is None:
                raise BadInput(checkpoint, "train_state.step", f"not an integer >= 0 ({step!r})")
            out.append(("train_state.step", n, "one"))
        for key, numbering in (("iter_num", "zero"), ("iteration", "one")):
            if key in obj and _counter_value(obj[key]) is not None:
                out.append((key, _counter_value(obj[key]), numbering))
    return out


def check_first(args, counters, adam_step):
    """FIRST against the checkpoint's counters and the optimizer's step count: each says how many
    updates the parameters have seen, so FIRST is that count (log numbered from 0) or one more (from 1).
    Returns the numbering used; a conflict is bad input naming both sides."""
    numbering = args.log_numbering or (counters[0][2] if counters else "zero")
    base = 1 if numbering == "one" else 0
    how = (f"--log-numbering {numbering}" if args.log_numbering else
           f"{counters[0][0]}'s convention" if counters else "the docs' convention, steps counted from 0")
    for name, n, _ in counters:
        if args.first != n + base:
            raise BadInput("command line", "--steps", f"FIRST is {args.first}, but the checkpoint's {name} is {n}: it "
                           f"holds the parameters after {n} updates, so with the log numbered from {base} ({how}) "
                           f"FIRST is {n + base}" + ("" if args.log_numbering else
                                                     "; pass --log-numbering if your log counts otherwise"))
    if adam_step is not None:
        fp16 = args.precision == "fp16"  # the scaler's skipped steps do not count in AdamW's step
        updates = counters[0][1] if counters else args.first - base
        if adam_step != updates and not (fp16 and adam_step < updates):
            raise BadInput("command line", "--steps", f"FIRST is {args.first}, but the optimizer's step count is "
                           f"{adam_step}: with the log numbered from {base} ({how}) FIRST is {adam_step + base}"
                           + (f", and {counters[0][0]} says {counters[0][1]} updates" if counters else "")
                           + ("" if args.log_numbering or counters else
                              "; pass --log-numbering one if your log numbers a step after its update"))
    return numbering


def check_incident_window(args, first, last, has_optimizer):
    """A non-finite logged loss (not a step the fp16 scaler skipped) outside FIRST..LAST: the bundle
    would lose the incident, so it is bad input naming the step."""
    for _, line in _log_lines(args.log):
        try:
            obj = json.loads(line) if line.strip() else None
        except ValueError:
            continue  # read_log names a bad line inside the window
        if not isinstance(obj, dict) or not isinstance(obj.get("step"), int) or first <= obj["step"] <= last:
            continue
        loss = obj.get("loss")
        try:
            value = _number(loss, args.log, "loss") if loss is not None else 0.0
        except BadInput:
            continue
        if not math.isfinite(value) and obj.get("skipped") is not True:
            where = "before the checkpoint" if obj["step"] < first else "after the last imported step"
            fix = ("import a checkpoint from before it" if obj["step"] < first else
                   f"extend --steps to {first}:{obj['step']}" if has_optimizer else
                   "give the optimizer state (--optimizer) so that the replay can roll forward to it, and extend --steps")
            raise BadInput(args.log, f"step {obj['step']}.loss", f"{loss} is the logged incident, {where} (--steps "
                                                                  f"{first}:{last}): the bundle would lose it; {fix}")
