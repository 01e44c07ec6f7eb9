"""One constrained sequence: its llguidance matcher, its next-token mask, its forced tokens.

The runner's loop, per step, for each sequence that samples:

    masks.start(guides)          # a worker thread computes every mask (llguidance drops the GIL)
    logits = engine.step(...)    # ... while the engine runs the step
    masks.wait()
    tok = guide.pick(sampler, logits, generated)     # the mask applied before temperature/top-p/top-k
    forced = guide.advance(tok, room)                 # the tokens the grammar now forces, consumed

Forced tokens are llguidance's fast-forward tokens: where the grammar allows exactly one
continuation (a schema's keys and punctuation), its canonical tokens. They are never
sampled (probability 1 under the constrained distribution, logprob 0); the runner feeds
them to the engine in one multi-token step, or one per step with folding off.
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from coli.grammar.constraint import Constraint, Vocabulary


class DeadEnd(Exception):
    """The grammar allows no token here (or the matcher failed): the choice ends with an error."""


class Guide:
    """A sequence's constraint state (see the module docstring). Not thread-safe: the
    mask worker and the runner's thread take turns (``MaskWorker.wait`` between them)."""

    def __init__(self, constraint: Constraint, vocab: Vocabulary):
        self.matcher = constraint.matcher(vocab)
        self.vocab = vocab
        self.bits = np.full((vocab.size + 31) // 32, -1, dtype=np.int32)  # (words,) bit i = token i allowed
        self.fresh = False  # bits hold the mask of the current state
        self.consumed = 0
        # counters (coli bench, Profile-free): seconds in mask computation, tokens sampled / forced
        self.mask_seconds = 0.0
        self.masks = 0
        self.forced = 0

    # -- masks ----------------------------------------------------------------------------------

    def compute_mask(self) -> None:
        """Fill ``bits`` for the current state (drops the GIL inside llguidance)."""
        if self.fresh:
            return
        t0 = time.perf_counter()
        self.matcher.unsafe_compute_mask_ptr(self.bits.ctypes.data, self.bits.nbytes)
        self.mask_seconds += time.perf_counter() - t0
        self.masks += 1
        self.fresh = True

    def allowed(self) -> np.ndarray:
        """(V,) bool: the tokens the grammar allows next."""
        self.compute_mask()
        return np.unpackbits(self.bits.view(np.uint8), bitorder="little")[: self.vocab.size].astype(bool)

    def mask_logits(self, logits: np.ndarray) -> tuple[np.ndarray, int]:
        """A copy of ``logits`` (V,) with disallowed tokens at -inf, and how many are allowed.
        Raises DeadEnd when none is."""
        ok = self.allowed()[: logits.shape[-1]]
        n = int(np.count_nonzero(ok))
        if n == 0:
            raise DeadEnd(self._dead_end())
        return np.where(ok, logits, np.float32(-np.inf)).astype(np.float32, copy=False), n

    # -- state ----------------------------------------------------------------------------------

    def consume(self, tok: int) -> None:
        if not self.matcher.consume_token(int(tok)):
            raise DeadEnd(self._dead_end(f"token {tok} was refused"))
        self.fresh = False
        self.consumed += 1

    def take_forced(self, room: int) -> list[int]:
        """Up to ``room`` tokens the grammar forces from here, consumed."""
        if room <= 0 or self.matcher.is_stopped():
            return []
        forced = [t for t in self.matcher.compute_ff_tokens()[:room] if t not in self.vocab.eos_ids]
        for t in forced:
            self.consume(t)
        self.forced += len(forced)
        return forced

    @property
    def done(self) -> bool:
        """The answer is complete: the grammar allows nothing but end of turn."""
        return self.matcher.is_stopped() and self.matcher.is_accepting() and not self.matcher.is_error()

    def check_alive(self) -> None:
        """Raises DeadEnd when the grammar can go no further and is not complete (an empty
        language, a failed matcher)."""
        if self.matcher.is_error() or (self.matcher.is_stopped() and not self.matcher.is_accepting()):
            raise DeadEnd(self._dead_end())

    @property
    def accepting(self) -> bool:
        return self.matcher.is_accepting()

    def _dead_end(self, what: str = "no token is allowed") -> str:
        reason = self.matcher.get_error() if self.matcher.is_error() else ""
        return (f"grammar dead end after {self.consumed} generated tokens: {what}"
                + (f" ({reason})" if reason else "") + "; the constraint cannot be completed with this vocabulary")


class MaskWorker:
    """Computes the masks of one step's constrained sequences on a worker thread while the
    engine runs that step. ``start(guides)`` then ``wait()``; one step at a time."""

    def __init__(self):
        self._pool: ThreadPoolExecutor | None = None
        self._pending: Future | None = None
        self._lock = threading.Lock()

    def start(self, guides: list[Guide]) -> None:
        if not guides:
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="coli-grammar")
        self._pending = self._pool.submit(_fill, guides)

    def wait(self) -> None:
        """Block until the masks are ready; a failure is left for the sequence to meet
        (its mask is computed again, and a dead end raised, when it samples)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.exception()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


def _fill(guides: list[Guide]) -> None:
    for g in guides:
        g.compute_mask()
