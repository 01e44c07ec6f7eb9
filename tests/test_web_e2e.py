"""The dashboard in a real browser: headless Chromium (Debian's `chromium`, driven by
Playwright through the npm package playwright-core) against real `coli web --no-browser`
processes on the built-in tiny MoE model, one without and one with an API key.

web/e2e/e2e.mjs holds the checks (chat streams and stops, Brio sums to 1, Brain lights
the routed experts, Profiling draws the turn, themes, phone width, keyboard, no console
errors, the API key prompt, Chat against another OpenAI-compatible server) and writes a screenshot of each page to test-output/web/.
"""
from __future__ import annotations

import asyncio
import json
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

    def __init__(self, *extra: str, env: dict | None = None):
        env = {**os.environ, "COLI_THREADS": "1", **(env or {})}
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


class OtherEndpoint:
    """A strict OpenAI-compatible server that is not colibri (no /experts, /profile, /v1/brio),
    on another origin: the dashboard's Chat must work against it, sending only OpenAI fields."""

    ALLOWED = {"model", "messages", "stream", "stream_options", "max_tokens", "temperature"}

    def __init__(self):
        self.bodies: list[dict] = []
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()
        assert self.ready.wait(30)

    def _run(self):
        from aiohttp import web

        @web.middleware
        async def cors(request, handler):
            if request.method == "OPTIONS":
                return web.Response(status=204, headers={
                    "Access-Control-Allow-Methods": "GET, POST",
                    "Access-Control-Allow-Headers": "authorization, content-type"})
            return await handler(request)

        async def allow_origin(request, response):  # before the headers go out (streams too)
            response.headers["Access-Control-Allow-Origin"] = "*"

        async def models(request):
            return web.json_response({"object": "list", "data": [
                {"id": "other-model", "object": "model", "owned_by": "someone-else"}]})

        async def chat(request):
            body = await request.json()
            self.bodies.append(body)
            unknown = set(body) - self.ALLOWED | set(body.get("stream_options") or {}) - {"include_usage"}
            if unknown:
                return web.json_response({"error": {"message": f"Unrecognized request arguments: {sorted(unknown)}",
                                                    "type": "invalid_request_error"}}, status=400)
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            pieces = [("reasoning_content", "Let me "), ("reasoning_content", "think."),
                      *(("content", p) for p in ("Hi ", "from ", "another ", "server."))]
            for field, piece in pieces:
                chunk = {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {field: piece}}]}
                await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
                await asyncio.sleep(0.05)
            await response.write(b"data: [DONE]\n\n")
            return response

        app = web.Application(middlewares=[cors])
        app.on_response_prepare.append(allow_origin)
        app.add_routes([web.get("/v1/models", models), web.post("/v1/chat/completions", chat),
                        web.options("/v1/{tail:.*}", models)])
        asyncio.set_event_loop(self.loop)
        runner = web.AppRunner(app, access_log=None)
        self.loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        self.ready.set()
        self.loop.run_forever()

    def stop(self):
        self.loop.call_soon_threadsafe(self.loop.stop)


def test_dashboard_in_headless_chromium(tmp_path):
    browser = chromium()
    if browser is None:
        pytest.skip("Chromium is not installed (apt-get install chromium; .ci/run installs it)")
    assert shutil.which("node"), "Node.js is needed to drive Chromium (playwright-core)"
    if not (WEB / "node_modules" / "playwright-core").is_dir():
        subprocess.run(["npm", "ci", "--no-audit", "--no-fund"], cwd=WEB, check=True, timeout=600)
    # the keyed server runs a copy of the built-in model without its expert atlas (Explore says how to make one)
    bare = tmp_path / "no-atlas"
    shutil.copytree(ROOT / "coli" / "default_model", bare, ignore=shutil.ignore_patterns("experts.json"))
    plain = WebProcess()
    keyed = WebProcess("--api-key", "e2e-key", "--model", str(bare), env={"XDG_CACHE_HOME": str(tmp_path / "cache")})
    other = OtherEndpoint()
    try:
        env = {**os.environ, "COLI_URL": plain.url(), "COLI_KEY_URL": keyed.url(), "COLI_KEY": "e2e-key",
               "OTHER_URL": other.url, "OUT": str(OUT), "CHROMIUM": browser}
        run = subprocess.run(["node", "e2e/e2e.mjs"], cwd=WEB, env=env, capture_output=True, text=True, timeout=600)
        print(run.stdout)
        assert run.returncode == 0, run.stdout + run.stderr + "\nserver:\n" + "".join(plain.lines[-20:])
        for name in ("chat", "brio", "brain-live", "brain-explore", "brain-atlas", "brain-region", "profiling",
                     "phone-chat", "api-key"):
            assert (OUT / f"{name}.png").stat().st_size > 1000, name
        assert other.bodies and all("cache_slot" not in b for b in other.bodies), other.bodies
    finally:
        plain.stop()
        keyed.stop()
        other.stop()
