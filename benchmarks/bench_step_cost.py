"""What a step of M tokens of one sequence costs against a one-token step: the price of a
speculative verification (the drafts ride along in one step) at a given context.

    python benchmarks/bench_step_cost.py -m /work/models/smollm2-int8 --threads 2
    COLI_SIMD=avx2 python benchmarks/bench_step_cost.py -m DIR --threads 1 --ms 1,4,6,8 --kernels

The prompt (``--context`` tokens) is prefilled once; then, for each M, ``engine.step`` of M
tokens is timed and the cache cut back to the prompt, so every step sees the same context.
Rounds alternate the sizes; a size's cost is the median over ``--rounds`` rounds of the best
of ``--tries`` steps. At one thread it times the calling thread's CPU (robust to other
processes), with more the wall clock. ``--kernels`` also prints, per M, the step's time in
each ``K.*`` kernel (every call wrapped and timed, as ``profile_decode.py`` does).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import coli
from coli._engine import kernels as K

sys.path.insert(0, str(Path(__file__).resolve().parent))
from profile_decode import kernels_timed  # noqa: E402


def step_costs(eng, cache, base: int, ms: list[int], rounds: int, tries: int, clock) -> dict[int, float]:
    res: dict[int, list[float]] = {m: [] for m in ms}
    for _ in range(rounds):
        for m in ms:
            best = float("inf")
            for _ in range(tries):
                t0 = clock()
                eng.step([(cache, [5] * m)], all_logits=True)
                best = min(best, clock() - t0)
                cache.truncate(base)
            res[m].append(best)
    return {m: statistics.median(v) for m, v in res.items()}


def per_kernel(eng, cache, base: int, m: int, n: int, clock) -> tuple[float, dict[str, float]]:
    with kernels_timed(clock) as (tot, _):
        t0 = clock()
        for _ in range(n):
            eng.step([(cache, [5] * m)], all_logits=True)
            cache.truncate(base)
        step = (clock() - t0) / n
    return step, {k: v / n for k, v in sorted(tot.items(), key=lambda kv: -kv[1])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=300, help="prompt tokens before the timed steps")
    ap.add_argument("--ms", default="1,2,3,4,5,6,8", help="step sizes (tokens), comma-separated")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--tries", type=int, default=6)
    ap.add_argument("--kernels", action="store_true", help="also time each K.* kernel per step size")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    ms = sorted({int(x) for x in a.ms.split(",")} | {1})
    clock = time.thread_time if a.threads == 1 else time.perf_counter
    model = coli.load(a.model, threads=a.threads)
    eng = model.engine
    cache = eng.new_cache(a.context + max(ms) + 8)
    ids = [2 + j % 1000 for j in range(a.context)]
    for s in range(0, len(ids), 256):
        eng.step([(cache, ids[s:s + 256])])
    base = len(cache)
    step_costs(eng, cache, base, ms, 1, 2, clock)  # warm-up
    cost = step_costs(eng, cache, base, ms, a.rounds, a.tries, clock)
    kernels = {m: per_kernel(eng, cache, base, m, 20, clock) for m in ms} if a.kernels else {}
    model.close()
    meta = dict(model=a.model, simd=K.simd_name(), threads=a.threads, context=a.context, load=os.getloadavg()[0],
                clock="thread CPU" if a.threads == 1 else "wall")
    if a.json:
        print(json.dumps(dict(meta, seconds={m: cost[m] for m in ms}, relative={m: cost[m] / cost[1] for m in ms},
                              kernels={m: dict(step=s, **k) for m, (s, k) in kernels.items()}), indent=1))
        return
    print(f"{a.model} · {meta['simd']} · {a.threads} threads · context {a.context} · {meta['clock']} · "
          f"load {meta['load']:.1f}")
    print("| M | " + " | ".join(str(m) for m in ms) + " |")
    print("|---|" + "---|" * len(ms))
    print("| ms a step | " + " | ".join(f"{cost[m] * 1e3:.2f}" for m in ms) + " |")
    print("| x one token | " + " | ".join(f"{cost[m] / cost[1]:.2f}" for m in ms) + " |")
    for m, (s, k) in kernels.items():
        print(f"M={m}: {s * 1e3:.2f} ms a step (every kernel timed): "
              + ", ".join(f"{name} {v * 1e3:.2f}" for name, v in k.items() if v > 5e-5))


if __name__ == "__main__":
    main()
