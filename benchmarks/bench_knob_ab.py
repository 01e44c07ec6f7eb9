"""Whole one-token decode steps with a kernels setting one way and the other, alternated in one
process: an A/B that a machine whose speed drifts (memory bandwidth moving by a third within
minutes on shared hosts) cannot bias towards either side.

    python benchmarks/bench_knob_ab.py -m /work/models/olmoe-mini-int4s --threads 2 --knob set_att_wide_split --values 1,0
    python benchmarks/bench_knob_ab.py -m DIR --knob set_att_wide --values 2,0 --rounds 12
    python benchmarks/bench_knob_ab.py -m DIR --knob set_moe_whole --values 0,1 --streams 4

Each round prefills a ``--prompt``-token prompt into a fresh cache, then decodes ``--tokens``
steps with every value in turn (the cache cut back to the prompt between values, so each
value decodes the same positions; with ``--streams`` S caches, each from its own prompt, step
together); the order of the values alternates between rounds. Prints
the median ms a step of each value over the rounds and their ratio to the first value.
Settings are those of ``coli._engine.kernels`` taking one int (``set_att_wide``,
``set_att_wide_split``, ``set_att_prefetch``, ...): results do not depend on them, only speed.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import coli
from coli._engine import kernels as K


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--knob", required=True, help="a kernels setter of one int, e.g. set_att_wide_split")
    ap.add_argument("--values", default="1,0", help="comma-separated values, the first the baseline of the ratios")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--streams", type=int, default=1, help="sequences decoded together, one token each a step")
    a = ap.parse_args()
    setter = getattr(K, a.knob, None)
    if setter is None or not a.knob.startswith("set_"):
        ap.error(f"--knob: coli._engine.kernels has no setter {a.knob!r}")
    values = [int(v) for v in a.values.split(",")]
    m = coli.load(a.model, threads=a.threads)
    # the thread governor off (coli.threads): its trials of fewer threads, 8 steps every 256 or
    # more, would land in some of the timed steps and not in others
    m.engine.governor = None
    eng = m.engine
    times: dict[int, list[float]] = {v: [] for v in values}
    try:
        for r in range(a.rounds + 1):
            caches = [eng.new_cache(a.prompt + a.tokens + 16) for _ in range(a.streams)]
            for i, c in enumerate(caches):  # (each stream its own prompt: different experts)
                own = [2 + (j + 37 * i) % 1000 for j in range(a.prompt)]
                for s0 in range(0, len(own), 256):
                    eng.step([(c, own[s0:s0 + 256])])
            order = values if r % 2 == 0 else values[::-1]
            for v in order:
                setter(v)
                for c in caches:
                    c.truncate(a.prompt)
                t0 = time.perf_counter()
                for t in range(a.tokens):
                    eng.step([(c, [5 + (t + 11 * i) % 500]) for i, c in enumerate(caches)])
                if r > 0:  # round 0 warms up
                    times[v].append((time.perf_counter() - t0) / a.tokens * 1e3)
    finally:
        m.close()
    print(f"{a.model} · {K.simd_name()} · {a.threads} threads · {a.prompt} → {a.prompt + a.tokens} positions · "
          f"{a.streams} stream(s) · {a.rounds} rounds · load {os.getloadavg()[0]:.1f}")
    base = statistics.median(times[values[0]])
    for v in values:
        med = statistics.median(times[v])
        print(f"  {a.knob}({v}): median {med:.3f} ms/step (min {min(times[v]):.3f}) · {med / base:.3f}x the first")


if __name__ == "__main__":
    main()
