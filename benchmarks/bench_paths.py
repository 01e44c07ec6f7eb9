"""Two SIMD paths of one build side by side (e.g. avx2 against avx2vnni on a CPU that has both).

    python benchmarks/bench_paths.py --paths avx2,avx2vnni --kernels --threads 1
    python benchmarks/bench_paths.py --paths avx2,avx2vnni -m /work/models/smollm2-int8 --streams 4

--kernels: one ``qlinear`` call per shape, format and token count, with each path's own
compiled module imported in this one process and the calls alternated (best of 5 rounds;
packed matrices where the path packs). -m MODEL: decode steps of the model, one process per
path (the engine uses one path per process), the paths in turns for --rounds rounds: the
median step of each run. On a shared host the speed drifts from minute to minute; the
alternation keeps both paths in the same minutes.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402

from coli._engine import dispatch  # noqa: E402

SHAPES = ((576, 576), (1536, 576), (576, 1536))
TOKENS = (1, 2, 4, 8, 64)

_DECODE = """if 1:
    import json, os, statistics, sys, time
    os.environ.setdefault("COLI_ADAPTIVE_THREADS", "0")
    import coli
    from coli._engine import kernels as K
    path, threads, streams, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    eng = coli.load(path, threads=threads).engine
    cs = [eng.new_cache(512) for _ in range(streams)]
    for i, c in enumerate(cs):
        eng.step([(c, [(7 * i + j) % 100 + 2 for j in range(128)])])
    ts = []
    for _ in range(steps + 10):
        t = time.perf_counter()
        eng.step([(c, [5]) for c in cs])
        ts.append(time.perf_counter() - t)
        for c in cs:
            c.truncate(128)
    print(json.dumps(dict(simd=K.simd_name(), tok_s=streams / statistics.median(ts[10:]))))
"""


def kernels(paths: list[str], threads: int) -> list[dict]:
    from coli.quant import quantize

    mods = {p: importlib.import_module(f"coli._engine._kernels_{p}") for p in paths}
    for K in mods.values():
        K.set_num_threads(threads)
    rng = np.random.default_rng(0)
    out = []
    for fmt in ("int8", "int4"):
        for rows, cols in SHAPES:
            q = quantize(rng.standard_normal((rows, cols)).astype(np.float32), fmt)
            d, s, mn = q.arrays()
            mats = {}
            for p, K in mods.items():
                m = K.QMatrix(q.fmt, d.copy(), s.copy(), rows, cols, None if mn is None else mn.copy())
                m.pack()  # (False where the path keeps rows)
                mats[p] = m
            for M in TOKENS:
                x = rng.standard_normal((M, cols)).astype(np.float32)
                best: dict[str, float] = {}
                n = max(5, int(3e6 // (rows * cols * M)))
                for _ in range(5):
                    for p, K in mods.items():
                        kp = K.padded(cols)
                        sc = (np.empty((M, kp), np.int8), np.empty((M, kp // 32), np.float32),
                              np.empty((M, kp // 32), np.int32))
                        y = np.empty((M, rows), np.float32)
                        t = time.perf_counter()
                        for _ in range(n):
                            K.qlinear(x, mats[p], y, None, *sc)
                        best[p] = min(best.get(p, 1e9), (time.perf_counter() - t) / n)
                out.append(dict(format=fmt, shape=f"{rows}x{cols}", tokens=M,
                                us={p: best[p] * 1e6 for p in paths}, speedup=best[paths[0]] / best[paths[1]]))
    return out


def decode(paths: list[str], model: str, threads: int, streams: int, steps: int, rounds: int) -> dict:
    runs: dict[str, list[float]] = {p: [] for p in paths}
    for _ in range(rounds):
        for p in paths:
            r = subprocess.run([sys.executable, "-c", _DECODE, model, str(threads), str(streams), str(steps)],
                               cwd=ROOT, capture_output=True, text=True, timeout=900,
                               env={**os.environ, "COLI_SIMD": p, "PYTHONPATH": ROOT})
            if r.returncode != 0:
                sys.exit(f"bench_paths: the {p} run failed: {r.stderr.strip().splitlines()[-1:]}")
            runs[p].append(json.loads(r.stdout.strip().splitlines()[-1])["tok_s"])
    return dict(model=model, streams=streams, tok_s=runs,
                speedup=statistics.median(runs[paths[1]]) / statistics.median(runs[paths[0]]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--paths", default="avx2,avx2vnni", help="two paths, the baseline first")
    ap.add_argument("-m", "--model", help="also decode this model on each path")
    ap.add_argument("--kernels", action="store_true", help="time qlinear calls in cache on each path")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--streams", type=int, default=1)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    paths = [p.strip() for p in a.paths.split(",") if p.strip()]
    if len(paths) != 2:
        sys.exit("bench_paths: --paths takes two paths, e.g. avx2,avx2vnni")
    can = dispatch.runnable()
    for p in paths:
        if p not in can:
            sys.exit(f"bench_paths: the {p} path cannot run here (runnable: {', '.join(can)})")
    if not a.kernels and not a.model:
        sys.exit("bench_paths: give --kernels and/or -m MODEL")
    res: dict = dict(paths=paths, threads=a.threads, load=os.getloadavg()[0])
    if a.kernels:
        res["kernels"] = kernels(paths, a.threads)
    if a.model:
        res["decode"] = decode(paths, a.model, a.threads, a.streams, a.steps, a.rounds)
    if a.json:
        print(json.dumps(res, indent=1))
        return
    print(f"{paths[0]} -> {paths[1]}, {a.threads} thread(s), load {res['load']:.1f}")
    for k in res.get("kernels", []):
        us = k["us"]
        print(f"  {k['format']} {k['shape']:>9} x {k['tokens']:2d} tokens: {us[paths[0]]:8.1f} -> {us[paths[1]]:8.1f} us "
              f"({k['speedup']:.2f}x)")
    if "decode" in res:
        d = res["decode"]
        runs = "; ".join(f"{p} " + ", ".join(f"{v:.1f}" for v in d["tok_s"][p]) for p in paths)
        print(f"  decode {d['model']} ({d['streams']} stream(s)): {runs} tok/s: {d['speedup']:.2f}x (medians)")


if __name__ == "__main__":
    main()
