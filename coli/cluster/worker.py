"""A cluster worker: one Ray actor owning a model, a Runner (engine, scheduler, KV slots).

The actor speaks only control messages and events: ``generate(assignment, prompt,
options)`` is a streaming generator of ``fencing.Message`` (each with the assignment id
and the next zero-based index; the terminal one also carries the worker's KV events),
``cancel(assignment)`` frees the request's slot, ``status()`` reports load and the prefix
blocks its slots hold. Weights, KV tensors, HTTP and JSON never cross the wire.

This module imports no Ray: ``coli.cluster.ray_backend`` wraps ``Worker`` with
``ray.remote``, so the class is also usable (and tested) in-process.
"""
from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import uuid

from coli.cluster.fencing import Message
from coli.cluster.index import DEFAULT_BLOCK, KVPublisher
from coli.errors import ColiError
from coli.scheduler.events import Error, Finished, TextDelta

log = logging.getLogger("coli.cluster.worker")


class Worker:
    def __init__(self, name: str, model_path: str | None = None, load_options: dict | None = None,
                 runner_options: dict | None = None, block: int = DEFAULT_BLOCK, model=None):
        import coli
        from coli.runner import Runner

        self.name = name
        self.epoch = uuid.uuid4().hex  # a new one per incarnation (Ray restarts re-run __init__)
        self.model = model if model is not None else coli.load(model_path, **(load_options or {}))
        opts = {"persist": False, **(runner_options or {})}
        if isinstance(opts.get("draft_model"), str):  # --draft-model DIR: each worker loads its own copy
            opts["draft_model"] = coli.load(opts["draft_model"], threads=self.model.engine.threads)
        self.runner = Runner(self.model, **opts)
        self.kv = KVPublisher(block)
        self.handles: dict[str, object] = {}
        self.seen: set[str] = set()  # assignment ids this incarnation has taken (the worker's fence)
        self.faults: dict[str, asyncio.Event] = {}  # test hooks: "hold_before", "hold_after_first"
        self.slow = 0.0  # test hook "slow_steps": seconds added to every engine step
        step = self.runner.engine.step

        def step_maybe_slowed(*args, **kwargs):
            if self.slow:
                time.sleep(self.slow)
            return step(*args, **kwargs)

        self.runner.engine.step = step_maybe_slowed

    def info(self) -> dict:
        try:
            import ray

            node = ray.util.get_node_ip_address()
        except Exception:
            node = socket.gethostname()
        m = self.model
        return dict(name=self.name, node=node, pid=os.getpid(), model=str(getattr(m, "path", "")),
                    model_type=m.config.model_type, vocab_size=m.config.vocab_size, ctx=self.runner.ctx,
                    kv_slots=self.runner.config.kv_slots, block=self.kv.block)

    def _histories(self):
        return [self.runner.scheduler.slot_history(i) for i in range(self.runner.config.kv_slots)]

    async def generate(self, assignment: str, prompt: list[int], options: dict):
        """The assignment's messages: Started, deltas, Profile, Usage, Finished | Error."""
        if assignment in self.seen:  # a redelivered assignment is never served twice
            yield Message(assignment, 0, Error("scheduler_error", f"assignment {assignment} was already taken"))
            return
        self.seen.add(assignment)
        await self._fault("hold_before")
        options = dict(options)
        start = options.pop("score_start", None)
        try:
            if start is not None:
                handle = self.runner.score(prompt, start, cache_slot=options.get("cache_slot"))
            else:
                handle = self.runner.submit(prompt, **options)
        except ColiError as e:
            yield Message(assignment, 0, Error(getattr(e, "code", "invalid_request_error"), str(e)))
            return
        self.handles[assignment] = handle
        index, delivered = 0, False
        try:
            async for ev in handle:
                kv = ()
                if isinstance(ev, (Finished, Error)):
                    d = self.kv.diff(self._histories())
                    kv = (d,) if d else ()
                yield Message(assignment, index, ev, kv)
                index += 1
                if isinstance(ev, TextDelta) and not delivered:
                    delivered = True
                    await self._fault("hold_after_first")
        finally:
            handle.cancel()  # a no-op once it ended; frees the slot if the router went away
            self.handles.pop(assignment, None)

    def cancel(self, assignment: str) -> bool:
        h = self.handles.get(assignment)
        return bool(h is not None and h.cancel())

    def status(self) -> dict:
        self.kv.diff(self._histories())  # bring ``published`` up to date; it is what we report
        snap = self.runner.scheduler.snapshot()
        return dict(snap, name=self.name, epoch=self.epoch, info=self.info(), steps=self.runner.steps,
                    assignments=len(self.handles), taken=len(self.seen), kv_seq=self.kv.seq,
                    kv_blocks=sorted(self.kv.published))

    # -- fault injection (tests) ---------------------------------------------------------------

    def set_fault(self, name: str, on: bool) -> None:
        """Hold new assignments before they start ("hold_before") or after their first delta
        ("hold_after_first") until turned off, or slow every engine step ("slow_steps"):
        lets tests kill or cancel at a known point."""
        if name == "slow_steps":
            self.slow = 0.05 if on else 0.0
            return
        ev = self.faults.setdefault(name, asyncio.Event())
        ev.clear() if on else ev.set()

    async def _fault(self, name: str) -> None:
        ev = self.faults.get(name)
        if ev is not None and not ev.is_set():
            await ev.wait()

    def shutdown(self) -> None:
        self.runner.close()
