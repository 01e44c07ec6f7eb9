"""Prompt lookup: draft the tokens that followed an earlier occurrence of the context's
own suffix (in the prompt or in the output so far).

Coding agents rewrite files they were just shown, so much of their output copies the
prompt; when the last few tokens occurred before, what followed them then is a good
guess for what follows now. No extra model: an index from each MIN_NGRAM-gram to the
positions after its occurrences, kept per request and extended as tokens arrive (each
min-gram is one int key, rolled on by a shift per token: no tuple per token). Of the
latest few occurrences of the suffix's last MIN_NGRAM tokens, the one whose match
reaches furthest back (up to MAX_NGRAM tokens) is followed: a longer match is a surer
sign of the same passage, and a recent one of the current copy. ``match`` keeps the
length of the last proposal's match, so a caller can trust long matches more.
"""
from __future__ import annotations

from collections.abc import Sequence

MAX_NGRAM = 16  # the longest match looked for
MIN_NGRAM = 2  # a single repeated token predicts too little to be worth a verification
CANDIDATES = 8  # the latest occurrences compared
KEY_BITS = 32  # bits per token in an index key (token ids are below 2**32)


class NgramDrafter:
    """One request's index: ``propose(context, k)`` -> up to k draft tokens (maybe none).

    A min-gram's key is one int, its tokens side by side KEY_BITS bits apart, rolled on
    by a shift as each token arrives: indexing costs a dict lookup and an append per
    token, and a step whose suffix never occurred before one more lookup."""

    def __init__(self, max_ngram: int = MAX_NGRAM, min_ngram: int = MIN_NGRAM, candidates: int = CANDIDATES):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min <= max, got {min_ngram}, {max_ngram}")
        self.max_n, self.min_n, self.candidates = max_ngram, min_ngram, candidates
        self.index: dict[int, list[int]] = {}  # min-gram's key -> positions just after its occurrences
        self.indexed = 0  # positions p < indexed have the min-gram ending at p in the index
        self.match = 0  # the length of the last proposal's match (0: none)
        self._mask = (1 << KEY_BITS * min_ngram) - 1

    @staticmethod
    def key(gram: Sequence[int]) -> int:
        """The index key of a min-gram (its tokens, oldest first)."""
        key = 0
        for t in gram:
            key = key << KEY_BITS | t
        return key

    def _extend(self, ctx: Sequence[int]) -> int:
        """Index the min-gram ending at every position p whose next token ctx[p] exists;
        returns the key of the context's last min-gram (its suffix, to look up)."""
        n, index, mask, L = self.min_n, self.index, self._mask, len(ctx)
        p = max(self.indexed, n)
        key = self.key(ctx[p - n:p])
        while p < L:
            at = index.get(key)
            if at is None:
                index[key] = [p]
            else:
                at.append(p)
            key = (key << KEY_BITS | ctx[p]) & mask  # the min-gram ending at p + 1
            p += 1
        self.indexed = max(self.indexed, L)
        return key

    def propose(self, ctx: Sequence[int], k: int) -> list[int]:
        """Draft tokens continuing ``ctx`` (prompt + output, the last token included):
        the earlier occurrence of its suffix with the longest match decides; [] when none.
        Indexed incrementally: ``ctx`` grows between calls (a shorter one starts again).
        Token ids are Python ints below 2**KEY_BITS."""
        self.match = 0
        L = len(ctx)
        if k < 1 or L <= self.min_n:
            return []
        if L < self.indexed:  # the context got shorter (a new request in the same drafter)
            self.index.clear()
            self.indexed = 0
        at = self.index.get(self._extend(ctx))  # the occurrences of the context's last min-gram
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
