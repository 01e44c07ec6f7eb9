"""The KV cache's dtype side by side: f16 against f32, in one process, steps alternated.

    python benchmarks/bench_kv.py -m /work/models/smollm2-int8 --contexts 128,512,2048
    python benchmarks/bench_kv.py -m DIR --contexts 512 --streams 4 --json
    python benchmarks/bench_kv.py -m HF_DIR --quality eval.jsonl --formats f32,int8,int4

The model is loaded twice (``kv_cache_dtype`` f16 and f32). For each context length C:
both engines prefill the same C-token prompt (the prefill tok/s is the better of --rounds
prefills each), then decode: each round takes --steps decode steps on one engine, then on
the other (f16 first in even rounds, f32 first in odd ones), every step appending one token
at context C and rolling it back (so every step attends exactly C + 1 positions); prompts of
4096 tokens and more are prefilled once per dtype. Reported:
the median step of every round, as decode tok/s (tokens per step / median step), and the
ratio. On a shared host the speed drifts from minute to minute; alternating keeps both in
the same minutes. Also: the KV bytes one decode token reads at C, per dtype.

--quality FILE (a .jsonl of {"text": ...} lines, e.g. quant_quality.py --split-corpus's
eval.jsonl, or plain text): one forward pass over its first --positions tokens per weight
format and cache dtype; per row, KL(f32 weights and f32 cache || this), top-1 agreement and
the text's perplexity (docs/QUANTIZATION.md, "The KV cache").
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("COLI_ADAPTIVE_THREADS", "0")

import coli  # noqa: E402
from coli._engine import kernels as K  # noqa: E402
from coli.kv.dtype import ITEMSIZE  # noqa: E402

DTYPES = ("f16", "f32")


def run(model: str, contexts: list[int], streams: int, threads: int, rounds: int, steps: int) -> dict:
    models = {t: coli.load(model, threads=threads, kv_cache_dtype=t) for t in DTYPES}
    net = models["f16"].engine.model
    kv_width = sum(l.attn.k_width + l.attn.v_width for l in net.layers)  # values a position holds, all layers
    rows = []
    for C in contexts:
        prompts = [[(7 * s + 13 * j) % 1000 + 2 for j in range(C)] for s in range(streams)]
        caches, prefill = {}, {}
        for t, m in models.items():
            eng = m.engine
            eng.step([(eng.new_cache(), prompts[0][:16])])  # warm: buffers grown, pages touched
            best = None
            for _ in range(1 if C >= 4096 else max(1, min(rounds, 3))):  # long prompts: one prefill each
                cs = [eng.new_cache(C + 8) for _ in range(streams)]
                t0 = time.perf_counter()
                for c, p in zip(cs, prompts):
                    eng.step([(c, p)])
                dt = time.perf_counter() - t0
                best = dt if best is None else min(best, dt)
            caches[t], prefill[t] = cs, streams * C / best
        times = {t: [] for t in DTYPES}
        for r in range(rounds):
            for t in (DTYPES if r % 2 == 0 else DTYPES[::-1]):
                eng, cs = models[t].engine, caches[t]
                ts = []
                for _ in range(steps):
                    t0 = time.perf_counter()
                    eng.step([(c, [5]) for c in cs])
                    ts.append(time.perf_counter() - t0)
                    for c in cs:
                        c.truncate(C)
                times[t].append(statistics.median(ts))
        dec = {t: streams / statistics.median(times[t]) for t in DTYPES}
        rows.append(dict(context=C, streams=streams,
                         prefill_tok_s={t: round(prefill[t], 1) for t in DTYPES},
                         decode_tok_s={t: round(dec[t], 2) for t in DTYPES},
                         decode_ratio=round(dec["f16"] / dec["f32"], 3),
                         prefill_ratio=round(prefill["f16"] / prefill["f32"], 3),
                         kv_bytes_read_per_token={t: (C + 1) * kv_width * ITEMSIZE[t] for t in DTYPES}))
    return dict(model=model, simd=K.simd_name(), threads=threads, rounds=rounds, steps=steps, rows=rows)


def quality(model: str, text: str, formats: list[str], positions: int, threads: int) -> list[dict]:
    import numpy as np

    if text.endswith(".jsonl"):
        texts = [json.loads(line)["text"] for line in open(text, encoding="utf-8") if line.strip()]
    else:
        texts = [open(text, encoding="utf-8").read()]
    ref = coli.load(model, threads=threads, kv_cache_dtype="f32")
    ids: list[int] = []
    for t in texts:
        ids += ref.tokenizer.encode(t)
        if len(ids) >= positions:
            break
    ids = ids[:positions]

    def logsoftmax(x):
        x = x - x.max(1, keepdims=True)
        return x - np.log(np.exp(x).sum(1, keepdims=True))

    lr = ref.forward(ids).astype(np.float64)
    pr = logsoftmax(lr)
    rows = []
    for fmt in formats:
        for kv in DTYPES[::-1]:
            m = coli.load(model, threads=threads, quant=fmt, kv_cache_dtype=kv)
            lq = m.forward(ids).astype(np.float64)
            pq = logsoftmax(lq)
            rows.append(dict(format=fmt, cache=kv, positions=len(ids),
                             kl=float((np.exp(pr) * (pr - pq)).sum(1).mean()),
                             top1=float((lr.argmax(1) == lq.argmax(1)).mean()),
                             perplexity=float(np.exp(-pq[np.arange(len(ids) - 1), ids[1:]].mean()))))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--contexts", default="128,512,2048", help="context lengths to decode at (comma-separated)")
    ap.add_argument("--streams", type=int, default=1, help="sequences decoded together")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=24, help="decode steps per round and dtype")
    ap.add_argument("--quality", metavar="FILE", help="measure quality over this text instead of speed")
    ap.add_argument("--formats", default="f32,int8,int4", help="weight formats for --quality")
    ap.add_argument("--positions", type=int, default=1172)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    if a.quality:
        rows = quality(a.model, a.quality, a.formats.split(","), a.positions, a.threads)
        if a.json:
            print(json.dumps(rows, indent=2))
            return
        print(f"{a.model}: {rows[0]['positions']} positions of {a.quality}; KL against f32 weights and an f32 cache")
        print("| weights | cache | KL(f32 ‖ q) | top-1 agreement | perplexity |")
        print("|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['format']} | {r['cache']} | {r['kl']:.2e} | {100 * r['top1']:.1f}% | {r['perplexity']:.3f} |")
        return
    res = run(a.model, [int(c) for c in a.contexts.split(",")], a.streams, a.threads, a.rounds, a.steps)
    if a.json:
        print(json.dumps(res, indent=2))
        return
    print(f"{res['model']} · {res['simd']} · {res['threads']} threads · {a.streams} stream(s) · "
          f"{a.rounds} rounds x {a.steps} steps, alternated")
    print("| context | KV read / token f16 / f32 | decode f16 | decode f32 | f16 / f32 | prefill f16 | prefill f32 | f16 / f32 |")
    print("|---|---|---|---|---|---|---|---|")
    for r in res["rows"]:
        kb = r["kv_bytes_read_per_token"]
        print(f"| {r['context']} | {kb['f16'] / 1e6:.1f} / {kb['f32'] / 1e6:.1f} MB | {r['decode_tok_s']['f16']:.1f} | "
              f"{r['decode_tok_s']['f32']:.1f} | {r['decode_ratio']:.2f}x | {r['prefill_tok_s']['f16']:.0f} | "
              f"{r['prefill_tok_s']['f32']:.0f} | {r['prefill_ratio']:.2f}x |")


if __name__ == "__main__":
    main()
