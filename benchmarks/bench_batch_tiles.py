"""What a few tokens cost against one: the quantized linear layer at M = 1..8, 1 thread.

    python benchmarks/bench_batch_tiles.py                       # SmolLM2 and olmoe shapes
    python benchmarks/bench_batch_tiles.py --fmts int4 --ms 1,4 --shapes 1536x576
    COLI_SIMD=avx2 python benchmarks/bench_batch_tiles.py        # another path
    python benchmarks/bench_batch_tiles.py --packed              # in the 4-row tiles the runner packs

For each weight shape (N x K) and format, one ``qlinear`` of M tokens is timed by the CPU
time of the calling thread (``time.thread_time``, so a busy machine inflates it less than
wall time), best of --rounds rounds of --reps calls; formats and M are interleaved within
a round. --packed holds each matrix in this path's 4-row tiles (``QMatrix.pack``), as
coli.weights.packing does for a resident model's dense matrices; without it they keep their
rows, as streamed experts do. "x M=1" is a call's cost over the one-token call's: 1.0 means the extra tokens
come free (a memory-bound kernel), M means each token pays in full (compute-bound).
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from coli._engine import kernels as K
from coli.quant import quantize

SHAPES = ("576x576", "1536x576", "576x1536", "1024x2048", "2048x1024", "8192x576")


def per_call(fn, reps: int) -> float:
    t = time.thread_time()
    for _ in range(reps):
        fn()
    return (time.thread_time() - t) / reps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated NxK")
    ap.add_argument("--fmts", default="int4,int4s,int8")
    ap.add_argument("--ms", default="1,2,3,4,8")
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--packed", action="store_true", help="hold the matrices in this path's 4-row tiles")
    a = ap.parse_args()
    K.set_num_threads(1)
    rng = np.random.default_rng(0)
    ms = [int(m) for m in a.ms.split(",")]
    fmts = a.fmts.split(",")
    print(f"SIMD path {K.simd_name()}, {'packed tiles' if a.packed else 'rows'}, 1 thread, "
          f"thread CPU time per call, best of {a.rounds} x {a.reps}")
    print("| shape | format | " + " | ".join(f"M={m}" for m in ms) + " | " +
          " | ".join(f"x M=1 @{m}" for m in ms if m > 1) + " |")
    print("|---|---|" + "---:|" * (2 * len(ms) - (1 in ms)))
    for shape in a.shapes.split(","):
        N, Kd = (int(v) for v in shape.split("x"))
        w = (rng.standard_normal((N, Kd)) * 0.05).astype(np.float32)
        kp = K.padded(Kd)
        mats = {f: quantize(w, f) for f in fmts}
        if a.packed:
            for mat in mats.values():
                mat.pack()  # False (rows kept) for a format this path does not tile
        M = max(ms)
        x = rng.standard_normal((M, Kd)).astype(np.float32)
        sc = (np.empty((M, kp), np.int8), np.empty((M, kp // 32), np.float32), np.empty((M, kp // 32), np.int32))
        outs = {m: np.empty((m, N), np.float32) for m in ms}
        best = {}
        reps = max(10, a.reps * 576 * 576 // (N * Kd))
        for _ in range(a.rounds):
            for f, mat in mats.items():
                for m in ms:
                    xm, om = x[:m], outs[m]
                    t = per_call(lambda: K.qlinear(xm, mat, om, None, *sc), reps)
                    best[f, m] = min(best.get((f, m), float("inf")), t)
        for f in fmts:
            base = best[f, ms[0]]
            print(f"| {shape} | {f} | " + " | ".join(f"{best[f, m] * 1e6:.1f} us" for m in ms) + " | " +
                  " | ".join(f"{best[f, m] / base:.2f}" for m in ms if m > 1) + " |")


if __name__ == "__main__":
    main()
