"""Fewer kernel threads while the machine is too busy for all of them.

Every layer of a decode step is a handful of OpenMP parallel regions, each ending in a
barrier. When other work holds the cores, one of the kernel threads is often waiting for a
core while the others wait for it at the barrier, so every region costs a scheduler time
slice instead of microseconds. Measured on a 2-core machine with four other busy processes
(SmolLM2-135M int8): one thread decodes at 46-76 ms a token, two threads at 500-2600 ms, a
tenth of one thread's speed, where on the quiet machine two threads are 1.6x faster than one.

The governor watches the engine's decode steps (the wall time of steps of up to SMALL tokens,
each compared only with steps of as many tokens: a batch of four costs less per token than
one token alone) and now and then tries another thread count for a few steps, keeping it
when it is clearly faster:

- at the most threads (``--threads``): one early trial of half as many after FIRST_TRIAL
  steps (a machine busy from the start, or one that grants fewer cores than ``--threads``, as a
  container's CPU quota does, can run two threads hundreds of times slower than one: waiting
  256 such steps would take minutes), then one every ``after`` steps (256 at first, doubling up
  to MAX_AFTER while trials lose, so a quiet machine pays ~0.2% for them in the long run), and
  at once when a window of steps runs STALL times slower than the best window seen (the machine
  got busy);
- with fewer: a trial of twice as many every UP_AFTER steps (doubling up to MAX_UP_AFTER
  while trials lose),
  abandoned at its first step if that step alone is ABORT times the current pace, so a trial
  on a still-busy machine costs one slow step.

A trial of fewer threads also ends after its first LOSE_EARLY steps when every one of them
was slower than the current pace: it could not have been BETTER times faster, and on a quiet
machine (where the early trial comes in the first reply of every new process) it then costs 3
slower steps instead of WINDOW.

Results do not depend on the thread count (the kernels split work so that each output's
arithmetic is the same however it is split; tests check), so the switch is invisible except
in speed. ``COLI_ADAPTIVE_THREADS=0`` keeps the configured count.
"""
from __future__ import annotations

import os
import statistics
import threading
import warnings
from collections import deque
from collections.abc import Callable

from coli.config import env_switch

ENV = "COLI_ADAPTIVE_THREADS"
SMALL = 16  # steps of at most this many tokens are timed (decode); a prefill chunk is not
WINDOW = 8  # timed steps per measurement (the current pace and each trial)
FIRST_TRIAL = 2 * WINDOW  # timed steps at the most threads before the early trial of fewer
FIRST_AFTER = 256  # ... then before the next one
MAX_AFTER = 4096  # ... the longest wait between trials, after trials that lost
UP_AFTER = 64  # steps with fewer threads before a trial of more
MAX_UP_AFTER = 1024  # ... at most, so a machine that got quiet again is noticed within ~1000 steps
STALL = 2.5  # a window this much slower than the best one seen at the same count: try fewer now
BETTER = 1.3  # fewer threads are kept only when this much faster (more threads: when faster at all)
ABORT = 4.0  # a trial step this much slower than the current pace ends the trial
LOSE_EARLY = 3  # a trial of fewer threads whose first this many steps are all slower ends there


def enabled(env=None) -> bool:
    """$COLI_ADAPTIVE_THREADS (default on); InvalidRequestError for a value that is neither."""
    return env_switch(ENV, env)


class ThreadGovernor:
    """``observe(tokens, seconds)`` after each engine step; it calls ``set_threads(n)`` when
    the count should change (before the next step). ``n`` is the count chosen, ``active`` the
    one the next step runs with (a trial's while one runs)."""

    def __init__(self, max_threads: int, set_threads: Callable[[int], None]):
        self.max = max(1, max_threads)
        self.n = self.max
        self._set = set_threads
        # steps are compared only with steps of as many tokens (a batch of 4 costs less per
        # token than one token alone: mixing them would look like a stall or a win)
        self.recent: dict[int, deque[float]] = {}  # tokens per step -> seconds of the latest, at self.n
        self.seen: dict[int, int] = {}  # tokens per step -> the timed step that last had that many
        self.best: dict[tuple[int, int], float] = {}  # (threads, tokens) -> the fastest window seen
        self.trial: tuple[int, dict[int, list[float]]] | None = None  # (count tried, its seconds by tokens)
        self.steps = 0  # timed steps so far
        self.since = 0  # ... since the last trial (or switch)
        self.after = FIRST_TRIAL
        self.trials = self.switches = 0

    @property
    def active(self) -> int:
        """The count the next step runs with: a trial's, or ``n``."""
        return self.trial[0] if self.trial is not None else self.n

    def for_step(self, tokens: int) -> int:
        """The count a step of ``tokens`` tokens runs with: ``active`` for the steps the
        governor times; a larger one (a prefill chunk) runs with the count kept, ``n``, since
        a trial is judged only by the timed steps: one that began just before a long prompt
        would otherwise run that prompt's whole prefill, chunk after chunk, with its count."""
        return self.active if tokens <= SMALL else self.n

    def _ref(self, tokens: int) -> float | None:
        """The current pace of steps of ``tokens`` tokens (None: none lately)."""
        q = self.recent.get(tokens)
        return statistics.median(q) if q else None

    def observe(self, tokens: int, seconds: float) -> None:
        if self.max == 1 or tokens < 1 or tokens > SMALL or seconds <= 0:
            return
        self.steps += 1
        if self.steps - self.seen.get(tokens, self.steps) > 4 * WINDOW:  # not seen lately: start afresh
            self.recent.pop(tokens, None)
        self.seen[tokens] = self.steps
        if self.trial is not None:
            self._trial_step(tokens, seconds)
            return
        q = self.recent.get(tokens)
        if q is None:
            q = self.recent[tokens] = deque(maxlen=WINDOW)
        q.append(seconds)
        self.since += 1
        stalled = False
        if len(q) == WINDOW:
            pace = statistics.median(q)
            best = self.best.get((self.n, tokens))
            self.best[self.n, tokens] = pace if best is None else min(best, pace)
            stalled = self.n > 1 and best is not None and pace > STALL * best
        if self.since >= self.after or stalled:
            other = max(1, self.n // 2) if self.n == self.max or stalled else min(self.max, 2 * self.n)
            if other != self.n:
                self._start(other)

    def _start(self, n: int) -> None:
        self.trial = (n, {})
        self.trials += 1
        self._set(n)

    def _trial_step(self, tokens: int, seconds: float) -> None:
        n, xs = self.trial
        xs.setdefault(tokens, []).append(seconds)
        ref = self._ref(tokens)
        if ref is not None and seconds > ABORT * ref:  # clearly slower: no need to see more of it
            self._end(won=False)
            return
        # fewer threads are kept only when BETTER times faster: first steps all slower than the
        # current pace cannot get there (a quiet machine, where one thread of two runs ~1.6x
        # slower: 3 steps of the trial instead of WINDOW)
        same = xs[tokens]
        if n < self.n and ref is not None and len(same) == LOSE_EARLY and min(same) > ref:
            self._end(won=False)
            return
        if sum(len(v) for v in xs.values()) < WINDOW:
            return
        # the size the trial saw most that the current count has a pace for
        m = max((m for m in xs if self._ref(m) is not None), key=lambda m: len(xs[m]), default=None)
        if m is None:  # nothing to compare with (the batch changed): as if it had not run
            self._end(won=None)
            return
        ratio = statistics.median(xs[m]) / self._ref(m)
        self._end(won=ratio * BETTER < 1.0 if n < self.n else ratio < 1.0)

    def _end(self, won: bool | None) -> None:
        n, xs = self.trial
        self.trial = None
        self.since = 0
        if won:
            self.n = n
            self.switches += 1
            self.recent = {m: deque(v[-WINDOW:], maxlen=WINDOW) for m, v in xs.items()}
            self.after = FIRST_AFTER if n == self.max else UP_AFTER
            return
        self._set(self.n)  # back to the count in use
        if won is None:
            return
        # wait longer before the next trial, and take the pace as this count's norm: steps also
        # get slower for reasons fewer threads do not cure (a longer context), which must not
        # trigger a trial every window
        if self.n == self.max:  # (the early trial's loss: the periodic ones from FIRST_AFTER)
            self.after = max(FIRST_AFTER, min(2 * self.after, MAX_AFTER))
        else:
            self.after = min(2 * self.after, MAX_UP_AFTER)
        for m, q in self.recent.items():
            if len(q) == WINDOW:
                self.best[self.n, m] = statistics.median(q)


class ComputeThreads:
    """Which threads of this process hold OpenMP teams from running the engine, and one
    warning when a second one computes while another's team lives.

    A thread that has run a parallel kernel keeps its own OpenMP team of worker threads until
    it ends or retires them (``kernels.release_threads``). With two such teams, a process whose
    kernel threads fill its cores has more OpenMP threads than CPUs, and libgomp then stops
    spinning at its barriers: every parallel region (about 150 a token) pays a futex wake
    instead. Measured at 2 threads on 2 cores, SmolLM2-135M int8 decode through a Runner ran
    2-3.5x slower while another live thread's team was there. So the Runner retires the
    constructing thread's workers when it starts, and its own whenever it runs out of work,
    and ``Model.generate`` retires the caller's when it ends (``released``); what is left, a
    thread computing while another computes, is said once per process."""

    def __init__(self, warn: Callable[[str], None] | None = None):
        self._last = None  # the thread of the last step (a threading.Thread)
        self._seen: list = []  # threads that have run a step, still alive when last looked
        self.warned = False
        self._warn = warn

    def released(self) -> None:
        """The calling thread has just retired its OpenMP workers (kernels.release_threads)."""
        t = threading.current_thread()
        self._seen = [s for s in self._seen if s is not t]
        if self._last is t:
            self._last = None

    def note(self, threads: int) -> None:
        """Called at each step with the kernel thread count: cheap when the thread is the last one."""
        t = threading.current_thread()
        if t is self._last:
            return
        self._last = t
        self._seen = [s for s in self._seen if s.is_alive() and s is not t] + [t]
        if self.warned or threads < 2 or len(self._seen) < 2:
            return
        try:
            cpus = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            cpus = os.cpu_count() or 1
        # (libgomp's test: its threads, the process's first one and each team's workers, over the CPUs)
        if 1 + len(self._seen) * (threads - 1) > cpus:
            self.warned = True
            others = ", ".join(f"{s.name!r} ({s.native_id})" for s in self._seen[:-1])
            msg = (f"coli: thread {t.name!r} ({t.native_id}) runs the model while {others} holds the OpenMP "
                   f"threads it ran it with: with more of them than cores ({cpus}) every kernel barrier sleeps "
                   "instead of spinning (2-3x slower decode); run the model from one thread (submit everything "
                   "to one Runner), or call coli._engine.kernels.release_threads() on the other when it is done")
            if self._warn is not None:
                self._warn(msg)
            else:
                warnings.warn(msg, RuntimeWarning, stacklevel=4)


compute_threads = ComputeThreads()  # the process's own (engines share the OpenMP runtime)
