"""Fewer kernel threads while the machine is too busy for all of them.

Every layer of a decode step is a handful of OpenMP parallel regions, each ending in a
barrier. When other work holds the cores, one of the kernel threads is often waiting for a
core while the others wait for it at the barrier, so every region costs a scheduler time
slice instead of microseconds. Measured on a 2-core machine with four other busy processes
(SmolLM2-135M int8): one thread decodes at 46-76 ms a token, two threads at 500-2600 ms, a
tenth of one thread's speed, where on the quiet machine two threads are 1.6x faster than one.

The governor watches the engine's decode steps (wall time per token of steps of up to SMALL
tokens) and now and then tries another thread count for a few steps, keeping it when it is
clearly faster:

- at the most threads (``--threads``): a trial of half as many every ``after`` steps (256 at
  first, doubling up to MAX_AFTER while trials lose, so a quiet machine pays ~0.2% for them in
  the long run), and at once when a window of steps runs STALL times slower than the best
  window seen (the machine got busy);
- with fewer: a trial of twice as many every UP_AFTER steps (doubling up to MAX_UP_AFTER
  while trials lose),
  abandoned at its first step if that step alone is ABORT times the current pace, so a trial
  on a still-busy machine costs one slow step.

Results do not depend on the thread count (the kernels split work so that each output's
arithmetic is the same however it is split; tests check), so the switch is invisible except
in speed. ``COLI_ADAPTIVE_THREADS=0`` keeps the configured count.
"""
from __future__ import annotations

import os
import statistics
from collections import deque
from collections.abc import Callable

ENV = "COLI_ADAPTIVE_THREADS"
SMALL = 16  # steps of at most this many tokens are timed (decode); a prefill chunk is not
WINDOW = 8  # timed steps per measurement (the current pace and each trial)
FIRST_AFTER = 256  # steps at the most threads before the first trial of fewer
MAX_AFTER = 4096  # ... the longest wait between trials, after trials that lost
UP_AFTER = 64  # steps with fewer threads before a trial of more
MAX_UP_AFTER = 1024  # ... at most, so a machine that got quiet again is noticed within ~1000 steps
STALL = 2.5  # a window this much slower than the best one seen at the same count: try fewer now
BETTER = 1.3  # fewer threads are kept only when this much faster (more threads: when faster at all)
ABORT = 4.0  # a trial step this much slower than the current pace ends the trial


def enabled(env=None) -> bool:
    v = (os.environ if env is None else env).get(ENV, "1").strip().lower()
    return v not in ("0", "false", "no", "off")


class ThreadGovernor:
    """``observe(tokens, seconds)`` after each engine step; it calls ``set_threads(n)`` when
    the count should change (before the next step). ``n`` is the count chosen, ``active`` the
    one the next step runs with (a trial's while one runs)."""

    def __init__(self, max_threads: int, set_threads: Callable[[int], None]):
        self.max = max(1, max_threads)
        self.n = self.max
        self._set = set_threads
        self.recent: deque[float] = deque(maxlen=WINDOW)  # seconds per token, at self.n
        self.best: dict[int, float] = {}  # thread count -> the fastest window seen with it
        self.trial: tuple[int, list[float]] | None = None  # (count tried, its seconds per token)
        self.since = 0  # timed steps since the last trial (or switch)
        self.after = FIRST_AFTER
        self.trials = self.switches = 0

    @property
    def active(self) -> int:
        """The count the next step runs with: a trial's, or ``n``."""
        return self.trial[0] if self.trial is not None else self.n

    def _window(self) -> float:
        return statistics.median(self.recent)

    def observe(self, tokens: int, seconds: float) -> None:
        if self.max == 1 or tokens < 1 or tokens > SMALL or seconds <= 0:
            return
        x = seconds / tokens
        if self.trial is not None:
            self._trial_step(x)
            return
        self.recent.append(x)
        self.since += 1
        if len(self.recent) < WINDOW:
            return
        pace = self._window()
        best = self.best.get(self.n)
        self.best[self.n] = pace if best is None else min(best, pace)
        stalled = self.n > 1 and best is not None and pace > STALL * best
        if self.since >= self.after or stalled:
            other = max(1, self.n // 2) if self.n == self.max or stalled else min(self.max, 2 * self.n)
            if other != self.n:
                self._start(other)

    def _start(self, n: int) -> None:
        self.trial = (n, [])
        self.trials += 1
        self._set(n)

    def _trial_step(self, x: float) -> None:
        n, xs = self.trial
        pace = self._window()
        xs.append(x)
        if x > ABORT * pace:  # clearly slower: no need to see more of it
            self._end(won=False)
            return
        if len(xs) < WINDOW:
            return
        t = statistics.median(xs)
        self._end(won=t * BETTER < pace if n < self.n else t < pace)

    def _end(self, won: bool) -> None:
        n, xs = self.trial
        self.trial = None
        self.since = 0
        if won:
            self.n = n
            self.switches += 1
            self.recent.clear()
            self.recent.extend(xs[-WINDOW:])
            self.after = FIRST_AFTER if n == self.max else UP_AFTER
            return
        self._set(self.n)  # back to the count in use; wait longer before the next trial
        self.after = min(2 * self.after, MAX_AFTER if self.n == self.max else MAX_UP_AFTER)
        # and take the pace as this count's norm: steps also get slower for reasons fewer
        # threads do not cure (a longer context), which must not trigger a trial every window
        self.best[self.n] = self._window()
