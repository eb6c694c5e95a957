"""The checkpoint formats `nanreplay import` reads, one module each, listed once in REGISTRY.

A format module has
    detect(path) -> str or None: why `path` (which exists) is in this format, or None when it is not;
    read(path) -> (state dict, whole loaded object or None, [(config dict, where)], label of what was read).
`--format auto` asks each in REGISTRY's order and takes the first that says yes (so a directory
holding both .metadata and config.json is DCP); `--format NAME` reads with that one. The command's
help (cli/import_command.cpp) takes the names from REGISTRY too: capture/gen_import_formats.py reads
this file's REGISTRY literal (with ast, no import) into a header at build time. A new format is a
module here and one row below (CONTRIBUTING.md, "Where to add an input format").
"""

import importlib
from pathlib import Path

from ..outcome import BadInput

REGISTRY = (  # (--format name, module in this package), in the order --format auto tries them
    ("dcp", "dcp"),
    ("hf", "hf"),
    ("torch", "torch_save"),
)

FORMATS = ("auto",) + tuple(name for name, _ in REGISTRY)


def format_module(name):
    """The module that reads --format `name` (one of REGISTRY's)."""
    module = dict(REGISTRY)[name]
    return importlib.import_module(f"{__name__}.{module}")


def detect_format(path):
    """(name, why) of the first format in REGISTRY that recognises `path`; bad input when none does."""
    p = Path(path)
    if not p.exists():
        raise BadInput(p, "--checkpoint", "does not exist")
    for name, _ in REGISTRY:
        why = format_module(name).detect(p)
        if why:
            return name, why
    if p.is_dir():
        raise BadInput(p, "--checkpoint", "a directory with neither .metadata (DCP) nor config.json / *.safetensors "
                                          "(Hugging Face)")
    raise BadInput(p, "--checkpoint", "neither a torch.save file, a safetensors file nor a checkpoint directory")
