"""Dense int4 and int8 matrices rearranged, once at load, into the tiles the kernels read fastest.

On the AVX-512 VNNI and AVX2 paths an int4 / int4s matrix, and on AVX2 an int8 one, can be
held in 4-row tiles (``QMatrix.pack``; the layouts are in coli/_engine/simd_qx.h): a decode
step then spends no instructions rearranging weights, several tokens share each step's
unpacking, and the matrix is one sequential stream. int4 on AVX-512 VNNI and int8 on AVX2
give the same bits as the row layout's tiles; int4 on AVX2 gives a token the same bits alone
or in a batch.

Only the matrices every decode step reads are packed: attention, dense and shared-expert
MLPs and the head. Routed experts keep their rows (they may be streamed from disk into
cache slots, which read rows). All packed matrices of a model share one buffer, asked
of the kernel for transparent huge pages, as the page cache already gives a mapped
checkpoint here: on 4 KB pages the same tiles decoded slower than the rows did.

``COLI_PACK=0`` keeps every matrix in rows.
"""
from __future__ import annotations

import mmap

import numpy as np

from coli.config import env_switch

ENV = "COLI_PACK"
HUGE = 2 << 20  # transparent huge page size on x86-64


def huge_buffer(size: int) -> np.ndarray:
    """``size`` zeroed bytes of anonymous memory starting on a huge-page boundary, advised
    for transparent huge pages where the kernel offers them (Linux; elsewhere plain pages)."""
    mm = mmap.mmap(-1, size + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            mm.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # a kernel without THP: plain pages
            pass
    raw = np.frombuffer(mm, np.uint8)  # keeps the mapping alive
    off = -raw.ctypes.data % HUGE
    return raw[off: off + size]


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


def _mapped_file(a: np.ndarray):
    """The read-only file mapping (an np.memmap's mmap) that array ``a`` views, or None."""
    b = a
    while isinstance(b, np.ndarray):
        mm = getattr(b, "_mmap", None) if isinstance(b, np.memmap) else None
        if mm is not None:
            return mm
        b = b.base
    return None


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


def pack_dense(model, env=None) -> int:
    """Pack the model's dense int4 / int8 matrices where this path has their tiles (unless
    ``COLI_PACK=0``); returns the bytes packed."""
    if not env_switch(ENV, env):
        return 0
    mats = [(m, m.packed_bytes) for m in dense_matrices(model)]
    mats = [(m, n) for m, n in mats if n]
    if not mats:
        return 0
    total = sum(-(-n // 64) * 64 for _, n in mats)  # each on a 64-byte boundary
    arena = huge_buffer(total)
    off, mapped = 0, []
    for m, n in mats:
        # a file's rows are kept as views until the end (a page fault maps the pages around it
        # back in too); rows in anonymous memory are freed as each matrix is packed, so the
        # load never holds all the rows and all the tiles at once
        mapped += [a for a in m.arrays() if a is not None and _mapped_file(a) is not None]
        m.pack(arena[off: off + n])
        off += -(-n // 64) * 64
    drop_file_pages(mapped)
    return sum(n for _, n in mats)
