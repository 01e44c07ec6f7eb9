"""Dense int4 and int8 matrices rearranged, once at load, into the tiles the kernels read fastest.

On the AVX-512 VNNI and AVX2 paths an int4 / int4s or int8 matrix can be held in 4-row
tiles (``QMatrix.pack``; the layouts are in coli/_engine/simd_qx.h): a decode step then
spends no instructions rearranging weights, several tokens share each step's unpacking, and
the matrix is one sequential stream. int4 on AVX-512 VNNI and int8 on both paths give the
same bits as the row layout's tiles; int4 on AVX2 gives a token the same bits alone or in a
batch.

Only the matrices every decode step reads are packed: attention, dense and shared-expert
MLPs and the head. Routed experts keep their rows (they may be streamed from disk into
cache slots, which read rows). All packed matrices of a model share one buffer, asked
of the kernel for transparent huge pages: on 4 KB pages the same tiles decoded slower than
the rows did. Those of the matrices that this path computes on as rows (int8 on AVX-512
without VNNI, f32 and bf16 everywhere, every format on the scalar and NEON paths) have their row arrays
moved into that buffer too where the kernel gives huge pages (Linux with transparent huge
pages not set to ``never``) and they take at most half the available memory: a mapped
checkpoint's 4 KB pages cost a TLB miss and a stop of the hardware prefetcher every 4 KB, and
SmolLM2-135M's int8 head read from them at 6.5-7.5 GB/s on one AVX-512 core where the same
rows in huge pages read at 8.6-10.7 (BENCHMARKS.md, "Rows in huge pages").

``COLI_PACK=0`` keeps every matrix in rows, where it was loaded.
"""
from __future__ import annotations

import mmap
import weakref

import numpy as np

from coli.config import env_switch

ENV = "COLI_PACK"
HUGE = 2 << 20  # transparent huge page size on x86-64
_ARENAS: weakref.WeakSet = weakref.WeakSet()  # the mappings huge_buffer made (and still alive)


def huge_buffer(size: int) -> np.ndarray:
    """``size`` zeroed bytes of anonymous memory starting on a huge-page boundary, advised
    for transparent huge pages where the kernel offers them (Linux; elsewhere plain pages)."""
    mm = mmap.mmap(-1, size + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            mm.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # a kernel without THP: plain pages
            pass
    _ARENAS.add(mm)
    raw = np.frombuffer(mm, np.uint8)  # keeps the mapping alive
    off = -raw.ctypes.data % HUGE
    return raw[off: off + size]


def huge_pages() -> bool:
    """Whether anonymous memory advised with MADV_HUGEPAGE gets transparent huge pages here."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[never]" not in f.read()
    except OSError:
        return False


def dense_matrices(model) -> list:
    """Every distinct QMatrix that a decode step multiplies by, outside routed experts."""
    from coli.models.base import GatedMLP, Linear, MoE

    seen: dict[int, object] = {}

    def add(lin):
        if isinstance(lin, Linear):
            seen.setdefault(id(lin.mat), lin.mat)

    def add_mlp(mlp):
        if isinstance(mlp, GatedMLP):
            for lin in (mlp.gate, mlp.up, mlp.down):
                add(lin)
        elif isinstance(mlp, MoE) and mlp.shared is not None:
            add_mlp(mlp.shared)

    for layer in model.layers:
        for v in vars(layer.attn).values():  # q/k/v/o, MLA's projections
            add(v)
        add_mlp(layer.mlp)
    add(model.lm_head)
    return list(seen.values())


def _owner(a: np.ndarray):
    """What array ``a``'s memory belongs to, following its bases: an np.memmap's mmap, else
    the object at the end of the chain (a memoryview for arrays made with np.frombuffer)."""
    b = a
    while isinstance(b, np.ndarray):
        mm = getattr(b, "_mmap", None) if isinstance(b, np.memmap) else None
        if mm is not None:
            return mm
        b = b.base
    return b


def _mapped_file(a: np.ndarray):
    """The read-only file mapping that array ``a`` views (an np.memmap's mmap, or an mmap
    opened for reading that the array was made from, as a safetensors checkpoint's), or None."""
    b = _owner(a)
    if isinstance(b, memoryview) and b.readonly:  # (huge_buffer's anonymous mappings are writable)
        b = b.obj
    return b if isinstance(b, mmap.mmap) and b not in _ARENAS else None


def drop_file_pages(arrays) -> int:
    """Unmap from this process the pages of file-mapped ``arrays`` (a converted model's rows,
    once packed): their bytes stay in the page cache, and a later read maps them again from
    it, so nothing changes but the resident size, which no longer counts the rows beside their
    tiles. Arrays in anonymous memory are left alone (dropping those would lose them).
    Returns the bytes advised."""
    if not hasattr(mmap, "MADV_DONTNEED"):
        return 0
    done = 0
    for a in arrays:
        mm = _mapped_file(a) if a is not None else None
        if mm is None:
            continue
        start = a.ctypes.data - np.frombuffer(mm, np.uint8).ctypes.data
        lo = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE  # whole pages inside the array only
        hi = (start + a.nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
        if hi > lo:
            try:
                mm.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
                done += hi - lo
            except (OSError, ValueError):  # a mapping that refuses: it only stays counted
                pass
    return done


def pack_dense(model, env=None, huge: bool | None = None) -> int:
    """Pack the model's dense int4 / int8 matrices where this path has their tiles, and move
    the rows of the others into the same huge-page buffer where the kernel gives huge pages
    (``huge``: None asks :func:`huge_pages`) and they take at most half the available memory,
    unless ``COLI_PACK=0``. Returns the bytes packed or moved (0 for a model already done)."""
    if not env_switch(ENV, env):
        return 0
    if huge is None:
        huge = huge_pages()
    mats, moves = [], []
    for m in dense_matrices(model):
        if m.packed_bytes:
            mats.append((m, m.packed_bytes, True))
        elif huge and not m.packed and not m.in_table and not _in_huge_buffer(m):
            moves.append((m, m.rows_bytes, False))
    if moves and not _room_for(sum(n for _, n, _ in moves)):
        moves = []  # rows that would crowd the memory stay in their (reclaimable) mapping
    mats += moves
    if not mats:
        return 0
    total = sum(-(-n // 64) * 64 for _, n, _ in mats)  # each on a 64-byte boundary
    arena = huge_buffer(total)
    off, mapped = 0, []
    for m, n, tiles in mats:
        # a file's rows are kept as views until the end (a page fault maps the pages around it
        # back in too); rows in anonymous memory are freed as each matrix is packed or moved, so
        # the load never holds all the rows twice
        mapped += [a for a in m.arrays() if a is not None and _mapped_file(a) is not None]
        if tiles:
            m.pack(arena[off: off + n])
        else:
            m.move_rows(arena[off: off + n])
        off += -(-n // 64) * 64
    drop_file_pages(mapped)
    return sum(n for _, n, _ in mats)


def _room_for(nbytes: int) -> bool:
    """Whether nbytes more of anonymous memory leave at least as much available (MemAvailable
    counts the page cache a mapped checkpoint sits in, which the kernel can reclaim, where it
    cannot take back moved rows without swap)."""
    from coli.engine import available_memory

    avail = available_memory()
    return avail is None or 2 * nbytes <= avail


def _in_huge_buffer(m) -> bool:
    """Whether matrix m's rows already live in a buffer of :func:`huge_buffer`'s."""
    b = _owner(m.arrays()[0])
    b = b.obj if isinstance(b, memoryview) else b
    return isinstance(b, mmap.mmap) and b in _ARENAS
