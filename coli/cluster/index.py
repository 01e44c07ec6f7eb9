"""Where prefixes live: chained hashes of token blocks, an exact index, and the routing policy.

A worker's KV slots hold token histories. Each full block of ``block`` tokens is named by a
hash chained over every block before it, so a block hash names a whole prefix. Workers
report the hashes they store and evict (``KVPublisher``); the router keeps an exact
``PrefixIndex`` of hash -> workers and measures, per worker, how many leading tokens of a
prompt it holds. ``choose`` weighs that against load in the spirit of SGLang's cache-aware
router: while the load is balanced, the worker with the longest cached prefix wins if it
covers more than ``cache_threshold`` of the prompt, else the least loaded one; when the
load is imbalanced (max - min > ``balance_abs`` and max > min * ``balance_rel``), the
least loaded one wins.
"""
from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

DEFAULT_BLOCK = 16
POLICIES = ("cache-aware", "round-robin", "least-loaded")


def block_hashes(tokens: Sequence[int], block: int = DEFAULT_BLOCK) -> list[str]:
    """The chained hash of every full block of ``tokens`` (16 hex digits each)."""
    arr = np.asarray(tokens, dtype=np.int64)
    out, prev = [], b""
    for i in range(len(arr) // block):
        h = hashlib.blake2b(prev + arr[i * block:(i + 1) * block].tobytes(), digest_size=8).digest()
        out.append(h.hex())
        prev = h
    return out


class KVPublisher:
    """The worker's side: diffs the blocks its slots hold against what it last reported."""

    def __init__(self, block: int = DEFAULT_BLOCK):
        self.block = block
        self.seq = 0
        self.published: set[str] = set()

    def current(self, histories: Iterable[Sequence[int]]) -> set[str]:
        held: set[str] = set()
        for tokens in histories:
            held.update(block_hashes(tokens, self.block))
        return held

    def diff(self, histories: Iterable[Sequence[int]]) -> tuple | None:
        """(seq, stored, evicted) since the last report, or None when nothing changed."""
        held = self.current(histories)
        stored, evicted = held - self.published, self.published - held
        if not stored and not evicted:
            return None
        self.seq += 1
        self.published = held
        return self.seq, tuple(sorted(stored)), tuple(sorted(evicted))


class PrefixIndex:
    """The router's exact index: block hash -> workers holding it, per worker its event seq."""

    def __init__(self, block: int = DEFAULT_BLOCK):
        self.block = block
        self.holders: dict[str, set[str]] = {}
        self.blocks: dict[str, set[str]] = {}  # worker -> hashes
        self.seq: dict[str, int] = {}

    def apply(self, worker: str, seq: int, stored: Iterable[str], evicted: Iterable[str]) -> bool:
        """Apply one KV event batch if it is the worker's next; False (ignored) otherwise."""
        if seq != self.seq.get(worker, 0) + 1:
            return False
        self._store(worker, stored)
        self._evict(worker, evicted)
        self.seq[worker] = seq
        return True

    def replace(self, worker: str, seq: int, held: Iterable[str]) -> bool:
        """A full report (a heartbeat): replaces the worker's entries unless older than what we have."""
        if seq < self.seq.get(worker, 0):
            return False
        held = set(held)
        mine = self.blocks.get(worker, set())
        self._evict(worker, mine - held)
        self._store(worker, held - mine)
        self.seq[worker] = seq
        return True

    def drop(self, worker: str) -> None:
        """The worker is gone (or restarted): forget everything it held."""
        self._evict(worker, set(self.blocks.get(worker, ())))
        self.blocks.pop(worker, None)
        self.seq.pop(worker, None)

    def _store(self, worker: str, hashes: Iterable[str]) -> None:
        mine = self.blocks.setdefault(worker, set())
        for h in hashes:
            mine.add(h)
            self.holders.setdefault(h, set()).add(worker)

    def _evict(self, worker: str, hashes: Iterable[str]) -> None:
        mine = self.blocks.get(worker, set())
        for h in list(hashes):
            mine.discard(h)
            s = self.holders.get(h)
            if s is not None:
                s.discard(worker)
                if not s:
                    del self.holders[h]

    def match(self, tokens: Sequence[int], workers: Iterable[str]) -> dict[str, int]:
        """Per worker, the number of leading prompt tokens whose blocks it holds."""
        hashes = block_hashes(tokens, self.block)
        out = {}
        for w in workers:
            mine, n = self.blocks.get(w, set()), 0
            for h in hashes:
                if h not in mine:
                    break
                n += 1
            out[w] = n * self.block
        return out

    def counts(self) -> dict[str, int]:
        return {w: len(b) for w, b in self.blocks.items()}


@dataclass(frozen=True)
class Balance:
    """SGLang-style thresholds (its defaults are 0.5, 64 and 1.0001 for large GPU batches;
    ours suit a few CPU slots per worker)."""

    cache_threshold: float = 0.3  # route by cache when the best match covers more of the prompt than this
    balance_abs: int = 4  # imbalanced when max load - min load exceeds this ...
    balance_rel: float = 1.5  # ... and max load exceeds min load times this


@dataclass(frozen=True)
class Choice:
    order: list[str]  # the chosen worker first, then the fall-backs
    matched: int  # prompt tokens the chosen worker holds, by the index
    reason: str  # "cache", "balance", "least-loaded", "round-robin", "sticky"


def choose(policy: str, prompt: Sequence[int], loads: Mapping[str, int], matches: Mapping[str, int],
           balance: Balance = Balance(), rr: int = 0) -> Choice:
    """Order the live workers (``loads``: worker -> active + queued) for one request."""
    workers = sorted(loads)
    if not workers:
        return Choice([], 0, "none")
    by_load = sorted(workers, key=lambda w: (loads[w], -matches.get(w, 0), w))
    if policy == "round-robin":
        k = rr % len(workers)
        order = workers[k:] + workers[:k]
        return Choice(order, matches.get(order[0], 0), "round-robin")
    if policy == "least-loaded":
        return Choice(by_load, matches.get(by_load[0], 0), "least-loaded")
    lo, hi = min(loads.values()), max(loads.values())
    if hi - lo > balance.balance_abs and hi > lo * balance.balance_rel:
        return Choice(by_load, matches.get(by_load[0], 0), "balance")
    best = max(workers, key=lambda w: (matches.get(w, 0), -loads[w]))
    if prompt and matches.get(best, 0) / len(prompt) > balance.cache_threshold:
        return Choice([best] + [w for w in by_load if w != best], matches[best], "cache")
    return Choice(by_load, matches.get(by_load[0], 0), "least-loaded")
