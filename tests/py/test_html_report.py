# report.html in a real headless Chromium: a synthetic head-overflow bundle is
# replayed, the page is screenshotted at desktop and phone widths and its DOM
# dumped after the inline script ran: no console errors, the title the script
# sets, the site named, the charts drawn on honest labelled axes, evidence as
# tables, the consequence entries folded away, and at phone width nothing
# wider than the screen. A copy of the page with a measuring script appended
# reports the layout as JSON in the dumped DOM (the report itself stays as
# written). Exits 77 (CTest SKIP_RETURN_CODE) only when chromium is not installed.
import argparse
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile

SKIP = 77
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--hide-scrollbars", "--enable-logging=stderr", "--v=0"]
DESKTOP = (1280, 900)
PHONE = (390, 844)

# A page that holds report.html in a frame exactly as wide as the screen
# (headless Chromium keeps its own window at least 500 px wide) and writes
# what a person would see there as JSON into the DOM. The report itself is
# measured as written.
MEASURE = """<!DOCTYPE html><html><body style="margin:0">
<iframe id="frame" src="REPORT" width="WIDTH" height="HEIGHT" style="border:0;display:block"></iframe>
<script>
document.getElementById('frame').addEventListener('load', function () {
  const doc = this.contentDocument;
  const ticks = (label) => {
    const svg = doc.querySelector('svg[aria-label="' + label + '"]');
    return svg ? Array.from(svg.querySelectorAll('text.tick')).map((t) => t.textContent) : null;
  };
  const folded = doc.querySelector('details.consequences');
  const out = {
    scrollWidth: doc.documentElement.scrollWidth,
    innerWidth: this.contentWindow.innerWidth,
    title: doc.title,
    lossTicks: ticks('loss per step'),
    normTicks: ticks('gradient norm per step'),
    originTicks: Array.from(doc.querySelectorAll('#origin-chart text.tick')).map((t) => t.textContent),
    originText: (doc.querySelector('#origin-chart') || {}).textContent || '',
    stripText: (doc.querySelector('#step-strip') || {}).textContent || '',
    evidenceTables: doc.querySelectorAll('table.evidence').length,
    consequenceOpen: folded ? folded.open : null,
    consequenceText: folded ? folded.textContent : '',
    visibleText: doc.body.innerText,
  };
  const pre = document.createElement('pre');
  pre.id = 'measured';
  pre.textContent = JSON.stringify(out);
  document.body.appendChild(pre);
});
</script></body></html>"""


def chromium(binary, extra, url, size):
    with tempfile.TemporaryDirectory(prefix="nanreplay-chromium-") as profile:
        return subprocess.run([binary, *CHROMIUM_FLAGS, f"--window-size={size[0]},{size[1]}",
                               f"--user-data-dir={profile}", *extra, url],
                              capture_output=True, text=True, timeout=180)


def check_console(result, what):
    bad = [line for line in result.stderr.splitlines() if "Uncaught" in line or "ERROR:CONSOLE" in line]
    assert not bad, f"{what}: console errors:\n" + "\n".join(bad)


def png_size(path):
    with open(path, "rb") as f:
        header = f.read(24)
    assert header[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    return struct.unpack(">II", header[16:24])


def screenshot(binary, url, size, path):
    shot = chromium(binary, [f"--screenshot={path}"], url, size)
    assert os.path.exists(path), shot.stderr[-2000:]
    check_console(shot, f"screenshot {size}")
    assert png_size(path) == size, f"{path}: {png_size(path)}, expected {size}"
    assert os.path.getsize(path) > 20000, f"{path} is only {os.path.getsize(path)} bytes"


def measure(binary, page, size, work):
    probe = os.path.join(work, f"measure-{size[0]}.html")
    with open(probe, "w", encoding="utf-8") as f:
        f.write(MEASURE.replace("REPORT", "file://" + os.path.abspath(page))
                .replace("WIDTH", str(size[0])).replace("HEIGHT", str(size[1])))
    window = (max(size[0], 800), size[1])
    dump = chromium(binary, ["--allow-file-access-from-files", "--dump-dom"], "file://" + os.path.abspath(probe), window)
    check_console(dump, f"dump-dom {size}")
    found = re.search(r'<pre id="measured">(.*?)</pre>', dump.stdout, re.S)
    assert found, "the measuring script did not run: " + dump.stderr[-1000:]
    text = found.group(1).replace("&quot;", '"').replace("&lt;", "<").replace("&gt;", ">").replace("&amp;", "&")
    return json.loads(text), open(page, encoding="utf-8").read()


def check_page(m, dom):
    assert m["title"] == "nanreplay report ok", "the report's inline script did not run to the end"
    assert re.search(r"layers\.\d+\.attn\.scores", dom), "the first non-finite site is not on the page"
    assert "REPRODUCED" in dom and "Propagation path" in dom
    # Honest axes: loss and gradient norm start at 0, with labelled ticks.
    assert m["lossTicks"] and m["lossTicks"][0] == "0" and len(m["lossTicks"]) >= 3, m["lossTicks"]
    assert m["normTicks"] and m["normTicks"][0] == "0" and len(m["normTicks"]) >= 3, m["normTicks"]
    # The origin's max|x| on a log axis that reaches fp16's limit, drawn and named.
    assert m["originTicks"] and all(t.startswith("1e") for t in m["originTicks"]), m["originTicks"]
    assert "limit of the type it is held in: 65504" in m["originText"], m["originText"]
    assert "inf at step" in m["originText"], m["originText"]
    assert "step" in m["stripText"] and "non-finite" in m["stripText"], m["stripText"]
    assert m["evidenceTables"] > 0, "evidence is not shown as tables"
    assert "key=value" not in dom and not re.search(r"\b(sample|step)=\d", m["visibleText"]), "raw key=value evidence"
    # The consequence-only entry is folded away, closed.
    assert m["consequenceOpen"] is False, m["consequenceOpen"]
    assert "consequences, not properties" in m["consequenceText"]
    assert "consequences, not properties" not in m["visibleText"], "a consequence entry is visible by default"


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
    for external in ("http://", "https://", "<script src", "<link", "<img src"):
        assert external not in html, f"report.html is not self-contained: {external}"
    url = "file://" + os.path.abspath(page)

    for name, size in (("desktop", DESKTOP), ("phone", PHONE)):
        path = os.path.join(args.work, f"report-{name}.png")
        screenshot(binary, url, size, path)
        m, dom = measure(binary, page, size, args.work)
        check_page(m, dom)
        assert m["innerWidth"] == size[0], f"{name}: the window is {m['innerWidth']} px wide, asked {size[0]}"
        assert m["scrollWidth"] <= m["innerWidth"], f"{name}: the page is {m['scrollWidth']} px wide in a {m['innerWidth']} px window"
        print(f"ok: {name} {size[0]}x{size[1]}: {path}, page width {m['scrollWidth']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
