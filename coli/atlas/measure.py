"""Running a corpus through a model, prefill only, and counting what routes where.

``measure(model, passages)`` tokenizes each passage (at most ``max_tokens`` tokens),
packs passages into batched forward passes (``batch_tokens`` tokens a step, one fresh
KV cache per passage, one logits row each: the LM head is nearly free) and reads each
step's routing from the engine (``StepStats.routed``: expert ids, ``StepStats.gates``:
their gate weights, per MoE layer, one row per token). A ``Recorder`` keeps:

- per layer and expert: tokens routed, summed gate weight, tokens per corpus category;
- co-activation: tokens routed to both e and e' in one layer, and to e in a layer and
  e' in the next MoE layer;
- per (layer, expert, token id): how often, and the occurrence with the highest gate
  weight (passage, position), kept sparse (only pairs that occurred) so a 150k-word
  vocabulary and hundreds of experts cost memory in proportion to the corpus.

The run can stop and resume: ``Recorder.save``/``load`` write everything to one .npz
with the passages already done, the corpus digest and the model fingerprint. The
engine's routing heat (and so a converted model's ``.coli_usage``) is left as it was.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from coli.atlas.corpus import Passage
from coli.errors import InvalidRequestError

MAX_PASSAGES_PER_STEP = 32  # each holds a KV cache for the step: bounded memory on deep models
GATE_LEVELS = 65535  # gate weights quantized to 16 bits inside the "best occurrence" code
POS_BITS, PASSAGE_BITS = 16, 24


class SparseCounter:
    """Counts per int64 key and, per key, the largest int64 value seen (an occurrence code)."""

    def __init__(self):
        self.keys = np.zeros(0, np.int64)  # sorted, unique
        self.counts = np.zeros(0, np.int64)
        self.best = np.zeros(0, np.int64)
        self._pending: list[tuple[np.ndarray, np.ndarray]] = []
        self._n = 0

    def add(self, keys: np.ndarray, values: np.ndarray) -> None:
        self._pending.append((keys.ravel(), values.ravel()))
        self._n += keys.size
        if self._n > 4_000_000:
            self.compact()

    def compact(self) -> None:
        if not self._pending:
            return
        keys = np.concatenate([self.keys, *(k for k, _ in self._pending)])
        vals = np.concatenate([self.best, *(v for _, v in self._pending)])
        weights = np.concatenate([self.counts, np.ones(self._n, np.int64)])
        self._pending, self._n = [], 0
        order = np.lexsort((vals, keys))  # by key, then value: a group's last row has its largest value
        keys, vals, weights = keys[order], vals[order], weights[order]
        starts = np.flatnonzero(np.r_[True, keys[1:] != keys[:-1]])
        ends = np.r_[starts[1:], len(keys)] - 1
        self.keys, self.best = keys[starts], vals[ends]
        self.counts = np.add.reduceat(weights, starts) if len(keys) else np.zeros(0, np.int64)

    def range(self, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(keys, counts, best) of the keys in [lo, hi)."""
        self.compact()
        a, b = np.searchsorted(self.keys, [lo, hi])
        return self.keys[a:b], self.counts[a:b], self.best[a:b]


class Recorder:
    """Routing statistics of L MoE layers of E experts, top-k, over a V-token vocabulary."""

    def __init__(self, L: int, E: int, k: int, V: int, categories: list[str]):
        self.L, self.E, self.k, self.V = L, E, k, V
        self.categories = list(categories)
        C = len(self.categories)
        self.tokens = 0
        self.passages_done = 0
        self.count = np.zeros((L, E), np.int64)  # tokens routed to (layer, expert)
        self.gate_sum = np.zeros((L, E), np.float64)
        self.cat_count = np.zeros((L, E, C), np.int64)  # ... by category of the passage
        self.cat_tokens = np.zeros(C, np.int64)  # corpus tokens per category
        self.token_total = np.zeros(V, np.int64)  # occurrences of each token id
        self.co = np.zeros((L, E, E), np.int64)  # tokens routed to both experts of a layer
        self.co_next = np.zeros((max(L - 1, 0), E, E), np.int64)  # to e in layer l and e' in l+1
        self.tok = SparseCounter()  # key (l*E + e)*V + token -> count, best occurrence

    def add(self, routed: list[np.ndarray], gates: list[np.ndarray], ids: np.ndarray, passage: np.ndarray,
            pos: np.ndarray, cat: np.ndarray) -> None:
        """One step: routed[l], gates[l] (M, k) per MoE layer; ids, passage, pos, cat (M,)
        for the step's tokens (cat -1 where the passage has no category)."""
        E, V, k = self.E, self.V, self.k
        M = len(ids)
        self.tokens += M
        self.token_total += np.bincount(ids, minlength=V)[:V]
        labelled = cat >= 0
        if labelled.any():
            self.cat_tokens += np.bincount(cat[labelled], minlength=len(self.categories))
        where = (passage.astype(np.int64) << POS_BITS) | np.minimum(pos, (1 << POS_BITS) - 1)  # (M,)
        keys, vals = [], []
        for l in range(self.L):
            r = np.asarray(routed[l], np.int64)[:M]  # (M, k)
            g = np.asarray(gates[l], np.float64)[:M]  # (M, k)
            flat = r.ravel()
            self.count[l] += np.bincount(flat, minlength=E)
            self.gate_sum[l] += np.bincount(flat, weights=g.ravel(), minlength=E)
            if labelled.any():
                rc = r[labelled] * len(self.categories) + cat[labelled, None]  # (m, k)
                self.cat_count[l] += np.bincount(rc.ravel(), minlength=E * len(self.categories)).reshape(E, -1)
            for a in range(k):
                for b in range(k):
                    if a != b:
                        self.co[l] += np.bincount(r[:, a] * E + r[:, b], minlength=E * E).reshape(E, E)
            if l + 1 < self.L:
                nxt = np.asarray(routed[l + 1], np.int64)[:M]
                for a in range(k):
                    for b in range(nxt.shape[1]):
                        self.co_next[l] += np.bincount(r[:, a] * E + nxt[:, b], minlength=E * E).reshape(E, E)
            keys.append((l * E + r) * V + ids[:, None])  # (M, k)
            q = np.clip(np.round(g * GATE_LEVELS), 0, GATE_LEVELS).astype(np.int64)
            vals.append((q << (POS_BITS + PASSAGE_BITS)) | where[:, None])
        self.tok.add(np.concatenate(keys), np.concatenate(vals))

    # -- resuming ---------------------------------------------------------------------------

    ARRAYS = ("count", "gate_sum", "cat_count", "cat_tokens", "token_total", "co", "co_next")

    def save(self, path: Path, meta: dict) -> None:
        """Everything, atomically (temp file + rename), with ``meta`` to check on resume."""
        import json

        self.tok.compact()
        tmp = path.with_name(path.name + ".tmp.npz")
        np.savez(tmp, **{a: getattr(self, a) for a in self.ARRAYS}, tok_keys=self.tok.keys,
                 tok_counts=self.tok.counts, tok_best=self.tok.best,
                 meta=np.frombuffer(json.dumps({**meta, "tokens": self.tokens, "passages_done": self.passages_done,
                                                "categories": self.categories}).encode(), np.uint8))
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path, L: int, E: int, k: int, V: int, meta: dict) -> Recorder | None:
        """The recorder saved at ``path`` if it was made with the same ``meta``; else None."""
        import json

        try:
            with np.load(path) as z:
                saved = json.loads(bytes(z["meta"]).decode())
                if any(saved.get(key) != value for key, value in meta.items()):
                    return None
                r = cls(L, E, k, V, saved["categories"])
                for a in cls.ARRAYS:
                    if z[a].shape != getattr(r, a).shape:
                        return None
                    setattr(r, a, z[a])
                r.tok.keys, r.tok.counts, r.tok.best = z["tok_keys"], z["tok_counts"], z["tok_best"]
        except (OSError, ValueError, KeyError):
            return None
        r.tokens, r.passages_done = int(saved["tokens"]), int(saved["passages_done"])
        return r


def occurrence(code: int) -> tuple[float, int, int]:
    """A best-occurrence code -> (gate weight, passage index, token position)."""
    gate = (code >> (POS_BITS + PASSAGE_BITS)) / GATE_LEVELS
    return gate, (code >> POS_BITS) & ((1 << PASSAGE_BITS) - 1), code & ((1 << POS_BITS) - 1)


def tokenize(model, passages: list[Passage], max_tokens: int) -> list[list[int]]:
    """Each passage's token ids (raw text, no chat template), cut to ``max_tokens``."""
    limit = min(max_tokens, model.engine.max_context, 1 << POS_BITS)
    if len(passages) >= 1 << PASSAGE_BITS:
        raise InvalidRequestError(f"--corpus: at most {(1 << PASSAGE_BITS) - 1} passages")
    return [model.tokenizer.encode(p.text)[:limit] for p in passages]


def measure(model, passages: list[Passage], token_ids: list[list[int]], recorder: Recorder, *,
            batch_tokens: int = 1024, on_step: Callable[[Recorder], None] | None = None,
            checkpoint: Callable[[Recorder], None] | None = None, checkpoint_seconds: float = 30.0) -> Recorder:
    """Run passages[recorder.passages_done:] through the model, adding to ``recorder``.

    ``on_step(recorder)`` after each forward pass (progress); ``checkpoint(recorder)``
    every ``checkpoint_seconds`` and at the end. The MoE layers' routing counts (heat,
    and a converted model's learned usage) are restored afterwards."""
    engine = model.engine
    moes = engine.model.moe_layers
    if not moes:
        raise InvalidRequestError(f"{model.path}: this model has no MoE layers: there are no experts to map")
    heat = [np.array(m.counts, copy=True) for m in moes]
    cat_index = {c: i for i, c in enumerate(recorder.categories)}
    caches = []
    last_save = time.monotonic()
    try:
        i = recorder.passages_done
        while i < len(passages):
            batch, n = [], 0
            while i < len(passages) and (not batch or (n + len(token_ids[i]) <= batch_tokens
                                                         and len(batch) < MAX_PASSAGES_PER_STEP)):
                if token_ids[i]:
                    batch.append(i)
                    n += len(token_ids[i])
                i += 1
            if batch:
                while len(caches) < len(batch):
                    caches.append(engine.new_cache())
                entries = []
                for c, j in zip(caches, batch):
                    c.truncate(0)
                    entries.append((c, token_ids[j]))
                engine.step(entries)
                stats = engine.last
                ids = np.concatenate([np.asarray(token_ids[j], np.int64) for j in batch])
                passage = np.concatenate([np.full(len(token_ids[j]), j, np.int64) for j in batch])
                pos = np.concatenate([np.arange(len(token_ids[j]), dtype=np.int64) for j in batch])
                cat = np.concatenate([np.full(len(token_ids[j]), cat_index.get(passages[j].category, -1), np.int64)
                                      for j in batch])
                recorder.add(stats.routed, stats.gates, ids, passage, pos, cat)
            recorder.passages_done = i
            if on_step is not None:
                on_step(recorder)
            if checkpoint is not None and time.monotonic() - last_save > checkpoint_seconds:
                checkpoint(recorder)
                last_save = time.monotonic()
    finally:
        for m, h in zip(moes, heat):
            m.counts[:] = h
    return recorder
