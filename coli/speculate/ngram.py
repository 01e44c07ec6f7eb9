"""Prompt lookup: draft the tokens that followed an earlier occurrence of the context's
own suffix (in the prompt or in the output so far).

Coding agents rewrite files they were just shown, so much of their output copies the
prompt; when the last few tokens occurred before, what followed them then is a good
guess for what follows now. No extra model: an index from each MIN_NGRAM-gram to the
positions after its occurrences, kept per request and extended as tokens arrive. Of the
latest few occurrences of the suffix's last MIN_NGRAM tokens, the one whose match
reaches furthest back (up to MAX_NGRAM tokens) is followed: a longer match is a surer
sign of the same passage, and a recent one of the current copy. ``match`` keeps the
length of the last proposal's match, so a caller can trust long matches more.

The engine runs the C version of this index (coli/speculate/_lookup.pyx, NgramIndex); this
plain one is its twin, what tests/test_speculate_lookup.py holds it to.
"""
from __future__ import annotations

from collections.abc import Sequence

MAX_NGRAM = 16  # the longest match looked for
MIN_NGRAM = 2  # a single repeated token predicts too little to be worth a verification
CANDIDATES = 8  # the latest occurrences compared


class NgramDrafter:
    """One request's index: ``propose(context, k)`` -> up to k draft tokens (maybe none)."""

    def __init__(self, max_ngram: int = MAX_NGRAM, min_ngram: int = MIN_NGRAM, candidates: int = CANDIDATES):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min <= max, got {min_ngram}, {max_ngram}")
        self.max_n, self.min_n, self.candidates = max_ngram, min_ngram, candidates
        self.index: dict[tuple[int, ...], list[int]] = {}  # min-gram -> positions just after its occurrences
        self.indexed = 0  # positions p < indexed have the min-gram ending at p in the index
        self.match = 0  # the length of the last proposal's match (0: none)

    def _extend(self, ctx: Sequence[int]) -> None:
        """Index the min-gram ending at every position p whose next token ctx[p] exists."""
        n, index = self.min_n, self.index
        for p in range(max(self.indexed, n), len(ctx)):
            key = tuple(ctx[p - n:p])
            at = index.get(key)
            if at is None:
                index[key] = [p]
            else:
                at.append(p)
        self.indexed = max(self.indexed, len(ctx))

    def propose(self, ctx: Sequence[int], k: int) -> list[int]:
        """Draft tokens continuing ``ctx`` (prompt + output, the last token included):
        the earlier occurrence of its suffix with the longest match decides; [] when none."""
        self.match = 0
        if k < 1 or len(ctx) <= self.min_n:
            return []
        if len(ctx) < self.indexed:  # the context got shorter (a new request in the same drafter)
            self.index.clear()
            self.indexed = 0
        self._extend(ctx)
        L = len(ctx)
        at = self.index.get(tuple(ctx[L - self.min_n:]))
        if not at:
            return []
        best, best_n = 0, 0
        for p in reversed(at[-self.candidates:]):
            n, top = self.min_n, min(self.max_n, p)
            while n < top and ctx[p - 1 - n] == ctx[L - 1 - n]:
                n += 1
            if n > best_n:
                best, best_n = p, n
                if n == self.max_n:
                    break
        self.match = best_n
        # ctx[best:] followed that match before; past the end it repeats with period L - best
        return [ctx[best + i % (L - best)] for i in range(k)]
