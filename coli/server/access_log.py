"""The access log: one line per request on stderr, as text or JSON (``--log-format``).

    2026-12-01T02:10:00.123Z POST /v1/messages 200 "claude-cli/2.1.197 (external, cli)" prompt=20312 cached=0 completion=12 queue_ms=0 ms=5321

Fields: time (UTC, when the request arrived), method, path (without the query), status
(499: the client went away first), client (its User-Agent), prompt/cached/completion
tokens summed over the request's generations (0 for requests that generate nothing), the
longest queue wait, and the duration until the last byte. ``--log-format json`` writes
the same as one JSON object per line; ``off`` writes nothing. The middleware opens a
record per request in a context variable; ``Generation`` adds what it generated
(``note_usage``, ``note_queue``), so no handler has to know about the log.
"""
from __future__ import annotations

import asyncio
import contextvars
import json
import sys
import time
from datetime import datetime, timezone

from aiohttp import web

FORMATS = ("text", "json", "off")
_current: contextvars.ContextVar[dict | None] = contextvars.ContextVar("coli_access_record", default=None)


def note_usage(prompt: int, cached: int, completion: int) -> None:
    """Add one finished generation's tokens to the current request's record (if any)."""
    rec = _current.get()
    if rec is not None:
        rec["prompt_tokens"] += prompt
        rec["cached_tokens"] += cached
        rec["completion_tokens"] += completion


def note_queue(seconds: float) -> None:
    rec = _current.get()
    if rec is not None:
        rec["queue_wait_ms"] = max(rec["queue_wait_ms"], round(1000 * seconds))


def line(rec: dict, fmt: str) -> str:
    if fmt == "json":
        return json.dumps(rec, ensure_ascii=False, separators=(",", ":"))
    client = json.dumps(rec["client"] or "-", ensure_ascii=False)
    return (f"{rec['time']} {rec['method']} {rec['path']} {rec['status']} {client} prompt={rec['prompt_tokens']} "
            f"cached={rec['cached_tokens']} completion={rec['completion_tokens']} "
            f"queue_ms={rec['queue_wait_ms']} ms={rec['duration_ms']}")


def middleware(fmt: str, stream=None):
    """The aiohttp middleware writing one line per request to ``stream`` (stderr)."""

    @web.middleware
    async def access_log(request: web.Request, handler):
        t0 = time.monotonic()
        now = datetime.now(timezone.utc)
        rec = {"time": now.strftime("%Y-%m-%dT%H:%M:%S.") + f"{now.microsecond // 1000:03d}Z",
               "method": request.method, "path": request.path, "status": 500,
               "client": request.headers.get("User-Agent", ""), "prompt_tokens": 0, "cached_tokens": 0,
               "completion_tokens": 0, "queue_wait_ms": 0, "duration_ms": 0}
        token = _current.set(rec)
        try:
            response = await handler(request)
            rec["status"] = response.status
            return response
        except web.HTTPException as e:
            rec["status"] = e.status
            raise
        except asyncio.CancelledError:
            rec["status"] = 499
            raise
        finally:
            _current.reset(token)
            rec["duration_ms"] = round(1000 * (time.monotonic() - t0))
            out = stream or sys.stderr
            try:
                out.write(line(rec, fmt) + "\n")
                out.flush()
            except (OSError, ValueError):  # stderr closed: the log is not worth a failed request
                pass

    return access_log
