"""`coli chat --url`: the client side against a fake `coli serve` (aiohttp) and, where it
is present, the real one."""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

aiohttp_web = pytest.importorskip("aiohttp.web")

from coli.errors import ColiError  # noqa: E402
from coli.scheduler.events import Error, Finished, ReasoningDelta, Started, TextDelta  # noqa: E402
from coli.tui.backend import RemoteBackend  # noqa: E402
from coli.tui.grid import ExpertGrid, encode  # noqa: E402
from coli.tui.stats import TurnStats  # noqa: E402

KEY = "sekrit"


class FakeServer:
    """Just enough of `coli serve`: /health, /v1/models, /v1/chat/completions (SSE), /experts, /profile."""

    def __init__(self, words=4, delay=0.0, key=KEY):
        self.words, self.delay, self.key = words, delay, key
        self.bodies: list[dict] = []
        self.disconnected = threading.Event()
        self.loop = asyncio.new_event_loop()
        self.url = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def authorized(self, request) -> bool:
        return self.key is None or request.headers.get("Authorization") == f"Bearer {self.key}"

    async def health(self, request):
        body = {"status": "ok", "capacity": 3, "slots": [{"slot": i} for i in range(3)]}
        if self.authorized(request):
            body.update(model="fake-moe", memory={"dense_bytes": 1 << 20, "experts_pinned_bytes": 0,
                                                  "experts_ram_bytes": 1 << 20, "experts_disk_bytes": 5 << 20})
        return aiohttp_web.json_response(body)

    async def models(self, request):
        return aiohttp_web.json_response({"data": [{"id": "fake-moe"}]})

    async def chat(self, request):
        if not self.authorized(request):
            return aiohttp_web.json_response({"error": {"message": "invalid API key", "code": "invalid_api_key"}},
                                             status=401)
        body = await request.json()
        self.bodies.append(body)
        resp = aiohttp_web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)

        async def send(obj):
            await resp.write(f"data: {json.dumps(obj)}\n\n".encode())

        try:
            await send({"choices": [{"index": 0, "delta": {"role": "assistant", "reasoning_content": "hmm"}}]})
            for i in range(self.words):
                await asyncio.sleep(self.delay)
                await send({"choices": [{"index": 0, "delta": {"content": f"tok{i} "}, "finish_reason": None}]})
            await send({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
            await send({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": self.words}})
            await resp.write(b"data: [DONE]\n\n")
        except (ConnectionResetError, asyncio.CancelledError):
            self.disconnected.set()
            raise
        return resp

    async def experts(self, request):
        tiers = np.array([[2, 1, 0, 0]], np.uint8)
        heat = np.array([[5, 3, 1, 0]], np.uint8)
        routed = np.array([[True, False, False, True]])
        return aiohttp_web.json_response(encode(ExpertGrid(tiers, heat, routed, seq=7)))

    async def profile(self, request):
        return aiohttp_web.json_response({"window": 64, "turns": [
            {"io_wait_seconds": 0.1, "expert_matmul_seconds": 0.2, "attention_seconds": 0.1,
             "dense_mlp_seconds": 0.0, "lm_head_seconds": 0.05, "other_seconds": 0.05, "prompt_tokens": 5,
             "completion_tokens": self.words, "tokens_per_second": 40.0, "experts_needed": 8, "experts_hit": 6}]})

    def _run(self):
        asyncio.set_event_loop(self.loop)
        app = aiohttp_web.Application()
        app.add_routes([aiohttp_web.get("/health", self.health), aiohttp_web.get("/v1/models", self.models),
                        aiohttp_web.post("/v1/chat/completions", self.chat),
                        aiohttp_web.get("/experts", self.experts), aiohttp_web.get("/profile", self.profile)])
        runner = aiohttp_web.AppRunner(app)
        self.loop.run_until_complete(runner.setup())
        site = aiohttp_web.TCPSite(runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        port = site._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self._ready.set()
        self.loop.run_forever()
        self.loop.run_until_complete(runner.cleanup())

    def __enter__(self):
        self._thread.start()
        self._ready.wait(10)
        return self

    def __exit__(self, *exc):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


def test_remote_stream_grid_and_profile():
    with FakeServer() as srv:
        b = RemoteBackend(srv.url + "/v1", KEY, max_tokens=9, sampling={"temperature": 0.0})
        assert b.slots == 3 and b.model_id == "fake-moe"
        assert b.info()["resident"] == "2.0 MiB"
        events = list(b.stream([{"role": "user", "content": "hi"}], 2))
        kinds = [type(e) for e in events]
        assert kinds[0] is Started and kinds[-1] is Finished and TurnStats in kinds
        assert "".join(e.text for e in events if isinstance(e, TextDelta)) == "tok0 tok1 tok2 tok3 "
        assert [e.text for e in events if isinstance(e, ReasoningDelta)] == ["hmm"]
        turn = next(e for e in events if isinstance(e, TurnStats))
        assert turn.tokens_per_second == pytest.approx(40.0) and turn.hit_rate == 0.75
        body = srv.bodies[0]
        assert body["cache_slot"] == 2 and body["stream"] and body["max_tokens"] == 9 and body["temperature"] == 0.0
        g = b.grid()
        assert g.shape == (1, 4) and g.tiers.tolist() == [[2, 1, 0, 0]] and g.routed.tolist() == [[1, 0, 0, 1]]
        assert g.seq == 7


def test_remote_cancel_closes_the_stream():
    with FakeServer(words=500, delay=0.01) as srv:
        b = RemoteBackend(srv.url, KEY)
        got = []
        for ev in b.stream([{"role": "user", "content": "hi"}], 0):
            got.append(ev)
            if sum(isinstance(e, TextDelta) for e in got) == 3:
                b.cancel()
        assert isinstance(got[-1], Error) and got[-1].code == "cancelled"
        assert sum(isinstance(e, TextDelta) for e in got) < 50
        assert srv.disconnected.wait(5)


def test_remote_errors():
    with FakeServer() as srv:
        b = RemoteBackend(srv.url, "wrong")
        events = list(b.stream([{"role": "user", "content": "hi"}], 0))
        assert isinstance(events[-1], Error) and "invalid API key" in events[-1].message
    with pytest.raises(ColiError, match="cannot reach"):
        RemoteBackend("http://127.0.0.1:9", None, timeout=2)


def test_remote_app_shows_the_server(tmp_path):
    from coli.tui.app import ChatApp
    from coli.tui.widgets import MessageView, RoutingPane

    async def body(app):
        async with app.run_test(size=(120, 36)) as pilot:
            app.query_one("#prompt").value = "hello"
            await pilot.press("enter")
            end = time.monotonic() + 10
            while app.busy or not app.history.last:
                assert time.monotonic() < end
                await pilot.pause(0.05)
            await pilot.pause(0.3)
            assert app.query(MessageView).last().content == "tok0 tok1 tok2 tok3 "
            assert app.query_one(RoutingPane).grid.shape == (1, 4)
            assert "fake-moe" in str(app.query_one("#status").render())

    with FakeServer() as srv:
        asyncio.run(body(ChatApp(RemoteBackend(srv.url, KEY), history_file=None)))


def test_piped_chat_with_url():
    with FakeServer() as srv:
        r = subprocess.run([sys.executable, "-m", "coli.cli", "chat", "--url", srv.url, "--api-key", KEY],
                           input="hello\n", capture_output=True, text=True, timeout=60, env=os.environ)
    assert r.returncode == 0, r.stderr
    assert r.stdout == "tok0 tok1 tok2 tok3 \n"
    r = subprocess.run([sys.executable, "-m", "coli.cli", "chat", "--url", "http://127.0.0.1:9"],
                       input="hello\n", capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and r.stdout == ""


def test_against_the_real_server(hf_models):
    server_app = pytest.importorskip("coli.server.app")
    import coli
    from coli.runner import Runner

    m = coli.load(hf_models("qwen3_moe"))
    with Runner(m, kv_slots=2, persist=False) as runner:
        with server_app.ServerThread(server_app.Server(m, runner)) as url:
            b = RemoteBackend(url)
            assert b.slots == 2
            events = list(b.stream([{"role": "user", "content": "w1 w2"}], 1))
            text = "".join(e.text for e in events if isinstance(e, TextDelta))
            assert text.strip().startswith("w") and isinstance(events[-1], Finished)
            turn = next(e for e in events if isinstance(e, TurnStats))
            assert turn.completion_tokens >= 1
            g = b.grid()
            assert g.shape == (2, 8) and g.heat.sum() > 0 and g.seq >= 1
