"""Prompt lookup: draft the tokens that followed the last occurrence of the context's
own suffix (an n-gram of the prompt or of the output so far).

Coding agents rewrite files they were just shown, so much of their output copies the
prompt; when the last few tokens occurred before, what followed them then is a good
guess for what follows now. No extra model: an index from each n-gram to the position
after its latest occurrence, kept per request and extended as tokens arrive.
"""
from __future__ import annotations

from collections.abc import Sequence

MAX_NGRAM = 4  # the longest suffix looked up first
MIN_NGRAM = 2  # a single repeated token predicts too little to be worth a verification


class NgramDrafter:
    """One request's index: ``propose(context, k)`` -> up to k draft tokens (maybe none)."""

    def __init__(self, max_ngram: int = MAX_NGRAM, min_ngram: int = MIN_NGRAM):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min <= max, got {min_ngram}, {max_ngram}")
        self.max_n, self.min_n = max_ngram, min_ngram
        self.index: dict[tuple[int, ...], int] = {}  # n-gram -> the position just after its latest occurrence
        self.indexed = 0  # positions p < indexed have their n-grams ending at p in the index

    def _extend(self, ctx: Sequence[int]) -> None:
        """Index the n-grams ending at every position p whose next token ctx[p] exists."""
        for p in range(max(self.indexed, self.min_n), len(ctx)):
            for n in range(self.min_n, min(self.max_n, p) + 1):
                self.index[tuple(ctx[p - n:p])] = p
        self.indexed = max(self.indexed, len(ctx))

    def propose(self, ctx: Sequence[int], k: int) -> list[int]:
        """Draft tokens continuing ``ctx`` (prompt + output, the last token included):
        the longest suffix of ctx seen before decides; [] when none was."""
        if k < 1 or len(ctx) <= self.min_n:
            return []
        if len(ctx) < self.indexed:  # the context got shorter (a new request in the same drafter)
            self.index.clear()
            self.indexed = 0
        self._extend(ctx)
        L = len(ctx)
        for n in range(min(self.max_n, L - 1), self.min_n - 1, -1):
            p = self.index.get(tuple(ctx[L - n:]))
            if p is not None:  # ctx[p:] followed that n-gram before; past the end it repeats with period L - p
                return [ctx[p + i % (L - p)] for i in range(k)]
        return []
