"""Decode on a busy machine: the thread governor (coli/threads.py) against a fixed thread
count, side by side in one run.

    python benchmarks/bench_threads.py -m /work/models/smollm2-int8 --threads 2            # as the machine is
    python benchmarks/bench_threads.py -m /work/models/smollm2-int8 --threads 2 --hogs 4   # + 4 busy processes

Each round runs one child process per setting (COLI_ADAPTIVE_THREADS=1, then 0), one after
the other: it loads the model, prefills 32 tokens and decodes one token a step for --steps
steps or --seconds seconds, whichever ends first, and reports tok/s, the median and 90th
percentile step, and how many steps ran with fewer threads. With ``--hogs K``, K processes
that only spin are started and every process (hogs and children) is pinned to the same
--threads CPUs, so the contention is the same on any machine.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys

CHILD = r"""
import json, os, sys, time
import coli
m = coli.load(sys.argv[1], threads=int(sys.argv[2]))
eng, steps, limit = m.engine, int(sys.argv[3]), float(sys.argv[4])
cache = eng.new_cache(steps + 64)
eng.step([(cache, list(range(2, 34)))])
ts, fewer = [], 0
t0 = time.perf_counter()
while len(ts) < steps and time.perf_counter() - t0 < limit:
    t = time.perf_counter()
    eng.step([(cache, [5])])
    ts.append(time.perf_counter() - t)
    fewer += eng.threads_in_use < eng.threads
g = eng.governor
print(json.dumps(dict(steps=len(ts), seconds=sum(ts), times=ts, fewer=fewer,
                      trials=g.trials if g else 0, switches=g.switches if g else 0)))
"""


def _spin() -> None:
    while True:
        pass


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--seconds", type=float, default=30.0, help="longest decode per child")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--hogs", type=int, default=0, help="busy processes sharing the --threads CPUs")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    cpus = None
    hogs = []
    if a.hogs:
        cpus = sorted(os.sched_getaffinity(0))[: a.threads]
        os.sched_setaffinity(0, cpus)  # children inherit it
        ctx = mp.get_context("fork")
        for _ in range(a.hogs):
            h = ctx.Process(target=_spin, daemon=True)
            h.start()
            hogs.append(h)
    rows = []
    try:
        for r in range(a.rounds):
            for adaptive in ("1", "0"):
                env = dict(os.environ, COLI_ADAPTIVE_THREADS=adaptive)
                out = subprocess.run([sys.executable, "-c", CHILD, a.model, str(a.threads), str(a.steps), str(a.seconds)],
                                     env=env, capture_output=True, text=True, check=True)
                d = json.loads(out.stdout.strip().splitlines()[-1])
                ts = sorted(d.pop("times"))
                d.update(round=r, adaptive=adaptive == "1", tok_s=d["steps"] / d["seconds"],
                         median_ms=statistics.median(ts) * 1e3, p90_ms=ts[int(0.9 * (len(ts) - 1))] * 1e3,
                         load=os.getloadavg()[0])
                rows.append(d)
                print(f"round {r} {'governed' if d['adaptive'] else 'fixed   '} {d['tok_s']:7.1f} tok/s  "
                      f"median {d['median_ms']:7.1f} ms  p90 {d['p90_ms']:8.1f} ms  {d['steps']} steps, "
                      f"{d['fewer']} with fewer threads, {d['trials']} trials  load {d['load']:.1f}", file=sys.stderr)
    finally:
        for h in hogs:
            h.terminate()
    if a.json:
        print(json.dumps(dict(model=a.model, threads=a.threads, hogs=a.hogs, cpus=cpus, rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
