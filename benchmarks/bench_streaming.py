"""Streaming benchmarks (issue: quantized weights and disk-streamed experts).

    python benchmarks/bench_streaming.py --synthetic olmoe-1b-7b --quant int4 --budget 1G --threads 2

1. Fully resident: decode tok/s against the roofline (memory bandwidth measured in the
   same run / bytes of weights one token reads).
2. With --budget: the same model streaming its experts from disk (O_DIRECT), as an A/B
   in one run: no pinning and no prefetch, prefetch only, learned pinning only, both.
   Learned pinning reads .coli_usage, which a warm-up pass over other prompts fills first.
   Decoding is fed a seeded random continuation (--decode random, the default) so that
   routing varies from token to token as it does with real text.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
from concurrent.futures import ProcessPoolExecutor

import coli
from coli import bench, synthetic
from coli.experts.store import parse_size


def _run_here(path, threads, a, label, load):
    m = coli.load(path, threads=threads, **load)
    try:
        return bench.run(m, prompt_tokens=a.prompt_tokens, gen_tokens=a.gen_tokens, repeats=a.repeats,
                         seed=a.seed, label=label, decode=a.decode)
    finally:
        m.close()


def run(path, threads, a, label, **load):
    """One configuration in a process of its own, so that its peak RSS and its page cache
    footprint are its own (memory a previous model left to the allocator would count)."""
    with ProcessPoolExecutor(max_workers=1, mp_context=mp.get_context("spawn")) as pool:
        return pool.submit(_run_here, path, threads, a, label, load).result()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--synthetic", default="olmoe-1b-7b")
    ap.add_argument("--model")
    ap.add_argument("--quant", default="int4")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--budget", default="1G")
    ap.add_argument("--pin", default=None, help="pinned bytes in the pinning runs (default: half the budget)")
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--gen-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--decode", choices=bench.DECODE_MODES, default="random",
                    help="decode input (default random: varied routing, as with real text; greedy on a "
                         "random-weight model repeats one token and its experts)")
    ap.add_argument("--skip-resident", action="store_true")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    path = a.model or synthetic.ensure(a.synthetic, a.quant)
    out = {"model": str(path), "threads": a.threads}
    if not a.skip_resident:
        r = run(path, a.threads, a, "resident")
        out["resident"] = {"decode_tok_s": r.median("decode_tok_s"), "prefill_tok_s": r.median("prefill_tok_s"),
                           "roofline_tok_s": r.roofline_tok_s, "bandwidth_GBs": r.bandwidth_bytes_s / 1e9,
                           "weight_MB_per_token": r.weight_bytes_per_token / 1e6,
                           "fraction_of_roofline": r.median("decode_tok_s") / r.roofline_tok_s}
    budget = parse_size(a.budget)
    pin = parse_size(a.pin) if a.pin else budget // 2
    # warm-up: fills .coli_usage with routing history from prompts the measured runs do not use
    warm = coli.load(path, threads=a.threads, ram_budget=budget, pin=0)
    bench.run(warm, prompt_tokens=a.prompt_tokens, gen_tokens=a.gen_tokens, repeats=2, seed=a.seed + 1000,
              decode=a.decode)
    warm.close()
    rows = []
    for label, p, pf in (("no pin, no prefetch", 0, False), ("prefetch", 0, True),
                         ("learned pinning", pin, False), ("pinning + prefetch", pin, True)):
        r = run(path, a.threads, a, label, ram_budget=budget, pin=p, prefetch=pf)
        rows.append({"config": label, "decode_tok_s": r.median("decode_tok_s"), "ttft_s": r.median("ttft_s"),
                     "hit_rate": r.median("hit_rate"), "MB_read_per_token": r.median("bytes_read_per_token") / 1e6,
                     "io_wait_s": r.median("io_wait_s"), "pinned_MB": r.resident["pinned"] / 1e6,
                     "peak_rss_GB": r.peak_rss_bytes / 1e9})
    out["streaming"] = {"budget": a.budget, "pin": pin, "runs": rows}
    if a.json:
        print(json.dumps(out, indent=1))
        return
    if "resident" in out:
        res = out["resident"]
        print(f"resident: decode {res['decode_tok_s']:.1f} tok/s, prefill {res['prefill_tok_s']:.1f} tok/s; "
              f"{res['weight_MB_per_token']:.0f} MB of weights per token at {res['bandwidth_GBs']:.1f} GB/s -> "
              f"roofline {res['roofline_tok_s']:.1f} tok/s ({res['fraction_of_roofline']:.0%} of it)")
    print(f"\nstreaming with --ram-budget {a.budget} (pin {pin / 1e6:.0f} MB in the pinning runs):")
    print("| config | decode tok/s | TTFT | expert hit rate | MB read / token | I/O wait / run | peak RSS |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['config']} | {r['decode_tok_s']:.2f} | {r['ttft_s']:.2f} s | {r['hit_rate']:.1%} | "
              f"{r['MB_read_per_token']:.1f} | {r['io_wait_s']:.2f} s | {r['peak_rss_GB']:.2f} GB |")


if __name__ == "__main__":
    main()
