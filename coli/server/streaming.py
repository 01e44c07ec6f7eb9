"""Server-sent events to one client without letting a slow reader hold anything up.

The handler formats events and hands their bytes to ``SSEStream.send``, which never
waits for the client: while the socket's buffer is below its high watermark the bytes go
straight to it; otherwise they go into the stream's own buffer, and a writer task moves
them on once the kernel has taken the socket's buffer below the low watermark
(``stream_high`` / ``stream_low``). The
engine thread never waits for any client (events queue per request), so a client that
stops reading only grows its own buffers; once they hold more than ``stream_ceiling``
bytes the stream is dropped (the connection aborted) and the caller cancels its request.
"""
from __future__ import annotations

import asyncio
import json
import logging
import socket

from aiohttp import web

from coli.scheduler import Error
from coli.server.errors import ApiError, from_coli

log = logging.getLogger("coli.server")


def sse(data, event: str | None = None) -> bytes:
    """One SSE frame; ``data`` is JSON-encoded unless it is already a string."""
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {text}\n\n".encode()


class SSEStream:
    def __init__(self, request: web.Request, *, high: int, low: int, ceiling: int, send_buffer: int | None = None):
        self.request = request
        self.high, self.low, self.ceiling, self.send_buffer = high, low, ceiling, send_buffer
        self.response: web.StreamResponse | None = None
        self._buf = bytearray()
        self._wake = asyncio.Event()
        self._closing = False
        self._busy = False  # the writer task is in a write
        self._writer: asyncio.Task | None = None
        self.dropped = False  # past the ceiling: the connection was aborted
        self.broken = False  # the client went away

    @property
    def alive(self) -> bool:
        return not (self.dropped or self.broken)

    async def open(self, headers: dict) -> None:
        """Send the status line and headers (after this, errors go inside the stream)."""
        self.response = web.StreamResponse(status=200, headers={
            "Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no", **headers})
        await self.response.prepare(self.request)
        transport = self.request.transport
        if transport is not None:
            transport.set_write_buffer_limits(high=self.high, low=self.low)
            sock = transport.get_extra_info("socket")
            if self.send_buffer and sock is not None:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.send_buffer)
        self._writer = asyncio.get_running_loop().create_task(self._pump())

    def pending(self) -> int:
        """Bytes queued for this client: ours plus the socket buffer's."""
        transport = self.request.transport
        return len(self._buf) + (transport.get_write_buffer_size() if transport is not None else 0)

    async def send(self, data: bytes) -> bool:
        """Queue bytes; False once the stream is gone (dropped or disconnected). Never waits
        for the client: with room in the socket buffer the bytes go straight to it, else
        to the stream's buffer and the writer task."""
        if not self.alive:
            return False
        transport = self.request.transport
        if not self._buf and not self._busy and transport is not None \
                and transport.get_write_buffer_size() < self.high:
            try:
                await self.response.write(data)  # below the high watermark: returns without waiting
            except (ConnectionError, RuntimeError):
                self.broken = True
                return False
            return True
        self._buf += data
        if self.pending() > self.ceiling:
            self._drop()
            return False
        self._wake.set()
        return True

    async def close(self) -> None:
        """Flush what is queued and end the response."""
        self._closing = True
        self._wake.set()
        if self._writer is not None:
            try:
                await self._writer
            except Exception:
                self.broken = True
        if self.alive and self.response is not None:
            try:
                await self.response.write_eof()
            except (ConnectionError, RuntimeError):
                self.broken = True

    def abort(self) -> None:
        """Stop writing (the handler is leaving early)."""
        if self._writer is not None and not self._writer.done():
            self._writer.cancel()

    async def _pump(self) -> None:
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                while self._buf and self.alive:
                    chunk = bytes(self._buf)
                    self._buf.clear()
                    self._busy = True
                    await self.response.write(chunk)  # waits while the socket buffer is above `high`
                    self._busy = False
                if self._closing or not self.alive:
                    return
        except (ConnectionError, RuntimeError):
            self.broken = True

    def _drop(self) -> None:
        log.warning("dropping a stream whose client is not reading (%d bytes queued, ceiling %d)",
                    self.pending(), self.ceiling)
        self.dropped = True
        self._buf.clear()
        if self._writer is not None:
            self._writer.cancel()
        transport = self.request.transport
        if transport is not None:
            transport.abort()


async def run_stream(request, server, gen, first: bytes, on_event, closing, keepalive: bytes,
                     error_frames) -> web.StreamResponse:
    """Send a stream: headers and ``first``, then each event's frames, keepalives while
    nothing comes, ``closing()`` at the end; an error after the headers goes in-band."""
    cfg = server.config
    metrics = server.telemetry.metrics
    stream = SSEStream(request, high=cfg.stream_high, low=cfg.stream_low, ceiling=cfg.stream_ceiling,
                       send_buffer=cfg.send_buffer)
    metrics.streams_open.inc()
    try:
        await stream.open(gen.headers)
        await stream.send(first)
        async for item in gen.events(cfg.keepalive):
            if item is None:
                data = keepalive
            else:
                i, ev = item
                if isinstance(ev, Error):
                    gen.cancel()
                    error = from_coli(ev.exception())
                    if getattr(server, "draining", False):
                        error = ApiError(503, "the server is shutting down; the answer was cut short",
                                         code="server_shutting_down")
                    await stream.send(error_frames(error))
                    break
                data = await on_event(i, ev)
            if data and not await stream.send(data):
                stream.abort()
                gen.cancel()  # the client is gone or not reading: free its slots now
                (metrics.dropped_total if stream.dropped else metrics.disconnects_total).inc()
                return stream.response
        else:
            await stream.send(closing())
        await stream.close()
        return stream.response
    except BaseException as e:
        stream.abort()
        gen.cancel()
        if isinstance(e, (asyncio.CancelledError, ConnectionError)):  # the client went away
            metrics.disconnects_total.inc()
        raise
    finally:
        metrics.streams_open.dec()
