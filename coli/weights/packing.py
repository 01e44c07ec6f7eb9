"""Dense int4 and int8 matrices rearranged, once at load, into the tiles the kernels read fastest.

On the AVX-512 VNNI and AVX2 paths an int4 / int4s or int8 matrix can be held in 4-row
tiles (``QMatrix.pack``; the layouts are in coli/_engine/simd_qx.h): a decode step then
spends no instructions rearranging weights, several tokens share each step's unpacking, and
the matrix is one sequential stream. int4 on AVX-512 VNNI and int8 on both paths give the
same bits as the row layout's tiles; int4 on AVX2 gives a token the same bits alone or in a
batch.

The matrices every decode step reads are packed: attention, dense and shared-expert MLPs and
the head (:func:`pack_dense`), and the routed experts of layers held wholly in memory where
their tiles give the rows' bits (:func:`pack_experts`): int8 experts go through coli_gemm_q16,
which reads tiles or rows alike; int4 experts (rows a multiple of 4) go through arranged
activations at every token count, with which rows compute as the tiles do (AVX-512 VNNI: the
rows' multi-token tiles are the tiles' arithmetic; AVX2: coli_q4tile_rx). Streamed layers keep
their rows (cache slots are filled by reads of the file's rows) and so give a resident
layer's results. All packed dense matrices of a model share one buffer, asked
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


def release_pages(a: np.ndarray) -> int:
    """Give back to the kernel the whole pages inside ``a``, an array in a buffer of
    :func:`huge_buffer`'s that nothing will read again (they would read as zeros); returns the
    bytes released (0 for other memory, left alone)."""
    b = _owner(a)
    b = b.obj if isinstance(b, memoryview) else b
    if not (isinstance(b, mmap.mmap) and b in _ARENAS and hasattr(mmap, "MADV_DONTNEED")):
        return 0
    start = a.ctypes.data - np.frombuffer(b, np.uint8).ctypes.data
    lo = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE
    hi = (start + a.nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
    if hi <= lo:
        return 0
    try:
        b.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
    except (OSError, ValueError):
        return 0
    return hi - lo


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


def _round64(n: int) -> int:
    return -(-n // 64) * 64


def pack_experts(model, env=None) -> int:
    """Pack the experts of every MoE layer held wholly in memory where this path has tiles
    for them with the rows' bits (int8; int4 and int4s, rows a multiple of 4), unless
    ``COLI_PACK=0``; returns the bytes packed. A layer whose experts sit in one buffer of
    their own (``ResidentExperts.region``: a converted model's experts.bin, read into huge pages) is packed into that buffer, through a copy of one layer at a time, so the
    load never holds more than one layer twice; where the tiles take more room than the rows
    (rows no multiple of 4, columns narrower than a tile), or for any other layer, the tiles
    get a huge-page buffer of their own and the rows' memory is given back (a region's pages
    by :func:`release_pages`, a mapped file's by :func:`drop_file_pages`)."""
    from coli._engine import kernels as K

    if not env_switch(ENV, env):
        return 0
    done = 0
    for moe in getattr(model, "moe_layers", []):
        src = getattr(moe, "experts", None)
        table = getattr(src, "table", None)
        if table is None or getattr(src, "streamed", True):
            continue
        trios = [table.get(e) for e in range(table.n_experts)]
        if any(m is None or not m.packed_bytes for t in trios for m in t):
            continue  # packed already, or this path keeps the format in rows (f32, bf16; int8 on
            # AVX-512 without VNNI; everything on scalar)
        if table.fmt != K.FORMATS["int8"] and any(m.rows % 4 for t in trios for m in t):
            continue  # int4 tiles give the rows' bits in whole tiles of 4 rows only
        total = sum(_round64(m.packed_bytes) for t in trios for m in t)
        region = getattr(src, "region", None)
        if region is not None and region.nbytes >= total and region.ctypes.data % 64 == 0:
            rows, arena = region.copy(), region  # the rows move aside; the tiles take their place
            base = region.ctypes.data

            def moved(a):
                o = a.ctypes.data - base
                if a.nbytes and not 0 <= o <= region.nbytes - a.nbytes:
                    raise ValueError("pack_experts: an expert's rows lie outside its layer's region")
                return rows[o: o + a.nbytes].view(a.dtype).reshape(a.shape)
        else:  # rows that do not fit (a wider tile, 4-row padding): tiles of their own
            arena, moved = huge_buffer(total), (lambda a: a)
        mapped, off = [], 0
        for e, trio in enumerate(trios):
            tiles = []
            for m in trio:
                data, scales, mins = m.arrays()
                mapped += [a for a in (data, scales, mins) if a is not None and _mapped_file(a) is not None]
                q = K.QMatrix(m.fmt, moved(data), moved(scales), m.rows, m.cols,
                              None if mins is None else moved(mins))
                n = q.packed_bytes
                q.pack(arena[off: off + n])
                off += _round64(n)
                tiles.append(q)
            table.set(e, *tiles)
        drop_file_pages(mapped)
        if region is not None and arena is not region:
            release_pages(region)  # nothing reads the rows any more
        done += total
    return done


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
