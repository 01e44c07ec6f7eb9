"""Speculative decoding: greedy decode tok/s without and with it, on copy-heavy requests
("rewrite this function with one change", "fix the typo in this paragraph") and on free
generation (a question), through the runner, side by side in one run.

    python benchmarks/bench_speculative.py --threads 2                 # the built-in model
    python benchmarks/bench_speculative.py -m DIR --modes auto ngram --json
    python benchmarks/bench_speculative.py --synthetic olmoe-1b-7b --ram-budget 1G --max-tokens 48

A synthetic (random-weight) model cannot be asked anything in words: its workloads are
seeded random token prompts, "copy" with its first two thirds repeated at the end (the
model is shown text it may write again), "free" without.

Each workload runs speculation off and on alternately (coli.speculate.bench.compare), and
reports decode tok/s both ways, the speed-up, the acceptance rate, the mean tokens per
decode step, and whether the greedy texts are identical (they must be).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

import coli
from coli._engine import kernels as K
from coli.speculate.bench import compare

FUNCTION = '''def propose(self, ctx, k):
    """Draft tokens continuing ctx: the longest suffix of ctx seen before decides."""
    if k < 1 or len(ctx) <= self.min_n:
        return []
    if len(ctx) < self.indexed:
        self.index.clear()
        self.indexed = 0
    self._extend(ctx)
    L = len(ctx)
    for n in range(min(self.max_n, L - 1), self.min_n - 1, -1):
        p = self.index.get(tuple(ctx[L - n:]))
        if p is not None:
            return [ctx[p + i % (L - p)] for i in range(k)]
    return []
'''
PARAGRAPH = ("The natural satellite of the Earth, visible by reflected light from the sun, is called the mooon. "
             "A large body of water constituting a principal part of the hydrosphere is an ocean. A sheltered "
             "port where ships can take on or discharge cargo is a harbor.")
WORKLOADS = {
    "copy: rewrite a function": f"Rewrite this function with one change (rename ctx to context):\n\n{FUNCTION}",
    "copy: fix a typo": f"Fix the typo in this paragraph and write it out again:\n\n{PARAGRAPH}",
    "free: a question": "What does 'harbor' mean?",
    "free: an open question": "Tell me about the sea, the ships and the people who sail them.",
}


def synthetic_workloads(model, n: int) -> dict[str, list[int]]:
    rng = np.random.default_rng(1)
    V = model.config.vocab_size
    size = max(1, n * 2 // 3)
    part = rng.integers(2, V, size=size).tolist()
    return {"copy: repeated random text": part + part[: n - size],
            "free: random text": rng.integers(2, V, size=n).tolist()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default=None, help="model directory (default: the built-in model)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quant", default=None)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--modes", nargs="+", default=["auto"], help="speculative modes to compare with off")
    ap.add_argument("--draft-model", default=None)
    ap.add_argument("--synthetic", default=None, help="a seeded random-weight model (coli.synthetic) instead")
    ap.add_argument("--ram-budget", default=None, help="as coli's --ram-budget: experts beyond it stream from disk")
    ap.add_argument("--prompt-tokens", type=int, default=96, help="synthetic workloads' prompt length")
    ap.add_argument("--only", default=None, help="only the workloads whose name contains this")
    ap.add_argument("--ctx", type=int, default=None, help="the context to plan memory for (a small one lets a "
                                                           "small --ram-budget hold its KV)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    opts = {k: v for k, v in dict(quant=a.quant, process_budget=a.ram_budget, max_context=a.ctx).items() if v}
    if a.synthetic:
        from coli import synthetic

        opts.pop("quant", None)
        model = coli.load(synthetic.ensure(a.synthetic, a.quant or "int4"), threads=a.threads, **opts)
    else:
        model = coli.load(a.model, threads=a.threads, **opts)
    draft = coli.load(a.draft_model, threads=a.threads) if a.draft_model else None
    workloads = synthetic_workloads(model, a.prompt_tokens) if a.synthetic else {
        name: model.prompt_ids([{"role": "user", "content": text}]) for name, text in WORKLOADS.items()}
    rows = []
    for mode in a.modes:
        for name, ids in workloads.items():
            if a.only and a.only not in name:
                continue
            res = compare(model, [ids], mode, max_tokens=a.max_tokens, repeats=a.repeats, draft_model=draft)
            res.update(workload=name, prompt_tokens=len(ids))
            rows.append(res)
            print(f"{mode:6} {name:26} wall {res['decode_tok_s_without']:7.1f} -> {res['decode_tok_s_with']:7.1f} tok/s "
                  f"{res['speedup']:5.2f}x  cpu {res['tok_per_cpu_s_without']:7.1f} -> {res['tok_per_cpu_s_with']:7.1f} "
                  f"{res['speedup_cpu']:5.2f}x  accept {res['acceptance_rate']:5.1%}  {res['tokens_per_step']:.2f} tok/step"
                  f"  {'same text' if res['identical'] else 'TEXT DIFFERS'}", file=sys.stderr)
    meta = dict(model=str(Path(model.path)), threads=a.threads, simd=K.simd_name(),
                quant=getattr(model.weights, "quant", "f32"), max_tokens=a.max_tokens, repeats=a.repeats,
                ram_budget=a.ram_budget, load=os.getloadavg())
    if a.json:
        print(json.dumps(dict(meta, results=rows), indent=1))
    return 0 if all(r["identical"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
