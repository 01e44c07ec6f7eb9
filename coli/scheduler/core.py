"""The scheduler: admission queue, KV slots, batched steps. No arrays, no I/O.

The seam is vLLM's: ``add_request`` (from any thread), ``schedule() -> StepPlan``
(what one forward pass computes) and ``update_from_output(plan, outputs)`` (what
it produced). The runner (``coli.runner``) turns plans into engine steps; tests
drive the same loop with a fake engine.

Admission follows the spec (shared/spec/colibri-api.md, the admission queue):

- waiters form one bounded FIFO (``max_queue``; 0 means nobody waits);
- an earlier pinned waiter (``cache_slot`` set) reserves its slot; an earlier
  any-slot waiter has priority over every slot, so nothing behind it is admitted
  while it waits;
- a request that can take an unreserved free slot at once is admitted even when
  the queue is full: the limit bounds waiters, not active requests;
- on every pass, each waiter's deadline is checked before any slot assignment:
  an expired waiter gets queue_timeout even if a slot is free;
- a cancelled request never takes a slot (cancellation of a waiter removes it
  at once); at submission the closed and queue-full checks come first.

Running requests in different slots are batched: every decoding sequence feeds
its last token each step, and prompts are prefilled in chunks of at most
``prefill_chunk`` tokens per step, interleaved with the decoding ones.
"""
from __future__ import annotations

import os
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from coli.errors import InvalidRequestError
from coli.kv.slots import MAX_SLOTS, Slot, SlotTable
from coli.scheduler.events import (ContextLengthExceededError, EngineError, QueueFullError, QueueTimeoutError,
                                   RequestCancelledError, SchedulerClosedError, SchedulerError)

DEFAULT_MAX_QUEUE = 8
DEFAULT_QUEUE_TIMEOUT = 300.0
DEFAULT_PREFILL_CHUNK = 256


@dataclass(frozen=True)
class SchedulerConfig:
    kv_slots: int = 1  # --kv-slots, COLI_KV_SLOTS
    max_queue: int = DEFAULT_MAX_QUEUE  # --max-queue, COLI_MAX_QUEUE
    queue_timeout: float = DEFAULT_QUEUE_TIMEOUT  # --queue-timeout, COLI_QUEUE_TIMEOUT (seconds)
    ctx: int = 4096  # tokens one slot holds: prompt + generated
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK  # prompt tokens per step, over all prefilling requests

    def __post_init__(self):
        if not isinstance(self.kv_slots, int) or not 1 <= self.kv_slots <= MAX_SLOTS:
            raise InvalidRequestError(f"--kv-slots must be a whole number from 1 to {MAX_SLOTS}, got {self.kv_slots!r}")
        if not isinstance(self.max_queue, int) or self.max_queue < 0:
            raise InvalidRequestError(f"--max-queue must be a whole number >= 0, got {self.max_queue!r}")
        if not self.queue_timeout > 0:
            raise InvalidRequestError(f"--queue-timeout must be more than 0 seconds, got {self.queue_timeout!r}")
        if self.ctx < 2:
            raise InvalidRequestError(f"--ctx must be at least 2 tokens, got {self.ctx!r}")
        if self.prefill_chunk < 1:
            raise InvalidRequestError(f"prefill_chunk must be at least 1, got {self.prefill_chunk!r}")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **given) -> SchedulerConfig:
        """Values given (not None) win; then COLI_KV_SLOTS / COLI_MAX_QUEUE / COLI_QUEUE_TIMEOUT; then defaults."""
        env = os.environ if env is None else env
        for key, var, kind in (("kv_slots", "COLI_KV_SLOTS", int), ("max_queue", "COLI_MAX_QUEUE", int),
                               ("queue_timeout", "COLI_QUEUE_TIMEOUT", float)):
            if given.get(key) is None and env.get(var):
                try:
                    given[key] = kind(env[var])
                except ValueError:
                    raise InvalidRequestError(f"{var}={env[var]!r} is not a {'whole ' if kind is int else ''}number") \
                        from None
        return cls(**{k: v for k, v in given.items() if v is not None})


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"
    TIMED_OUT = "timed_out"
    REJECTED = "rejected"

    @property
    def terminal(self) -> bool:
        return self not in (Status.WAITING, Status.RUNNING)


@dataclass(eq=False)
class Request:
    """One generation. ``payload`` is the runner's (sampling, stops, detokenizer): the
    scheduler never looks at it. Fields after ``request_id`` are the scheduler's."""

    prompt: list[int]
    max_tokens: int
    cache_slot: int | None = None
    payload: Any = None
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    reuse_limit: int | None = None  # reuse at most this many cached prompt tokens (scoring needs the rest's logits)

    status: Status = Status.WAITING
    arrival: float = 0.0
    deadline: float = 0.0
    admitted_at: float | None = None
    started_at: float | None = None  # its first step: the engine call starts
    finished_at: float | None = None
    first_output_at: float | None = None
    slot: int | None = None
    cached_tokens: int = 0
    fed: int = 0  # prompt tokens whose KV is in the slot
    generated: int = 0  # tokens sampled, not counting an end-of-turn token
    next_token: int | None = None  # sampled, to be fed next step
    forced: list[int] = field(default_factory=list)  # tokens a constraint forced after it, fed in the same step
    finish_reason: str | None = None
    error: SchedulerError | None = None
    cancel_requested: bool = False
    cancel_step: int | None = None  # the scheduler's step counter when cancel() was called
    release_step: int | None = None  # ... and when the slot was given back

    @property
    def queue_wait(self) -> float | None:
        """Seconds from submission to admission (None until admitted)."""
        return None if self.admitted_at is None else self.admitted_at - self.arrival

    @property
    def prefilling(self) -> bool:
        return self.fed < len(self.prompt)


@dataclass(frozen=True)
class ScheduledSeq:
    """Feed ``tokens`` to the request's slot at positions start.. . ``sample``: the
    logits of the last one pick the request's next token. ``draft``: the last ``draft``
    tokens are speculative (coli.speculate appends them to a decoding entry); the slot
    keeps only those its SeqOutput lists as ``accepted``."""

    request: Request
    slot: int
    start: int  # the slot's history length before this step (the runner truncates its cache to it)
    tokens: list[int]
    sample: bool
    draft: int = 0


@dataclass
class StepPlan:
    step: int
    seqs: list[ScheduledSeq]

    def __bool__(self) -> bool:
        return bool(self.seqs)


@dataclass(frozen=True)
class SeqOutput:
    """What the runner made of a sampling entry: the token (None for end of turn), or
    that the request stops here ("stop": a stop string), or an error (a message, which
    fails the request with engine_error, or a SchedulerError to fail it with). ``forced``:
    tokens that follow ``token`` without sampling (a grammar allows nothing else); they
    count as generated and are fed with it in one step."""

    token: int | None = None
    finish_reason: str | None = None
    error: str | SchedulerError | None = None
    forced: tuple[int, ...] = ()
    accepted: tuple[int, ...] = ()  # speculation: draft tokens accepted (generated) before ``token``


Listener = Callable[[Request], None]


class Scheduler:
    """One per process. Thread-safe: front ends call ``add_request``/``cancel`` from
    their threads while one engine thread alternates ``schedule`` and
    ``update_from_output``. ``listener(request)`` is called (under the scheduler's
    lock: keep it quick) when a request is admitted and when it ends."""

    def __init__(self, config: SchedulerConfig, *, metrics=None, listener: Listener | None = None,
                 clock: Callable[[], float] = time.monotonic, histories: Mapping[int, Sequence[int]] | None = None):
        from coli.metrics import SchedulerMetrics

        self.config = config
        self.clock = clock
        self.listener = listener or (lambda req: None)
        self.metrics = metrics if metrics is not None else SchedulerMetrics()
        self.slots = SlotTable(config.kv_slots)
        for i, toks in (histories or {}).items():
            self.slots[i].tokens = [int(t) for t in toks][: config.ctx]
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order
        self.step_no = 0
        self.closed = False
        self._in_flight: StepPlan | None = None
        self._released: list[Request] = []  # running requests cancelled between steps (take_released)
        self.hold_released = False  # their slots wait for saved() (set by a runner that persists KV)
        self._lock = threading.RLock()
        self._wake = threading.Condition(self._lock)
        self.counts = dict(admitted=0, completed=0, failed=0, rejected=0, timed_out=0, cancelled=0)
        m = self.metrics
        m.capacity.set(config.kv_slots)
        m.max_queue.set(config.max_queue)
        m.kv_capacity_tokens.set(config.kv_slots * config.ctx)
        self._gauges()

    # -- front-end side ------------------------------------------------------------------------

    def add_request(self, req: Request) -> Request:
        """Admit ``req`` to a slot, queue it, or raise: SchedulerClosedError,
        ContextLengthExceededError, InvalidRequestError (a bad cache_slot or max_tokens),
        QueueFullError, RequestCancelledError (cancelled before it was submitted)."""
        ctx = self.config.ctx
        if not req.prompt:
            raise InvalidRequestError("the prompt is empty")
        if req.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be at least 1 (got {req.max_tokens})")
        if req.cache_slot is not None and not (isinstance(req.cache_slot, int) and not isinstance(req.cache_slot, bool)
                                               and 0 <= req.cache_slot < self.config.kv_slots):
            n = self.config.kv_slots
            raise InvalidRequestError(
                f"cache_slot must be an integer from 0 to {n - 1} (--kv-slots {n}), got {req.cache_slot!r}")
        if len(req.prompt) >= ctx:
            raise ContextLengthExceededError(
                f"context_length_exceeded: the prompt has {len(req.prompt)} tokens and the context holds {ctx} "
                "(with room for at least one generated token)")
        req.max_tokens = min(req.max_tokens, ctx - len(req.prompt))
        with self._lock:
            now = self.clock()
            req.arrival, req.deadline = now, now + self.config.queue_timeout
            if self.closed:
                self._end(req, Status.REJECTED, SchedulerClosedError("the scheduler is closed"), count=None)
                raise req.error
            self._admit_waiters(now)
            slot = self._free_slot_for(req, *self._reservations())
            if slot is None and len(self.waiting) >= self.config.max_queue:
                self._end(req, Status.REJECTED, QueueFullError(
                    f"queue_full: {len(self.waiting)} requests are waiting (--max-queue {self.config.max_queue})"),
                    count="rejected")
                raise req.error
            if req.cancel_requested:
                self._end(req, Status.CANCELLED, RequestCancelledError("cancelled before admission"), count="cancelled")
                raise req.error
            if slot is not None:
                self._admit(req, slot, now)
            else:
                self.waiting.append(req)
                self._gauges()
            self._wake.notify_all()
        return req

    def cancel(self, req: Request) -> bool:
        """Cancel a request: a waiter leaves the queue now; a running request gives its
        slot back now, or at the end of the step computing it. False if it had ended."""
        with self._lock:
            if req.status.terminal or req.cancel_requested:
                return False
            req.cancel_requested, req.cancel_step = True, self.step_no
            if req.status is Status.WAITING:
                self.waiting.remove(req)
                self._end(req, Status.CANCELLED, RequestCancelledError("cancelled while waiting for a KV slot"),
                          count="cancelled")
            elif not self._is_in_flight(req):
                self._release(req, Status.CANCELLED, RequestCancelledError("cancelled"))
                if self.hold_released:  # no step reports it: the engine thread saves it (take_released),
                    self.slots[req.slot].saving = True  # and no other request may take the slot before
                    self._released.append(req)
            self._wake.notify_all()
            return True

    def take_released(self) -> list[Request]:
        """The running requests cancelled between steps since the last call (a client that
        left, or close() at shutdown): a step's own endings are update_from_output's; these
        gave their slot back outside any step. With ``hold_released`` set, their slots stay
        unavailable until ``saved(...)`` (the engine thread saves their KV first, then hands
        them back: within one engine step); otherwise none are kept and the slot is free at
        once."""
        with self._lock:
            out, self._released = self._released, []
            return out

    def saved(self, reqs: list[Request]) -> None:
        """The slots of these (take_released's) requests are free for others again."""
        with self._lock:
            for req in reqs:
                self.slots[req.slot].saving = False
            self._wake.notify_all()

    def close(self) -> None:
        """Take no new requests; cancel waiters and running requests."""
        with self._lock:
            self.closed = True
            for req in list(self.waiting) + list(self.running):
                self.cancel(req)
            self._wake.notify_all()

    def abort(self, message: str) -> None:
        """The engine thread cannot go on: close, and end every request with engine_error."""
        with self._lock:
            self.closed = True
            self._in_flight = None
            for req in list(self.waiting):
                self.waiting.remove(req)
                self._end(req, Status.FAILED, EngineError(message), count=None)  # never admitted: not "failed"
            for req in list(self.running):
                self._release(req, Status.FAILED, EngineError(message))
            self._wake.notify_all()

    def paused(self):
        """``with scheduler.paused(): ...`` — no step is planned while the block runs, so
        requests submitted in it start together (e.g. the n choices of one API call)."""
        return self._lock

    def note_first_output(self, req: Request) -> None:
        """The runner produced the request's first nonempty text or tool output."""
        if req.first_output_at is not None:  # (every later token: once set it stays, no lock needed)
            return
        with self._lock:
            if req.first_output_at is None and req.started_at is not None:
                req.first_output_at = self.clock()
                self.metrics.first_output_seconds.observe(req.first_output_at - req.started_at)

    # -- engine side ---------------------------------------------------------------------------

    def schedule(self) -> StepPlan:
        """The next step: expire and admit waiters, then every decoding sequence's next
        token and up to ``prefill_chunk`` prompt tokens. An empty plan means idle."""
        with self._lock:
            if self._in_flight is not None:
                raise RuntimeError("schedule() called again before update_from_output()")
            self.step_no += 1
            now = self.clock()
            self._admit_waiters(now)
            seqs = [self._seq(r, [r.next_token, *r.forced], sample=True) for r in self.running if not r.prefilling]
            budget = self.config.prefill_chunk
            for r in self.running:
                if budget == 0:
                    break
                if r.prefilling:
                    chunk = r.prompt[r.fed : r.fed + budget]
                    budget -= len(chunk)
                    seqs.append(self._seq(r, chunk, sample=r.fed + len(chunk) == len(r.prompt)))
            for s in seqs:
                if s.request.started_at is None:
                    s.request.started_at = now
            plan = StepPlan(self.step_no, seqs)
            self._in_flight = plan if seqs else None
            return plan

    def update_from_output(self, plan: StepPlan, outputs: Mapping[str, SeqOutput]) -> list[Request]:
        """Record a finished step: ``outputs`` has a SeqOutput for every sampling entry
        (by request_id). Returns the requests that ended in this update."""
        with self._lock:
            self._check_plan(plan)
            ended = []
            for s in plan.seqs:
                req, slot = s.request, self.slots[s.slot]
                keep = len(s.tokens) - s.draft  # rejected draft tokens' KV is overwritten later
                if s.draft and req.status is Status.RUNNING and not req.cancel_requested:
                    out = outputs.get(req.request_id)
                    keep += len(out.accepted) if out is not None and out.error is None else 0
                slot.tokens.extend(s.tokens[:keep])  # the engine wrote their KV
                if req.status is not Status.RUNNING:
                    continue
                if req.prefilling:
                    req.fed += len(s.tokens)
                if req.cancel_requested:
                    self._release(req, Status.CANCELLED, RequestCancelledError("cancelled"))
                elif s.sample:
                    self._apply(req, outputs.get(req.request_id))
                if req.status.terminal:
                    ended.append(req)
            self._in_flight = None
            self._gauges()
            self._wake.notify_all()
            return ended

    def fail_step(self, plan: StepPlan, error: str) -> list[Request]:
        """The engine raised during ``plan``: every request in it fails; histories are
        unchanged (the engine appends tokens only after a whole forward pass)."""
        with self._lock:
            self._check_plan(plan)
            ended = []
            for s in plan.seqs:
                if s.request.status is Status.RUNNING:
                    self._release(s.request, Status.FAILED, EngineError(error))
                    ended.append(s.request)
            self._in_flight = None
            self._wake.notify_all()
            return ended

    def wait_for_work(self, timeout: float | None = None) -> None:
        """Block (the engine thread, when idle) until a request arrives or changes, or
        the next queue deadline, or ``timeout``."""
        with self._lock:
            if self.running or self.closed or self._released:
                return
            deadline = min((r.deadline for r in self.waiting), default=None)
            if deadline is not None:
                left = deadline - self.clock()
                timeout = left if timeout is None else min(timeout, left)
            if timeout is None or timeout > 0:
                self._wake.wait(timeout)

    def idle(self) -> bool:
        with self._lock:
            return not self.running and not self.waiting and self._in_flight is None

    def slot_history(self, i: int) -> list[int]:
        with self._lock:
            return list(self.slots[i].tokens)

    def snapshot(self) -> dict:
        """Counters and slot states (for /health)."""
        with self._lock:
            return dict(active=len(self.running), queued=len(self.waiting), capacity=self.config.kv_slots,
                        max_queue=self.config.max_queue, **self.counts,
                        slots=[dict(slot=s.index, busy=not s.free, tokens=len(s.tokens)) for s in self.slots])

    # -- internals (called with the lock held) ------------------------------------------------

    def _reservations(self) -> tuple[set[int], bool]:
        """Slots reserved by waiters (pinned ones), and whether an any-slot waiter
        holds priority over all of them."""
        pinned = {r.cache_slot for r in self.waiting if r.cache_slot is not None}
        return pinned, any(r.cache_slot is None for r in self.waiting)

    def _free_slot_for(self, req: Request, reserved: set[int], all_reserved: bool) -> Slot | None:
        if all_reserved:
            return None
        if req.cache_slot is not None:
            s = self.slots[req.cache_slot]
            return s if s.free and s.index not in reserved else None
        return self.slots.choose(req.prompt, reserved)

    def _admit_waiters(self, now: float) -> None:
        if not self.waiting:  # (every step while nobody waits: nothing to expire, admit or count)
            return
        reserved: set[int] = set()
        all_reserved = False
        keep: deque[Request] = deque()
        for req in self.waiting:
            if now >= req.deadline:  # deadlines before slot assignment
                self._end(req, Status.TIMED_OUT, QueueTimeoutError(
                    f"queue_timeout: no KV slot became free within {self.config.queue_timeout:g} s"),
                    count="timed_out")
                continue
            slot = self._free_slot_for(req, reserved, all_reserved)
            if slot is not None:
                self._admit(req, slot, now)
                continue
            keep.append(req)
            if req.cache_slot is None:  # (FIFO order already implies this; it is the spec's rule, said plainly)
                all_reserved = True
            else:
                reserved.add(req.cache_slot)
        self.waiting = keep
        self._gauges()

    def _admit(self, req: Request, slot: Slot, now: float) -> None:
        slot.owner = req
        self.slots.touch(slot)
        req.slot, req.status, req.admitted_at = slot.index, Status.RUNNING, now
        req.cached_tokens = req.fed = slot.reusable(req.prompt)
        if req.reuse_limit is not None:
            req.cached_tokens = req.fed = max(0, min(req.cached_tokens, req.reuse_limit))
        self.running.append(req)
        self.counts["admitted"] += 1
        m = self.metrics
        m.admitted_total.inc()
        m.queue_wait_seconds.observe(now - req.arrival)
        m.prompt_tokens_total.inc(len(req.prompt))
        m.cached_tokens_total.inc(req.cached_tokens)
        if req.cached_tokens:
            m.prefix_hits_total.inc()
        self._gauges()
        self.listener(req)

    def _seq(self, req: Request, tokens: list[int], sample: bool) -> ScheduledSeq:
        slot = self.slots[req.slot]
        if req.started_at is None:  # its first step: drop the history past the reused prefix
            del slot.tokens[req.cached_tokens:]
        return ScheduledSeq(req, slot.index, len(slot.tokens), tokens, sample)

    def _apply(self, req: Request, out: SeqOutput | None) -> None:
        if out is None or out.error is not None:
            err = out.error if out is not None else "no output for a sampling entry"
            self._release(req, Status.FAILED, err if isinstance(err, SchedulerError) else EngineError(err))
            return
        req.generated += len(out.accepted)
        if out.token is not None:
            req.generated += 1 + len(out.forced)
            req.next_token, req.forced = int(out.token), [int(t) for t in out.forced]
        if out.token is None or out.finish_reason is not None:
            self._release(req, Status.COMPLETED, reason=out.finish_reason or "stop")
        elif req.generated >= req.max_tokens:
            self._release(req, Status.COMPLETED, reason="length")

    def _release(self, req: Request, status: Status, error: SchedulerError | None = None,
                 reason: str | None = None) -> None:
        slot = self.slots[req.slot]
        slot.owner = None
        self.slots.touch(slot)
        self.running.remove(req)
        req.release_step = self.step_no
        now = self.clock()
        self.metrics.slot_duration_seconds.observe(now - req.admitted_at)
        if req.started_at is not None:
            self.metrics.engine_call_seconds.observe(now - req.started_at)
        req.finish_reason = reason
        count = {Status.COMPLETED: "completed", Status.FAILED: "failed", Status.CANCELLED: "cancelled"}[status]
        self._end(req, status, error, count)

    def _end(self, req: Request, status: Status, error: SchedulerError | None, count: str | None) -> None:
        req.status, req.error, req.finished_at = status, error, self.clock()
        if count:
            self.counts[count] += 1
            getattr(self.metrics, f"{count}_total").inc()
        self._gauges()
        if status is not Status.REJECTED:  # refusals are raised to the caller instead
            self.listener(req)

    def _gauges(self) -> None:
        self.metrics.active.set(len(self.running))
        self.metrics.queued.set(len(self.waiting))
        self.metrics.kv_tokens.set(self.slots.held_tokens())

    def _is_in_flight(self, req: Request) -> bool:
        return self._in_flight is not None and any(s.request is req for s in self._in_flight.seqs)

    def _check_plan(self, plan: StepPlan) -> None:
        if plan is not self._in_flight and (plan or self._in_flight is not None):
            raise RuntimeError("update for a plan that is not the one in flight")
