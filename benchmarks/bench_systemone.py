#!/usr/bin/env python3
"""Batched closed-set scoring vs the per-option loop it replaced, side by side in one run.

Two requests in /v1/systemone's rendering (coli.server.systemone) over a ~200-token state:
``three`` (one noul, one 5-option choice, one 5-level score) and ``choice255`` (a choice
of 255 options). Each runs through the runner two ways:

- batched: one ``Runner.score_branches`` request (coli.scoring);
- loop: what /v1/brio did before, one ``Runner.score`` request per option, pinned to one
  KV slot so that every option after the first reuses the prefix.

``cold``: the slot holds something else first (the prefix is computed); ``warm``: the
same request again (the state is in the slot). Engine steps are the runner's counter;
wall time is from submission to the last answer. Also times ``evaluate`` (the whole
handler minus HTTP: validation, rendering, tokenizing, scoring, formulas) warm.

    python benchmarks/bench_systemone.py --threads 2 [--model DIR] [--repeats 5] [--json]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model directory (default: the built-in model)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))

    import coli
    from coli.runner import Runner
    from coli.scheduler import Error, PromptLogprobs
    from coli.scoring import BranchLogprobs, Question
    from coli.server import Server, ServerConfig
    from coli.server import systemone as S

    model = coli.load(args.model, threads=args.threads)
    runner = Runner(model, kv_slots=1, persist=False, notice=lambda t: None)
    server = Server(model, runner, ServerConfig())
    tok = model.tokenizer
    words = "the quick brown fox jumps over the lazy dog while a small bird sings in the old oak tree near the river"
    state = " ".join([words] * 40)
    state = tok.decode(tok.encode(state, add_special_tokens=False)[:200])
    three = {"refund": {"type": "noul", "instructions": "Does the customer ask for a refund?"},
             "team": {"type": "choice", "instructions": "Which team should handle this?",
                      "criteria": {n: None for n in ("billing", "technical", "shipping", "sales", "other")}},
             "urgency": {"type": "score", "instructions": "How urgent is it?",
                         "criteria": ["not at all", "a little", "somewhat", "very", "extremely"]}}
    # 255 distinct words of the vocabulary (one or a few tokens each, like real option names)
    vocab = sorted({tok.decode([i]).strip() for i in range(model.config.vocab_size)})
    words_ = [w for w in vocab if w.isalpha() and len(w) > 3]
    names = words_[::max(1, len(words_) // 255)][:255] if len(words_) >= 255 else [f"option {i}" for i in range(255)]
    big = {"pick": {"type": "choice", "instructions": "Which word fits best?", "criteria": {n: None for n in names}}}

    def build(questions: dict):
        head, tail = S._split(server, state)
        prefix = tok.encode(head, add_special_tokens=False)
        qs = []
        for qid, q in questions.items():
            a = S._question(qid, q, [])
            qs.append(Question.of(tok.encode(a.text + tail, add_special_tokens=False),
                                  [tok.encode(x, add_special_tokens=False) for x in a.labels]))
        return prefix, qs

    def batched(prefix, qs):
        out = None
        for ev in runner.score_branches(prefix, qs, cache_slot=0).events(600):
            if isinstance(ev, BranchLogprobs):
                out = ev.logprobs
            elif isinstance(ev, Error):
                raise ev.exception()
        return out

    def loop(prefix, qs):
        out = []
        for q in qs:
            row = []
            for o in q.options:
                ids = prefix + list(q.ids) + list(o)
                for ev in runner.score(ids, len(prefix) + len(q.ids), cache_slot=0).events(600):
                    if isinstance(ev, PromptLogprobs):
                        row.append(ev.logprobs)
                    elif isinstance(ev, Error):
                        raise ev.exception()
            out.append(row)
        return out

    other = tok.encode("something else entirely " * 20, add_special_tokens=False)

    def measure(fn, prefix, qs, warm: bool):
        steps, walls = [], []
        for _ in range(args.repeats):
            if warm:
                fn(prefix, qs)  # the state is now in the slot
            else:
                list(runner.generate(other, max_tokens=1, cache_slot=0))  # the slot now holds other tokens
            s0, t0 = runner.steps, time.perf_counter()
            fn(prefix, qs)
            walls.append(time.perf_counter() - t0)
            steps.append(runner.steps - s0)
        return {"steps": statistics.median(steps), "ms": round(1000 * statistics.median(walls), 1),
                "ms_min": round(1000 * min(walls), 1), "ms_max": round(1000 * max(walls), 1)}

    rows = []
    for name, questions in (("three", three), ("choice255", big)):
        prefix, qs = build(questions)
        for warm in (False, True):
            b = measure(batched, prefix, qs, warm)
            lp = measure(loop, prefix, qs, warm)
            rows.append({"request": name, "cache": "warm" if warm else "cold", "prefix_tokens": len(prefix),
                         "question_tokens": sum(len(q.ids) for q in qs),
                         "options": sum(len(q.options) for q in qs), "batched": b, "loop": lp,
                         "fewer_steps": round(lp["steps"] / b["steps"], 1), "speedup": round(lp["ms"] / b["ms"], 1)})
    # the whole handler (no HTTP), warm
    body = {"state": state, "questions": three}
    asyncio.run(S.evaluate(server, body))
    walls = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        asyncio.run(S.evaluate(server, body))
        walls.append(time.perf_counter() - t0)
    handler = {"request": "three via evaluate()", "cache": "warm", "ms": round(1000 * statistics.median(walls), 1),
               "ms_min": round(1000 * min(walls), 1)}
    runner.close()
    report = {"model": str(model.path), "threads": args.threads, "repeats": args.repeats, "rows": rows,
              "handler": handler, "load": os.getloadavg()}
    if args.json:
        print(json.dumps(report, indent=1))
        return
    print(f"model {model.path}  threads {args.threads}  repeats {args.repeats}  load {os.getloadavg()}")
    print("| request | cache | prefix tok | options | batched steps | loop steps | fewer steps | batched ms | "
          "loop ms | speedup |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['request']} | {r['cache']} | {r['prefix_tokens']} | {r['options']} | {r['batched']['steps']} | "
              f"{r['loop']['steps']} | {r['fewer_steps']}x | {r['batched']['ms']} ({r['batched']['ms_min']}–"
              f"{r['batched']['ms_max']}) | {r['loop']['ms']} ({r['loop']['ms_min']}–{r['loop']['ms_max']}) | "
              f"{r['speedup']}x |")
    print(f"\nwhole handler (evaluate, no HTTP), three questions, warm: median {handler['ms']} ms "
          f"(min {handler['ms_min']})", file=sys.stdout)


if __name__ == "__main__":
    main()
