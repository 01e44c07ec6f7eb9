"""What speculation's bookkeeping costs per decode step: the runner's two hooks
(Speculator.extend before the engine step, Speculator.observe after it), timed with
perf_counter_ns in a real runner, for ``--speculative off`` and ``auto`` side by side.

    python benchmarks/bench_speculative_overhead.py                  # the built-in model, 2 threads
    PYTHONPATH=/path/to/other/checkout python benchmarks/bench_speculative_overhead.py   # another tree

Each workload of bench_speculative.py (default: the ones where the built-in model drafts
nothing) runs greedily through an ``off`` runner and an ``auto`` runner, alternating.
Reported per mode, in microseconds per decode step (prefill steps left out): all steps,
a request's first decode step (its speculation state is made), steps timed for the cost
model (the thread's CPU clock read twice) and the other ("plain") steps. The hooks run
right after an engine step, with cold caches: the same code costs several times less in a
loop. ``off`` is the floor (the hooks are called and return).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import coli  # noqa: E402
from bench_speculative import WORKLOADS  # noqa: E402
from coli.runner import Runner  # noqa: E402
from coli.sampling import SamplingParams  # noqa: E402
from coli.speculate import Speculator  # noqa: E402


def measure(model, workloads: dict[str, list[int]], repeats: int, max_tokens: int) -> dict:
    rec: dict[tuple[str, str], list[int]] = {}
    pending: dict[int, tuple[int, bool]] = {}
    seen: set[int] = set()
    extend, observe = Speculator.extend, Speculator.observe

    def timed_extend(self, plan):
        req = plan.seqs[0].request if plan.seqs else None
        first = req is not None and not req.prefilling and id(req) not in seen
        t = time.perf_counter_ns()
        extend(self, plan)
        pending[id(self)] = (time.perf_counter_ns() - t, first)
        if first:
            seen.add(id(req))

    def timed_observe(self, plan, seconds):
        t = time.perf_counter_ns()
        observe(self, plan, seconds)
        d = time.perf_counter_ns() - t
        x, first = pending.pop(id(self), (0, False))
        if plan.seqs and not any(s.request.prefilling for s in plan.seqs):
            kind = "first" if first else "timed" if getattr(self, "_timed", False) else "plain"
            for k in (kind, "all"):
                rec.setdefault((self.mode, k), []).append(x + d)

    Speculator.extend, Speculator.observe = timed_extend, timed_observe
    try:
        with Runner(model, persist=False, speculative="off") as off, \
                Runner(model, persist=False, speculative="auto") as on:
            for _ in range(repeats):
                for ids in workloads.values():
                    for runner in (off, on):
                        runner.submit(ids, max_tokens=max_tokens, sampling=SamplingParams(temperature=0)).result(600)
    finally:
        Speculator.extend, Speculator.observe = extend, observe
    return {f"{mode} {kind}": dict(steps=len(xs), median_us=statistics.median(xs) / 1e3,
                                   mean_us=statistics.mean(xs) / 1e3)
            for (mode, kind), xs in sorted(rec.items())}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default=None, help="model directory (default: the built-in model)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quant", default=None)
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--only", nargs="+", default=["free", "typo"], help="workloads whose name contains one of these")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    model = coli.load(a.model, threads=a.threads, **({"quant": a.quant} if a.quant else {}))
    workloads = {name: model.prompt_ids([{"role": "user", "content": text}])
                 for name, text in WORKLOADS.items() if any(s in name for s in a.only)}
    load0 = os.getloadavg()
    res = measure(model, workloads, a.repeats, a.max_tokens)
    for name, r in res.items():
        print(f"{name:12} steps {r['steps']:5}  median {r['median_us']:7.2f} us  mean {r['mean_us']:7.2f} us",
              file=sys.stderr)
    meta = dict(coli=coli.__file__, model=str(model.path), threads=a.threads, workloads=list(workloads),
                repeats=a.repeats, load=[load0, os.getloadavg()])
    print(f"load {load0[0]:.1f} -> {os.getloadavg()[0]:.1f}  ({coli.__file__})", file=sys.stderr)
    if a.json:
        print(json.dumps(dict(meta, results=res), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
