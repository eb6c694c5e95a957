"""The command: its flags, checked, and main (exit 0, 2 for bad input, 3 for a bug here)."""

import argparse
import math
import os
import re
import shutil
import sys
from pathlib import Path

import nanreplay_capture as _capture

from .build import build
from .formats import FORMATS
from .formats.torchtitan_numerics import numerics_steps
from .inputs import _check_regular
from .naming import NAMINGS
from .optimizer import optimizer_kind
from .outcome import BadInput, _write_outcome, fail
from .window import _TOKEN_WIDTH


def _parser(kind=argparse.ArgumentParser):
    ap = kind(prog="nanreplay import", description=sys.modules[__package__].__doc__.split("\n\n")[0],
              add_help=kind is argparse.ArgumentParser)
    ap.add_argument("--checkpoint", required=True, help="the checkpoint: HF directory or safetensors file, "
                                                        "torch.save file, or torch.distributed.checkpoint directory")
    ap.add_argument("--optimizer", help="AdamW state: a torch.save file or DCP directory (default: the checkpoint's own, "
                                        "when it holds one, or HF Trainer's optimizer.pt beside the weights)")
    ap.add_argument("--optimizer-class", metavar="CLASS",
                    help="the optimizer's class, module and name (torch.optim.AdamW, torch.optim.Adam, "
                         "torch.optim.Adafactor, transformers.Adafactor, torch.optim.Muon); default: from the state's "
                         "entry and param_group names where they say it, AdamW for exp_avg/exp_avg_sq")
    ap.add_argument("--aux-optimizer", metavar="PATH",
                    help="a second optimizer's torch.save'd state of the same run, over the parameters the first does "
                         "not take (a torch.optim.Muon run's AdamW for embeddings, norms and the head)")
    ap.add_argument("--aux-optimizer-class", metavar="CLASS",
                    help="--aux-optimizer's class (default: from its state's names, as --optimizer-class)")
    ap.add_argument("--format", default="auto", choices=FORMATS)
    ap.add_argument("--naming", default="auto", choices=NAMINGS)
    ap.add_argument("--config", help="model config JSON (HF config.json, Meta params.json, nanoGPT/llama2.c model_args, "
                                     "Megatron args, or manifest model keys)")
    ap.add_argument("--num-heads", type=int, help="attention heads (before any config)")
    ap.add_argument("--num-kv-heads", type=int, help="key/value heads (checked against the k projection's rows)")
    ap.add_argument("--norm-eps", type=float, help="the norms' epsilon (before any config)")
    ap.add_argument("--rope-theta", type=float, help="the rotary base (before any config)")
    ap.add_argument("--rope-style", choices=("rotate_half", "interleaved"), help="the rotary convention (default: the "
                                                                                 "naming's, or the config's)")
    ap.add_argument("--tie-embeddings", choices=("true", "false"), help="whether the output head is the embedding")
    ap.add_argument("--activation", help="the MLP's activation, checked: silu (llama's SwiGLU) or gelu_tanh (gpt2)")
    ap.add_argument("--log-numbering", choices=("zero", "one"), help="zero: the log's step s is the update applied "
                    "after s updates (nanoGPT, llama2.c, a range() loop); one: the s-th update (torchtitan, HF Trainer); "
                    "default: the checkpoint's own counter's convention, else zero")
    ap.add_argument("--data", nargs="+", action="extend", required=True, metavar="SHARD",
                    help="token shards, in order; repeating the flag appends")
    ap.add_argument("--token-dtype", action="append", choices=tuple(_TOKEN_WIDTH),
                    help="uint16 (default) or uint32: once for every shard, or once per --data shard, in order")
    ap.add_argument("--seq-len", type=int, required=True)
    ap.add_argument("--micro-batch-size", type=int, required=True)
    ap.add_argument("--grad-accum", type=int, default=1)
    ap.add_argument("--world-size", type=int, default=1)
    ap.add_argument("--sampler-seed", type=int)
    ap.add_argument("--epoch", type=int, default=0)
    ap.add_argument("--epoch-start-step", type=int, default=0)
    ap.add_argument("--samples", help="JSON object: step -> per-rank sample lists")
    ap.add_argument("--log", required=True, help="JSON lines: step, lr, loss, optionally grad_norm, loss_scale, skipped")
    ap.add_argument("--steps", required=True, metavar="FIRST:LAST")
    ap.add_argument("--torchtitan-numerics", action="append", default=[], metavar="STEP=PATH",
                    help="torchtitan's numerics capture of bundle step STEP (numerics/rank_<R>_activations.log, or "
                         "that directory for every rank), written as that step's logged.site_stats (docs/import.md)")
    ap.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "fp16", "fp8"))
    ap.add_argument("--mtp-loss-scale", type=float, metavar="F",
                    help="required when the checkpoint holds multi-token prediction layers (DeepSeek-V3's): the "
                         "run's mtp_loss_scaling_factor F > 0 replays them in the loss as Megatron-LM does, 0 says the "
                         "run's loss left them out (docs/import.md)")
    ap.add_argument("--router-aux-loss-coef", type=float, metavar="F",
                    help="a mixture of experts: the run added the router's load-balancing loss times F (0: it added "
                         "none), in place of the config's rule (Hugging Face adds it only with output_router_logits; "
                         "docs/import.md)")
    ap.add_argument("--grad-clip", type=float)
    ap.add_argument("--betas", help="B1,B2 when the optimizer state does not say (default 0.9,0.999)")
    ap.add_argument("--eps", type=float, help="when the optimizer state does not say (default 1e-8)")
    ap.add_argument("--weight-decay", type=float, help="when the optimizer state does not say (default 0.01)")
    ap.add_argument("--trust-pickle", action="store_true",
                    help="load pickles (torch.save files, DCP) with Python's full unpickler: only for files you trust, "
                         "since a crafted pickle runs code (recorded in the manifest)")
    ap.add_argument("--out", required=True)
    return ap


class _ArgError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise _ArgError(message)


def _check_flags(ap, argv):
    """A mistyped flag is named, with the nearest real one, before argparse asks for required ones."""
    import difflib
    known = list(ap._option_string_actions)
    for token in argv:
        flag = token.split("=", 1)[0]
        if flag.startswith("--") and not any(k.startswith(flag) for k in known):  # argparse takes prefixes
            near = difflib.get_close_matches(flag, known, n=1)
            raise BadInput("command line", flag, f"unknown option '{flag}'" + (f"; did you mean '{near[0]}'?" if near else ""))


def parse_args(argv):
    ap = _parser(_Parser)
    _check_flags(ap, argv)
    try:
        args = ap.parse_args(argv)
    except _ArgError as e:
        m = re.search(r"(--[a-z-]+)", str(e))
        raise BadInput("command line", m.group(1) if m else "arguments", str(e))
    m = re.fullmatch(r"(\d+)[:-](\d+)", args.steps)  # FIRST:LAST, or FIRST-LAST as run takes it
    if not m or int(m.group(1)) > int(m.group(2)):
        raise BadInput("command line", "--steps", f"{args.steps!r} is not FIRST:LAST with FIRST <= LAST")
    args.first, args.last = int(m.group(1)), int(m.group(2))
    args.torchtitan_numerics = numerics_steps(args.torchtitan_numerics, args.first, args.last)
    dtypes = args.token_dtype or ["uint16"]
    if len(dtypes) not in (1, len(args.data)):
        raise BadInput("command line", "--token-dtype", f"given {len(dtypes)} times for {len(args.data)} --data shards: "
                                                        "give it once for all of them, or once per shard")
    args.token_dtypes = dtypes * len(args.data) if len(dtypes) == 1 else dtypes
    for flag, value in (("--checkpoint", args.checkpoint), ("--optimizer", args.optimizer),
                        ("--aux-optimizer", args.aux_optimizer), ("--config", args.config),
                        ("--log", args.log), ("--samples", args.samples), *(("--data", d) for d in args.data)):
        if value is not None and os.path.exists(value):  # missing ones are named where they are read
            _check_regular(value, flag)
    for flag, value, low in (("--seq-len", args.seq_len, 1), ("--micro-batch-size", args.micro_batch_size, 1),
                             ("--grad-accum", args.grad_accum, 1), ("--world-size", args.world_size, 1),
                             ("--epoch", args.epoch, 0), ("--epoch-start-step", args.epoch_start_step, 0)):
        if value < low:
            raise BadInput("command line", flag, f"must be >= {low}, got {value}")
    if (args.sampler_seed is None) == (args.samples is None):
        raise BadInput("command line", "--sampler-seed", "give exactly one of --sampler-seed (randperm) and --samples")
    if args.sampler_seed is not None and not 0 <= args.sampler_seed < 2**64:
        raise BadInput("command line", "--sampler-seed", "must be in [0, 2^64)")
    if args.mtp_loss_scale is not None and not (math.isfinite(args.mtp_loss_scale) and args.mtp_loss_scale >= 0):
        raise BadInput("command line", "--mtp-loss-scale", f"must be a finite number >= 0, got {args.mtp_loss_scale}")
    if args.grad_clip is not None and not (math.isfinite(args.grad_clip) and args.grad_clip > 0):
        raise BadInput("command line", "--grad-clip", "must be a finite number > 0")
    if args.betas is not None:
        try:
            b = [float(x) for x in args.betas.split(",")]
            assert len(b) == 2 and all(0 <= x < 1 for x in b)
            args.betas = b
        except (ValueError, AssertionError):
            raise BadInput("command line", "--betas", f"{args.betas!r} is not B1,B2 with each in [0, 1)")
    if args.eps is not None and not (math.isfinite(args.eps) and args.eps > 0):
        raise BadInput("command line", "--eps", "must be a finite number > 0")
    if args.weight_decay is not None and not (math.isfinite(args.weight_decay) and args.weight_decay >= 0):
        raise BadInput("command line", "--weight-decay", "must be a finite number >= 0")
    for flag, value, low in (("--num-heads", args.num_heads, 1), ("--num-kv-heads", args.num_kv_heads, 1)):
        if value is not None and value < low:
            raise BadInput("command line", flag, f"must be >= {low}, got {value}")
    if args.norm_eps is not None and not (math.isfinite(args.norm_eps) and args.norm_eps >= 0):
        raise BadInput("command line", "--norm-eps", "must be a finite number >= 0")
    if args.rope_theta is not None and not (math.isfinite(args.rope_theta) and args.rope_theta > 0):
        raise BadInput("command line", "--rope-theta", "must be a finite number > 0")
    if args.tie_embeddings is not None:
        args.tie_embeddings = args.tie_embeddings == "true"
    for flag, cls in (("--optimizer-class", args.optimizer_class), ("--aux-optimizer-class", args.aux_optimizer_class)):
        if cls is not None:
            optimizer_kind(cls, "command line", flag)  # an unknown class is refused before anything is read
    return args


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        _parser().print_help()
        return 0
    created = None
    try:
        args = parse_args(argv)
        out = Path(args.out)
        created = None if out.exists() else out  # run standalone: a failure removes what it made
        build(args)
        created = None
    except BadInput as e:
        return fail(2, "bad_input", e.what, e.file, e.key)
    except _capture.CaptureError as e:
        return fail(2, "bad_input", str(e), getattr(e, "file", "checkpoint"), "model")
    except Exception as e:  # a bug here, not bad input: the traceback, then one summary line
        import traceback
        traceback.print_exc()
        return fail(3, "internal", f"import: {type(e).__name__}: {e}")
    finally:
        if created is not None:
            shutil.rmtree(created, ignore_errors=True)
    _write_outcome()
    return 0
