"""The engine: a built model, its run state, and per-sequence KV caches.

``Engine.step(entries)`` is one forward pass over a flat batch: each entry is a
sequence (its ``KVCache``) and the tokens to append to it — one token for a
decoding sequence, a chunk of a prompt for a prefilling one. Keys and values of
the new tokens are written into each sequence's cache, every token attends over
its own sequence, and the logits of the requested rows come back. Weights are
read once per step for all the tokens in it.

This module is the only importer of ``coli._engine``'s kernels outside
``coli.models``; it knows nothing of HTTP, JSON or terminals.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import numpy as np

from coli._engine import kernels as K
from coli.errors import InvalidRequestError
from coli.models.base import Batch, DecoderLM, RunState


def default_threads() -> int:
    """COLI_THREADS if set, else the cores this process may run on."""
    env = os.environ.get("COLI_THREADS")
    if env:
        try:
            n = int(env)
        except ValueError:
            raise InvalidRequestError(f"COLI_THREADS={env!r} is not a whole number") from None
        if n < 1:
            raise InvalidRequestError(f"COLI_THREADS={env!r} must be at least 1")
        return n
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


class KVCache:
    """One sequence's keys and values for every layer.

    k: (layers, capacity, n_kv_heads * head_dim) float32, v likewise with the value
    width. Capacity doubles when a step needs more room (copying the filled part),
    up to the engine's context limit; ``tokens`` is the history the cache holds."""

    def __init__(self, n_layers: int, k_width: int, v_width: int, capacity: int = 64):
        self.n_layers, self.k_width, self.v_width = n_layers, k_width, v_width
        self.k = np.zeros((n_layers, capacity, k_width), dtype=np.float32)  # (L, cap, kw)
        self.v = np.zeros((n_layers, capacity, v_width), dtype=np.float32)  # (L, cap, vw)
        self.tokens: list[int] = []

    @property
    def capacity(self) -> int:
        return self.k.shape[1]

    def __len__(self) -> int:
        return len(self.tokens)

    def reserve(self, n: int) -> None:
        if n <= self.capacity:
            return
        cap = self.capacity
        while cap < n:
            cap *= 2
        filled = len(self.tokens)
        k = np.zeros((self.n_layers, cap, self.k_width), dtype=np.float32)
        v = np.zeros((self.n_layers, cap, self.v_width), dtype=np.float32)
        k[:, :filled] = self.k[:, :filled]
        v[:, :filled] = self.v[:, :filled]
        self.k, self.v = k, v

    def truncate(self, n: int) -> None:
        """Forget everything after the first n tokens (their KV is overwritten later)."""
        del self.tokens[n:]

    def layer_ptrs(self) -> tuple[np.ndarray, np.ndarray]:
        """Addresses of each layer's (capacity, width) block: two (L,) int64 arrays."""
        kb, vb = self.k.ctypes.data, self.v.ctypes.data
        layers = np.arange(self.n_layers, dtype=np.int64)
        return (kb + layers * self.k.strides[0], vb + layers * self.v.strides[0])

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


@dataclass
class StepStats:
    tokens: int = 0
    seconds: float = 0.0
    routed: list[np.ndarray] = field(default_factory=list)  # per MoE layer: (M, k) expert ids


class Engine:
    """Owns a built model and its run state; ``step`` runs one batched forward pass."""

    def __init__(self, model: DecoderLM, *, threads: int | None = None, max_context: int | None = None):
        self.model = model
        self.cfg = model.cfg
        self.threads = threads or default_threads()
        K.set_num_threads(self.threads)
        self.max_context = max_context or self.cfg.max_position_embeddings
        self.run_state = RunState()
        attn = model.layers[0].attn
        self._kw, self._vw = attn.nkv * attn.hd, attn.nkv * attn.hd
        self.last = StepStats()

    def new_cache(self, capacity: int = 64) -> KVCache:
        return KVCache(self.cfg.num_hidden_layers, self._kw, self._vw, capacity)

    def step(self, entries: list[tuple[KVCache, list[int]]], all_logits: bool = False) -> np.ndarray:
        """Append entries' tokens to their caches in one forward pass.

        Returns float32 logits: one row per entry (its last token), or one per token
        when all_logits. The array is the engine's buffer: valid until the next step."""
        V = self.cfg.vocab_size
        ids, pos, kp, vp, rows = [], [], [], [], []
        n = 0
        for cache, toks in entries:
            if not toks:
                raise InvalidRequestError("a step entry has no tokens")
            start = len(cache)
            if start + len(toks) > self.max_context:
                raise InvalidRequestError(
                    f"context_length_exceeded: {start + len(toks)} tokens do not fit the context of {self.max_context}"
                )
            cache.reserve(start + len(toks))
            kl, vl = cache.layer_ptrs()
            ids.append(np.asarray(toks, dtype=np.int64))
            pos.append(np.arange(start, start + len(toks), dtype=np.int32))
            kp.append(np.repeat(kl[:, None], len(toks), axis=1))  # (L, T)
            vp.append(np.repeat(vl[:, None], len(toks), axis=1))
            n += len(toks)
            rows.append(np.arange(n - len(toks), n) if all_logits else np.array([n - 1]))
        flat = np.concatenate(ids)
        if flat.min() < 0 or flat.max() >= V:
            bad = int(flat[(flat < 0) | (flat >= V)][0])
            raise InvalidRequestError(f"token id {bad} is outside the vocabulary (0..{V - 1})")
        batch = Batch(ids=flat.astype(np.int32), pos=np.concatenate(pos),
                      kptr=np.ascontiguousarray(np.concatenate(kp, axis=1)),
                      vptr=np.ascontiguousarray(np.concatenate(vp, axis=1)))
        t0 = time.perf_counter()
        logits = self.model.forward(batch, self.run_state, np.concatenate(rows).astype(np.intp))
        for cache, toks in entries:
            cache.tokens.extend(int(t) for t in toks)
        self.last = StepStats(tokens=n, seconds=time.perf_counter() - t0,
                              routed=[m.last for m in self.model.moe_layers])
        return logits
