"""The tests' cache of `nanreplay synth` outputs, shared with the Catch2 tests (tests/synth_cache.h).

Every exec of the CLI pays LibTorch's start (~0.8 s of CPU on the CI machine) while writing a preset takes
milliseconds, and the suite writes the same presets hundreds of times. The first plain
`synth PRESET DIR [--checkpoint-every N] [--steps N] [--lr LR] [--json]` of a CLI binary runs into
$TMPDIR/nanreplay-test-synth-<uid>/<sha256 of the binary>/<key>; later ones copy that tree and give back its
stdout/stderr with the directory's name swapped in. Flags naming files, an environment, an existing target or
one inside a bundle run the CLI as usual. NANREPLAY_TEST_SYNTH_CACHE=0 turns it off.
"""
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

DIR_MARK = "\x01DIR\x01"
VALUE_FLAGS = ("--checkpoint-every", "--steps", "--lr")
_digests = {}


def _enabled():
    return os.environ.get("NANREPLAY_TEST_SYNTH_CACHE") != "0"


def _flags_cacheable(flags):
    i = 0
    while i < len(flags):
        if flags[i] == "--json":
            i += 1
        elif flags[i] in VALUE_FLAGS and i + 1 < len(flags):
            i += 2
        else:
            return False
    return True


def _target(args, env):
    """The target directory of a cacheable synth, or None."""
    if not _enabled() or env is not None or len(args) < 3 or args[0] != "synth":
        return None
    if args[1].startswith("-") or args[2].startswith("-") or not _flags_cacheable(args[3:]):
        return None
    target = Path(args[2]).absolute()
    if target.exists() or not target.parent.is_dir():
        return None
    if any((d / "manifest.json").exists() for d in target.parents):
        return None  # synth refuses to write inside a bundle; the cache's folder would not be
    return target


def _binary_folder(cli):
    cli = str(Path(cli).resolve())
    if cli not in _digests:
        _digests[cli] = hashlib.sha256(Path(cli).read_bytes()).hexdigest()
    # One folder per OpenMP thread count too: synth's training sums in another order with another count
    # (tests/synth_cache.h names it alike).
    threads = os.environ.get("OMP_NUM_THREADS")
    suffix = "" if threads is None else "-omp" + "".join(c for c in threads if c.isdigit() or c == ",")
    folder = Path(tempfile.gettempdir()) / f"nanreplay-test-synth-{os.getuid()}" / (_digests[cli] + suffix)
    folder.mkdir(parents=True, exist_ok=True)
    os.utime(folder)  # in use: the Catch2 side prunes folders untouched for two hours
    return folder


def _key(args):
    joined = "".join(a + "\0" for i, a in enumerate(args) if i != 2)
    return hashlib.sha256(joined.encode()).hexdigest()[:32]


def _fill(cli, args, entry, timeout):
    filling = Path(f"{entry}.fill-{os.getpid()}")
    made = subprocess.run([cli, args[0], args[1], str(filling), *args[3:]], capture_output=True, text=True,
                          timeout=timeout)
    if made.returncode != 0:
        shutil.rmtree(filling, ignore_errors=True)
        return False
    Path(f"{entry}.out").write_text(made.stdout.replace(str(filling), DIR_MARK))
    Path(f"{entry}.err").write_text(made.stderr.replace(str(filling), DIR_MARK))
    try:
        os.rename(filling, entry)
    except OSError:  # another process published it first
        shutil.rmtree(filling, ignore_errors=True)
    return True


def run(cli, args, env=None, timeout=600):
    """subprocess.run([cli, *args], capture_output=True, text=True), a plain synth from the cache."""
    args = [str(a) for a in args]
    target = _target(args, env)
    if target is not None:
        entry = _binary_folder(cli) / _key(args)
        if entry.is_dir() or _fill(cli, args, entry, timeout):
            shutil.copytree(entry, target, symlinks=True)
            out = Path(f"{entry}.out").read_text().replace(DIR_MARK, args[2])
            err = Path(f"{entry}.err").read_text().replace(DIR_MARK, args[2])
            return subprocess.CompletedProcess([cli, *args], 0, out, err)
    return subprocess.run([cli, *args], capture_output=True, text=True, env=env, timeout=timeout)


def synth(cli, *args, check=True):
    """`nanreplay synth args...` through the cache; raises CalledProcessError on failure if `check`."""
    done = run(cli, ["synth", *args])
    if check and done.returncode != 0:
        raise subprocess.CalledProcessError(done.returncode, done.args, done.stdout, done.stderr)
    return done
