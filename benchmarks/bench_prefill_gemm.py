"""One quantized linear layer of many tokens (a prompt's), with and without chunks of tokens.

    python benchmarks/bench_prefill_gemm.py                         # SmolLM2's shapes, 1 thread
    python benchmarks/bench_prefill_gemm.py --threads 2 --ms 2048
    python benchmarks/bench_prefill_gemm.py --chunks 0,32,128,512   # budgets in KB (0: one piece)
    COLI_SIMD=avx2 python benchmarks/bench_prefill_gemm.py          # another path

For each weight shape (N x K), format and token count M, one ``qlinear`` call is timed for
each chunk budget (``kernels.set_xe_chunk_bytes``; the budgets alternate within each of
--rounds rounds, best kept), by the calling thread's CPU time at one thread and the wall
clock with more. Reported in G multiply-adds per second (M x N x K / time). Every budget's
output is checked to have the bits of the first one. A tree from before chunks (no
``set_xe_chunk_bytes``) is timed as it is, in one column.
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from coli._engine import kernels as K
from coli.quant import quantize


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="1536x576,576x1536,576x576", help="comma-separated NxK")
    ap.add_argument("--fmts", default="int4,int8", help="formats; 'packed' packs where the path packs")
    ap.add_argument("--ms", default="8,64,256,2048", help="token counts")
    ap.add_argument("--chunks", default="0,128", help="chunk budgets in KB (0: never in chunks)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--no-pack", action="store_true", help="keep the matrices in rows")
    a = ap.parse_args()
    K.set_num_threads(a.threads)
    clock = time.thread_time if a.threads == 1 else time.perf_counter
    rng = np.random.default_rng(0)
    chunking = hasattr(K, "set_xe_chunk_bytes")
    budgets = [int(v) for v in a.chunks.split(",")] if chunking else [-1]
    print(f"SIMD path {K.simd_name()}, {a.threads} thread(s), "
          f"{'thread CPU time' if a.threads == 1 else 'wall clock'}, best of {a.rounds}; G multiply-adds/s")
    print("| shape | format | M | " + " | ".join(f"chunks {b} KB" if b > 0 else "one piece" if b == 0
                                             else "this tree (no chunks)" for b in budgets) + " |")
    print("|---|---|---:|" + "---:|" * len(budgets))
    try:
        for shape in a.shapes.split(","):
            N, Kd = (int(v) for v in shape.split("x"))
            w = (rng.standard_normal((N, Kd)) * 0.05).astype(np.float32)
            kp = K.padded(Kd)
            for fmt in a.fmts.split(","):
                m = quantize(w, fmt)
                packed = False if a.no_pack else m.pack()
                for M in (int(v) for v in a.ms.split(",")):
                    x = rng.standard_normal((M, Kd)).astype(np.float32)
                    sc = (np.empty((M, kp), np.int8), np.empty((M, kp // 32), np.float32),
                          np.empty((M, kp // 32), np.int32))
                    out = np.empty((M, N), np.float32)
                    reps = max(1, int(5e7 // (M * N * Kd)))
                    best = {b: float("inf") for b in budgets}
                    first = None
                    for _ in range(a.rounds):
                        for b in budgets:
                            if chunking:
                                K.set_xe_chunk_bytes(b << 10)
                            t = clock()
                            for _ in range(reps):
                                K.qlinear(x, m, out, None, *sc)
                            best[b] = min(best[b], (clock() - t) / reps)
                            if first is None:
                                first = out.copy()
                            elif not np.array_equal(out, first):
                                raise SystemExit(f"{shape} {fmt} M={M}: budget {b} KB changed the bits")
                    name = f"{fmt}{' packed' if packed else ''}"
                    print(f"| {shape} | {name} | {M} | " +
                          " | ".join(f"{M * N * Kd / best[b] / 1e9:.0f}" for b in budgets) + " |")
    finally:
        if chunking:
            K.set_xe_chunk_bytes(128 << 10)


if __name__ == "__main__":
    main()
