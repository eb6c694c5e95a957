#!/usr/bin/env python3
"""The include rules of docs/architecture.md, checked on the sources.

Every C++ folder has a layer; a file may include its own folder and the
folders below it, never one above. Findings are made only under
reports/triage/. No folder holds more than a fifth of the C++ source lines.
docs/architecture.md's layer table lists the folders in this order.
Standard library only; prints one line per violation and exits 1 on any.
"""
import os
import re
import sys

# Bottom to top. A folder's subfolders are layers of their own, listed where
# they sit (reports/triage/data below reports/triage, which calls its rules).
LAYERS = [
    "kernels",
    "loaders/base",
    "loaders/formats",
    "loaders/arch",
    "loaders/bundle",
    "probes",
    "reports/results",
    "replay/probing",
    "replay/arch",
    "replay/optim",
    "replay/step/ranks",
    "replay/step",
    "reports/triage/data",
    "reports/triage/numeric",
    "reports/triage/system",
    "reports/triage",
    "replay/workflows",
    "reports/outputs/trace",
    "reports/outputs",
    "synth",
    "cli",
]
SOURCE_ROOTS = ("kernels", "loaders", "probes", "replay", "reports", "synth", "cli")
FINDINGS_FOLDER = "reports/triage"
# The finding type itself defines make_finding.
FINDING_TYPE_FILES = {"reports/results/finding.h", "reports/results/finding.cpp"}
MAX_FOLDER_SHARE = 0.20
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"')


def sources(root):
    for top in SOURCE_ROOTS:
        for folder, _, names in os.walk(os.path.join(root, top)):
            for name in sorted(names):
                if name.endswith((".h", ".cpp", ".cu", ".cuh")):
                    yield os.path.relpath(os.path.join(folder, name), root)


def layer_of(path):
    return os.path.dirname(path)


def include_violations(root, files):
    out = []
    for path in files:
        mine = layer_of(path)
        if mine not in LAYERS:
            out.append(f"{path}: folder {mine} has no layer in scripts/check_layers.py")
            continue
        with open(os.path.join(root, path), encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                m = INCLUDE.match(line)
                if not m or not os.path.exists(os.path.join(root, m.group(1))):
                    continue  # system and generated headers
                theirs = layer_of(m.group(1))
                if theirs in LAYERS and LAYERS.index(theirs) > LAYERS.index(mine):
                    out.append(f"{path}:{number}: includes {m.group(1)}, a layer above ({theirs} over {mine})")
    return out


def finding_violations(root, files):
    out = []
    for path in files:
        if path.startswith(FINDINGS_FOLDER + "/") or path in FINDING_TYPE_FILES:
            continue
        with open(os.path.join(root, path), encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if "make_finding(" in line:
                    out.append(f"{path}:{number}: makes a finding outside {FINDINGS_FOLDER}/")
    return out


def share_violations(root, files):
    lines = {}
    for path in files:
        with open(os.path.join(root, path), encoding="utf-8") as f:
            lines[layer_of(path)] = lines.get(layer_of(path), 0) + sum(1 for _ in f)
    total = sum(lines.values())
    return [f"{folder}: {count} of {total} C++ lines ({100 * count / total:.1f} %), over {MAX_FOLDER_SHARE:.0%}"
            for folder, count in sorted(lines.items()) if count > MAX_FOLDER_SHARE * total]


def docs_violations(root):
    path = os.path.join(root, "docs", "architecture.md")
    with open(path, encoding="utf-8") as f:
        listed = [m.group(1).rstrip("/") for m in re.finditer(r"^\| `([a-z_/]+)/?` \|", f.read(), re.M)]
    if listed != LAYERS:
        return [f"docs/architecture.md: its layer table lists {listed}, the sources' layers are {LAYERS}"]
    return []


def main():
    root = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), ".."))
    files = list(sources(root))
    problems = (include_violations(root, files) + finding_violations(root, files) +
                share_violations(root, files) + docs_violations(root))
    for p in problems:
        print(p)
    print(f"check_layers: {len(files)} files, {len(LAYERS)} layers, {len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
