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
from coli.kv.dtype import KV_DTYPES, kv_dtype
from coli.models.base import Batch, DecoderLM, RunState
from coli.threads import ThreadGovernor, compute_threads, enabled


def cpu_quota(root: str = "/sys/fs/cgroup") -> int | None:
    """The whole CPUs the cgroup's CPU quota grants (rounded up), None without a quota.

    A container started with ``--cpus=2`` on a 32-core host still sees 32 CPUs in its
    affinity mask, but the kernel throttles it to two cores' worth of time: 32 kernel threads
    would wait for each other at every barrier. cgroup v2 (``cpu.max``: "quota period" or
    "max period") and v1 (``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``, -1: none)."""
    def read(*parts):
        try:
            with open(os.path.join(root, *parts)) as f:
                return f.read().split()
        except (OSError, UnicodeDecodeError):
            return None

    pair = read("cpu.max")
    if pair is None:
        for d in ("cpu", "cpu,cpuacct"):
            q, p = read(d, "cpu.cfs_quota_us"), read(d, "cpu.cfs_period_us")
            if q and p:
                pair = [q[0], p[0]]
                break
    if not pair or len(pair) < 2 or pair[0] == "max":
        return None
    try:
        quota, period = int(pair[0]), int(pair[1])
    except ValueError:
        return None
    if quota <= 0 or period <= 0:
        return None
    return max(1, -(-quota // period))


def default_threads() -> int:
    """COLI_THREADS if set, else the cores this process may run on (its affinity mask, and
    no more than its cgroup's CPU quota grants)."""
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
        n = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1
    quota = cpu_quota()
    return min(n, quota) if quota else n


def available_memory() -> int | None:
    """MemAvailable from /proc/meminfo, in bytes (None where there is none)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _zeros_aligned(shape: tuple[int, ...], dtype=np.float32) -> np.ndarray:
    """An array of zeros starting on a 64-byte boundary (NumPy's own large arrays start 16
    bytes past one). With rows a multiple of 64 bytes wide, every head's K / V row is then
    cache-line aligned, which the attention kernel reads fastest."""
    dtype = np.dtype(dtype)
    n = int(np.prod(shape)) * dtype.itemsize
    raw = np.zeros(n + 64, dtype=np.uint8)
    off = -raw.ctypes.data % 64
    return raw[off:off + n].view(dtype).reshape(shape)


class KVCache:
    """One sequence's keys and values for every layer.

    k: (layers, capacity, n_kv_heads * head_dim), v likewise with the value width, both
    ``dtype`` ("f16", the default, or "f32": see KV_DTYPES). Capacity doubles when a step
    needs more room (copying the filled part), up to the engine's context limit; ``tokens``
    is the history the cache holds."""

    def __init__(self, n_layers: int, k_width: int, v_width: int, capacity: int = 64, dtype: str | None = None):
        self.n_layers, self.k_width, self.v_width = n_layers, k_width, v_width
        self.dtype = kv_dtype(dtype)
        self.k = _zeros_aligned((n_layers, capacity, k_width), KV_DTYPES[self.dtype])  # (L, cap, kw)
        self.v = _zeros_aligned((n_layers, capacity, v_width), KV_DTYPES[self.dtype])  # (L, cap, vw)
        self.tokens: list[int] = []
        self._ptrs: tuple = (None, None, None, None)  # k, v and their layer_ptrs()

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
        k = _zeros_aligned((self.n_layers, cap, self.k_width), self.k.dtype)
        v = _zeros_aligned((self.n_layers, cap, self.v_width), self.v.dtype)
        k[:, :filled] = self.k[:, :filled]
        v[:, :filled] = self.v[:, :filled]
        self.k, self.v = k, v

    def truncate(self, n: int) -> None:
        """Forget everything after the first n tokens (their KV is overwritten later)."""
        del self.tokens[n:]

    def layer_ptrs(self) -> tuple[np.ndarray, np.ndarray]:
        """Addresses of each layer's (capacity, width) block: two (L, 1) int64 arrays,
        computed again only when k or v is a new array (the cache grew)."""
        k, v, kp, vp = self._ptrs
        if k is not self.k or v is not self.v:
            layers = np.arange(self.n_layers, dtype=np.int64)[:, None]
            kp, vp = self.k.ctypes.data + layers * self.k.strides[0], self.v.ctypes.data + layers * self.v.strides[0]
            self._ptrs = (self.k, self.v, kp, vp)
        return kp, vp

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    @property
    def half(self) -> bool:
        return self.dtype == "f16"


@dataclass
class StepStats:
    """What one step did and where its time went (seconds)."""

    tokens: int = 0
    seconds: float = 0.0
    attention: float = 0.0
    expert_matmul: float = 0.0  # MoE layers minus the time spent waiting for expert reads
    dense_mlp: float = 0.0
    lm_head: float = 0.0
    io_wait: float = 0.0  # waiting for experts to arrive from disk
    disk: float = 0.0  # disk service time of expert reads (overlaps compute)
    experts_needed: int = 0
    experts_hit: int = 0  # resident, or already being read by a prefetch
    bytes_read: int = 0
    routed: list[np.ndarray] = field(default_factory=list)  # per MoE layer: (M, k) expert ids
    gates: list[np.ndarray] = field(default_factory=list)  # per MoE layer: (M, k) their gate weights

    @property
    def other(self) -> float:
        return max(0.0, self.seconds - self.attention - self.expert_matmul - self.dense_mlp - self.lm_head
                   - self.io_wait)

    @property
    def hit_rate(self) -> float:
        return self.experts_hit / self.experts_needed if self.experts_needed else 1.0

    def __iadd__(self, o: "StepStats") -> "StepStats":
        for f in ("tokens", "seconds", "attention", "expert_matmul", "dense_mlp", "lm_head", "io_wait", "disk",
                  "experts_needed", "experts_hit", "bytes_read"):
            setattr(self, f, getattr(self, f) + getattr(o, f))
        self.routed, self.gates = o.routed, o.gates
        return self


class Engine:
    """Owns a built model and its run state; ``step`` runs one batched forward pass."""

    def __init__(self, model: DecoderLM, *, threads: int | None = None, max_context: int | None = None,
                 weights=None, adaptive_threads: bool | None = None, kv_cache_dtype: str | None = None):
        self.model = model
        self.weights = weights
        self.cfg = model.cfg
        self.threads = threads or default_threads()  # the most the kernels use
        K.set_num_threads(self.threads)
        # fewer while the machine is too busy for all of them (coli/threads.py)
        self.governor = ThreadGovernor(self.threads, K.set_num_threads) \
            if self.threads > 1 and (enabled() if adaptive_threads is None else adaptive_threads) else None
        self.max_context = max_context or self.cfg.max_position_embeddings
        self.run_state = RunState()
        attn = model.layers[0].attn
        self._kw, self._vw = attn.k_width, attn.v_width
        self.kv_cache_dtype = kv_dtype(kv_cache_dtype)  # what every cache of this engine stores
        if self.kv_cache_dtype == "f16" and not model.f16_kv_ok():
            self.kv_cache_dtype = "f32"  # heads wider than the f16 attention stages (none known)
        self.last = StepStats()
        self.totals = StepStats()
        self._expert_bytes = sum(
            sum(q.nbytes for q in m.table.get(e)) for m in model.moe_layers if m.table is not None
            for e in range(m.E)) if weights is None or getattr(weights, "store", None) is None else 0
        self._dense_bytes = _dense_bytes(model)

    @property
    def threads_in_use(self) -> int:
        """The kernel threads the next decode step uses: ``threads``, or fewer while the
        governor finds the machine too busy for all of them (or tries fewer; a prefill chunk
        runs with the count it has kept)."""
        return self.governor.active if self.governor is not None else self.threads

    def new_cache(self, capacity: int = 64) -> KVCache:
        return KVCache(self.cfg.num_hidden_layers, self._kw, self._vw, capacity, self.kv_cache_dtype)

    def step(self, entries: list[tuple[KVCache, list[int]]], all_logits: bool | list[bool] = False) -> np.ndarray:
        """Append entries' tokens to their caches in one forward pass.

        Returns float32 logits: one row per entry (its last token), or one per token
        when all_logits (a list: per entry, in order). The array is the engine's buffer:
        valid until the next step."""
        for cache, toks in entries:
            if not toks:
                raise InvalidRequestError("a step entry has no tokens")
            if cache.dtype != self.kv_cache_dtype or (cache.k_width, cache.v_width) != (self._kw, self._vw):
                raise ValueError(f"a {cache.dtype} cache of widths ({cache.k_width}, {cache.v_width}) given to an "
                                 f"engine of {self.kv_cache_dtype} caches ({self._kw}, {self._vw}): use new_cache()")
            start = len(cache)
            if start + len(toks) > self.max_context:
                raise InvalidRequestError(
                    f"context_length_exceeded: {start + len(toks)} tokens do not fit the context of {self.max_context}"
                )
            cache.reserve(start + len(toks))
        if len(entries) == 1 and len(entries[0][1]) == 1:  # one sequence decoding: the common step
            batch, rows = self._one_token(*entries[0])
        else:
            batch, rows = self._batch(entries, all_logits)
        n = len(batch.ids)
        gov = self.governor
        want = gov.for_step(n) if gov is not None else None
        if want is not None and K.get_num_threads() != want:  # (or another engine in this process set its own)
            K.set_num_threads(want)
        compute_threads.note(want or K.get_num_threads())
        ph0, io0 = dict(self.model.phases), self.io_stats()
        t0 = time.perf_counter()
        logits = self.model.forward(batch, self.run_state, rows)
        wall = time.perf_counter() - t0
        if gov is not None:
            gov.observe(n, wall)
        for cache, toks in entries:
            cache.tokens.extend(int(t) for t in toks)
        ph, io1 = self.model.phases, self.io_stats()
        wait = io1.io_wait_s - io0.io_wait_s if io1 else 0.0
        self.last = StepStats(
            tokens=n, seconds=wall, attention=ph["attention"] - ph0["attention"],
            expert_matmul=max(0.0, ph["moe"] - ph0["moe"] - wait), dense_mlp=ph["mlp"] - ph0["mlp"],
            lm_head=ph["lm_head"] - ph0["lm_head"], io_wait=wait,
            disk=io1.disk_s - io0.disk_s if io1 else 0.0,
            experts_needed=io1.needed - io0.needed if io1 else 0,
            experts_hit=(io1.hits + io1.prefetch_hits - io0.hits - io0.prefetch_hits) if io1 else 0,
            bytes_read=io1.bytes_read - io0.bytes_read if io1 else 0,
            routed=[m.last for m in self.model.moe_layers], gates=[m.last_weights for m in self.model.moe_layers])
        if not io1:  # resident experts: every needed expert is a hit
            need = sum(m.used for m in self.model.moe_layers)
            self.last.experts_needed = self.last.experts_hit = need
        self.totals += self.last
        return logits

    def _batch(self, entries: list[tuple[KVCache, list[int]]], all_logits) -> tuple[Batch, np.ndarray]:
        """The Batch of a step and the rows whose logits it returns."""
        V = self.cfg.vocab_size
        ids, pos, kp, vp, rows = [], [], [], [], []
        n = 0
        for e, (cache, toks) in enumerate(entries):
            start, T = len(cache), len(toks)
            every = all_logits if isinstance(all_logits, bool) else all_logits[e]
            kl, vl = cache.layer_ptrs()
            ids.append(np.asarray(toks, dtype=np.int64))
            pos.append(np.arange(start, start + T, dtype=np.int32))
            kp.append(np.repeat(kl, T, axis=1))  # (L, T)
            vp.append(np.repeat(vl, T, axis=1))
            n += T
            rows.append(np.arange(n - T, n) if every else np.array([n - 1]))
        flat = np.concatenate(ids)
        if flat.min() < 0 or flat.max() >= V:
            bad = int(flat[(flat < 0) | (flat >= V)][0])
            raise InvalidRequestError(f"token id {bad} is outside the vocabulary (0..{V - 1})")
        batch = Batch(ids=flat.astype(np.int32), pos=np.concatenate(pos),
                      kptr=np.ascontiguousarray(np.concatenate(kp, axis=1)),
                      vptr=np.ascontiguousarray(np.concatenate(vp, axis=1)), half=self.kv_cache_dtype == "f16")
        return batch, np.concatenate(rows).astype(np.intp)

    def _one_token(self, cache: KVCache, toks: list[int]) -> tuple[Batch, np.ndarray]:
        """``_batch`` of one entry with one token, without the concatenations."""
        t, V = int(toks[0]), self.cfg.vocab_size
        if not 0 <= t < V:
            raise InvalidRequestError(f"token id {t} is outside the vocabulary (0..{V - 1})")
        kp, vp = cache.layer_ptrs()  # (L, 1)
        return Batch(ids=np.array([t], np.int32), pos=np.array([len(cache)], np.int32), kptr=kp, vptr=vp,
                     half=cache.half), _ROW0

    def io_stats(self):
        """The expert store's cumulative counters (None when experts are resident)."""
        store = getattr(self.weights, "store", None)
        return store.stats.snapshot() if store is not None and not store.resident else None

    def heat(self) -> np.ndarray:
        """(MoE layers, experts) tokens routed to each expert, including stored history."""
        moes = self.model.moe_layers
        return np.stack([m.counts for m in moes]) if moes else np.zeros((0, 0), np.int64)

    def resident_bytes(self) -> dict[str, int]:
        """Bytes of experts by tier: pinned, cached (in RAM), disk; plus the dense part."""
        store = getattr(self.weights, "store", None)
        tiers = store.resident_bytes() if store is not None else {"pinned": 0, "cached": self._expert_bytes, "disk": 0}
        return {**tiers, "dense": self._dense_bytes}


def release_threads() -> None:
    """Retire the calling thread's OpenMP workers (the next kernel call starts fresh ones),
    so that another thread computing next is the process's only team (coli.threads.ComputeThreads)."""
    K.release_threads()
    compute_threads.released()


_ROW0 = np.zeros(1, np.intp)  # the logit row of a one-token step


def _dense_bytes(model: DecoderLM) -> int:
    """Bytes of every weight that is not an expert (attention, dense MLPs, norms, embeddings, head)."""
    seen, total = set(), 0

    def add(a):
        nonlocal total
        if a is not None and id(a) not in seen:
            seen.add(id(a))
            total += a.nbytes

    for obj in [model, *model.layers, *(l.attn for l in model.layers), *(l.mlp for l in model.layers)]:
        for v in vars(obj).values():
            if isinstance(v, np.ndarray):
                add(v)
            elif hasattr(v, "mat"):  # Linear
                add(v.mat)  # (QMatrix.nbytes: its arrays, or its tiles when packed)
                add(getattr(v, "bias", None))
            elif isinstance(v, K.QMatrix):
                add(v)
    return total
