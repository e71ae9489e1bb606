"""Every table and code block of the built docs site in headless Chromium: its scrollWidth against its column's
width, at each window width asked. A record of how the site reads on a screen (issue 38), not a test: CI has no
browser; tests/test_docs.py holds the rendered tables to the column count this run found to fit.

    mkdocs build --strict --site-dir /tmp/site
    python measurements/docs_fit/probe.py /tmp/site --widths 1280,412 --json measurements/docs_fit/docs_fit.json

Needs Debian's chromium (/usr/bin/chromium). Serves the site on localhost:8765 for the run.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import re
import subprocess
import tempfile
import time

SCRIPT = """<script>window.addEventListener('load', () => { const out = {tables: [], code: []};
document.querySelectorAll('article table').forEach((t, i) => { const box = t.closest('.md-typeset__scrollwrap') || t.parentElement;
  out.tables.push([i, t.rows[0] ? t.rows[0].cells.length : 0, t.scrollWidth, box.clientWidth]); });
document.querySelectorAll('article pre > code').forEach((c, i) => out.code.push([i, c.scrollWidth, c.clientWidth,
  (c.closest('[class*=language-]') || {className: ''}).className.split(' ').filter(k => k.startsWith('language-')).join('')]));
const d = document.createElement('div'); d.id = 'measured'; d.textContent = JSON.stringify(out); document.body.appendChild(d); });</script>"""
CHROMIUM = ["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
            "--disable-component-update", "--disable-sync", "--no-first-run", "--virtual-time-budget=3000"]


def measure(site: str, page: str, width: int) -> dict:
    probe = os.path.join(site, page.replace("index.html", "_probe.html"))
    with open(os.path.join(site, page), encoding="utf-8") as f:
        html = f.read()
    with open(probe, "w", encoding="utf-8") as f:
        f.write(html.replace("</body>", SCRIPT + "</body>"))
    try:
        dom = subprocess.run([*CHROMIUM, f"--user-data-dir={tempfile.mkdtemp()}", f"--window-size={width},2000",
                              "--dump-dom", "http://localhost:8765/" + os.path.relpath(probe, site)],
                             capture_output=True, text=True, timeout=60).stdout  # fmt: skip
    finally:
        os.remove(probe)
    m = re.search(r'<div id="measured">(.*?)</div>', dom)
    return json.loads(m.group(1).replace("&quot;", '"')) if m else {"error": "not measured"}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("site")
    p.add_argument("--widths", default="1280,412")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    server = subprocess.Popen(["python3", "-m", "http.server", "8765"], cwd=args.site, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)  # fmt: skip
    time.sleep(1)
    result = {"date": time.strftime("%Y-%m-%d"), "machine": platform.processor() or platform.machine(),
              "chromium": subprocess.run(["chromium", "--version"], capture_output=True, text=True).stdout.strip(),
              "widths": {}}  # fmt: skip
    try:
        pages = sorted(os.path.relpath(f, args.site) for f in glob.glob(os.path.join(args.site, "**", "index.html"),
                                                                         recursive=True))  # fmt: skip
        for width in map(int, args.widths.split(",")):
            over = {}
            for page in pages:
                found = measure(args.site, page, width)
                tables = [t for t in found.get("tables", []) if t[2] > t[3] + 1]
                code = [c for c in found.get("code", []) if c[1] > c[2] + 1]
                if tables or code:
                    over[page] = {"tables": tables, "code": code}
            result["widths"][str(width)] = {"pages": len(pages), "overflowing": over}
            wide = sum(1 for v in over.values() if v["tables"])
            print(f"{width} px: {len(pages)} pages; tables wider than their column on {wide}; code blocks scrolling "
                  f"on {sum(1 for v in over.values() if v['code'])}")  # fmt: skip
    finally:
        server.terminate()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
