"""The import's input formats are one registry (capture/nanreplay_import/formats/__init__.py,
REGISTRY): each row a module with detect(path) and read(path); `--format auto` asks them in its
order; the helper's --format choices and the command's help (cli/import_command.cpp, through the
header capture/gen_import_formats.py writes at build time) both come from it. ~2 s with Debian's
/usr/bin/python3.
"""
import argparse
import importlib.util
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "capture"))
import nanreplay_import as ni  # noqa: E402
from nanreplay_import import formats  # noqa: E402

failures = []


def check(ok, what):
    print(("ok   " if ok else "FAIL ") + what, flush=True)
    if not ok:
        failures.append(what)


def registry_rows():
    names = [name for name, _ in formats.REGISTRY]
    check(len(set(names)) == len(names) and "auto" not in names, f"REGISTRY names each format once: {names}")
    for name, _ in formats.REGISTRY:
        module = formats.format_module(name)
        check(callable(getattr(module, "detect", None)) and callable(getattr(module, "read", None)),
              f"{name}: {module.__name__} has detect(path) and read(path)")
    check(ni.FORMATS == ("auto", *names), f"the helper's --format choices are auto and the registry's: {ni.FORMATS}")
    spec = importlib.util.spec_from_file_location("gen_import_formats", ROOT / "capture" / "gen_import_formats.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    check(gen.format_names() == names, "capture/gen_import_formats.py reads the same list with ast (no import)")
    check(f'#define NANREPLAY_IMPORT_FORMATS "{"|".join(["auto", *names])}"' in gen.header(),
          "the header it writes defines the help's list")
    return names


def command_help(cli, names):
    proc = subprocess.run([cli, "import", "--help"], capture_output=True, text=True)
    want = f"[--format {'|'.join(['auto', *names])}]"
    check(proc.returncode == 0 and want in proc.stdout, f"nanreplay import --help lists {want}")


def detection(work):
    def detected(path):
        try:
            return ni.detect_format(path)[0]
        except ni.BadInput as e:
            return e.line()

    both = work / "dcp_and_config"
    both.mkdir()
    (both / ".metadata").write_bytes(b"")
    (both / "config.json").write_text("{}")
    hf = work / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    shards = work / "shards"
    shards.mkdir()
    (shards / "a.safetensors").write_bytes(b"")
    single = work / "w.safetensors"
    single.write_bytes(b"PK not a zip")
    saved = work / "ckpt.pt"
    torch.save({"w": torch.zeros(1)}, saved)
    legacy = work / "legacy.pt"
    torch.save({"w": torch.zeros(1)}, legacy, _use_new_zipfile_serialization=False)
    empty, text = work / "empty", work / "notes.txt"
    empty.mkdir()
    text.write_text("hello")
    for path, want in ((both, "dcp"), (hf, "hf"), (shards, "hf"), (single, "hf"), (saved, "torch"), (legacy, "torch")):
        check(detected(path) == want, f"auto: {path.name} is {want} ({detected(path)})")
    for path, said in ((empty, "a directory with neither .metadata (DCP) nor config.json / *.safetensors"),
                       (text, "neither a torch.save file, a safetensors file nor a checkpoint directory"),
                       (work / "missing", "--checkpoint: does not exist")):
        check(said in detected(path), f"auto: {path.name} is refused by name: {detected(path)}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cli", required=True)
    ap.add_argument("--work", required=True)
    args = ap.parse_args()
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    started = time.perf_counter()
    names = registry_rows()
    command_help(args.cli, names)
    detection(work)
    print(f"{len(failures)} failed; {time.perf_counter() - started:.1f} s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
