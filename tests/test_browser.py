"""The live dashboard in a real browser: Voila runs the quickstart notebook, Debian's Chromium shows it.

Needs Debian's ``chromium`` (``apt install chromium``) and the Python packages voila and playwright;
Playwright drives the system browser, it downloads none. Skipped where Chromium is missing. One of the
slow tests (``pytest -m slow``): Voila's kernel and Chromium take about 100 s to start on 2 cores.
"""

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from PIL import Image

REPO = Path(__file__).resolve().parents[1]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# Flags for a sandbox without network: no first-run work, no calls home, no GPU.
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]

pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (apt install chromium)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def voila(tmp_path):
    """Voila serving a copy of notebooks/quickstart.ipynb on localhost; yields its URL."""
    shutil.copy(REPO / "notebooks" / "quickstart.ipynb", tmp_path)
    port = free_port()
    env = {**os.environ, "COLOCATE_GRPO_STEPS": "6", "MPLBACKEND": "Agg"}
    command = [sys.executable, "-m", "voila", "quickstart.ipynb", "--no-browser", f"--port={port}"]
    command += ["--Voila.ip=127.0.0.1", "--show_tracebacks=True"]
    log = (tmp_path / "voila.log").open("w")
    server = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/"
    try:
        for _ in range(120):
            try:
                urllib.request.urlopen(url + "api", timeout=1)
                break
            except OSError:
                assert server.poll() is None, (tmp_path / "voila.log").read_text()
                time.sleep(0.5)
        yield url
    finally:
        server.terminate()
        server.wait(timeout=30)
        log.close()


@pytest.mark.slow
def test_the_live_dashboard_shows_in_chromium(voila, tmp_path):
    from playwright.sync_api import sync_playwright

    assert CHROMIUM, "Debian's chromium is missing: .ci/run installs it (apt install chromium)"

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.goto(voila, wait_until="commit", timeout=60_000)
        # The status line reads "(done)" after the last redraw; training the tiny model takes about a minute.
        status = page.locator(".widget-html", has_text="colocate_grpo")
        status.filter(has_text="(done)").wait_for(timeout=480_000)
        image = page.locator("img.widget-image")
        image.wait_for()
        page.screenshot(path=tmp_path / "page.png", full_page=True)
        image.screenshot(path=tmp_path / "dashboard.png")
        text = page.inner_text("body")
        natural_width = image.evaluate("img => img.naturalWidth")
        browser.close()

    assert "step 6 of 6 (done)" in text and "Traceback" not in text, text[-2000:]
    assert natural_width >= 1000  # the figure's PNG, not a placeholder
    shown = Image.open(tmp_path / "dashboard.png").convert("RGB")
    assert shown.width >= 800 and shown.height >= 400, shown.size
    # A drawn figure: mostly white, with the panels' many colors (a blank or broken image has a handful).
    colors = shown.getcolors(maxcolors=1 << 20)
    assert colors is not None and len(colors) > 500, f"{len(colors or [])} colors"
