"""The router: ``ClusterRunner`` has the front-end interface of ``coli.runner.Runner``
(``submit -> handle`` with the same events, ``cancel``, ``scheduler.snapshot()``,
``metrics.registry``), so the HTTP server is the same whether generation runs here or on
a cluster. Generation is placed on workers through a *transport* (``coli.cluster.ray_backend``
on Ray; tests use a fake one):

    transport.names() -> [worker names]
    transport.open(worker, assignment, prompt, options) -> async iterator of fencing.Message
    await transport.cancel(worker, assignment)
    await transport.status(worker) -> dict (epoch, info, load, kv_seq, kv_blocks, ...)

Each request is an asyncio task on the router's own event loop (a background thread). It
picks a worker (``coli.cluster.index.choose``), opens an assignment, and passes the fenced
events to the request's handle. A worker that is lost, refuses (queue full, closing) or
stalls before any delta reached the client is replaced by the next candidate; after the
first delta the stream ends with an ``engine_error`` and is never continued elsewhere.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge

from coli.cluster.catalog import Catalog
from coli.cluster.fencing import REASONS, Message, StreamFence, new_assignment_id
from coli.cluster.index import POLICIES, Balance, choose
from coli.errors import InvalidRequestError
from coli.scheduler.core import Request
from coli.scheduler.events import (ContextLengthExceededError, Error, Finished, ReasoningDelta, SchedulerClosedError,
                                   Started, TextDelta, TokenLogprob, ToolCallDelta, Usage)
from coli.scheduler.stream import RequestHandle
from coli.speculate import MODES as SPECULATIVE_MODES

log = logging.getLogger("coli.cluster")
RETRYABLE = frozenset({"queue_full", "queue_timeout", "scheduler_closed"})  # refusals: another worker may serve
DELTAS = (TextDelta, ReasoningDelta, ToolCallDelta, TokenLogprob)


class WorkerLost(Exception):
    """The transport lost the worker (died, restarting, unreachable)."""


class ClusterMetrics:
    """The router's series (``registry`` is what /metrics serves)."""

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = r = registry if registry is not None else CollectorRegistry()
        p = "colibri_cluster_"
        self.routed = Counter(p + "routed", "Assignments sent to a worker", ["worker"], registry=r)
        self.retried = Counter(p + "retried", "Assignments abandoned before the first delta and retried elsewhere",
                               ["worker"], registry=r)
        self.fenced = Counter(p + "fenced_dropped", "Messages dropped by the fence", ["worker", "reason"], registry=r)
        self.hits = Counter(p + "routing_hits", "Requests routed to a worker the index said holds a prefix",
                            ["worker"], registry=r)
        self.lost = Counter(p + "workers_lost", "Times a worker was lost (died, restarting, stalled)", ["worker"],
                            registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens of finished requests", ["worker"], registry=r)
        self.cached_tokens = Counter(p + "cached_tokens", "Of those, tokens the worker restored from its KV cache",
                                     ["worker"], registry=r)
        self.hit_rate = Gauge(p + "routing_hit_rate", "routing_hits / routed, over all workers", registry=r)
        self.cache_hit_rate = Gauge(p + "prefix_cache_hit_rate",
                                    "cached_tokens / prompt_tokens (the workers' own counts)", registry=r)
        self.up = Gauge(p + "worker_up", "1 while the worker is in the routing table", ["worker"], registry=r)
        self.load = Gauge(p + "worker_load", "Requests the router has in flight on the worker", ["worker"], registry=r)
        self.blocks = Gauge(p + "worker_prefix_blocks", "Prefix blocks the index holds for the worker", ["worker"],
                            registry=r)
        self._routed = self._hits = self._prompt = self._cached = 0
        self.workers_status: Callable[[], dict] = dict  # set by the runner: worker -> its last status report
        r.register(_WorkerCollector(self))

    def count_route(self, worker: str, hit: bool) -> None:
        self.routed.labels(worker).inc()
        self._routed += 1
        if hit:
            self.hits.labels(worker).inc()
            self._hits += 1
        self.hit_rate.set(self._hits / self._routed)

    def count_usage(self, worker: str, usage: Usage) -> None:
        self.prompt_tokens.labels(worker).inc(usage.prompt_tokens)
        self.cached_tokens.labels(worker).inc(usage.cached_tokens)
        self._prompt += usage.prompt_tokens
        self._cached += usage.cached_tokens
        if self._prompt:
            self.cache_hit_rate.set(self._cached / self._prompt)

    def value(self, name: str, labels: dict | None = None) -> float | None:
        return self.registry.get_sample_value(name, labels or {})


class _WorkerCollector:
    """Each worker's own scheduler figures, from its last status report (heartbeat)."""

    GAUGES = ("active", "queued", "admitted", "completed", "failed", "cancelled", "rejected", "timed_out")

    def __init__(self, metrics: ClusterMetrics):
        self.metrics = metrics

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily

        reports = self.metrics.workers_status()
        for key in self.GAUGES:
            g = GaugeMetricFamily(f"colibri_cluster_worker_scheduler_{key}",
                                  f"The worker's colibri_scheduler {key} figure (its last heartbeat)", labels=["worker"])
            for name, s in sorted(reports.items()):
                if key in s:
                    g.add_metric([name], float(s[key]))
            yield g


@dataclass(frozen=True)
class ClusterConfig:
    policy: str = "cache-aware"  # --routing
    balance: Balance = Balance()
    stall_timeout: float = 600.0  # seconds without a message before a worker counts as lost
    heartbeat: float = 1.0  # seconds between status polls of every worker
    status_timeout: float = 10.0  # a status poll slower than this marks the worker down
    drain_timeout: float = 1.0  # after the end, how long late messages are still read (and dropped)

    def __post_init__(self):
        if self.policy not in POLICIES:
            raise InvalidRequestError(f"--routing must be one of {', '.join(POLICIES)}, got {self.policy!r}")


class _SchedulerView:
    """What the HTTP layer reads from ``runner.scheduler``."""

    def __init__(self, runner: ClusterRunner):
        self._runner = runner

    @property
    def closed(self) -> bool:
        return self._runner.closed

    @contextlib.contextmanager
    def paused(self):
        yield  # choices of one call may land on different workers; nothing to hold

    def snapshot(self) -> dict:
        return self._runner.snapshot()


class _Config:
    def __init__(self, kv_slots: int):
        self.kv_slots = kv_slots


class ClusterRunner:
    """See the module docstring. ``transport`` must already reach its workers."""

    def __init__(self, transport, config: ClusterConfig | None = None, *, catalog: Catalog | None = None,
                 start_timeout: float = 300.0):
        self.transport = transport
        self.cluster = config or ClusterConfig()
        self.catalog = catalog or Catalog()
        self.metrics = ClusterMetrics()
        self.metrics.workers_status = lambda: dict(self.status)
        self.scheduler = _SchedulerView(self)
        self.closed = False
        self.alive: set[str] = set()
        self.status: dict[str, dict] = {}  # worker -> its last status report
        self.errors: dict[str, str] = {}  # worker -> why its last status poll failed
        self.inflight: dict[str, int] = defaultdict(int)
        self.sticky: dict[tuple, str] = {}
        self.tasks: dict[str, asyncio.Task] = {}
        self._rr = 0
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run_loop, name="coli-cluster-router", daemon=True)
        self._thread.start()
        for name in transport.names():  # every series exists from the start, at 0
            self.metrics.up.labels(name).set(0)
            for c in (self.metrics.routed, self.metrics.retried, self.metrics.hits, self.metrics.lost):
                c.labels(name)
            for reason in REASONS:
                self.metrics.fenced.labels(name, reason)
        # wait until every worker has answered once (they load their models meanwhile)
        fut = asyncio.run_coroutine_threadsafe(self._first_contact(start_timeout), self.loop)
        fut.result(start_timeout + 5)
        self._beat = asyncio.run_coroutine_threadsafe(self._heartbeat(), self.loop)
        infos = [s.get("info", {}) for s in self.status.values()]
        self.ctx = min((i.get("ctx", 0) for i in infos), default=0)
        self.vocab_size = min((i.get("vocab_size", 0) for i in infos), default=0)
        self.config = _Config(sum(i.get("kv_slots", 0) for i in infos))

    # -- the front-end API (as coli.runner.Runner) --------------------------------------------------

    @property
    def steps(self) -> int:
        return sum(s.get("steps", 0) for s in self.status.values())

    def submit(self, prompt: Sequence[int], *, max_tokens: int = 256, sampling=None, stop=None,
               cache_slot: int | None = None, routing: bool = False, request_id: str | None = None,
               ignore_leading_stop: bool = False, stop_token_ids: Collection[int] = (), logprobs: int | None = None,
               logit_bias: Mapping[int, float] | None = None, parser=None, session: str | None = None,
               speculative: str | None = None) -> RequestHandle:
        """As ``Runner.submit``; ``session``: requests with the same one stick to one worker;
        ``speculative``: this request's coli.speculate mode, checked by the worker's runner."""
        ids = self._check(prompt)
        if sampling is not None:
            sampling.validate()
        if speculative is not None and speculative not in SPECULATIVE_MODES:
            raise InvalidRequestError(f"speculative must be one of {', '.join(SPECULATIVE_MODES)}, got {speculative!r}")
        opts = dict(max_tokens=int(max_tokens), sampling=sampling, stop=stop, cache_slot=cache_slot, routing=routing,
                    ignore_leading_stop=ignore_leading_stop, stop_token_ids=tuple(int(t) for t in stop_token_ids),
                    logprobs=logprobs, logit_bias=dict(logit_bias) if logit_bias else None,
                    **({"speculative": speculative} if speculative is not None else {}))
        return self._start(ids, opts, cache_slot, session, parser, request_id)

    def score(self, prompt: Sequence[int], start: int, *, cache_slot: int | None = None,
              request_id: str | None = None) -> RequestHandle:
        ids = self._check(prompt)
        if not 1 <= start < len(ids):
            raise InvalidRequestError(f"score: start must be from 1 to {len(ids) - 1}, got {start}")
        return self._start(ids, dict(score_start=start, cache_slot=cache_slot), cache_slot, None, None, request_id)

    def close(self, timeout: float | None = 30.0) -> None:
        """Cancel what runs (each request ends with a ``cancelled`` error), stop the router."""
        if self.closed:
            return
        self.closed = True
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(self._shutdown(), self.loop).result(timeout)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout)
        self.catalog.close()

    async def _shutdown(self) -> None:
        me = asyncio.current_task()
        tasks = [t for t in asyncio.all_tasks() if t is not me]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def __enter__(self) -> ClusterRunner:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def snapshot(self) -> dict:
        """For /health and `coli cluster status`: totals plus one row per worker."""
        counts = self.catalog.counts()
        workers = []
        for name in self.transport.names():
            s = self.status.get(name, {})
            info = s.get("info", {})
            workers.append(dict(name=name, health="up" if name in self.alive else "down", node=info.get("node"),
                                pid=info.get("pid"), epoch=s.get("epoch"), active=s.get("active", 0),
                                queued=s.get("queued", 0), capacity=info.get("kv_slots", 0),
                                inflight=self.inflight.get(name, 0), prefix_blocks=counts.get(name, 0),
                                cached_tokens=counts.get(name, 0) * self.catalog.index.block,
                                steps=s.get("steps", 0),
                                routed=int(self.metrics.value("colibri_cluster_routed_total", {"worker": name}) or 0)))
        up = [w for w in workers if w["health"] == "up"]
        return dict(active=sum(w["active"] for w in up), queued=sum(w["queued"] for w in up),
                    capacity=sum(w["capacity"] for w in up), max_queue=0, slots=[],
                    cluster=dict(policy=self.cluster.policy, block=self.catalog.index.block,
                                 routing_hit_rate=self.metrics.hit_rate._value.get(),
                                 prefix_cache_hit_rate=self.metrics.cache_hit_rate._value.get(), workers=workers))

    # -- requests ------------------------------------------------------------------------------------

    def _check(self, prompt: Sequence[int]) -> list[int]:
        if self.closed:
            raise SchedulerClosedError("the cluster router is shutting down")
        ids = [int(t) for t in prompt]
        if not ids:
            raise InvalidRequestError("the prompt is empty")
        if self.vocab_size and any(not 0 <= t < self.vocab_size for t in ids):
            raise InvalidRequestError(f"a prompt token id is outside the vocabulary (0..{self.vocab_size - 1})")
        if self.ctx and len(ids) >= self.ctx:
            raise ContextLengthExceededError(f"the prompt has {len(ids)} tokens; the context holds {self.ctx}")
        return ids

    def _start(self, ids, opts, cache_slot, session, parser, request_id) -> RequestHandle:
        req = Request(ids, int(opts.get("max_tokens", 1)), cache_slot)
        if request_id is not None:
            req.request_id = request_id
        handle = RequestHandle(req, self._cancel)
        key = ("slot", cache_slot) if cache_slot is not None else ("session", session) if session else None
        fut = asyncio.run_coroutine_threadsafe(self._spawn(req, handle, opts, key, parser), self.loop)
        fut.result(10)
        return handle

    async def _spawn(self, req, handle, opts, key, parser) -> None:
        task = self.loop.create_task(self._serve(req, handle, opts, key, parser))
        self.tasks[req.request_id] = task
        task.add_done_callback(lambda _: self.tasks.pop(req.request_id, None))

    def _cancel(self, req: Request) -> bool:
        task = self.tasks.get(req.request_id)
        if task is None or task.done():
            return False
        req.cancel_requested = True
        self.loop.call_soon_threadsafe(task.cancel)
        return True

    def route(self, prompt: Sequence[int], key: tuple | None, exclude: Collection[str] = ()):
        """The candidate workers for a request, best first, and what the index predicted."""
        live = [w for w in sorted(self.alive) if w not in exclude]
        if key is not None and self.sticky.get(key) in live:
            w = self.sticky[key]
            return [w], self.catalog.match(prompt, [w])[w], "sticky"
        loads = {w: self.inflight.get(w, 0) for w in live}
        matches = self.catalog.match(prompt, live) if self.cluster.policy == "cache-aware" else {}
        self._rr += 1
        c = choose(self.cluster.policy, prompt, loads, matches, self.cluster.balance, self._rr - 1)
        return c.order, c.matched, c.reason

    async def _serve(self, req: Request, handle: RequestHandle, opts: dict, key, parser) -> None:
        fence = StreamFence()
        state = dict(started=False, error=None)
        tried: set[str] = set()
        try:
            while True:
                order, matched, _ = self.route(req.prompt, key, tried)
                if not order:
                    err = state["error"] or Error("scheduler_closed", "no worker of the cluster is available")
                    handle.put(err)
                    return
                worker = order[0]
                tried.add(worker)
                aid = new_assignment_id()
                fence.assign(aid, worker)
                self.metrics.count_route(worker, matched > 0)
                self.inflight[worker] += 1
                self.metrics.load.labels(worker).set(self.inflight[worker])
                try:
                    outcome = await self._attempt(req, handle, fence, worker, aid, opts, parser, state, key)
                finally:
                    self.inflight[worker] -= 1
                    self.metrics.load.labels(worker).set(self.inflight[worker])
                if outcome == "done":
                    return
                self.metrics.retried.labels(worker).inc()
                log.info("request %s: retrying after %s on %s", req.request_id, outcome, worker)
        except asyncio.CancelledError:
            handle.put(Error("cancelled", "the request was cancelled"))
        except Exception as e:  # a router bug must not leave a client waiting
            log.exception("request %s failed in the router", req.request_id)
            handle.put(Error("engine_error", f"the cluster router failed: {type(e).__name__}: {e}"))
        finally:
            fence.close()

    async def _attempt(self, req, handle, fence: StreamFence, worker, aid, opts, parser, state, key) -> str:
        """Serve the request on one worker: "done" (it ended, one way or another) or a reason to retry."""
        stream = self.transport.open(worker, aid, req.prompt, opts)
        ended = False
        try:
            while True:
                try:
                    msg: Message = await asyncio.wait_for(stream.__anext__(), self.cluster.stall_timeout)
                except StopAsyncIteration:
                    return self._lost(handle, fence, worker, aid, "its stream ended early")
                except asyncio.TimeoutError:
                    return self._lost(handle, fence, worker, aid, f"no message for {self.cluster.stall_timeout:g} s")
                except WorkerLost as e:
                    return self._lost(handle, fence, worker, aid, str(e) or "it died")
                if not self._accept(fence, worker, msg):
                    continue
                ev = msg.event
                for seq, stored, evicted in msg.kv:
                    self.catalog.apply(worker, seq, stored, evicted)
                if isinstance(ev, Started):
                    if key is not None:
                        self.sticky[key] = worker
                    if not state["started"]:
                        state["started"] = True
                        handle.put(ev)
                    continue
                if isinstance(ev, Error):
                    if ev.code in RETRYABLE and not fence.delivered:
                        state["error"] = ev
                        ended = True
                        return f"a refusal ({ev.code})"
                    handle.put(ev)
                    ended = True
                    return "done"
                if isinstance(ev, DELTAS):
                    fence.delivered_delta()
                    if parser is not None and isinstance(ev, TextDelta):
                        if not parser.done:
                            for out in parser.push(ev.text):
                                handle.put(out)
                        continue
                elif isinstance(ev, Usage):
                    self.metrics.count_usage(worker, ev)
                elif isinstance(ev, Finished):
                    ended = True
                    if parser is not None:
                        for out in parser.finish():
                            handle.put(out)
                        ev = Finished(parser.finish_reason(ev.finish_reason), ev.stop)
                    fence.close()
                    handle.put(ev)
                    self.loop.create_task(self._drain(stream, fence, worker))
                    stream = None
                    return "done"
                handle.put(ev)
        except asyncio.CancelledError:
            if not ended:
                self.loop.create_task(self._cancel_on(worker, aid))
            raise
        finally:
            if stream is not None:
                with contextlib.suppress(Exception):
                    await stream.aclose()

    def _accept(self, fence: StreamFence, worker: str, msg: Message) -> bool:
        reason = fence.check(msg.assignment, msg.index)
        if reason is None:
            return fence.accept(msg.assignment, msg.index)
        fence.dropped[reason] += 1
        self.metrics.fenced.labels(worker, reason).inc()
        return False

    async def _drain(self, stream, fence: StreamFence, worker: str) -> None:
        """Read what still comes after the end (none should): every message is late and dropped."""
        end = time.monotonic() + self.cluster.drain_timeout
        try:
            while (left := end - time.monotonic()) > 0:
                msg = await asyncio.wait_for(stream.__anext__(), left)
                self._accept(fence, worker, msg)
        except (StopAsyncIteration, asyncio.TimeoutError, WorkerLost, Exception):
            pass
        finally:
            with contextlib.suppress(Exception):
                await stream.aclose()

    def _lost(self, handle, fence: StreamFence, worker: str, aid: str, why: str) -> str:
        self.metrics.lost.labels(worker).inc()
        self._mark_down(worker)
        self.loop.create_task(self._cancel_on(worker, aid))
        if not fence.delivered:
            return f"losing {worker} ({why})"
        handle.put(Error("engine_error", f"the worker {worker} was lost after output began ({why}); the stream "
                                         "ends here and is not continued elsewhere"))
        return "done"

    async def _cancel_on(self, worker: str, aid: str) -> None:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.transport.cancel(worker, aid), self.cluster.status_timeout)

    # -- workers ---------------------------------------------------------------------------------

    def _mark_down(self, worker: str) -> None:
        if worker in self.alive:
            log.warning("worker %s left the routing table", worker)
        self.alive.discard(worker)
        self.catalog.mark_down(worker)
        self.metrics.up.labels(worker).set(0)
        self.metrics.blocks.labels(worker).set(0)
        for k in [k for k, w in self.sticky.items() if w == worker]:
            del self.sticky[k]

    async def _poll(self, worker: str) -> None:
        try:
            s = await asyncio.wait_for(self.transport.status(worker), self.cluster.status_timeout)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            if worker in self.alive:
                self.metrics.lost.labels(worker).inc()
            log.debug("status of %s failed: %r", worker, e)
            self.errors[worker] = str(e)
            self._mark_down(worker)
            return
        self.errors.pop(worker, None)
        if s.get("epoch") != self.catalog.epoch(worker):
            self.catalog.register(worker, s["epoch"], s.get("info", {}))
        self.catalog.replace(worker, s.get("kv_seq", 0), s.get("kv_blocks", ()))
        self.status[worker] = s
        self.alive.add(worker)
        self.metrics.up.labels(worker).set(1)
        self.metrics.blocks.labels(worker).set(self.catalog.counts().get(worker, 0))

    async def poll_all(self) -> None:
        await asyncio.gather(*(self._poll(w) for w in self.transport.names()))

    async def _first_contact(self, timeout: float) -> None:
        end = time.monotonic() + timeout
        names = set(self.transport.names())
        while self.alive != names and time.monotonic() < end:
            await self.poll_all()
            failed = {w: e for w, e in self.errors.items() if "creation task" in e}
            if failed and not self.alive and set(failed) == names - self.alive:  # they cannot start: say why now
                why = next(iter(failed.values())).strip().splitlines()
                raise RuntimeError(f"the cluster workers failed to start: {why[-1] if why else '?'}")
            if self.alive != names:
                await asyncio.sleep(0.2)
        if not self.alive:
            raise RuntimeError(f"no cluster worker answered within {timeout:g} s")

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(self.cluster.heartbeat)
            with contextlib.suppress(Exception):
                await self.poll_all()

    def refresh(self, timeout: float = 30.0) -> None:
        """Poll every worker now (tests, `coli cluster status`)."""
        asyncio.run_coroutine_threadsafe(self.poll_all(), self.loop).result(timeout)

    def _run_loop(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()
