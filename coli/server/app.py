"""The aiohttp application: routes, and ways to run it (``Server`` is in state.py).

    server = Server(model, runner, ServerConfig(port=8000))
    await serve(server)                        # coli serve: until cancelled
    with ServerThread(server) as url: ...      # tests and benchmarks: a background thread
"""
from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading

from aiohttp import web

from coli.server import access_log, anthropic, atlas, brio, completions, dashboard, openai, responses, systemone
from coli.server.connections import ConnectionGuard, raise_file_limit
from coli.server.openapi import document
from coli.server.security import Guard
from coli.server.state import SERVER, Server

__all__ = ["SERVER", "Server", "ServerThread", "build_app", "serve", "start"]
log = logging.getLogger("coli.server")


CONNECTIONS = web.AppKey("connections", ConnectionGuard)
SHUTDOWN_GRACE = 3.0  # seconds in-flight handlers get to send their last frames at shutdown


def build_app(server: Server) -> web.Application:
    guard, connections = Guard(server.config), ConnectionGuard(server.config)
    logged = [access_log.middleware(server.config.log_format)] if server.config.log_format != "off" else []
    app = web.Application(middlewares=[connections.middleware, *logged, _counted, guard.middleware],
                          client_max_size=server.config.max_body)
    app[SERVER], app[CONNECTIONS] = server, connections
    app.on_cleanup.append(connections.close)
    app.on_response_prepare.append(guard.on_prepare)
    t = server.telemetry
    app.add_routes([
        web.get("/v1/models", openai.models), web.get("/v1/models/{model}", openai.model),
        web.post("/v1/chat/completions", openai.chat_completions),
        web.post("/v1/completions", completions.completions),
        web.post("/v1/messages", anthropic.messages), web.post("/v1/messages/count_tokens", anthropic.count_tokens),
        web.post("/v1/brio", brio.brio), web.post("/v1/systemone", systemone.systemone),
        web.post("/tokenize", completions.tokenize),
        web.post("/detokenize", completions.detokenize), web.get("/health", t.health),
        web.get("/metrics", t.prometheus),
        web.get("/experts", t.experts), web.get("/profile", t.profile), web.get("/openapi.json", _openapi),
        web.get("/experts/atlas", atlas.atlas),
    ])
    responses.add_routes(app)  # POST /v1/responses and the stored responses (server/responses.py)
    dashboard.mount(app)  # the web dashboard's files (coli web), public like /health
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
    runner = web.AppRunner(build_app(server), handler_cancellation=True, access_log=None,
                           keepalive_timeout=server.config.idle_timeout, shutdown_timeout=SHUTDOWN_GRACE)
    await runner.setup()
    runner.app[CONNECTIONS].install(runner.server)
    site = web.TCPSite(runner, host, port, backlog=runner.app[CONNECTIONS].backlog)
    await site.start()
    sock = site._server.sockets[0]
    bound = sock.getsockname()[1]
    shown = f"[{host}]" if ":" in host else host
    return runner, f"http://{shown}:{bound}"


async def serve(server: Server, on_ready=None, on_stopping=None) -> None:
    """Serve until Ctrl-C or SIGTERM (or cancelled); ``on_ready(url)`` once listening.

    The first signal stops gracefully: the listener closes, every running or waiting
    request is cancelled (streams end with an error event and their terminator, other
    requests get 503), and the handlers get SHUTDOWN_GRACE seconds to send that; the
    caller then closes the runner, which saves KV. ``on_stopping()`` is called as it begins.
    A second signal exits the process at once (status 130)."""
    raise_file_limit()
    runner, url = await start(server)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()

    def on_signal() -> None:
        if stop.is_set():
            os.write(2, b"coli serve: stopped at once (second signal); KV slots were not saved\n")
            os._exit(130)
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):  # docker stop and systemd send SIGTERM
        try:
            loop.add_signal_handler(sig, on_signal)
        except (NotImplementedError, RuntimeError, ValueError):  # not the main thread, or no signals here
            pass
    if on_ready is not None:
        on_ready(url)
    try:
        await stop.wait()
    finally:
        for site in list(runner.sites):  # stop accepting first
            await site.stop()
        server.draining = True
        if on_stopping is not None:
            on_stopping()
        close = getattr(getattr(server.runner, "scheduler", None), "close", None)
        if close is not None:
            close()  # ends what runs or waits; their handlers answer at once (a cluster's: after the grace)
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
