"""Prefill attention: one layer's ``K.attention`` over a prompt's rows (row t attends keys
0..t), as a prefill step calls it, for a model's attention shape.

    python benchmarks/bench_attention_prefill.py --tokens 2048 --threads 2
    COLI_SIMD=avx2 python benchmarks/bench_attention_prefill.py --tokens 512,2048 --dtype f16,f32

Shape: SmolLM2-135M's by default (9 query heads, 3 KV heads, head_dim 64); the caches are
64-byte aligned, as the engine's are. Prints the best of --repeats calls per setting, in ms
and in GFLOP/s (4 * heads * head_dim * T(T+1)/2 multiply-adds counted as two flops: q.k and
p.v). To compare two trees, run it with each on ``PYTHONPATH`` in turn, several times
(this machine's L3 is shared with other tenants), and keep the load (printed) next to the
numbers.
"""
from __future__ import annotations

import argparse
import os
import time

import numpy as np

from coli._engine import kernels as K


def _aligned(shape, dtype) -> np.ndarray:
    n = int(np.prod(shape)) * np.dtype(dtype).itemsize
    raw = np.empty(n + 64, np.uint8)
    o = (-raw.ctypes.data) % 64
    return raw[o : o + n].view(dtype).reshape(shape)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="2048", help="prompt lengths, comma-separated")
    ap.add_argument("--threads", default="2", help="thread counts, comma-separated")
    ap.add_argument("--dtype", default="f16", help="KV cache dtypes, comma-separated (f16, f32)")
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--window", type=int, default=0, help="sliding window (0: causal over all)")
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    nh, nkv, hd = a.heads, a.kv_heads, a.head_dim
    rng = np.random.default_rng(0)
    print(f"{K.simd_name()} · {nh} heads, {nkv} KV heads of {hd} · load {os.getloadavg()[0]:.1f}")
    print("| tokens | threads | cache | ms (best) | GFLOP/s |")
    print("|---|---|---|---|---|")
    for T in (int(x) for x in a.tokens.split(",")):
        q = rng.standard_normal((T, nh * hd)).astype(np.float32)
        pos = np.arange(T, dtype=np.int32)
        out = np.empty((T, nh * hd), np.float32)
        for dt in a.dtype.split(","):
            half = dt == "f16"
            kc, vc = _aligned((T, nkv * hd), np.float16 if half else np.float32), \
                _aligned((T, nkv * hd), np.float16 if half else np.float32)
            kc[:], vc[:] = rng.standard_normal(kc.shape), rng.standard_normal(vc.shape)
            kp, vp = np.full(T, kc.ctypes.data, np.int64), np.full(T, vc.ctypes.data, np.int64)
            keys = sum(min(t + 1, a.window) if a.window > 0 else t + 1 for t in range(T))
            for th in (int(x) for x in a.threads.split(",")):
                K.set_num_threads(th)
                best = float("inf")
                for _ in range(a.repeats):
                    t0 = time.perf_counter()
                    K.attention(q, kp, vp, pos, out, nh, nkv, hd, hd, hd ** -0.5, a.window, 0.0, 0, half)
                    best = min(best, time.perf_counter() - t0)
                print(f"| {T} | {th} | {dt} | {best * 1e3:.1f} | {4.0 * nh * hd * keys / best / 1e9:.1f} |")


if __name__ == "__main__":
    main()
