"""nanreplay import: write a rolling-forward bundle (bundle v1 and its extensions) from a checkpoint
a user already has, in their framework's format and parameter naming, plus the token data, the data
order and what the training log says.

    /usr/bin/python3 capture/nanreplay_import.py --checkpoint PATH [--optimizer PATH]
        [--format auto|hf|torch|dcp] [--naming auto|hf|meta|torchtitan|megatron|nanogpt] [--config FILE]
        --data SHARD... [--token-dtype uint16|uint32] --seq-len N --micro-batch-size N [--grad-accum N]
        [--world-size N] (--sampler-seed N [--epoch N] [--epoch-start-step N] | --samples FILE)
        --log FILE --steps FIRST:LAST [--precision fp32|bf16|fp16|fp8] [--grad-clip X]
        [--betas B1,B2] [--eps X] [--weight-decay X] [--trust-pickle] --out DIR

`nanreplay import` (the C++ command) runs this script with the same flags into a fresh staging
directory, validates the result as `inspect` does and renames it into place. Run directly, the
script writes DIR itself (created; refused when it exists and is not empty). Bad input: exit 2 with
one line `nanreplay: error: <file>: <key>: <what is wrong>` on stderr. Needs torch (1.13 or later)
and the standard library only. Every pickle (torch.save files, torch.distributed.checkpoint
directories, whose format is parsed here) is read by a restricted unpickler that refuses anything but
tensors, plain data and a named list of framework classes; --trust-pickle lifts that for a file the
user trusts. --data may be repeated (shards in order); --token-dtype once, or once per shard.

This package is the helper's code, split by concern (docs/import.md, "Layout"): formats/ (one module
per --format, listed once in formats.REGISTRY), safe_pickle, inputs (bounded reading), naming,
model_settle, optimizer, window (log, samples, data), provenance, build (the bundle) and cli (flags,
main). capture/nanreplay_import.py, which the command runs, only starts cli.main.

Reference: docs/import.md in the nanreplay repository.
"""

import sys
from pathlib import Path

from .outcome import BadInput, fail, say, warn

try:
    import torch  # noqa: F401
except ImportError as _e:  # one line, as for any input the import cannot use
    sys.exit(fail(2, "bad_input", f"cannot be imported ({_e}); the import needs PyTorch (Debian: apt-get install "
                                  "python3-torch; or set NANREPLAY_PYTHON to a Python that has it)",
                  sys.executable, "torch"))

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import nanreplay_capture as _capture  # noqa: E402,F401  (safetensors writer, the bundle's parameter table, HF options)

# The names the single-file helper had, still reachable as nanreplay_import.NAME (the tests use them).
from .build import IMPORT_VERSION, build, load_checkpoint, settle_model_section  # noqa: E402,F401
from .checkpoint_state import find_model_state, find_optimizer_state  # noqa: E402,F401
from .cli import main, parse_args  # noqa: E402,F401
from .formats import FORMATS, REGISTRY, detect_format, format_module  # noqa: E402,F401
from .formats.dcp import read_dcp, read_dcp_from_format, read_dcp_metadata, read_dcp_with_torch  # noqa: E402,F401
from .formats.hf import read_hf, read_safetensors  # noqa: E402,F401
from .model_settle import (FLAG_OF, FLAGS_WHERE, _moe_config, check_parameters, expected_parameters,  # noqa: E402,F401
                           flag_config, framework_defaults, model_options, normalize_config, required_values,
                           settle_activation, settle_model)
from .naming import NAMINGS, Mapper, detect_naming, group_names, strip_prefix, unstack_megatron_layers  # noqa: E402,F401
from .optimizer import _unflatten_optimizer, read_optimizer  # noqa: E402,F401
from .provenance import (PROVENANCE_KINDS, check_first, check_incident_window, checkpoint_counters,  # noqa: E402,F401
                         hf_trainer_file)
from .safe_pickle import PickleRefused, _SafeUnpickler, _torch_load  # noqa: E402,F401
from .window import copy_shards, copy_windows, read_log, read_samples  # noqa: E402,F401
