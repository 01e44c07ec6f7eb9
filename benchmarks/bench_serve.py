"""coli serve under concurrent streaming clients, against the same runner called in-process.

For each concurrency level (default 1, 4, 8) every client sends ``--requests`` streaming
chat requests one after another, each with its own random prompt (no prefix reuse) and a
fixed number of generated tokens (end-of-turn banned with logit_bias). Reported per level:
TTFT p50/p95 (request sent -> first content token), per-stream decode tok/s (tokens after
the first / time after the first), aggregate tok/s (all tokens / wall time, prefill
included) and aggregate decode tok/s (tokens after each stream's first / the time from the
last stream's first token to the last token: with ``--requests 1`` every stream decodes
at once there, so this is bench_scheduler.py's measure through HTTP; "x 1" is its ratio to
the lowest level's):

    python benchmarks/bench_serve.py --model DIR --threads 2 --levels 1 4 --tokens 128 --requests 1 --repeat 5

The same workload runs twice: over HTTP against a `coli serve` subprocess (clients in this
process, aiohttp, SSE parsed), and in-process through ``Runner.submit`` (no HTTP, no JSON).
The difference in per-token time at concurrency 1 is the server's overhead per token.

Also reported per level (Linux): the `coli serve` process's CPU time per generated token,
from /proc: its busiest thread's (at --threads 1 the runner thread: the engine step,
sampling, detokenization, event delivery) and every other thread's (the HTTP side: the
event loop; with --threads > 1 also the OpenMP workers and their spinning). CPU time is
far less disturbed by other processes on the machine than wall-clock tok/s.

    python benchmarks/bench_serve.py --model olmoe-mini --quant int4 --threads 1
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time

import numpy as np


def prompts(level: int, clients: int, requests: int, words: int, vocab: int) -> list[list[str]]:
    rng = np.random.default_rng(1000 + level)
    return [[" ".join(f"w{t}" for t in rng.integers(2, vocab, size=words)) for _ in range(requests)]
            for _ in range(clients)]


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q)) if xs else float("nan")


def summarize(records: list[dict], wall: float) -> dict:
    ttft = [r["ttft"] for r in records]
    rates = [(r["tokens"] - 1) / (r["last"] - r["first"]) for r in records if r["tokens"] > 1 and r["last"] > r["first"]]
    per_token = [(r["last"] - r["first"]) / (r["tokens"] - 1) for r in records if r["tokens"] > 1]
    tokens = sum(r["tokens"] for r in records)
    # every stream decoding at once (prefill excluded, as bench_scheduler.py): meaningful with --requests 1
    timed = [r for r in records if r["first"] is not None and r["last"] is not None]
    span = max(r["last"] for r in timed) - max(r["first"] for r in timed) if timed else 0.0
    decode = sum(r["tokens"] - 1 for r in timed) / span if span > 0 else float("nan")
    return {"ttft_p50_ms": 1000 * pct(ttft, 50), "ttft_p95_ms": 1000 * pct(ttft, 95),
            "stream_tok_s_p50": pct(rates, 50), "aggregate_tok_s": tokens / wall, "decode_tok_s": decode,
            "ms_per_token_p50": 1000 * pct(per_token, 50), "requests": len(records), "tokens": tokens}


# -- over HTTP ----------------------------------------------------------------------------------


async def http_client(session, url: str, texts: list[str], tokens: int, bias: dict, out: list) -> None:
    for text in texts:
        body = {"model": "bench", "messages": [{"role": "user", "content": text}], "max_tokens": tokens,
                "temperature": 0, "stream": True, "stream_options": {"include_usage": True}, "logit_bias": bias}
        t0 = time.perf_counter()
        first = last = None
        n = 0
        async with session.post(url + "/v1/chat/completions", json=body) as resp:
            assert resp.status == 200, await resp.text()
            async for line in resp.content:
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    n = chunk["usage"]["completion_tokens"]
                for c in chunk["choices"]:
                    if c["delta"].get("content"):
                        last = time.perf_counter()
                        first = first or last
        out.append({"ttft": first - t0, "first": first, "last": last, "tokens": n})


async def run_http(url: str, level: int, texts: list[list[str]], tokens: int, bias: dict) -> dict:
    import aiohttp

    records: list[dict] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:
        t0 = time.perf_counter()
        await asyncio.gather(*(http_client(session, url, t, tokens, bias, records) for t in texts[:level]))
        wall = time.perf_counter() - t0
    return summarize(records, wall)


def start_server(model: str, threads: int, slots: int) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "COLI_THREADS": str(threads)}
    proc = subprocess.Popen([sys.executable, "-m", "coli.cli", "serve", "--model", model, "--port", "0",
                             "--model-id", "bench", "--kv-slots", str(slots), "--no-kv-persist", "--ctx", "1024"],
                            env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    for line in proc.stderr:
        m = re.search(r"listening on (http://\S+)", line)
        if m:
            threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()
            return proc, m.group(1)
    raise RuntimeError("coli serve did not start")


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) of each thread of process ``pid`` by thread id; empty
    where /proc is not there."""
    out: dict[str, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[tid] = (int(fields[11]) + int(fields[12])) / tick
    return out


def cpu_per_token(before: dict, after: dict, tokens: int) -> dict:
    """ms of CPU per generated token: the busiest thread's (the runner's, at --threads 1),
    and all the others' together."""
    delta = sorted((after[k] - before.get(k, 0.0) for k in after), reverse=True) or [0.0]
    return {"runner_cpu_ms_per_token": 1000 * delta[0] / max(tokens, 1),
            "other_cpu_ms_per_token": 1000 * sum(delta[1:]) / max(tokens, 1)}


# -- in-process -----------------------------------------------------------------------------------


async def runner_client(runner, model, texts: list[str], tokens: int, bias: dict, out: list) -> None:
    from coli.sampling import SamplingParams
    from coli.scheduler import TextDelta, Usage

    for text in texts:
        ids = model.prompt_ids([{"role": "user", "content": text}])
        t0 = time.perf_counter()
        first = last = None
        n = 0
        h = runner.submit(ids, max_tokens=tokens, sampling=SamplingParams(temperature=0), logit_bias=bias)
        async for ev in h:
            if isinstance(ev, TextDelta) and ev.text:
                last = time.perf_counter()
                first = first or last
            elif isinstance(ev, Usage):
                n = ev.completion_tokens
        out.append({"ttft": first - t0, "first": first, "last": last, "tokens": n})


async def run_inprocess(runner, model, level: int, texts, tokens: int, bias: dict) -> dict:
    records: list[dict] = []
    t0 = time.perf_counter()
    await asyncio.gather(*(runner_client(runner, model, t, tokens, bias, records) for t in texts[:level]))
    return summarize(records, time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="olmoe-mini", help="a synthetic model name or a model directory")
    ap.add_argument("--quant", default="int4")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--levels", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--requests", type=int, default=3, help="requests per client, one after another")
    ap.add_argument("--tokens", type=int, default=64, help="tokens generated per request")
    ap.add_argument("--prompt-words", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=3, help="rounds; each reports the median")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()

    import coli
    from coli import synthetic
    from coli.runner import Runner

    path = str(synthetic.ensure(args.model, args.quant)) if args.model in synthetic.SPECS else args.model
    slots = max(args.levels)
    model = coli.load(path, threads=args.threads)
    bias = {str(t): -100 for t in model.eos_ids | model.tokenizer.special_token_ids}
    int_bias = {int(k): v for k, v in bias.items()}
    vocab = model.config.vocab_size
    runner = Runner(model, kv_slots=slots, persist=False, ctx=1024, notice=lambda t: None)
    proc, url = start_server(path, args.threads, slots)
    rounds = {"http": {lv: [] for lv in args.levels}, "inprocess": {lv: [] for lv in args.levels}}
    load = [os.getloadavg()[0]]
    try:
        warm = prompts(99, 1, 1, args.prompt_words, vocab)
        asyncio.run(run_inprocess(runner, model, 1, warm, 8, int_bias))
        asyncio.run(run_http(url, 1, warm, 8, bias))
        for r in range(args.repeat):
            for lv in args.levels:  # fresh prompts every round: no prefix reuse
                work = prompts(1000 * r + lv, lv, args.requests, args.prompt_words, vocab)
                rounds["inprocess"][lv].append(asyncio.run(run_inprocess(runner, model, lv, work, args.tokens,
                                                                         int_bias)))
                work = prompts(1000 * r + lv + 500, lv, args.requests, args.prompt_words, vocab)
                before = thread_cpu(proc.pid)
                rounds["http"][lv].append(asyncio.run(run_http(url, lv, work, args.tokens, bias)))
                rounds["http"][lv][-1].update(cpu_per_token(before, thread_cpu(proc.pid),
                                                            rounds["http"][lv][-1]["tokens"]))
                load.append(os.getloadavg()[0])
                h = rounds["http"][lv][-1]
                print(r, lv, "in-process", _fmt(rounds["inprocess"][lv][-1]), "| http", _fmt(h),
                      f"| serve CPU/token: busiest thread {h['runner_cpu_ms_per_token']:.2f} ms, "
                      f"others {h['other_cpu_ms_per_token']:.2f} ms", flush=True)
    finally:
        proc.terminate()
        proc.wait(60)
        runner.close()
    med = {mode: {lv: {k: statistics.median(x[k] for x in rs) for k in rs[0]} for lv, rs in per.items()}
           for mode, per in rounds.items()}
    one = min(args.levels)
    results = {"model": path, "threads": args.threads, "tokens": args.tokens, "requests_per_client": args.requests,
               "repeat": args.repeat, "load_1min": [min(load), max(load)], "median": med,
               "overhead_ms_per_token": med["http"][one]["ms_per_token_p50"] - med["inprocess"][one]["ms_per_token_p50"],
               "overhead_ttft_ms": med["http"][one]["ttft_p50_ms"] - med["inprocess"][one]["ttft_p50_ms"]}
    print("| clients | mode | TTFT p50 ms | TTFT p95 ms | stream tok/s p50 | aggregate tok/s | ms/token p50 "
          "| aggregate decode tok/s | x 1 |")
    for lv in args.levels:
        for mode in ("inprocess", "http"):
            m = med[mode][lv]
            print(f"| {lv} | {mode} | {m['ttft_p50_ms']:.0f} | {m['ttft_p95_ms']:.0f} | {m['stream_tok_s_p50']:.1f} | "
                  f"{m['aggregate_tok_s']:.1f} | {m['ms_per_token_p50']:.2f} | {m['decode_tok_s']:.1f} | "
                  f"{m['decode_tok_s'] / med[mode][one]['decode_tok_s']:.2f}x |")
    if "runner_cpu_ms_per_token" in med["http"][one]:
        print("| clients | `coli serve` CPU ms per token: busiest thread | other threads |")
        for lv in args.levels:
            m = med["http"][lv]
            print(f"| {lv} | {m['runner_cpu_ms_per_token']:.2f} | {m['other_cpu_ms_per_token']:.2f} |")
    print(json.dumps({k: results[k] for k in ("overhead_ms_per_token", "overhead_ttft_ms", "load_1min")}))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


def _fmt(m: dict) -> str:
    return (f"ttft {m['ttft_p50_ms']:.0f}/{m['ttft_p95_ms']:.0f} ms, {m['aggregate_tok_s']:.1f} tok/s, "
            f"decode {m['decode_tok_s']:.1f} tok/s")


if __name__ == "__main__":
    main()
