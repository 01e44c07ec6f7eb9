"""One-token decode attention from a cache-hot f16 cache, timed by the calling thread's CPU time:
the kernel's compute cost alone, robust to other processes on a shared host (run it at one
thread; with more the wall clock is used, and other work moves it).

    python benchmarks/bench_attention_hot.py --heads 9 --kv-heads 3 --head-dim 64 --pos 500 --wide 1
    COLI_SIMD=avx2 python benchmarks/bench_attention_hot.py --heads 16 --kv-heads 16 --pos 159

Compare two trees by running it with ``PYTHONPATH=<tree>`` one after the other; the ways
(``--wide``, kernels.set_att_wide) give the same bits, so only their time differs.
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from coli._engine import kernels as K


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--pos", type=int, default=159, help="the query's position (keys 0..pos)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--wide", type=int, choices=(0, 1, 2), default=2,
                    help="0 runs of heads, 1 wide rows, 2 the engine's choice (kernels.set_att_wide)")
    ap.add_argument("--calls", type=int, default=300, help="timed calls per round (7 rounds)")
    a = ap.parse_args()
    nh, nkv, hd, pos = a.heads, a.kv_heads, a.head_dim, a.pos
    K.set_num_threads(a.threads)
    K.set_att_wide(a.wide)
    rng = np.random.default_rng(0)
    kc = rng.standard_normal((pos + 1, nkv * hd)).astype(np.float16)
    vc = rng.standard_normal((pos + 1, nkv * hd)).astype(np.float16)
    q = rng.standard_normal((1, nh * hd)).astype(np.float32)
    out = np.empty((1, nh * hd), np.float32)
    kp, vp = np.array([kc.ctypes.data], np.int64), np.array([vc.ctypes.data], np.int64)
    p = np.array([pos], np.int32)

    def call():
        K.attention(q, kp, vp, p, out, nh, nkv, hd, hd, hd ** -0.5, 0, 0.0, 0, True)

    clock = time.thread_time if a.threads == 1 else time.perf_counter
    for _ in range(200):
        call()
    medians = []
    for _ in range(7):
        ts = []
        for _ in range(a.calls):
            t0 = clock()
            call()
            ts.append(clock() - t0)
        medians.append(sorted(ts)[len(ts) // 2])
    medians.sort()
    print(f"{K.simd_name()} · {nh} heads / {nkv} KV heads x {hd} · position {pos} · {a.threads} thread(s) · "
          f"wide {a.wide}: {medians[0] * 1e6:.2f} us a call (best round's median; median round {medians[3] * 1e6:.2f})")


if __name__ == "__main__":
    main()
