#!/usr/bin/env bash
# The capture helper's FSDP path on a real FSDP: Debian 12's torch 1.13 cannot
# run FSDP at all (docs/capture.md, "FSDP"), so CI tests that path with
# stand-ins only; this runs capture/examples/fsdp_nan.py under PyTorch 2.6 in
# the Debian 13 root that scripts/make_dcp_fixture.py builds (build-dcp-root/,
# python3-torch from trixie), with FSDP2 (fully_shard) and with FSDP1
# (FullyShardedDataParallel), 2 processes, gloo on CPU. Each job goes NaN on
# rank 1 and dumps automatically, and dumps a healthy window on demand; this
# host's nanreplay (build/nanreplay) then replays both bundles and must name
# the planted rank, micro-batch, sample and position, reproduce every healthy
# step's logged loss, per-rank losses and gradient norm (and, under FSDP1,
# the per-rank norms the comm hook measured), and replay the healthy dump
# clean. Last, the snapshot cost of a 21 M-parameter model under both (no
# replay). Not part of CTest (the root is not in CI).
#
# Needs root (chroot, mounts: proc and a tmpfs on the root's /tmp, undone on
# exit) and a built nanreplay. About 2 minutes on 2 cores.
#
# Environment: NANREPLAY_DCP_ROOT (default build-dcp-root/; make it with
# `sudo python3 scripts/make_dcp_fixture.py --debian-root build-dcp-root`),
# NANREPLAY_CLI (default build/nanreplay), NANREPLAY_FSDP_LARGE=0 skips the
# large-model cost runs.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
rootfs="${NANREPLAY_DCP_ROOT:-$root/build-dcp-root}/rootfs"
cli="${NANREPLAY_CLI:-$root/build/nanreplay}"
[[ $(id -u) == 0 ]] || { echo "fsdp_check: needs root (chroot, mount)" >&2; exit 2; }
[[ -d "$rootfs/usr/lib/python3/dist-packages/torch" ]] || {
  echo "fsdp_check: no PyTorch root at $rootfs; make it with: sudo python3 scripts/make_dcp_fixture.py --debian-root build-dcp-root" >&2
  exit 2
}
[[ -x "$cli" ]] || { echo "fsdp_check: no nanreplay at $cli (build it first)" >&2; exit 2; }

inside=/root/nanreplay-fsdp   # the check's directory, as the root sees it
work="$rootfs$inside"
rm -rf "$work"
mkdir -p "$work/src"
(cd "$root" && tar --exclude=__pycache__ -cf - capture) | tar -xf - -C "$work/src"

mounted=()
cleanup() {
  local i
  for ((i = ${#mounted[@]} - 1; i >= 0; i--)); do umount "${mounted[i]}" || true; done
}
trap cleanup EXIT
mount -t proc proc "$rootfs/proc" && mounted+=("$rootfs/proc")
mount -t tmpfs tmpfs "$rootfs/tmp" && mounted+=("$rootfs/tmp")

in_root() {
  chroot "$rootfs" /usr/bin/env -i HOME=/root PATH=/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8 GLOO_SOCKET_IFNAME=lo USE_LIBUV=0 "$@"
}
example() { in_root python3 "$inside/src/capture/examples/fsdp_nan.py" --timeout 240 "$@"; }

status=0
for mode in fully_shard fsdp1; do
  echo "== $mode: a 2-process job that goes NaN at step 8 (and dumps at step 4)"
  example --work "$inside/$mode" --fsdp "$mode" --steps 10 --snapshot-every 3 --fault-step 8 --dump-at 4 \
    || { echo "FAIL $mode: the job failed"; status=1; }
done
if [[ "${NANREPLAY_FSDP_LARGE:-1}" != 0 ]]; then
  for mode in fully_shard fsdp1; do
    echo "== $mode, 21 M parameters: snapshot cost"
    example --work "$inside/large-$mode" --fsdp "$mode" --size large --steps 10 --snapshot-every 3 --fault-step -1 \
      || { echo "FAIL $mode large: the job failed"; status=1; }
  done
fi
torch_version=$(in_root dpkg-query -W -f '${Version}' python3-torch)
cleanup
mounted=()

# On this host: replay the bundles the root wrote and check what nanreplay says.
python3 - "$cli" "$work" "${NANREPLAY_FSDP_LARGE:-1}" << 'EOF' || status=1
import json, math, shutil, subprocess, sys
from pathlib import Path

cli, work, large = sys.argv[1], Path(sys.argv[2]), sys.argv[3] != "0"
inside = "/root/nanreplay-fsdp"
failures = []


def check(ok, what):
    print(("ok   " if ok else "FAIL ") + what)
    if not ok:
        failures.append(what)


def rel(a, b):
    return abs(a - b) / max(abs(b), 1e-12)


def host_path(p):  # a path the job printed, as the root saw it
    return work / Path(p).relative_to(inside)


def replay(bundle, out):
    shutil.rmtree(out, ignore_errors=True)
    proc = subprocess.run([cli, "run", str(bundle), "--out", str(out)], capture_output=True, text=True)
    path = out / "report.json"
    return proc, (json.loads(path.read_text()) if path.exists() else None)


def check_steps(label, report, logged, bundle, hook_norms):
    for row in report["steps"]:
        want = logged.get(str(row["step"]))
        if want is None or not math.isfinite(want["loss"]):
            continue
        state = json.loads((bundle / "steps" / str(row["step"]) / "state.json").read_text())["logged"]
        ok = (rel(row["loss"], want["loss"]) <= 1e-5 and rel(row["grad_norm"], want["grad_norm"]) <= 1e-5
              and all(rel(a, b) <= 1e-5 for a, b in zip(row["rank_losses"], state["rank_losses"])))
        norms = state.get("rank_grad_norms")
        if hook_norms:
            ok = ok and norms is not None and len(norms) == 2 and all(
                rel(a, b) <= 1e-4 for a, b in zip(row["rank_grad_norms"], norms))
        else:
            ok = ok and norms is None
        check(ok, f"{label} step {row['step']}: replayed loss {row['loss']:.9g}, grad norm {row['grad_norm']:.7g}, "
                  f"ranks {row['rank_losses']}, rank norms {row.get('rank_grad_norms')} match the log "
                  f"({want['loss']:.9g}, {want['grad_norm']:.7g}, {state['rank_losses']}, {norms})")
    bad = [f["code"] for f in report["findings"] if f["code"].startswith("SYSTEM_")
           or f["code"] in ("DATA_SAMPLER_MISMATCH", "BUNDLE_CHECKSUM_MISMATCH")]
    check(not bad, f"{label}: no finding that says the capture misstates the run {bad}")


for mode in ("fully_shard", "fsdp1"):
    path = work / mode / "result.json"
    if not path.exists():
        check(False, f"{mode}: the job wrote result.json")
        continue
    result = json.loads(path.read_text())
    planted, bundles, logged = result["planted"], result["bundles"], result["logged"]
    print(f"== {mode}: {result['params']} parameters, torch {result['torch']}")
    check(set(bundles) == {"incident", "dump"}, f"{mode}: the job dumped on demand and on NaN {sorted(bundles)}")
    check(max(int(s) for s in logged) == planted["step"], f"{mode}: every rank stopped at the NaN step")
    if "incident" not in bundles:
        continue
    incident = host_path(bundles["incident"])
    manifest = json.loads((incident / "manifest.json").read_text())
    steps = [e["step"] for e in manifest["steps"]]
    snaps = sorted(int(p.parent.name) for p in incident.glob("steps/*/model.safetensors"))
    check(manifest["data"]["world_size"] == 2 and steps == list(range(3, 9)) and snaps == [3, 6],
          f"{mode}: incident bundle: world_size 2, steps {steps} rolled forward from the snapshot at 3 "
          f"(snapshots {snaps})")
    proc, report = replay(incident, work / mode / "out-incident")
    check(proc.returncode == 1 and report is not None,
          f"{mode}: nanreplay run on the incident exits 1 (got {proc.returncode}) {proc.stderr.strip()[-300:]}")
    if report:
        first = report["first_nonfinite"] or {}
        print(f"{mode}: nanreplay first_nonfinite", json.dumps(first))
        for key in ("step", "rank", "micro_batch", "sample", "position"):
            check(first.get(key) == planted[key],
                  f"{mode}: first_nonfinite.{key} = {first.get(key)!r}, planted {planted[key]!r}")
        check(first.get("site") == "layers.0.attn_norm" and first.get("phase") == "forward",
              f"{mode}: first_nonfinite at layers.0.attn_norm, forward ({first.get('site')}, {first.get('phase')})")
        check_steps(f"{mode} incident", report, logged, incident, hook_norms=mode == "fsdp1")
    if "dump" in bundles:
        dump = host_path(bundles["dump"])
        proc, report = replay(dump, work / mode / "out-dump")
        check(proc.returncode == 0 and report is not None and not report["reproduced"],
              f"{mode}: nanreplay run on the healthy dump() exits 0 (got {proc.returncode}) {proc.stderr.strip()[-300:]}")
        if report:
            check_steps(f"{mode} dump", report, logged, dump, hook_norms=mode == "fsdp1")

print("== snapshot cost (rank 0; medians over healthy steps after the first)")
for mode in ("fully_shard", "fsdp1"):
    for label in (mode, "large-" + mode) if large else (mode,):
        path = work / label / "result.json"
        if not path.exists():
            continue
        r = json.loads(path.read_text())
        c, steps, setup = r["cost"]["rank0"], r["per_rank_steps"][0], r["setup"][0]
        by = {int(s): v for s, v in steps.items()}
        base = setup["rss_after_recorder"]
        rss = " ".join(f"{s}:{(v['rss_after_begin'] - base) / 2**20:+.0f}" for s, v in sorted(by.items()))
        print(f"{label}: P={r['params']}, snapshot buffers {r['snapshot_bytes'] / 2**20:.1f} MiB; "
              f"snapshot begin_step {c['snapshot_begin_ms']:.1f} ms (steps {c['snapshot_steps']}), "
              f"light step recorder {c['light_recorder_ms']:.1f} ms of {c['step_ms']:.1f} ms; "
              f"recorder init {setup['recorder_init_s'] * 1e3:.0f} ms, RSS at recorder creation "
              f"{(setup['rss_after_recorder'] - setup['rss_before_recorder']) / 2**20:+.0f} MiB; "
              f"RSS after each begin_step vs then, MiB: {rss}; peak RSS {max(v['peak_rss'] for v in by.values()) / 2**20:.0f} MiB")
print(f"{len(failures)} failed")
sys.exit(1 if failures else 0)
EOF
echo "fsdp_check: status $status, python3-torch $torch_version in $rootfs (work: $work)"
exit "$status"
