"""The runner's own cost per step: the runner thread's CPU time outside ``engine.step``
(scheduling, sampling, detokenization, stop strings, events and their delivery), beside
the CPU time of ``engine.step`` itself, for S greedy streams decoding together.

    python benchmarks/bench_runner_overhead.py --model DIR --streams 1 4 [--bias] [--threads 1]

Thread CPU clocks (the runner thread's, and the calling thread's inside engine.step), so a
loaded machine disturbs this far less than a wall-clock rate; at --threads 1 the engine's
number is its whole cost. ``--bias`` gives every request a logit_bias (as bench_serve.py's
clients send: end of turn banned). Compare two trees by running this with each on
PYTHONPATH, alternating; the median of --repeats runs is printed.
"""
from __future__ import annotations

import argparse
import os
import statistics
import threading
import time

import numpy as np

import coli
from coli.runner import Runner
from coli.sampling import SamplingParams


def one_run(model, streams: int, tokens: int, bias, seed: int) -> tuple[float, float]:
    """(runner thread CPU outside engine.step, engine.step CPU), microseconds per step."""
    eng, acc = model.engine, {"cpu": 0.0, "steps": 0}
    step = eng.step

    def timed(*a, **kw):
        c = time.thread_time()
        try:
            return step(*a, **kw)
        finally:
            acc["cpu"] += time.thread_time() - c
            acc["steps"] += 1

    eng.step = timed
    rng = np.random.default_rng(seed)
    V = model.config.vocab_size
    try:
        with Runner(model, kv_slots=streams, persist=False, max_queue=streams, notice=lambda t: None) as runner:
            clock = time.pthread_getcpuclockid(runner._thread.ident)
            c0 = time.clock_gettime(clock)
            with runner.scheduler.paused():  # every stream starts in the same step
                handles = [runner.submit(rng.integers(2, V, 16).tolist(), max_tokens=tokens,
                                         sampling=SamplingParams(temperature=0), logit_bias=bias)
                           for _ in range(streams)]
            readers = [threading.Thread(target=lambda h=h: [None for _ in h]) for h in handles]
            for t in readers:
                t.start()
            for t in readers:
                t.join()
            total = time.clock_gettime(clock) - c0
    finally:
        eng.step = step
    n = max(acc["steps"], 1)
    return 1e6 * (total - acc["cpu"]) / n, 1e6 * acc["cpu"] / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--tokens", type=int, default=96, help="generated per stream")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--bias", action="store_true", help="every request bans end of turn with logit_bias")
    a = ap.parse_args()
    model = coli.load(a.model, threads=a.threads)
    bias = {int(t): -100.0 for t in model.eos_ids} if a.bias else None
    print(f"{a.model}, {a.threads} thread(s), {a.tokens} tokens per stream, logit_bias {'on' if a.bias else 'off'}, "
          f"median of {a.repeats}")
    print("| streams | runner CPU outside engine.step, us/step | engine.step CPU, us/step | load |")
    print("|---|---|---|---|")
    for s in a.streams:
        runs = [one_run(model, s, a.tokens, bias, seed=r) for r in range(a.repeats)]
        print(f"| {s} | {statistics.median(r[0] for r in runs):.0f} ({min(r[0] for r in runs):.0f} … "
              f"{max(r[0] for r in runs):.0f}) | {statistics.median(r[1] for r in runs):.0f} | "
              f"{os.getloadavg()[0]:.1f} |", flush=True)


if __name__ == "__main__":
    main()
