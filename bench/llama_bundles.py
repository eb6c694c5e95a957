"""fp32 llama bundles for the benchmarks (scripts/make_llama_bundle.py), made once in a work directory and
reused: bench_stream.py and bench_distributed.py."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def cached_llama_bundle(work, **shape):
    """The bundle of this shape in `work`, made on first use (its name holds every option that shapes it), read
    once into the page cache so the first timed run does not pay the disk. `shape`: make_llama_bundle options
    (hidden=512, layers=8, ...), micro-batch 1 and fp32 storage and compute unless given."""
    options = {"micro_batch": 1, "storage": "fp32", "compute": "fp32", **shape}
    Path(work).mkdir(parents=True, exist_ok=True)
    path = Path(work) / ("llama-" + "-".join(f"{k}{v}" for k, v in sorted(options.items())))
    if not path.exists():
        args = [f"--{k.replace('_', '-')}={v}" for k, v in options.items()]
        subprocess.run([sys.executable, str(ROOT / "scripts" / "make_llama_bundle.py"), str(path), *args],
                       check=True, stdout=subprocess.DEVNULL)
    for f in path.rglob("*.safetensors"):
        with open(f, "rb") as fh:
            while fh.read(1 << 24):
                pass
    return path
