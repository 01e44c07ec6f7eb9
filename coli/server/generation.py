"""One API call's generations: submit its n choices, wait for admission, merge their events.

Admission comes before any response byte: ``start()`` returns once every choice holds a
KV slot, or raises the API error (429 with Retry-After for a full queue or a queue
timeout) while a streaming handler can still answer with a status code. A client that
leaves while queued or generating cancels every choice (``cancel()``, called from the
handler's ``finally``), so their slots are free within one engine step.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace

from coli.errors import ColiError
from coli.sampling import SamplingParams
from coli.scheduler import (Error, Finished, Profile, ReasoningDelta, Started, TextDelta, TokenLogprob, ToolCallDelta,
                            Usage)
from coli.scheduler.stream import RequestHandle
from coli.server import access_log
from coli.server.errors import ApiError, from_coli

SEED_SPACE = 2**63


@dataclass
class GenSpec:
    """What to generate (front-end neutral)."""

    prompts: list[list[int]]  # one or more prompts; each gets n choices (index = prompt * n + j)
    max_tokens: int
    sampling: SamplingParams
    n: int = 1
    stop: list[str] = field(default_factory=list)
    ignore_leading_stop: bool = False
    stop_token_ids: frozenset[int] = frozenset()
    logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    cache_slot: int | None = None
    parser: Callable[[], object] | None = None  # a fresh OutputParser per choice
    constraint: object | None = None  # a coli.grammar.Constraint every choice's answer matches
    speculative: str | None = None  # x_colibri_speculative: this request's speculative decoding mode


def speculative_field(body: dict) -> str | None:
    """The ``x_colibri_speculative`` extension field: auto, off, ngram, draft or mtp (None: the server's)."""
    from coli.server import params as P
    from coli.speculate import MODES

    return P.choice(body, "x_colibri_speculative", MODES)


class Generation:
    def __init__(self, server, spec: GenSpec):
        self.server, self.spec = server, spec
        self.handles: list[RequestHandle] = []
        self.started: list[Started] = []
        self._tasks: list[asyncio.Task] = []
        self._profiles: dict[int, Profile] = {}
        self._usage: dict[int, Usage] = {}
        self._t0: float = 0.0

    @property
    def queue_wait_ms(self) -> int:
        return round(1000 * max((s.queue_wait_seconds for s in self.started), default=0.0))

    @property
    def headers(self) -> dict:
        return {"x-colibri-queue-wait-ms": str(self.queue_wait_ms)}

    async def start(self) -> None:
        """Submit every choice and wait until all are admitted; raises ApiError."""
        spec, runner = self.spec, self.server.runner
        check_capacity(runner, len(spec.prompts) * spec.n)
        try:
            with runner.scheduler.paused():  # the choices start in the same step
                for prompt, j in ((p, j) for p in spec.prompts for j in range(spec.n)):
                    sampling = spec.sampling
                    if j and sampling.seed is not None:  # n copies of one sample would be pointless
                        sampling = replace(sampling, seed=(sampling.seed + j) % SEED_SPACE)
                    self.handles.append(runner.submit(
                        prompt, max_tokens=spec.max_tokens, sampling=sampling, stop=spec.stop or None,
                        cache_slot=spec.cache_slot, ignore_leading_stop=spec.ignore_leading_stop,
                        stop_token_ids=spec.stop_token_ids, logprobs=spec.logprobs, logit_bias=spec.logit_bias,
                        parser=spec.parser() if spec.parser else None,
                        **({"constraint": spec.constraint} if spec.constraint is not None else {}),
                        **({"speculative": spec.speculative} if spec.speculative else {})))
        except ColiError as e:
            self.cancel()
            raise from_coli(e) from None
        firsts = await asyncio.gather(*(h.__anext__() for h in self.handles))
        for ev in firsts:
            if isinstance(ev, Error):
                self.cancel()
                raise from_coli(ev.exception())
        self.started = list(firsts)
        self._t0 = time.monotonic()
        access_log.note_queue(max((s.queue_wait_seconds for s in self.started), default=0.0))

    async def events(self, keepalive: float | None = None) -> AsyncIterator[tuple[int, object] | None]:
        """(choice index, event) until every choice has ended; None after ``keepalive``
        seconds without an event (time for a keepalive frame)."""
        next_item = self._one() if len(self.handles) == 1 else self._merged()
        poll = self.handles[0].poll if len(self.handles) == 1 else None
        while True:
            ev = poll() if poll is not None else None  # queued already (a step's events come together):
            if ev is not None:                         # no timer to arm and cancel for it
                self._observe(0, ev)
                yield 0, ev
                continue
            try:
                if keepalive:
                    async with asyncio.timeout(keepalive):
                        item = await next_item()
                else:
                    item = await next_item()
            except TimeoutError:
                yield None
                continue
            if item is None:
                return
            self._observe(*item)
            yield item

    def _one(self):
        """The next event of the only choice (no queue: this is per token, keep it short)."""
        handle = self.handles[0]

        async def next_item():
            try:
                return 0, await handle.__anext__()
            except StopAsyncIteration:
                return None

        return next_item

    def _merged(self):
        """The next event of any choice, in arrival order."""
        queue: asyncio.Queue = asyncio.Queue()

        async def read(i: int, h: RequestHandle) -> None:
            async for ev in h:
                queue.put_nowait((i, ev))
            queue.put_nowait((i, None))

        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(read(i, h)) for i, h in enumerate(self.handles)]
        open_ = len(self.handles)

        async def next_item():
            nonlocal open_
            while open_:
                i, ev = await queue.get()
                if ev is not None:
                    return i, ev
                open_ -= 1
            return None

        return next_item

    def cancel(self) -> None:
        """Cancel every choice still running (a no-op for those that ended)."""
        for h in self.handles:
            h.cancel()
        for t in self._tasks:
            t.cancel()

    def _observe(self, i: int, ev) -> None:
        if isinstance(ev, Profile):
            self._profiles[i] = ev
        elif isinstance(ev, Usage):
            self._usage[i] = ev
            access_log.note_usage(ev.prompt_tokens, ev.cached_tokens, ev.completion_tokens)
        elif isinstance(ev, Finished) and i in self._profiles and i in self._usage:
            self.server.telemetry.record_turn(time.monotonic() - self._t0, self._profiles[i], self._usage[i])


def check_capacity(runner, choices: int) -> None:
    """400 for more choices at once than the slots and the queue can ever hold together: a
    429 would tell the client to retry a request that can never be admitted."""
    config = getattr(runner, "config", None)
    slots, queue = getattr(config, "kv_slots", None), getattr(config, "max_queue", None)
    if slots is None or queue is None or choices <= slots + queue:
        return
    raise ApiError(400, f"this request needs {choices} generations at once (n times the prompts), and this server "
                        f"holds at most {slots + queue} ({slots} KV slot(s), --kv-slots, plus {queue} waiting, "
                        "--max-queue): ask for fewer choices", code="too_many_choices", param="n")


@dataclass
class Choice:
    """One choice's answer gathered from its events (for non-streaming responses)."""

    index: int
    text: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    calls: dict[int, dict] = field(default_factory=dict)  # call index -> {"id", "name", "arguments"}
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop: str | None = None
    usage: Usage | None = None
    error: Error | None = None

    def add(self, ev) -> None:
        if isinstance(ev, TextDelta):
            self.text.append(ev.text)
        elif isinstance(ev, ReasoningDelta):
            self.reasoning.append(ev.text)
        elif isinstance(ev, ToolCallDelta):
            call = self.calls.setdefault(ev.index, {"id": ev.id, "name": ev.name, "arguments": ""})
            call["arguments"] += ev.arguments
        elif isinstance(ev, TokenLogprob):
            self.logprobs.append(ev)
        elif isinstance(ev, Usage):
            self.usage = ev
        elif isinstance(ev, Finished):
            self.finish_reason, self.stop = ev.finish_reason, ev.stop
        elif isinstance(ev, Error):
            self.error = ev


async def collect(gen: Generation) -> list[Choice]:
    """Every choice's whole answer; raises the ApiError of a choice that failed."""
    choices = [Choice(i) for i in range(len(gen.handles))]
    async for item in gen.events():
        i, ev = item
        choices[i].add(ev)
        if isinstance(ev, Error):
            gen.cancel()
            raise from_coli(ev.exception())
    return choices
