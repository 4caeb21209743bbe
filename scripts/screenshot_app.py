"""Screenshot of the web page after a fresh start: `pop-vlm serve` on the default model, one question in headless
Chromium (the first request of the server's life), the page saved as a PNG and the figures it shows printed.

    python scripts/screenshot_app.py --out docs/app.png [--image assets/images/shapes_1.png] [--question ...]
        [--threads N] [--repeat]

Needs Debian's chromium (`make browser`) and the test extra (playwright).
"""
from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAUNCH_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
               "--disable-component-update", "--disable-sync"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_healthy(url: str, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/healthz", timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"{url} did not become healthy in {timeout_s:.0f} s")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "docs" / "app.png"))
    parser.add_argument("--image", default=str(ROOT / "assets" / "images" / "shapes_1.png"))
    parser.add_argument("--question", default="What color is the triangle?")
    parser.add_argument("--model", default=None, help="served model (default: the project's default model)")
    parser.add_argument("--threads", type=int, help="the server's torch threads (default: torch's choice)")
    parser.add_argument("--repeat", action="store_true", help="tick 'repeat 3x and take the median' before asking")
    args = parser.parse_args(argv)
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        sys.exit("chromium is not installed: run `make browser` (Debian's chromium)")

    from playwright.sync_api import sync_playwright

    port = free_port()
    command = [sys.executable, "-m", "pop_vlm.cli", "serve", "--host", "127.0.0.1", "--port", str(port)]
    if args.model:
        command += ["--model", args.model]
    if args.threads:
        command += ["--threads", str(args.threads)]
    server = subprocess.Popen(command, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url)
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=chromium, headless=True, args=LAUNCH_ARGS)
            page = browser.new_page(viewport={"width": 1400, "height": 1100})
            page.goto(url + "/")
            page.wait_for_selector("#question textarea", timeout=60_000)
            page.set_input_files("#image input[type=file]", args.image)
            page.fill("#question textarea", args.question)
            if args.repeat:
                page.check("#repeat input[type=checkbox]")
            page.click("#run")
            page.wait_for_function("() => { const e = document.querySelector('#speedup'); "
                                   "return !!e && e.innerText.includes('LM-only speedup'); }", timeout=120_000)
            page.wait_for_timeout(1500)  # the chart arrives with the last update
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=args.out, full_page=True)
            for selector in ("#speedup", "#full-timing", "#pop-timing"):
                print(f"{selector}: {' | '.join(page.inner_text(selector).split(chr(10)))}")
            browser.close()
    finally:
        server.terminate()
        server.wait(timeout=30)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
