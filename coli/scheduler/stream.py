"""A request's event stream, read from asyncio or from plain threads.

The engine thread puts events; a front end reads them with ``async for ev in
handle`` (aiohttp, Textual workers) or ``for ev in handle`` (pipes, tests). The
stream ends after its ``Finished`` or ``Error`` event.

Inside ``batched_delivery()`` (the runner wraps each engine step in it) the events a
thread puts are queued at once, and a reading thread wakes at once as elsewhere, but the
asyncio readers are woken only when the block ends: with one call into each loop for all
of its readers, however many events and requests the step produced (each call writes to
the loop's wake-up pipe, and each wake-up of the loop takes the GIL from the engine's
thread).
"""
from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from coli.scheduler.core import Request
from coli.scheduler.events import Error, Event, Finished, Profile, SchedulerError, Started, TextDelta, Usage


_deferred = threading.local()  # .handles: {handle: None} whose readers this thread wakes at the block's end


@contextmanager
def batched_delivery():
    """Defer the asyncio readers' wake-ups of the events this thread puts until the block
    ends (see the module docstring); nested blocks wake at the outermost one's end."""
    if getattr(_deferred, "handles", None) is not None:
        yield
        return
    _deferred.handles = {}
    try:
        yield
    finally:
        handles, _deferred.handles = _deferred.handles, None
        _wake(handles)


def _wake(handles) -> None:
    loops: dict[asyncio.AbstractEventLoop, list[asyncio.Event]] = {}
    for h in handles:
        with h._cond:
            if h._loop is not None:
                loops.setdefault(h._loop, []).append(h._ready)
    for loop, readies in loops.items():
        try:
            loop.call_soon_threadsafe(_set_all, readies)
        except RuntimeError:  # the readers' loop has closed
            pass


def _set_all(readies: list[asyncio.Event]) -> None:
    for ready in readies:
        ready.set()


@dataclass(frozen=True)
class Timings:
    """When the reader got a request's Started and its Finished event (``result(timings=True)``):
    time.perf_counter() seconds, and the ``cpu_clock`` given to ``result`` (None without one)."""

    started: float
    finished: float
    started_cpu: float | None = None
    finished_cpu: float | None = None


@dataclass(frozen=True)
class Completion:
    """A whole answer, as ``RequestHandle.result`` gathers it."""

    text: str
    finish_reason: str
    usage: Usage
    started: Started
    profile: Profile | None = None
    timings: Timings | None = None


class RequestHandle:
    """What ``Runner.submit`` returns: the request's events, and ``cancel()``."""

    def __init__(self, request: Request, cancel: Callable[[Request], bool]):
        self.request = request
        self._cancel = cancel
        self._items: deque[Event] = deque()
        self._cond = threading.Condition()
        self._ended = False  # the terminal event was put
        self._done = False  # ... and read
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready: asyncio.Event | None = None

    @property
    def request_id(self) -> str:
        return self.request.request_id

    def cancel(self) -> bool:
        """Stop the request; its slot is free within one engine step. Thread-safe."""
        return self._cancel(self.request)

    # -- the engine side -------------------------------------------------------------------------

    def put(self, event: Event) -> None:
        deferred = getattr(_deferred, "handles", None)
        with self._cond:
            if self._ended:
                return
            self._items.append(event)
            self._ended = isinstance(event, (Finished, Error))
            self._cond.notify_all()  # a reading thread wakes at once
            if deferred is not None:  # batched_delivery: an asyncio reader at the end of the block
                if self._loop is not None:
                    deferred[self] = None
                return
            loop, ready = self._loop, self._ready
        if loop is not None:
            try:
                loop.call_soon_threadsafe(ready.set)
            except RuntimeError:  # the reader's loop has closed
                pass

    # -- the reading side ------------------------------------------------------------------------

    def _pop(self) -> Event | None:
        ev = self._items.popleft()
        if isinstance(ev, (Finished, Error)):
            self._done = True
        return ev

    def poll(self) -> Event | None:
        """The next event if one is queued, else None; never waits."""
        with self._cond:
            return self._pop() if self._items else None

    def __iter__(self) -> Iterator[Event]:
        return self.events()

    def events(self, timeout: float | None = None) -> Iterator[Event]:
        """Blocking iterator; raises TimeoutError when no event comes for ``timeout`` seconds."""
        while True:
            with self._cond:
                if self._done:
                    return
                if not self._cond.wait_for(lambda: self._items, timeout):
                    raise TimeoutError(f"no event for request {self.request_id} in {timeout} s")
                ev = self._pop()
            yield ev

    def __aiter__(self):
        return self

    async def __anext__(self) -> Event:
        loop = asyncio.get_running_loop()
        while True:
            with self._cond:
                if self._items:
                    return self._pop()
                if self._done:
                    raise StopAsyncIteration
                if self._loop is not loop:
                    self._loop, self._ready = loop, asyncio.Event()
                self._ready.clear()
                ready = self._ready
            await ready.wait()

    def result(self, timeout: float | None = None, *, timings: bool = False,
               cpu_clock: Callable[[], float] | None = None) -> Completion:
        """Wait for the whole answer; raises the request's SchedulerError (queue_timeout,
        cancelled, engine_error) or TimeoutError when ``timeout`` seconds pass.
        ``timings``: also note when Started and Finished were read (``Completion.timings``),
        by time.perf_counter and by ``cpu_clock`` when given (e.g. the runner thread's CPU
        clock: ``coli.speculate.bench`` measures decode speed so)."""
        end = None if timeout is None else time.monotonic() + timeout
        text, usage, started, profile, t0, c0 = [], None, None, None, None, None
        for ev in self.events(timeout):
            if isinstance(ev, TextDelta):
                text.append(ev.text)
            elif isinstance(ev, Usage):
                usage = ev
            elif isinstance(ev, Profile):
                profile = ev
            elif isinstance(ev, Started):
                started = ev
                if timings:
                    t0, c0 = time.perf_counter(), cpu_clock() if cpu_clock is not None else None
            elif isinstance(ev, Error):
                raise ev.exception()
            elif isinstance(ev, Finished):
                times = None
                if timings:
                    times = Timings(t0, time.perf_counter(), c0, cpu_clock() if cpu_clock is not None else None)
                return Completion("".join(text), ev.finish_reason, usage, started, profile, times)
            if end is not None and time.monotonic() > end:
                raise TimeoutError(f"request {self.request_id} did not finish in {timeout} s")
        raise SchedulerError("the stream ended without a Finished event")
