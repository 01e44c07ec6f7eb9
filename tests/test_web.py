"""The web dashboard without a browser: `coli web`'s command, the committed build (current
with web/ and served beside the API, public even with an API key), and web/'s unit tests."""
from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from typer.testing import CliRunner

import coli.cli.web as webcli
import coli.server
from coli.server import dashboard

ROOT = Path(__file__).resolve().parent.parent
WEB = ROOT / "web"


def _npm_ready():
    if shutil.which("node") is None or shutil.which("npx") is None:
        pytest.skip("Node.js is not installed (the committed build is still served and tested)")
    if not (WEB / "node_modules" / ".bin" / "vite").exists():
        pytest.skip("web/node_modules is missing: run `npm ci` in web/ (.ci/run does)")


# -- coli web ---------------------------------------------------------------------------------


def test_web_has_serve_options_and_no_browser():
    from coli.cli.main import app

    out = CliRunner().invoke(app, ["web", "--help"], env={"COLUMNS": "200", "NO_COLOR": "1", "TERM": "dumb"}).output
    for option in ("--no-browser", "--model", "--host", "--port", "--api-key", "--kv-slots", "--cors-origin"):
        assert option in out, option


@pytest.mark.parametrize("platform,env,expected", [
    ("linux", {}, True), ("linux", {"DISPLAY": ":0"}, False), ("linux", {"WAYLAND_DISPLAY": "wayland-0"}, False),
    ("darwin", {}, False), ("win32", {}, False),
])
def test_headless(monkeypatch, platform, env, expected):
    monkeypatch.setattr(webcli.sys, "platform", platform)
    for var in ("DISPLAY", "WAYLAND_DISPLAY"):
        monkeypatch.delenv(var, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert webcli.headless() is expected


def test_browsable_address():
    assert webcli.browsable("http://127.0.0.1:8000") == "http://127.0.0.1:8000/"
    assert webcli.browsable("http://0.0.0.0:8000") == "http://localhost:8000/"
    assert webcli.browsable("http://[::]:9") == "http://localhost:9/"


@pytest.mark.parametrize("no_browser,display,opens", [(False, ":0", True), (True, ":0", False), (False, None, False)])
def test_web_opens_the_browser_once_ready(monkeypatch, capsys, no_browser, display, opens):
    """`coli web` runs `coli serve` and opens the page when the server says it is listening."""
    monkeypatch.setattr(webcli.sys, "platform", "linux")
    monkeypatch.delenv("WAYLAND_DISPLAY", raising=False)
    if display:
        monkeypatch.setenv("DISPLAY", display)
    else:
        monkeypatch.delenv("DISPLAY", raising=False)
    opened, served = [], []

    async def fake_run_server(server, on_ready=None):  # what coli.server.serve does, minus the server
        on_ready("http://127.0.0.1:4321")

    def fake_serve(**options):  # `coli serve` calls coli.server.serve(server, on_ready=...)
        served.append(options)
        import asyncio

        asyncio.run(coli.server.serve(object(), on_ready=lambda url: None))

    monkeypatch.setattr(coli.server, "serve", fake_run_server)
    monkeypatch.setattr(webcli, "serve", fake_serve)
    monkeypatch.setattr(webcli, "open_browser", opened.append)
    webcli.web(no_browser=no_browser, port=4321)
    assert served == [{"port": 4321}]
    assert opened == (["http://127.0.0.1:4321/"] if opens else [])
    assert coli.server.serve is fake_run_server  # restored
    err = capsys.readouterr().err
    assert "the dashboard is at http://127.0.0.1:4321/" in err
    assert ("no display" in err) == (not no_browser and display is None)


# -- the committed build ------------------------------------------------------------------------


def test_build_is_in_the_package():
    files = dashboard.files()
    assert "/" in files and "/index.html" in files
    html = files["/"].read_text()
    refs = re.findall(r'(?:src|href)="\./(assets/[^"]+)"', html)
    assert refs and all(f"/{r}" in files for r in refs), refs
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert '"web_dist/*"' in pyproject and '"web_dist/assets/*"' in pyproject


def test_dashboard_is_served_and_public_with_an_api_key(tmp_path):
    from aiohttp import web as aioweb
    from aiohttp.test_utils import TestClient, TestServer
    import asyncio

    (tmp_path / "assets").mkdir()
    (tmp_path / "index.html").write_text('<script src="./assets/a-1.js"></script>')
    (tmp_path / "assets" / "a-1.js").write_text("console.log(1)")

    async def check():
        app = aioweb.Application()
        dashboard.mount(app, tmp_path)
        async with TestClient(TestServer(app)) as client:
            r = await client.get("/")
            assert r.status == 200 and r.headers["Content-Type"].startswith("text/html")
            assert "a-1.js" in await r.text()
            r = await client.get("/assets/a-1.js")
            assert r.status == 200 and r.headers["Content-Type"].startswith("text/javascript")
            assert "immutable" in r.headers["Cache-Control"]
            assert (await client.get("/assets/missing.js")).status == 404

    asyncio.run(check())
    from coli.server.security import PUBLIC

    assert {"/", "/assets/a-1.js"} <= PUBLIC


def test_unbuilt_dashboard_says_how_to_build(tmp_path):
    from aiohttp import web as aioweb
    from aiohttp.test_utils import TestClient, TestServer
    import asyncio

    async def check():
        app = aioweb.Application()
        dashboard.mount(app, tmp_path)
        async with TestClient(TestServer(app)) as client:
            r = await client.get("/")
            assert r.status == 200 and "web/build.sh" in await r.text()

    asyncio.run(check())


def test_real_server_serves_dashboard_beside_api_with_key():
    from server_kit import http
    from coli.server import Server, ServerConfig, ServerThread
    from coli.runner import Runner
    import coli

    model = coli.load()  # the built-in model
    runner = Runner(model, persist=False)
    try:
        with ServerThread(Server(model, runner, ServerConfig(api_key="s3cret"))) as url:
            status, headers, body = http(url, "GET", "/")
            assert status == 200 and "text/html" in headers["content-type"] and "<div id=\"root\">" in body
            assert http(url, "GET", "/experts")[0] == 401  # the API still needs the key
            assert http(url, "GET", "/experts", headers={"Authorization": "Bearer s3cret"})[0] == 200
    finally:
        runner.close()
        model.close()


def _digest(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def test_committed_build_matches_the_source(tmp_path):
    """web/build.sh into a temporary folder gives the committed coli/web_dist, byte for byte."""
    _npm_ready()
    out = tmp_path / "dist"
    run = subprocess.run(["bash", str(WEB / "build.sh"), str(out)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    built, committed = _digest(out), _digest(dashboard.DIST)
    assert built == committed, ("coli/web_dist is stale: run web/build.sh and commit it\n"
                                + json.dumps({"built": built, "committed": committed}, indent=1))


def test_web_unit_tests():
    """web/'s vitest suite: the API client and the data transforms."""
    _npm_ready()
    run = subprocess.run(["npx", "vitest", "run", "--reporter=dot"], cwd=WEB, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
