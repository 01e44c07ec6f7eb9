"""Kernel micro-benchmark across SIMD paths: one linear layer, best of N calls, 1 thread.

    COLI_SIMD=avx2 python benchmarks/bench_kernels_paths.py            # every table below
    COLI_SIMD=avx2 python benchmarks/bench_kernels_paths.py --only bf16
    COLI_SIMD=avx2 python benchmarks/bench_kernels_paths.py --only q4    # int4/int4s, M = 1 .. 128

bf16 vs f32 prefill (x (M, 576) @ W (1536, 576).T, SmolLM2-135M's MLP shape) and the
quantized GEMV/GEMM (2048 x 2048, M = 1 and 4) for int8, int4 and int4s; ``--only q4``: int4
and int4s over M = 1, 2, 4, 8, 16, 128 tokens at olmoe-mini's and SmolLM2-135M's shapes. The path is
COLI_SIMD's (or the best this CPU has); numbers are wall time, so give the load with them.
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from coli._engine import kernels as K
from coli.quant import quantize


def best_of(fn, n):
    best = float("inf")
    for _ in range(n):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def run(w, M, fmts, reps, rounds=3):
    rng = np.random.default_rng(1)
    N, Kd = w.shape
    kp = K.padded(Kd)
    x = rng.standard_normal((M, Kd)).astype(np.float32)
    sc = (np.empty((M, kp), np.int8), np.empty((M, kp // 32), np.float32), np.empty((M, kp // 32), np.int32))
    out = np.empty((M, N), np.float32)
    mats = {f: quantize(w, f) for f in fmts}
    res = {}
    for _ in range(rounds):  # formats interleaved, A/B/A/B
        for f, m in mats.items():
            res[f] = min(res.get(f, float("inf")), best_of(lambda: K.qlinear(x, m, out, None, *sc), reps))
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=["bf16", "quant", "q4"])
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args()
    K.set_num_threads(1)
    rng = np.random.default_rng(0)
    print(f"SIMD path {K.simd_name()}, 1 thread")
    if a.only in (None, "bf16"):
        w = (rng.standard_normal((1536, 576)) * 0.1).astype(np.float32)
        for M in (4, 128, 512):
            r = run(w, M, ("f32", "bf16"), a.reps)
            flops = 2 * M * w.shape[0] * w.shape[1]
            print(f"bf16 vs f32, M={M}: " + ", ".join(f"{f} {t * 1e3:.2f} ms ({flops / t / 1e9:.1f} GFLOP/s)"
                                                     for f, t in r.items()))
    if a.only == "q4":
        for N, Kd in ((1024, 1024), (512, 1024), (1024, 512), (1536, 576), (576, 1536)):
            w = (rng.standard_normal((N, Kd)) * 0.05).astype(np.float32)
            for M in (1, 2, 4, 8, 16, 128):
                r = run(w, M, ("int4", "int4s"), a.reps if M < 100 else max(3, a.reps // 4))
                print(f"{N}x{Kd}, M={M}: " + ", ".join(f"{f} {t * 1e6:.0f} us ({t * 1e6 / M:.1f} us/token)"
                                                        for f, t in r.items()))
        return
    if a.only != "bf16":
        w = (rng.standard_normal((2048, 2048)) * 0.05).astype(np.float32)
        for M in (1, 4):
            r = run(w, M, ("int8", "int4", "int4s"), a.reps)
            print(f"2048x2048, M={M}: " + ", ".join(f"{f} {t * 1e6:.0f} us" for f, t in r.items()))


if __name__ == "__main__":
    main()
