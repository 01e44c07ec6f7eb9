"""Where a one-token decode step's time goes: per kernel, per call, and what the layer's
matrices cost alone.

    python benchmarks/profile_decode.py -m /work/models/smollm2-int4 --threads 2
    python benchmarks/profile_decode.py -m /work/models/smollm2-int4 --threads 1 --matrices

Three parts:
  * plain decode steps (wall clock and process CPU time per token: with several threads, CPU
    time above threads x wall is time spent spinning in OpenMP barriers);
  * the same steps with every ``K.*`` call of ``coli.models.base`` wrapped and timed (around
    each call, so it includes the call's Python argument checks and its OpenMP fork/join;
    the calling thread's CPU time at one thread, the wall clock with more, see --clock): ms
    per token, calls per token, us per call, and what is left outside them; then (dense
    models) the step's Python alone, every ``K.*`` call replaced by a no-op;
  * with ``--matrices``, each of layer 0's matrices alone, one token, cache-hot, timed with
    ``time.thread_time`` (median and minimum of ``--calls``): the kernels' compute cost
    without the memory wall, robust to other processes when run at one thread.

Kernel times under load are only comparable inside one run; compare two trees by running
this with ``PYTHONPATH=<tree>`` one after the other, twice, and keep the load (``uptime``)
next to the numbers.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import os
import time

import numpy as np

import coli
from coli._engine import kernels as K

KERNELS = ("qlinear", "qlinear_many", "attention_front", "attention", "rmsnorm", "add_rmsnorm", "gated_act",
           "embed_rows", "linear", "moe_experts", "moe_route_softmax", "moe_route_sigmoid")


def decode(eng, caches, n: int) -> tuple[float, float]:
    """Seconds of wall clock and of process CPU time per step over n steps of one token for
    each cache (several caches: one batched step of several sequences)."""
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(n):
        eng.step([(c, [5]) for c in caches])
    return (time.perf_counter() - t0) / n, (time.process_time() - c0) / n


@contextlib.contextmanager
def kernels_timed(clock):
    """Every K.* kernel of KERNELS wrapped and timed by ``clock`` while inside: yields
    (seconds by kernel, calls by kernel), filled in as the calls happen."""
    tot: dict[str, float] = collections.defaultdict(float)
    cnt: collections.Counter = collections.Counter()
    orig = {k: getattr(K, k) for k in KERNELS if hasattr(K, k)}

    def wrap(name, f):
        def timed(*a, **kw):
            t0 = clock()
            r = f(*a, **kw)
            tot[name] += clock() - t0
            cnt[name] += 1
            return r
        return timed

    for k, f in orig.items():
        setattr(K, k, wrap(k, f))
    try:
        yield tot, cnt
    finally:
        for k, f in orig.items():
            setattr(K, k, f)


def per_kernel(eng, caches, n: int, clock) -> tuple[dict, collections.Counter, float]:
    with kernels_timed(clock) as (tot, cnt):
        t0 = clock()
        decode(eng, caches, n)
        seconds = (clock() - t0) / n
    return tot, cnt, seconds


def wiring(eng, caches, n: int) -> float:
    """Thread CPU seconds per one-token step with every K.* call a no-op: the Python of the
    engine's step and the model's wiring alone (the cache is cut back after each step)."""
    orig = {k: getattr(K, k) for k in KERNELS if hasattr(K, k)}
    for k in orig:
        setattr(K, k, lambda *a, **kw: None)
    starts = [len(c) for c in caches]
    try:
        ts = []
        for _ in range(n):
            t0 = time.thread_time()
            eng.step([(c, [5]) for c in caches])
            ts.append(time.thread_time() - t0)
            for c, start in zip(caches, starts):
                c.truncate(start)
    finally:
        for k, f in orig.items():
            setattr(K, k, f)
    return sorted(ts)[n // 2]


def matrices(model, rs, calls: int) -> list[tuple[str, float, float]]:
    """(name, median us, minimum us) of each of layer 0's projections for one token, cache-hot."""
    layer = model.layers[0]
    rows = []
    lins = [(n, getattr(layer.attn, n)) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
    mlp = layer.mlp
    if hasattr(mlp, "gate"):
        lins += [("gate_proj", mlp.gate), ("up_proj", mlp.up), ("down_proj", mlp.down)]
    lins.append(("lm_head", model.lm_head))
    rng = np.random.default_rng(0)
    for name, lin in lins:
        x = rng.standard_normal((1, lin.mat.cols)).astype(np.float32)
        out = np.zeros((1, lin.mat.rows), np.float32)
        n = max(20, calls // 50) if name == "lm_head" else calls
        for _ in range(10):
            lin(x, out, rs)
        ts = []
        for _ in range(n):
            t0 = time.thread_time_ns()
            lin(x, out, rs)
            ts.append(time.thread_time_ns() - t0)
        ts.sort()
        rows.append((f"{name} {lin.mat.rows}x{lin.mat.cols} {lin.mat.format}", ts[n // 2] / 1e3, ts[0] / 1e3))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=64, help="decode steps per part")
    ap.add_argument("--streams", type=int, default=1,
                    help="sequences decoded together, one token each per step (times are per step)")
    ap.add_argument("--context", type=int, default=32,
                    help="prompt tokens prefilled before the decode steps (attention reads this many positions)")
    ap.add_argument("--matrices", action="store_true", help="also time layer 0's matrices alone")
    ap.add_argument("--calls", type=int, default=1000, help="timed calls per matrix (--matrices)")
    ap.add_argument("--clock", choices=("cpu", "wall"), default=None,
                    help="what the per-kernel part times: the calling thread's CPU time (default at one "
                         "thread: robust to other processes) or the wall clock (default with more)")
    a = ap.parse_args()
    cpu_clock = a.clock == "cpu" or (a.clock is None and a.threads == 1)
    clock = time.thread_time if cpu_clock else time.perf_counter
    m = coli.load(a.model, threads=a.threads)
    # the thread governor off (coli.threads): its trials of fewer threads, 8 steps every 256 or
    # more, would land in some of the timed steps and not in others
    m.engine.governor = None
    eng = m.engine
    caches = [eng.new_cache(a.context + 16 + 2 * a.tokens) for _ in range(a.streams)]
    for i, c in enumerate(caches):
        ids = [2 + (i + j) % 1000 for j in range(a.context)]
        for s0 in range(0, len(ids), 256):
            eng.step([(c, ids[s0:s0 + 256])])
    decode(eng, caches, 8)  # warm-up
    wall, cpu = decode(eng, caches, a.tokens)
    load = os.getloadavg()[0]
    S = a.streams
    print(f"{a.model} · {K.simd_name()} · {a.threads} threads · {S} stream{'s' if S > 1 else ''} · "
          f"context {a.context} · load {load:.1f}")
    print(f"decode: {wall * 1e3:.3f} ms/step ({S / wall:.1f} tok/s), process CPU {cpu * 1e3:.3f} ms/step")
    tot, cnt, wall2 = per_kernel(eng, caches, a.tokens, clock)
    n = a.tokens
    print(f"with every K.* call timed ({'thread CPU time' if cpu_clock else 'wall clock'}): {wall2 * 1e3:.3f} ms/step")
    inside = 0.0
    for k, v in sorted(tot.items(), key=lambda kv: -kv[1]):
        print(f"  {k:18s} {v / n * 1e3:8.3f} ms/step {cnt[k] / n:6.0f} calls/step {v / cnt[k] * 1e6:8.1f} us/call")
        inside += v / n
    print(f"  {'outside K.*':18s} {(wall2 - inside) * 1e3:8.3f} ms/step (the step's Python and the timers' own cost)")
    if not eng.model.moe_layers:  # (MoE layers read the no-op router's output)
        print(f"the step's Python alone (every K.* a no-op, median): {wiring(eng, caches, 200) * 1e6:.1f} us/step")
    if a.matrices:
        print(f"layer 0's matrices alone, one token, cache-hot, thread CPU time ({a.threads} threads: the caller's):")
        for name, med, low in matrices(eng.model, eng.run_state, a.calls):
            print(f"  {name:32s} median {med:8.2f} us  min {low:8.2f} us")


if __name__ == "__main__":
    main()
