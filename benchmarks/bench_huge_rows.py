"""Rows read from a checkpoint's mapping against the same rows in transparent huge pages.

The dense matrices a SIMD path computes on as rows (int8 on AVX-512 without VNNI, f32 and bf16
everywhere) are moved at load into a buffer of huge pages (coli/weights/packing.py, QMatrix.move_rows).
This times each such matrix of a model both ways in one process, alternated call by call:
the matrix as the checkpoint maps it (``COLI_PACK=0``, then only the tiles packed) and a copy
of its rows in a huge-page buffer. One token (or ``--tokens``), the threads given, wall clock,
medians. Matrices smaller than the caches are read from them after the first call, so the
difference shows on the large ones (the head, and every matrix of a large model).

    python benchmarks/bench_huge_rows.py -m /path/to/smollm2-int4 --threads 1
"""
from __future__ import annotations

import argparse
import os
import time

import numpy as np

import coli
from coli._engine import kernels as K
from coli.weights.packing import dense_matrices, huge_buffer, huge_pages, pack_dense


def huge_copy(m):
    """A QMatrix of m's values whose rows live in a huge-page buffer."""
    buf = huge_buffer(m.rows_bytes)
    data, scales, mins = (np.array(x) if x is not None else None for x in m.arrays())
    c = type(m)(K.FORMATS[m.format], data, scales, m.rows, m.cols, mins)
    c.move_rows(buf)
    return c


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=1, help="rows of activations per call")
    ap.add_argument("--calls", type=int, default=30, help="timed calls per matrix and layout")
    ap.add_argument("--min-mb", type=float, default=4.0, help="time matrices of at least this many MB")
    a = ap.parse_args()
    os.environ["COLI_PACK"] = "0"
    model = coli.load(a.model, threads=a.threads)
    del os.environ["COLI_PACK"]
    pack_dense(model.engine.model, huge=False)  # the tiles, as at load; the rows stay where they were
    rows = [m for m in dense_matrices(model.engine.model) if not m.packed and m.nbytes >= a.min_mb * 1e6]
    print(f"{a.model} · {K.simd_name()} · {a.threads} threads · {a.tokens} token(s) · huge pages here: "
          f"{huge_pages()} · load {os.getloadavg()[0]:.1f}")
    if not rows:
        print(f"no dense matrix of {a.min_mb} MB or more is kept in rows on this path")
        return
    rng = np.random.default_rng(0)
    for m in rows:
        c = huge_copy(m)
        kp = K.padded(m.cols)
        x = rng.standard_normal((a.tokens, m.cols)).astype(np.float32)
        out = np.empty((a.tokens, m.rows), np.float32)
        xq = np.empty((a.tokens, kp), np.int8)
        xqd, xqs = np.empty((a.tokens, kp // 32), np.float32), np.empty((a.tokens, kp // 32), np.int32)
        ts = {"mapped": [], "huge": []}
        for _ in range(a.calls + 2):
            for name, w in (("mapped", m), ("huge", c)):
                t0 = time.perf_counter()
                K.qlinear(x, w, out, None, xq, xqd, xqs)
                ts[name].append(time.perf_counter() - t0)
        med = {k: float(np.median(v[2:])) for k, v in ts.items()}
        print(f"  {m.rows}x{m.cols} {m.format:5s} {m.nbytes / 1e6:7.1f} MB: mapped rows {med['mapped'] * 1e3:7.2f} ms "
              f"({m.nbytes / med['mapped'] / 1e9:5.1f} GB/s), huge-page rows {med['huge'] * 1e3:7.2f} ms "
              f"({m.nbytes / med['huge'] / 1e9:5.1f} GB/s)")


if __name__ == "__main__":
    main()
