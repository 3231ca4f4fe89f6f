#!/usr/bin/env python
"""Look at the documentation as a reader does: build the site and take screenshots of the Results
page and the home page in headless chromium, at 1280 and 390 pixels wide (a laptop, a phone).

    python scripts/docs_screenshots.py --out shots/

writes ``results-1280.png``, ``results-390.png``, ``index-1280.png`` and ``index-390.png`` into the
folder (made if missing; files of these names there are replaced). Open them and look: tables inside
the content column, labels of the front picture apart, the picture first on the Results page.
Needs mkdocs (the ``docs`` extra) and chromium (``scripts/setup.sh`` installs both where it can).
Exit 1 when the site does not build or chromium is missing or fails.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGES = {"results": "results/index.html", "index": "index.html"}
WIDTHS = (1280, 390)


def chromium() -> str | None:
    return next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)), None)


def shoot(browser: str, page: Path, out: Path, width: int, height: int) -> None:
    with tempfile.TemporaryDirectory(prefix="slmedge-shot-") as profile:
        res = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                              f"--user-data-dir={profile}", f"--window-size={width},{height}",
                              f"--screenshot={out}", page.as_uri()], capture_output=True, text=True, timeout=180)
    if res.returncode != 0 or not out.is_file():
        raise SystemExit(f"error: chromium could not take {out.name}: {(res.stderr or res.stdout).strip()[-500:]}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="folder for the screenshots")
    ap.add_argument("--height", type=int, default=2400, help="pixels of page shown (default 2400)")
    args = ap.parse_args(argv)
    browser = chromium()
    if browser is None:
        print("error: chromium is not installed (scripts/setup.sh installs it as root with apt)", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory(prefix="slmedge-site-") as tmp:
        site = Path(tmp) / "site"
        res = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(site)],
                             cwd=ROOT, capture_output=True, text=True)
        if res.returncode != 0:
            print(f"error: the site does not build:\n{res.stderr[-2000:]}", file=sys.stderr)
            return 1
        args.out.mkdir(parents=True, exist_ok=True)
        for name, rel in PAGES.items():
            for width in WIDTHS:
                target = args.out / f"{name}-{width}.png"
                shoot(browser, site / rel, target, width, args.height)
                print(target)
    return 0


if __name__ == "__main__":
    sys.exit(main())
