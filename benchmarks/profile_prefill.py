"""Where one prefill's time goes: each ``K.*`` kernel of the step, and each quantized linear
call by shape, for the synthetic olmoe-mini (or any model directory).

    python benchmarks/profile_prefill.py --quant int8                 # olmoe-mini, 128 tokens, 1 thread
    COLI_SIMD=avx2 python benchmarks/profile_prefill.py --quant int4s --tokens 128
    python benchmarks/profile_prefill.py -m /work/models/smollm2-int8 --threads 2

One prefill step of --tokens tokens, every ``K.*`` call of the step wrapped and timed (the
calling thread's CPU time at one thread, robust to other processes; the wall clock with
more), the fastest of --repeats steps kept. ``moe_experts`` includes the experts' activation
quantization and gather/scatter; ``qlinear`` / ``qlinear_many`` include the quantization of
their inputs. Compare two trees by running it with each on ``PYTHONPATH``, alternated, and keep
the load (printed) next to the numbers.
"""
from __future__ import annotations

import argparse
import collections
import os
import time

import numpy as np

import coli
from coli._engine import kernels as K


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", default=None, help="model directory (default: the synthetic olmoe-mini, seed 0)")
    ap.add_argument("--quant", default="int8", help="weight format for an HF directory (default int8; a converted directory keeps its own)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    path = a.model
    if path is None:
        from coli.synthetic import cache_dir, write_hf
        d = cache_dir() / "olmoe-mini-hf-s0"
        if not (d / "config.json").exists():
            write_hf("olmoe-mini", d, seed=0)
        path = str(d)
    from pathlib import Path

    from coli.weights.converted import MANIFEST

    converted = (Path(path) / MANIFEST).exists()  # (a converted directory has its own format)
    m = coli.load(path, threads=a.threads, **({} if converted else {"quant": a.quant, "head_quant": a.quant}))
    eng = m.engine
    ids = [int(t) for t in np.random.default_rng(0).integers(3, 1000, a.tokens)]
    clock = time.thread_time if a.threads == 1 else time.perf_counter
    names = [n for n in dir(K) if not n.startswith("_") and callable(getattr(K, n))]
    orig = {n: getattr(K, n) for n in names}
    tot: dict = collections.defaultdict(float)
    cnt: collections.Counter = collections.Counter()
    shapes: dict = collections.defaultdict(float)

    def wrap(n, f):
        def timed(*args, **kw):
            t = clock()
            r = f(*args, **kw)
            dt = clock() - t
            tot[n] += dt
            cnt[n] += 1
            if n in ("qlinear", "qlinear_many"):
                mats = (args[1],) if n == "qlinear" else args[1]
                shapes[f"{n} {'+'.join(f'{w.rows}x{w.cols}' for w in mats)} {mats[0].format} M={len(args[0])}"] += dt
            return r
        return timed

    def step() -> float:
        cache = eng.new_cache(a.tokens + 8)
        t = clock()
        eng.step([(cache, ids)])
        return clock() - t

    step()  # warm-up
    best = None
    for _ in range(a.repeats):
        tot.clear(), cnt.clear(), shapes.clear()
        for n, f in orig.items():
            setattr(K, n, wrap(n, f))
        try:
            t = step()
        finally:
            for n, f in orig.items():
                setattr(K, n, f)
        if best is None or t < best[0]:
            best = (t, dict(tot), dict(cnt), dict(shapes))
    t, tot, cnt, shapes = best
    print(f"{path} · {'converted' if converted else a.quant} · {K.simd_name()} · {a.threads} thread(s) · load {os.getloadavg()[0]:.1f}")
    print(f"prefill of {a.tokens} tokens: {t * 1e3:.1f} ms ({a.tokens / t:.0f} tok/s), "
          f"{'thread CPU time' if a.threads == 1 else 'wall clock'}, best of {a.repeats}")
    for k, v in sorted(tot.items(), key=lambda kv: -kv[1]):
        if v * 1e3 >= 0.05:
            print(f"  {k:20s} {v * 1e3:8.2f} ms {100 * v / t:5.1f}% {cnt[k]:4d} calls")
    print(f"  {'outside K.*':20s} {(t - sum(tot.values())) * 1e3:8.2f} ms")
    for k, v in sorted(shapes.items(), key=lambda kv: -kv[1]):
        print(f"    {k:52s} {v * 1e3:8.2f} ms")


if __name__ == "__main__":
    main()
