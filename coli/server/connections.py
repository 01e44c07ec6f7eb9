"""Connections that do nothing cannot pile up: request and idle timeouts, a connection cap.

- ``request_timeout`` (--request-timeout): a new connection must send a whole request head
  within this many seconds, and a request's body must arrive within as many again
  (``params.read_json``); slower clients (slowloris) are closed, or answered 408.
- ``idle_timeout`` (--idle-timeout): a keep-alive connection idle this long between
  requests is closed (also aiohttp's own keep-alive timeout).
- ``max_connections`` (--max-connections): past it, the connection idle longest is closed
  to make room; when none is idle, the new one gets a 503 with Retry-After and is closed.
  It is also kept below the open-file limit, which ``raise_file_limit`` lifts to the hard
  limit at start, so accepting never fails with "Too many open files" (``connection_plan``).

The aiohttp server reports each connection through its public ``connection_made`` /
``connection_lost`` hooks; an outer middleware marks which of them are inside a request.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import resource

from aiohttp import web

log = logging.getLogger("coli.server")
FILE_RESERVE = 16  # descriptors kept, beyond those open at start, for KV files, logs and the listener


def raise_file_limit() -> int:
    """Lift the soft limit on open files to the hard one; returns the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError) as e:
            log.warning("could not raise the open-file limit from %d to %d: %s", soft, want, e)
    return soft


def connection_plan(configured: int) -> tuple[int, int]:
    """(connection cap, listen backlog) for the open-file limit: ``configured`` lowered to
    what the descriptors not yet open allow. The event loop accepts up to a backlog of
    connections at once before any is counted (and the idlest closed), so the cap leaves
    room for two such bursts, and a low limit gets a small backlog."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY:
        return configured, 128
    try:
        in_use = len(os.listdir("/proc/self/fd"))
    except OSError:
        in_use = 64
    free = soft - in_use - FILE_RESERVE
    backlog = max(4, min(128, free // 8))
    return max(1, min(configured, free - 2 * backlog)), backlog


class _State:
    __slots__ = ("transport", "busy", "served", "last")

    def __init__(self, transport, now: float):
        self.transport, self.busy, self.served, self.last = transport, 0, 0, now


class ConnectionGuard:
    def __init__(self, config):
        self.request_timeout = config.request_timeout
        self.idle_timeout = config.idle_timeout
        self.max_connections, self.backlog = connection_plan(config.max_connections)
        self.states: dict[object, _State] = {}
        self._sweeper: asyncio.Task | None = None

    def install(self, server: web.Server) -> None:
        """Watch ``server``'s connections (call after ``AppRunner.setup``, on its loop)."""
        made, lost = server.connection_made, server.connection_lost
        loop = asyncio.get_running_loop()

        def connection_made(handler, transport) -> None:
            made(handler, transport)
            if len(self.states) >= self.max_connections and not self._evict_idle():
                self._refuse(handler, transport)
                return
            self.states[handler] = _State(transport, loop.time())

        def connection_lost(handler, exc=None) -> None:
            self.states.pop(handler, None)
            lost(handler, exc)

        server.connection_made, server.connection_lost = connection_made, connection_lost
        self._sweeper = loop.create_task(self._sweep())

    async def close(self, app=None) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()

    @web.middleware
    async def middleware(self, request: web.Request, handler):
        state = self.states.get(request.protocol)
        if state is None:
            return await handler(request)
        state.busy += 1
        try:
            return await handler(request)
        finally:
            state.busy -= 1
            state.served += 1
            state.last = asyncio.get_running_loop().time()

    # -- policy -----------------------------------------------------------------------------------

    def _evict_idle(self) -> bool:
        idle = [(s.last, h) for h, s in self.states.items() if not s.busy]
        if not idle:
            return False
        _, handler = min(idle, key=lambda x: x[0])
        self._close(handler)
        return True

    def _refuse(self, handler, transport) -> None:
        log.warning("refusing a connection: %d are open and busy (--max-connections)", len(self.states))
        body = json.dumps({"error": {"message": f"the server has {len(self.states)} connections open and busy "
                                                "(--max-connections); retry shortly", "type": "server_error",
                                     "param": None, "code": "too_many_connections"}}).encode()
        transport.write(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
                        b"Connection: close\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        handler.force_close()

    def _close(self, handler) -> None:
        self.states.pop(handler, None)
        handler.force_close()

    async def _sweep(self) -> None:
        loop = asyncio.get_running_loop()
        tick = max(0.05, min(1.0, self.request_timeout / 4, self.idle_timeout / 4))
        while True:
            await asyncio.sleep(tick)
            now = loop.time()
            for handler, s in list(self.states.items()):
                if not s.busy and now - s.last > (self.idle_timeout if s.served else self.request_timeout):
                    self._close(handler)


def check_port(host: str, port: int) -> None:
    """Raise InvalidRequestError (one line for the CLI) when ``host:port`` cannot be listened
    on, before minutes go into loading a model; binds and closes a probe socket."""
    import errno
    import socket

    from coli.errors import InvalidRequestError

    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise InvalidRequestError(f"--host {host!r}: cannot resolve it ({e.strerror})") from None
    for family, kind, proto, _, address in infos:
        probe = socket.socket(family, kind, proto)
        try:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server itself binds
            if family == socket.AF_INET6:
                probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            probe.bind(address)
        except OSError as e:
            why = "it is already in use (another server? pick another --port)" if e.errno == errno.EADDRINUSE else e.strerror
            raise InvalidRequestError(f"cannot listen on {host or '*'}:{port}: {why}") from None
        finally:
            probe.close()
