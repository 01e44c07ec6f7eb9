"""The dashboard in a real browser: headless Chromium (Debian's `chromium`, driven by
Playwright through the npm package playwright-core) against real `coli web --no-browser`
processes on the built-in tiny MoE model, one without and one with an API key.

web/e2e/e2e.mjs holds the checks (chat streams and stops, Brio sums to 1, Brain lights
the routed experts, Profiling draws the turn, themes, phone width, keyboard, no console
errors, the API key prompt) and writes a screenshot of each page to test-output/web/.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
WEB = ROOT / "web"
OUT = ROOT / "test-output" / "web"
WAIT = 180


def chromium() -> str | None:
    for candidate in (os.environ.get("CHROMIUM"), "/usr/bin/chromium", shutil.which("chromium"),
                      shutil.which("chromium-browser"), shutil.which("google-chrome")):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


class WebProcess:
    """`coli web --no-browser` on a free port; the URL is read from what it prints."""

    def __init__(self, *extra: str):
        env = {**os.environ, "COLI_THREADS": "1"}
        for var in ("COLI_API_KEY", "COLI_MODEL", "DISPLAY", "WAYLAND_DISPLAY"):
            env.pop(var, None)
        self.proc = subprocess.Popen([sys.executable, "-m", "coli.cli", "web", "--no-browser", "--port", "0",
                                      "--no-kv-persist", *extra],
                                     env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
        self.lines: list[str] = []
        self.ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stderr:
            self.lines.append(line)
            if "the dashboard is at" in line:
                self.ready.set()

    def url(self) -> str:
        assert self.ready.wait(WAIT), "coli web did not start:\n" + "".join(self.lines)
        return re.search(r"the dashboard is at (http://\S+?)/?$", "".join(self.lines), re.M).group(1)

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def test_dashboard_in_headless_chromium():
    browser = chromium()
    if browser is None:
        pytest.skip("Chromium is not installed (apt-get install chromium; .ci/run installs it)")
    assert shutil.which("node"), "Node.js is needed to drive Chromium (playwright-core)"
    if not (WEB / "node_modules" / "playwright-core").is_dir():
        subprocess.run(["npm", "ci", "--no-audit", "--no-fund"], cwd=WEB, check=True, timeout=600)
    plain, keyed = WebProcess(), WebProcess("--api-key", "e2e-key")
    try:
        env = {**os.environ, "COLI_URL": plain.url(), "COLI_KEY_URL": keyed.url(), "COLI_KEY": "e2e-key",
               "OUT": str(OUT), "CHROMIUM": browser}
        run = subprocess.run(["node", "e2e/e2e.mjs"], cwd=WEB, env=env, capture_output=True, text=True, timeout=600)
        print(run.stdout)
        assert run.returncode == 0, run.stdout + run.stderr + "\nserver:\n" + "".join(plain.lines[-20:])
        for name in ("chat", "brio", "brain-live", "brain-explore", "profiling", "phone-chat", "api-key"):
            assert (OUT / f"{name}.png").stat().st_size > 1000, name
    finally:
        plain.stop()
        keyed.stop()
