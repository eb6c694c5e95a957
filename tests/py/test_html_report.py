# report.html in a real headless Chromium: a synthetic head-overflow bundle is
# replayed, the page is screenshotted and its DOM dumped after the inline
# script ran; no console errors, the title the script sets, the site named.
# Exits 77 (CTest SKIP_RETURN_CODE) only when chromium is not installed.
import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile

SKIP = 77
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--enable-logging=stderr", "--v=0", "--window-size=1400,2000"]


def chromium(binary, extra, url):
    with tempfile.TemporaryDirectory(prefix="nanreplay-chromium-") as profile:
        return subprocess.run([binary, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *extra, url],
                              capture_output=True, text=True, timeout=180)


def check_console(result, what):
    bad = [line for line in result.stderr.splitlines() if "Uncaught" in line or "ERROR:CONSOLE" in line]
    assert not bad, f"{what}: console errors:\n" + "\n".join(bad)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--cli", required=True)
    parser.add_argument("--work", required=True)
    args = parser.parse_args()
    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    if binary is None:
        print("SKIP: chromium is not installed (apt-get install chromium)")
        return SKIP
    shutil.rmtree(args.work, ignore_errors=True)
    os.makedirs(args.work)
    bundle = os.path.join(args.work, "bundle")
    out = os.path.join(args.work, "out")
    subprocess.run([args.cli, "synth", "head-overflow", bundle], check=True, capture_output=True)
    run = subprocess.run([args.cli, "run", bundle, "--out", out, "--quiet"], capture_output=True, text=True)
    assert run.returncode == 1, run.stderr
    page = os.path.join(out, "report.html")
    html = open(page, encoding="utf-8").read()
    for external in ("http://", "https://", "<script src", "<link"):
        assert external not in html, f"report.html is not self-contained: {external}"
    url = "file://" + os.path.abspath(page)

    screenshot = os.path.join(args.work, "report.png")
    shot = chromium(binary, [f"--screenshot={screenshot}"], url)
    assert os.path.exists(screenshot), shot.stderr[-2000:]
    assert os.path.getsize(screenshot) > 20000, f"screenshot is only {os.path.getsize(screenshot)} bytes"
    check_console(shot, "screenshot")

    dump = chromium(binary, ["--dump-dom"], url)
    check_console(dump, "dump-dom")
    dom = dump.stdout
    assert "<title>nanreplay report ok</title>" in dom, "the inline script did not run to the end"
    assert re.search(r"layers\.\d+\.attn\.scores", dom), "the first non-finite site is not on the page"
    assert "REPRODUCED" in dom and "Propagation path" in dom
    print(f"ok: screenshot {screenshot} ({os.path.getsize(screenshot)} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
