"""The aiohttp application: routes, the shared ``Server`` state, and ways to run it.

    server = Server(model, runner, ServerConfig(port=8000))
    await serve(server)                        # coli serve: until cancelled
    with ServerThread(server) as url: ...      # tests and benchmarks: a background thread
"""
from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from functools import lru_cache
from pathlib import Path

from aiohttp import web

from coli.chat_format import detect
from coli.server import anthropic, brio, openai
from coli.server.config import ServerConfig
from coli.server.errors import ApiError, invalid
from coli.server.openapi import document
from coli.server.security import Guard
from coli.server.telemetry import Telemetry

log = logging.getLogger("coli.server")
SERVER = web.AppKey("server", object)


class Server:
    """A loaded model, its runner and the settings: what every handler reads."""

    def __init__(self, model, runner, config: ServerConfig | None = None):
        self.model, self.runner = model, runner
        self.config = config or ServerConfig()
        self.model_id = self.config.model_id or Path(str(model.path)).name
        self.chat_format = detect(model.config.model_type, model.tokenizer.chat_template)
        self.telemetry = Telemetry(self)
        self.created = int(time.time())
        self._byte_level = _is_byte_level(model.tokenizer)
        self.token_text = lru_cache(maxsize=65536)(self._token_text)
        self.token_bytes = lru_cache(maxsize=65536)(self._token_bytes)

    def check_model(self, body: dict) -> str:
        """The request's ``model``: absent (this one) or this server's id; else 404."""
        name = body.get("model")
        if name is None:
            return self.model_id
        if not isinstance(name, str):
            raise invalid("model: expected a string", "model")
        if name != self.model_id:
            raise ApiError(404, f"the model {name!r} is not served here; this server serves {self.model_id!r} "
                                "(GET /v1/models)", code="model_not_found", param="model")
        return name

    def _token_text(self, token: int) -> str:
        return self.model.tokenizer.decode([token], skip_special_tokens=False)

    def _token_bytes(self, token: int) -> tuple[int, ...]:
        """The token's own bytes (byte-level vocabularies: also a part of a UTF-8 character)."""
        if self._byte_level:
            piece = self.model.tokenizer.id_to_token(token) or ""
            if all(c in _UNICODE_TO_BYTE for c in piece):
                return tuple(_UNICODE_TO_BYTE[c] for c in piece)
        return tuple(self._token_text(token).encode())


def build_app(server: Server) -> web.Application:
    guard = Guard(server.config)
    app = web.Application(middlewares=[_counted, guard.middleware], client_max_size=server.config.max_body)
    app[SERVER] = server
    app.on_response_prepare.append(guard.on_prepare)
    t = server.telemetry
    app.add_routes([
        web.get("/v1/models", openai.models), web.get("/v1/models/{model}", openai.model),
        web.post("/v1/chat/completions", openai.chat_completions), web.post("/v1/completions", openai.completions),
        web.post("/v1/messages", anthropic.messages), web.post("/v1/messages/count_tokens", anthropic.count_tokens),
        web.post("/v1/brio", brio.brio), web.post("/tokenize", openai.tokenize),
        web.post("/detokenize", openai.detokenize), web.get("/health", t.health), web.get("/metrics", t.prometheus),
        web.get("/experts", t.experts), web.get("/profile", t.profile), web.get("/openapi.json", _openapi),
    ])
    return app


async def _openapi(request: web.Request) -> web.Response:
    return web.json_response(document(request.app[SERVER]))


@web.middleware
async def _counted(request: web.Request, handler):
    """Counts answers per endpoint and status (colibri_server_requests_total)."""
    resource = request.match_info.route.resource
    endpoint = resource.canonical if resource is not None else "unmatched"
    status = 500
    try:
        response = await handler(request)
        status = response.status
        return response
    except asyncio.CancelledError:
        status = 499  # the client went away
        raise
    finally:
        request.app[SERVER].telemetry.metrics.requests_total.labels(endpoint, str(status)).inc()


# -- running ----------------------------------------------------------------------------------


async def start(server: Server, host: str | None = None, port: int | None = None) -> tuple[web.AppRunner, str]:
    """Start listening; returns the aiohttp runner and the URL (with the real port)."""
    host = server.config.host if host is None else host
    port = server.config.port if port is None else port
    runner = web.AppRunner(build_app(server), handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    sock = site._server.sockets[0]
    bound = sock.getsockname()[1]
    shown = f"[{host}]" if ":" in host else host
    return runner, f"http://{shown}:{bound}"


async def serve(server: Server, on_ready=None) -> None:
    """Serve until cancelled (Ctrl-C); ``on_ready(url)`` once listening."""
    runner, url = await start(server)
    if on_ready is not None:
        on_ready(url)
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


class ServerThread:
    """The server on its own event loop in a background thread, on 127.0.0.1 and a free port."""

    def __init__(self, server: Server, host: str = "127.0.0.1", port: int = 0):
        self.server, self.host, self.port = server, host, port
        self.url: str | None = None
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="coli-server", daemon=True)

    def __enter__(self) -> str:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self, timeout: float = 60) -> str:
        self._thread.start()
        if not self._ready.wait(timeout) or self._error is not None:
            raise RuntimeError(f"the server did not start: {self._error!r}")
        return self.url

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self._runner, self.url = self.loop.run_until_complete(start(self.server, self.host, self.port))
        except BaseException as e:
            self._error = e
            self._ready.set()
            return
        self._ready.set()
        self.loop.run_forever()
        self.loop.run_until_complete(self._runner.cleanup())
        self.loop.close()

    def stop(self, timeout: float = 30) -> None:
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout)


# -- token bytes ------------------------------------------------------------------------------


def _byte_table() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: the character standing for each byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


_UNICODE_TO_BYTE = _byte_table()


def _is_byte_level(tokenizer) -> bool:
    backend = getattr(tokenizer, "_backend", None)
    decoder = getattr(backend, "decoder", None)
    if decoder is None:
        return False
    try:
        return '"ByteLevel"' in json.dumps(json.loads(decoder.__getstate__()))
    except Exception:
        return False
