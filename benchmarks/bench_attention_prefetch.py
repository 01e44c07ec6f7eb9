"""Attention's L2 prefetch of the next chunk, off against on, alternated in one process.

    python benchmarks/bench_attention_prefetch.py --threads 2 --pos 4096 --rows 4
    python benchmarks/bench_attention_prefetch.py --threads 2 --pos 1024 --shape 16,16,128
    COLI_ADAPTIVE_THREADS=0 python benchmarks/bench_attention_prefetch.py -m DIR --streams 4 --context 2048

Without ``-m``: one-token ``K.attention`` of ``--rows`` sequences at position ``--pos`` over
f16 caches, cold (each layer's caches in turn, 64 MB read between passes; 30 layers, 16 for
shapes of 16 heads or more), median µs a call over ``--passes`` passes per setting. With
``-m``: whole decode steps of ``--streams`` sequences prefilled to ``--context`` positions,
best of 4 steps a round, median over ``--rounds`` rounds per setting. Each pass alternates
``set_att_prefetch(0)`` and ``set_att_prefetch(--ahead)``, and the kernel mode checks that both
settings give the same bits. Keep the load (printed) next to the numbers.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

from coli._engine import kernels as K


def kernel(a) -> dict[int, float]:
    nh, nkv, hd = (int(x) for x in a.shape.split(","))
    L = 30 if nh < 16 else 16
    rng = np.random.default_rng(0)

    def cache():  # 64-byte aligned, as the engine's
        raw = np.empty((a.pos + 1) * nkv * hd + 64, np.float16)
        s = (-(raw.ctypes.data // 2)) % 32
        c = raw[s:s + (a.pos + 1) * nkv * hd]
        c[:] = rng.standard_normal(c.shape)
        return c

    layers = [[(cache(), cache()) for _ in range(a.rows)] for _ in range(L)]
    ptrs = [(np.array([k.ctypes.data for k, _ in lay], np.int64), np.array([v.ctypes.data for _, v in lay], np.int64))
            for lay in layers]
    q = rng.standard_normal((a.rows, nh * hd)).astype(np.float32)
    pos = np.full(a.rows, a.pos, np.int32)
    evict = np.ones(64 << 20, np.int8)
    res: dict[int, list[float]] = {0: [], a.ahead: []}
    outs = {}
    for _ in range(a.passes):
        for pf in res:
            K.set_att_prefetch(pf)
            out = np.zeros((a.rows, nh * hd), np.float32)
            evict.sum()
            t0 = time.perf_counter()
            for kp, vp in ptrs:
                K.attention(q, kp, vp, pos, out, nh, nkv, hd, hd, hd ** -0.5, half=True)
            res[pf].append((time.perf_counter() - t0) / L * 1e6)
            outs[pf] = out
    assert np.array_equal(outs[0], outs[a.ahead]), "the prefetch changed the output"
    return {pf: statistics.median(v) for pf, v in res.items()}


def prefilled(a):
    """``a.model`` loaded at ``a.threads`` threads and ``a.streams`` caches, each prefilled to
    ``a.context`` positions: (model, engine, caches, their lengths)."""
    import coli

    model = coli.load(a.model, threads=a.threads)
    eng = model.engine
    caches = [eng.new_cache(a.context + 16) for _ in range(a.streams)]
    for i, c in enumerate(caches):
        ids = [2 + (j * (i + 3)) % 1000 for j in range(a.context)]
        for s in range(0, a.context, 256):
            eng.step([(c, ids[s:s + 256])])
    return model, eng, caches, [len(c) for c in caches]


def best_step_ms(eng, caches, base, tries: int = 4) -> float:
    """The best of ``tries`` one-token steps of every cache, in ms, each cache cut back to its
    length in ``base`` after every step."""
    best = float("inf")
    for _ in range(tries):
        t0 = time.perf_counter()
        eng.step([(c, [5]) for c in caches])
        best = min(best, time.perf_counter() - t0)
        for c, b in zip(caches, base):
            c.truncate(b)
    return best * 1e3


def steps(a) -> dict[int, float]:
    model, eng, caches, base = prefilled(a)
    res: dict[int, list[float]] = {0: [], a.ahead: []}
    for _ in range(a.rounds):
        for pf in res:
            K.set_att_prefetch(pf)
            res[pf].append(best_step_ms(eng, caches, base))
    model.close()
    return {pf: statistics.median(v) for pf, v in res.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", help="time whole decode steps of this model instead of the kernel")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ahead", type=int, default=1, help="chunks ahead for the 'on' setting")
    ap.add_argument("--pos", type=int, default=4096)
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--shape", default="9,3,64", help="heads,kv_heads,head_dim (default SmolLM2-135M's)")
    ap.add_argument("--passes", type=int, default=30)
    ap.add_argument("--streams", type=int, default=1)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=12)
    a = ap.parse_args()
    K.set_num_threads(a.threads)
    if a.model:
        r, unit = steps(a), "ms a step"
        what = f"{a.model} · {a.streams} streams · context {a.context}"
    else:
        r, unit = kernel(a), "us a call"
        what = f"shape {a.shape} · position {a.pos} · {a.rows} rows"
    print(f"{K.simd_name()} · {a.threads} threads · {what} · load {os.getloadavg()[0]:.1f}")
    print(f"no prefetch {r[0]:.2f} {unit} · {a.ahead} chunk(s) ahead {r[a.ahead]:.2f} · x{r[0] / r[a.ahead]:.3f}")
    K.set_att_prefetch(1)


if __name__ == "__main__":
    main()
