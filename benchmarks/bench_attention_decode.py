"""One-token decode attention, cold against cache-hot: what a call costs when its cache rows
come from L3 / DRAM (as in a decode step, whose weights went through the caches since the
layer last read them) and when they sit in L1 / L2.

    python benchmarks/bench_attention_decode.py --threads 1 --pos 136
    python benchmarks/bench_attention_decode.py --threads 1 --pos 136 --half   # an f16 cache, the default
    python benchmarks/bench_attention_decode.py -m DIR --threads 2 --streams 4 --context 2048  # whole steps
    python benchmarks/bench_attention_decode.py --threads 2 --pos 160 --half --heads 16 --kv-heads 16 --layers 8 --wide 0
    python benchmarks/bench_attention_decode.py --threads 2 --pos 191 --half --heads 16 --kv-heads 16 --layers 8 --split 0

Shape: SmolLM2-135M's (9 heads, 3 KV heads, head_dim 64, 30 layers). Cold: the 30 layers'
caches attended in turn, ``--evict`` MB walked between passes; hot: one cache, again and
again. The caches start on a 64-byte boundary, as the engine's do (``--offset`` floats past
it: misaligned rows, which several heads realign before use). Wall clock per call (median and
minimum), and at one thread the calling thread's CPU time too (robust to other processes);
compare two trees with ``PYTHONPATH=<tree>`` one after the other, and keep the load
(``uptime``) next to the numbers.

With ``-m DIR``: whole one-token decode steps of that model instead (``--streams`` sequences
each prefilled to ``--context`` positions, one token each per step, the cache cut back after
every step), the median over ``--rounds`` rounds of the best of 4 steps, in ms; at long
contexts attention is most of such a step. Compare trees the same way, alternating them.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from coli._engine import kernels as K

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_attention_prefetch import best_step_ms, prefilled  # noqa: E402


def steps(a) -> None:
    model, eng, caches, base = prefilled(a)
    res = [best_step_ms(eng, caches, base) for _ in range(a.rounds)]
    model.close()
    print(f"{a.model} · {K.simd_name()} · {a.threads} threads · {a.streams} streams · context {a.context} · "
          f"load {os.getloadavg()[0]:.1f}")
    print(f"decode step: median {statistics.median(res):.3f} ms (min {min(res):.3f}) of {a.rounds} rounds")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--pos", type=int, default=136, help="the query's position (keys 0..pos)")
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--evict", type=int, default=64, help="MB read between cold passes")
    ap.add_argument("--passes", type=int, default=40)
    ap.add_argument("--half", action="store_true", help="an f16 cache (the engine's default) instead of float32")
    ap.add_argument("--offset", type=int, default=0, help="floats past a 64-byte boundary the caches start")
    ap.add_argument("--wide", type=int, default=2, choices=(0, 1, 2),
                    help="one-token rows: 0 by runs of heads, 1 every head at once, 2 (default) the engine's choice "
                         "(kernels.set_att_wide)")
    ap.add_argument("--split", type=int, default=1, choices=(0, 1),
                    help="K.set_att_wide_split: 1 (the default) cuts a lone row's leftover chunks into one part "
                         "of their heads a thread, 0 gives each chunk whole to one thread")
    ap.add_argument("-m", "--model", help="time whole decode steps of this model instead of the kernel")
    ap.add_argument("--streams", type=int, default=1)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=12)
    a = ap.parse_args()
    K.set_att_wide(a.wide)
    K.set_att_wide_split(bool(a.split))
    if a.model:
        steps(a)
        return
    K.set_num_threads(a.threads)
    nh, nkv, hd, L = a.heads, a.kv_heads, a.head_dim, a.layers
    rng = np.random.default_rng(0)
    cap = a.pos + 1

    def cache():  # (cap, nkv*hd), a.offset floats past a 64-byte boundary
        dt = np.float16 if a.half else np.float32
        raw = np.empty(cap * nkv * hd + 64, dt)
        s = (-(raw.ctypes.data // raw.itemsize)) % (64 // raw.itemsize) + a.offset % 16
        c = raw[s : s + cap * nkv * hd].reshape(cap, nkv * hd)
        c[:] = rng.standard_normal(c.shape)
        return c

    caches = [(cache(), cache()) for _ in range(L)]
    ptrs = [(np.array([k.ctypes.data], np.int64), np.array([v.ctypes.data], np.int64)) for k, v in caches]
    q = rng.standard_normal((1, nh * hd)).astype(np.float32)  # (1, nh*hd)
    out = np.zeros((1, nh * hd), np.float32)
    pos = np.array([a.pos], np.int32)
    evict = np.ones(a.evict << 20, np.int8)

    def call(kp, vp):
        K.attention(q, kp, vp, pos, out, nh, nkv, hd, hd, hd ** -0.5, half=a.half)

    cold, hot, cold_cpu, hot_cpu = [], [], [], []
    for _ in range(a.passes):
        evict.sum()
        t0, c0 = time.perf_counter(), time.thread_time()
        for kp, vp in ptrs:
            call(kp, vp)
        cold.append((time.perf_counter() - t0) / L * 1e6)
        cold_cpu.append((time.thread_time() - c0) / L * 1e6)
    for _ in range(a.passes * L):
        t0, c0 = time.perf_counter(), time.thread_time()
        call(*ptrs[0])
        hot.append((time.perf_counter() - t0) * 1e6)
        hot_cpu.append((time.thread_time() - c0) * 1e6)
    for t in (cold, hot, cold_cpu, hot_cpu):
        t.sort()
    print(f"{K.simd_name()} · {a.threads} threads · position {a.pos} · offset {a.offset % 16} · "
          f"wide mode {a.wide} · split {a.split} · "
          f"load {os.getloadavg()[0]:.1f}")
    for name, wall, cpu in (("cold", cold, cold_cpu), ("hot ", hot, hot_cpu)):
        line = f"{name}: median {wall[len(wall) // 2]:.2f} us/call, min {wall[0]:.2f}"
        if a.threads == 1:
            line += f" · thread CPU median {cpu[len(cpu) // 2]:.2f} us/call"
        print(line)


if __name__ == "__main__":
    main()
