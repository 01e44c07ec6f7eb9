"""The expert store: MoE experts resident in RAM, or streamed from experts.bin.

When every expert fits the RAM budget, experts.bin is read once at load (and its
checksums verified) and every expert is resident. Otherwise each MoE layer gets a
cache of ``slots`` (each one expert's bytes, aligned for direct I/O):

- a **pinned** hot set, chosen at start from the routing history in ``.coli_usage``
  and never evicted (``pin`` bytes in all);
- the other slots hold recently used experts (LRU);
- experts a step needs are read with one ``pread`` each, once per step however many
  tokens chose them (batch-union); when a step needs more experts than a layer has
  slots, they are computed in groups (see MoE in coli/models/base.py);
- the previous MoE layer guesses this layer's experts from its own input and starts
  reading them on a background thread (``prefetch``); a wrong guess only costs a
  slot, never a wait: demand reads go straight to the disk from the caller.

Reads bypass the page cache (O_DIRECT, or posix_fadvise DONTNEED where direct I/O
is not available) unless ``io="buffered"``, so a benchmark measures the disk.
Placement never changes results: a layer computes the same experts in the same
order whatever is resident.
"""
from __future__ import annotations

import os
import sys
import threading
import time
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from coli._engine import kernels as K
from coli.engine import available_memory
from coli.errors import ModelLoadError
from coli.experts.usage import USAGE_FILE, Usage, state_dir
from coli.weights.packing import huge_buffer
from coli.weights.source import ResidentExperts

PAGE = 4096


@dataclass
class StoreStats:
    """Cumulative counters; take differences between two snapshots for a step or a turn."""

    needed: int = 0  # (layer, expert) pairs steps needed
    hits: int = 0  # ... that were resident and ready
    prefetch_hits: int = 0  # ... that a prefetch had started reading
    misses: int = 0  # ... read on demand
    bytes_read: int = 0
    io_wait_s: float = 0.0  # time the compute thread waited for expert reads
    disk_s: float = 0.0  # time reads took on the disk (overlaps compute)
    prefetch_issued: int = 0

    def snapshot(self) -> "StoreStats":
        return StoreStats(**self.__dict__)


def aligned_buffer(nbytes: int) -> np.ndarray:
    raw = np.empty(nbytes + PAGE, dtype=np.uint8)
    off = (-raw.ctypes.data) % PAGE
    return raw[off : off + nbytes]


class ExpertStore:
    """All experts of one converted model: residency policy, the file, I/O and stats."""

    def __init__(self, model_dir: Path, manifest: dict, *, ram_budget: int | None = None, pin: int | None = None,
                 io: str = "direct", verify: bool = True, prefetch: bool = False,
                 pin_prior: list[np.ndarray] | None = None):
        ex = manifest["experts"]
        self.dir, self.manifest = model_dir, manifest
        self.path = model_dir / ex["file"]
        self.stride, self.parts, self.crcs = ex["stride"], ex["parts"], ex["crc32"]
        self.layers_info = ex["layers"]
        self.total_bytes = ex["bytes"]
        if ram_budget is None:
            ram_budget = max(0, (available_memory() or 4 << 30) - manifest["dense"]["bytes"] - (512 << 20))
        self.ram_budget = ram_budget
        self.resident = self.total_bytes <= ram_budget
        self.verify, self.io, self.prefetch_enabled = verify, io, prefetch
        self.stats = StoreStats()
        self.layers: dict[str, ResidentExperts | StreamedExperts] = {}
        self._lock = threading.Lock()
        fp = manifest["source_fingerprint"]
        self.usage = Usage(state_dir(model_dir, fp) / USAGE_FILE, fp,
                           {name: info["count"] for name, info in self.layers_info.items()})
        self.pin_bytes = (ram_budget // 2 if pin is None else pin) if not self.resident else 0
        self.pin_prior = pin_prior  # per MoE layer: routing counts from the expert atlas (--pin auto)
        self._all: np.ndarray | None = None
        self._pool: ThreadPoolExecutor | None = None
        if self.resident:
            self._read_all()
        elif self.layers_info:
            self._open()

    # ---- I/O
    def _read_all(self) -> None:
        self._all = huge_buffer(self.total_bytes)  # (pack_experts packs them in place)
        n = 0
        if self.total_bytes:
            view = memoryview(self._all)
            with open(self.path, "rb", buffering=0) as f:
                while n < self.total_bytes:  # one read returns at most ~2 GiB
                    got = f.readinto(view[n:])
                    if not got:
                        break
                    n += got
            if n != self.total_bytes:
                raise ModelLoadError(f"{self.path}: truncated ({n} of {self.total_bytes} bytes); convert the model again")
        if self.verify:
            for i, crc in enumerate(self.crcs):
                if zlib.crc32(self._all[i * self.stride : (i + 1) * self.stride]) != crc:
                    raise ModelLoadError(f"{self.path}: checksum mismatch in expert {i} (the file was altered or "
                                         "damaged); convert the model again")

    def _open(self) -> None:
        flags = os.O_RDONLY
        self.direct = False
        if self.io == "direct" and hasattr(os, "O_DIRECT"):
            try:
                self.fd = os.open(self.path, flags | os.O_DIRECT)
                self.direct = True
            except OSError:  # e.g. tmpfs: fall back to buffered reads + dropping the pages
                self.fd = os.open(self.path, flags)
        else:
            self.fd = os.open(self.path, flags)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="coli-expert-io")

    def read_into(self, index: int, buf: np.ndarray) -> None:
        """Read expert ``index`` of experts.bin into ``buf`` (one pread; GIL released)."""
        t0 = time.perf_counter()
        off = index * self.stride
        n = os.preadv(self.fd, [memoryview(buf)], off)
        if n != self.stride:
            raise ModelLoadError(f"{self.path}: short read of expert {index} ({n} of {self.stride} bytes); "
                                 "the file is truncated — convert the model again")
        if not self.direct and self.io != "buffered" and hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self.fd, off, self.stride, os.POSIX_FADV_DONTNEED)
        if self.verify and zlib.crc32(buf) != self.crcs[index]:
            raise ModelLoadError(f"{self.path}: checksum mismatch in expert {index} (the file was altered or "
                                 "damaged); convert the model again")
        with self._lock:
            self.stats.bytes_read += self.stride
            self.stats.disk_s += time.perf_counter() - t0

    def submit(self, index: int, buf: np.ndarray) -> Future:
        return self._pool.submit(self.read_into, index, buf)

    def expert_mats(self, blob: np.ndarray) -> tuple[K.QMatrix, K.QMatrix, K.QMatrix]:
        from coli.weights.converted import matrix_view

        return tuple(matrix_view(p, lambda span, dt: blob[span[0] : span[0] + span[1]].view(dt)) for p in self.parts)

    # ---- layers
    def layer(self, name: str, E: int, H: int, I: int, k: int):
        info = self.layers_info.get(name)
        if info is None or info["count"] != E:
            raise ModelLoadError(f"{self.dir}: experts of {name} missing from the manifest; convert the model again")
        fmt = K.FORMATS[self.manifest["quant"]]
        if self.resident:
            table = K.ExpertTable(E, H, I, fmt)
            for e in range(E):
                i = info["first"] + e
                table.set(e, *self.expert_mats(self._all[i * self.stride : (i + 1) * self.stride]))
            first = info["first"]
            src = ResidentExperts(table, self._all[first * self.stride : (first + E) * self.stride])
        else:
            n_moe = len(self.layers_info)
            slots = min(E, max(k, (self.ram_budget // self.stride) // n_moe))
            src = StreamedExperts(self, name, info["first"], E, H, I, k, slots, fmt)
        src.counts = self.usage.counts[name]
        self.layers[name] = src
        return src

    def finish(self) -> None:
        """After every layer exists: pin the hot set learned from .coli_usage."""
        if self.resident or not self.pin_bytes:
            return
        streamed = [(n, s) for n, s in self.layers.items() if isinstance(s, StreamedExperts)]
        score = self._pin_scores(streamed)
        ranked = sorted(((score[name][e], name, e) for name, s in streamed for e in range(len(s.counts))
                         if score[name][e] > 0), reverse=True)
        budget = self.pin_bytes
        for _, name, e in ranked:
            if budget < self.stride:
                break
            if self.layers[name].pin(e):
                budget -= self.stride

    def _pin_scores(self, streamed) -> dict[str, np.ndarray]:
        """Per layer: each expert's share of the routings in .coli_usage, plus its share in the
        expert atlas with --pin auto (coli.atlas.pinning)."""
        used = sum(int(s.counts.sum()) for _, s in streamed)
        score = {name: s.counts / used if used else np.zeros(len(s.counts)) for name, s in streamed}
        if self.pin_prior is not None:
            order = list(self.layers)
            total = sum(float(np.sum(p)) for p in self.pin_prior) or 1.0
            for name, s in streamed:
                i = order.index(name)
                if i < len(self.pin_prior) and len(self.pin_prior[i]) == len(s.counts):
                    score[name] = score[name] + np.asarray(self.pin_prior[i], np.float64) / total
        return score

    def resident_bytes(self) -> dict[str, int]:
        if self.resident:
            return {"pinned": 0, "cached": self.total_bytes, "disk": 0}
        pinned = sum(int(s.pinned.sum()) for s in self.layers.values()) * self.stride
        cached = sum(int((s.holder >= 0).sum()) for s in self.layers.values()) * self.stride - pinned
        return {"pinned": pinned, "cached": cached, "disk": self.total_bytes - pinned - cached}

    def close(self) -> None:
        self.usage.save()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            os.close(self.fd)
            self._pool = None


class StreamedExperts:
    """One MoE layer's cache of expert slots over experts.bin."""

    streamed = True

    def __init__(self, store: ExpertStore, name: str, first: int, E: int, H: int, I: int, k: int, slots: int,
                 fmt: int):
        self.store, self.name, self.first, self.E, self.k = store, name, first, E, k
        self.table = K.ExpertTable(E, H, I, fmt)
        self.bufs = [aligned_buffer(store.stride) for _ in range(slots)]
        self.mats = [store.expert_mats(b) for b in self.bufs]
        self.slot_of = np.full(E, -1, dtype=np.int32)  # expert -> slot, -1 when on disk
        self.holder = np.full(slots, -1, dtype=np.int32)  # slot -> expert
        self.pinned = np.zeros(slots, dtype=bool)
        self.stamp = np.zeros(slots, dtype=np.int64)  # last use, for LRU
        self.pending: dict[int, Future] = {}  # slot -> read in flight
        self.prefetched: set[int] = set()  # experts whose slot a prefetch filled
        self.started: set[int] = set()  # missed experts whose read start() began ahead of their group
        self._clock = 0  # steps seen (groups calls)

    @property
    def slots(self) -> int:
        return len(self.bufs)

    def _victim(self, keep: np.ndarray, allow_pending: bool, spare_recent: bool = False) -> int:
        """The slot to fill next: an empty one, else the least recently used one that is not
        pinned and holds none of ``keep``; -1 if there is none. ``spare_recent`` also spares
        the experts of the latest step (a guess may only take a slot nobody used then)."""
        ok = ~self.pinned & ~np.isin(self.holder, keep)
        if spare_recent:
            ok &= (self.holder < 0) | (self.stamp < self._clock)
        if not allow_pending and self.pending:
            ok[list(self.pending)] = False
        cand = np.flatnonzero(ok)
        if not len(cand):
            return -1
        empty = cand[self.holder[cand] < 0]
        return int(empty[0]) if len(empty) else int(cand[np.argmin(self.stamp[cand])])

    def _assign(self, e: int, s: int) -> None:
        old = self.holder[s]
        if old >= 0:
            self.slot_of[old] = -1
            self.prefetched.discard(int(old))
            self.started.discard(int(old))
        self.holder[s], self.slot_of[e] = e, s

    def _settle(self, s: int) -> None:
        """Wait for slot s's read if one is in flight, then publish it in the table."""
        fut = self.pending.pop(s, None)
        if fut is not None:
            t0 = time.perf_counter()
            fut.result()
            self.store.stats.io_wait_s += time.perf_counter() - t0
            self.table.set(int(self.holder[s]), *self.mats[s])

    def pin(self, e: int) -> bool:
        """Read expert e now and keep it for good (at most slots - k pinned per layer)."""
        if self.pinned.sum() >= self.slots - self.k or self.slot_of[e] >= 0:
            return False
        s = self._victim(np.array([e]), allow_pending=False)
        if s < 0:
            return False
        self._assign(e, s)
        self.store.read_into(self.first + e, self.bufs[s])
        self.table.set(e, *self.mats[s])
        self.pinned[s] = True
        return True

    def groups(self, idx: np.ndarray) -> list[np.ndarray]:
        """The step's experts split into groups that fit this layer's unpinned slots:
        the resident ones, then the missing ones that fit beside them, then the rest in
        chunks of the unpinned slots; each group is (E,) uint8 with 1 for its experts."""
        need = np.unique(idx)
        self._clock += 1  # one tick per step: every expert a step uses gets the same stamp
        st = self.store.stats
        st.needed += len(need)
        here = self.slot_of[need] >= 0
        resident, missing = need[here], need[~here]
        room = self.slots - int(self.pinned.sum())
        used = int((~self.pinned[self.slot_of[resident]]).sum()) if len(resident) else 0
        first = max(room - used, 0)
        # the resident experts form their own group, so that the reads of the first missing
        # ones (which fit beside them) can run while they compute (see start)
        chunks = [resident, missing[:first]]
        chunks += [missing[i : i + room] for i in range(first, len(missing), room)]
        masks = []
        for c in chunks:
            if not len(c):
                continue
            m = np.zeros(self.E, dtype=np.uint8)
            m[c] = 1
            masks.append(m)
        return masks

    def load(self, active: np.ndarray) -> None:
        """Make every expert marked in ``active`` resident, reading what is missing."""
        st = self.store.stats
        group = np.flatnonzero(active)
        for e in group:
            s = self.slot_of[e]
            if s >= 0:
                if s in self.pending:
                    self._settle(s)
                if e in self.started:  # a miss whose read start() overlapped with compute
                    st.misses += 1
                    self.started.discard(int(e))
                elif e in self.prefetched:
                    st.prefetch_hits += 1
                    self.prefetched.discard(int(e))
                else:
                    st.hits += 1
            else:
                s = self._victim(group, allow_pending=False)
                if s < 0:
                    s = self._victim(group, allow_pending=True)
                    self._settle(s)
                self._assign(int(e), s)
                t0 = time.perf_counter()
                self.store.read_into(self.first + int(e), self.bufs[s])
                st.io_wait_s += time.perf_counter() - t0
                st.misses += 1
                self.table.set(int(e), *self.mats[s])
            self.stamp[s] = self._clock

    def start(self, active: np.ndarray, keep: np.ndarray | None) -> None:
        """Begin reading the missing experts of ``active`` on the I/O thread, into slots
        that hold none of ``keep`` (the group computing meanwhile); ``load(active)`` then
        waits for them. Experts for which no such slot is free are left to ``load``."""
        group = np.flatnonzero(active)
        protect = group if keep is None else np.concatenate([group, np.flatnonzero(keep)])
        self._read_ahead(group[self.slot_of[group] < 0], protect, self.started)

    def prefetch(self, idx: np.ndarray) -> None:
        """Start background reads of the experts ``idx`` names that are not resident.

        A guess never evicts an expert that the layer's latest step used: in decoding those
        are the likeliest to be needed again, and a wrong guess would cost a read later."""
        if not self.store.prefetch_enabled:
            return
        need = np.unique(idx)
        self.store.stats.prefetch_issued += self._read_ahead(need[self.slot_of[need] < 0], need, self.prefetched,
                                                             spare_recent=True)

    def _read_ahead(self, experts: np.ndarray, keep: np.ndarray, mark: set[int], spare_recent: bool = False) -> int:
        """Start background reads of ``experts`` (none resident) into slots that hold none
        of ``keep``, until no such slot is free; ``mark`` records each one started. Returns
        how many reads started."""
        n = 0
        for e in experts:
            s = self._victim(keep, allow_pending=False, spare_recent=spare_recent)
            if s < 0:
                break
            self._assign(int(e), s)
            mark.add(int(e))
            self.pending[s] = self.store.submit(self.first + int(e), self.bufs[s])
            n += 1
        return n


def parse_size(text: str) -> int:
    """'2G', '512M', '1.5G', '123456' -> bytes."""
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    try:
        if t and t[-1] in mult:
            return int(float(t[:-1]) * mult[t[-1]])
        return int(t)
    except ValueError:
        raise ValueError(f"not a size: {text!r} (use e.g. 2G, 512M)") from None


def warn(msg: str) -> None:
    print(f"warning: {msg}", file=sys.stderr)
