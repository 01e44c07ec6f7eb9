"""Scheduler benchmarks (issue: the scheduler): aggregate decode throughput with 1, 2, 4
and 8 concurrent streams, and the TTFT of a second turn that shares a long prefix.

    python benchmarks/bench_scheduler.py --synthetic olmoe-mini --quant int4 --threads 2 [--vs-engine] [--json]

Every stream decodes greedily for --gen-tokens from its own short random prompt. The
aggregate is (all generated tokens after each stream's first) / (wall time from the
moment every stream has its first token to the moment the last one finishes), so
prefill is excluded. The prefix test prefills --prefix-tokens once (cold first turn),
then submits the same prefix plus a short new turn (warm second turn), each in KV slot 0.

--vs-engine also times the engine alone (``engine.step`` on the same prompts, argmax
in the loop, no scheduler, events or consumer threads), each repeat right after the
runner's so that both see the same machine; "runner / engine" is then the share of
the engine's throughput that the runner keeps.
"""
from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

import numpy as np

import coli
from coli import synthetic
from coli.runner import Runner
from coli.scheduler import Started, TextDelta


def decode_throughput(model, streams: int, gen_tokens: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    V = model.config.vocab_size
    greedy = model.sampling_params(temperature=0.0)
    with Runner(model, kv_slots=max(streams, 1), persist=False, max_queue=streams) as runner:
        handles = [runner.submit(rng.integers(2, V, 16).tolist(), max_tokens=gen_tokens, sampling=greedy)
                   for _ in range(streams)]
        first, last, counts = [None] * streams, [None] * streams, [0] * streams

        def consume(i):
            for ev in handles[i]:
                if isinstance(ev, TextDelta):
                    counts[i] += 1
                    now = time.perf_counter()
                    first[i] = first[i] or now
                    last[i] = now

        threads = [threading.Thread(target=consume, args=(i,)) for i in range(streams)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(600)
    t0, t1 = max(first), max(last)
    tokens = sum(c - 1 for c in counts)
    return {"streams": streams, "tokens": tokens, "seconds": t1 - t0, "tok_s": tokens / (t1 - t0)}


def engine_throughput(model, streams: int, gen_tokens: int, seed: int) -> dict:
    """decode_throughput's measure with the engine alone: the same prompts prefilled in one
    step, then gen_tokens - 1 greedy decode steps timed."""
    rng = np.random.default_rng(seed)
    V = model.config.vocab_size
    engine = model.engine
    caches = [engine.new_cache() for _ in range(streams)]
    logits = engine.step([(c, rng.integers(2, V, 16).tolist()) for c in caches])  # (streams, V)
    picks = logits.argmax(axis=1).tolist()
    t0 = time.perf_counter()
    for _ in range(gen_tokens - 1):
        picks = engine.step([(c, [t]) for c, t in zip(caches, picks)]).argmax(axis=1).tolist()
    seconds = time.perf_counter() - t0
    tokens = streams * (gen_tokens - 1)
    return {"streams": streams, "tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds}


def _summary(streams: int, runs: list[dict]) -> dict:
    return {"streams": streams, "tok_s": statistics.median(r["tok_s"] for r in runs),
            "min": min(r["tok_s"] for r in runs), "max": max(r["tok_s"] for r in runs)}


def prefix_ttft(model, prefix_tokens: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    V = model.config.vocab_size
    prefix = rng.integers(2, V, prefix_tokens).tolist()
    greedy = model.sampling_params(temperature=0.0)
    out = {}
    with Runner(model, kv_slots=1, persist=False) as runner:
        for name, prompt in (("cold", prefix), ("warm", prefix + rng.integers(2, V, 24).tolist())):
            t0 = time.perf_counter()
            cached = 0
            for ev in runner.submit(prompt, max_tokens=2, sampling=greedy, cache_slot=0):
                if isinstance(ev, Started):
                    cached = ev.cached_tokens
                if isinstance(ev, TextDelta):
                    out[name] = {"ttft_s": time.perf_counter() - t0, "prompt_tokens": len(prompt),
                                 "cached_tokens": cached}
                    break
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model")
    ap.add_argument("--synthetic", default="olmoe-mini")
    ap.add_argument("--quant", default="int4")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--gen-tokens", type=int, default=48)
    ap.add_argument("--streams", default="1,2,4,8")
    ap.add_argument("--prefix-tokens", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--vs-engine", action="store_true", help="also time the engine alone (see the docstring)")
    a = ap.parse_args()
    path = a.model or synthetic.ensure(a.synthetic, a.quant)
    model = coli.load(path, threads=a.threads)
    rows, engine_rows = [], []
    for n in (int(x) for x in a.streams.split(",")):
        runs, alone = [], []
        for r in range(a.repeats):
            runs.append(decode_throughput(model, n, a.gen_tokens, seed=r))
            if a.vs_engine:
                alone.append(engine_throughput(model, n, a.gen_tokens, seed=r))
        rows.append(_summary(n, runs))
        if a.vs_engine:
            engine_rows.append(_summary(n, alone))
    for table in (rows, engine_rows):
        for r in table:
            r["speedup"] = r["tok_s"] / table[0]["tok_s"]
    ttft = prefix_ttft(model, a.prefix_tokens, seed=99)
    result = {"model": str(path), "threads": a.threads, "gen_tokens": a.gen_tokens, "decode": rows, "prefix": ttft}
    if a.vs_engine:
        result["engine_alone"] = engine_rows
    if a.json:
        print(json.dumps(result, indent=1))
        return
    print(f"model {path}, {a.threads} threads, {a.gen_tokens} tokens per stream, median of {a.repeats}")
    if a.vs_engine:
        print("| streams | aggregate decode tok/s | min … max | vs 1 stream | engine alone tok/s | vs 1 stream "
              "| runner / engine |")
        print("|---|---|---|---|---|---|---|")
        for r, e in zip(rows, engine_rows):
            print(f"| {r['streams']} | {r['tok_s']:.1f} | {r['min']:.1f} … {r['max']:.1f} | {r['speedup']:.2f}x "
                  f"| {e['tok_s']:.1f} | {e['speedup']:.2f}x | {r['tok_s'] / e['tok_s']:.3f} |")
    else:
        print("| streams | aggregate decode tok/s | min … max | vs 1 stream |")
        print("|---|---|---|---|")
        for r in rows:
            print(f"| {r['streams']} | {r['tok_s']:.1f} | {r['min']:.1f} … {r['max']:.1f} | {r['speedup']:.2f}x |")
    c, w = ttft["cold"], ttft["warm"]
    print(f"\nTTFT cold first turn ({c['prompt_tokens']} tokens): {c['ttft_s']:.3f} s; second turn sharing the "
          f"prefix ({w['prompt_tokens']} tokens, {w['cached_tokens']} cached): {w['ttft_s']:.3f} s")


if __name__ == "__main__":
    main()
