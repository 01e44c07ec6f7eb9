"""Packed int4 and int8 (QMatrix.pack, coli/weights/packing.py) against the row layout, side
by side in one process.

    python benchmarks/bench_packing.py -m /work/models/smollm2-int4 --threads 2
    COLI_SIMD=avx2 python benchmarks/bench_packing.py -m /work/models/smollm2-int8 --format int8 --kernels
    python benchmarks/bench_packing.py -m /work/models/smollm2-int4 --threads 2 --streams 4
    python benchmarks/bench_packing.py --synthetic olmoe-1b-7b --threads 2 --steps 60
    python benchmarks/bench_packing.py -m /work/models/olmoe-mini-int8 --format int8 --experts --prefill 128

The model is loaded twice, with COLI_PACK=0 and =1, each prefilled with --prompt tokens
(per stream), then decode steps alternate between the two (one step of each, in turns
whose order flips every step) for --steps steps each, so both see the same machine and the
same cache pressure: on a shared machine the speed of one setting drifts by 20% from minute
to minute, far more than the difference measured. Reported: the median step of each and
the ratio; then, with --kernels, one qlinear call per shape of a 576-wide model at 1..8
tokens with the matrix in cache (the compute alone). Needs a path with packed tiles for
--format (int4: AVX-512 VNNI, AVX2, AVX-512; int8: AVX-512 VNNI, AVX2; COLI_SIMD=avx2 forces
AVX2), or a kernel that gives transparent huge pages: then COLI_PACK=1 holds the rows of the
matrices a path does not pack (int8 on AVX-512 without VNNI) in huge pages, COLI_PACK=0 reads
them from the checkpoint's mapping, and the decode and prefill steps compare those. With
--experts both pack their dense matrices and only the packed one its resident routed
experts (pack_experts). Both models stay loaded for the decode and the prefill steps.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

import coli  # noqa: E402
from coli import synthetic  # noqa: E402
from coli._engine import kernels as K  # noqa: E402
from coli.quant import quantize  # noqa: E402
from coli.weights.packing import huge_pages, pack_dense, pack_experts  # noqa: E402


def _load(path: str, threads: int, pack: bool, moves_only: bool = False, experts_only: bool = False):
    """The model with COLI_PACK=1 (pack) or 0; with moves_only both pack their tiles and only
    the pack one moves the other dense rows into huge pages (the other reads them mapped);
    with experts_only both pack their dense matrices and only the pack one its experts."""
    os.environ["COLI_PACK"] = "1" if pack and not (moves_only or experts_only) else "0"
    try:
        model = coli.load(path, threads=threads)
    finally:
        os.environ.pop("COLI_PACK", None)
    if moves_only:
        pack_dense(model.engine.model, huge=pack)
    if experts_only:
        pack_dense(model.engine.model)
        if pack and not pack_experts(model.engine.model):
            sys.exit(f"bench_packing: {path} has no resident experts this path packs "
                     "(int8, or int4 with rows a multiple of 4)")
    return model


def decode(engines: dict, steps: int, prompt: int, streams: int) -> dict:
    """Decode steps of ``streams`` sequences, the two settings in turn."""
    runs = {}
    for pack, eng in engines.items():
        caches = [eng.new_cache(prompt + 8) for _ in range(streams)]
        for i, c in enumerate(caches):
            eng.step([(c, [(7 * i + j) % 100 + 2 for j in range(prompt)])])
        runs[pack] = (eng, caches, [len(c) for c in caches], [])
    for i in range(steps + 5):
        for pack in ((False, True) if i % 2 else (True, False)):
            eng, caches, starts, times = runs[pack]
            t0 = time.perf_counter()
            eng.step([(c, [5]) for c in caches])
            dt = time.perf_counter() - t0
            for c, s in zip(caches, starts):
                c.truncate(s)
            if i >= 5:  # warm-up
                times.append(dt)
    rows, packed = (statistics.median(runs[p][3]) for p in (False, True))
    return dict(rows_ms=rows * 1e3, packed_ms=packed * 1e3, speedup=rows / packed,
                tok_s_rows=streams / rows, tok_s_packed=streams / packed)


def prefill(engines: dict, rounds: int, tokens: int) -> dict:
    """One prefill step of ``tokens`` tokens on each setting in turn, ``rounds`` times."""
    runs = {}
    for pack, eng in engines.items():
        runs[pack] = (eng, eng.new_cache(tokens + 8), [])
    ids = [(7 * j) % 100 + 2 for j in range(tokens)]
    for i in range(rounds + 1):
        for pack in ((False, True) if i % 2 else (True, False)):
            eng, cache, times = runs[pack]
            t0 = time.perf_counter()
            eng.step([(cache, ids)])
            dt = time.perf_counter() - t0
            cache.truncate(0)
            if i:  # the first round warms up
                times.append(dt)
    rows, packed = (statistics.median(runs[p][2]) for p in (False, True))
    return dict(tokens=tokens, rows_tok_s=tokens / rows, packed_tok_s=tokens / packed, speedup=rows / packed)


def kernels(threads: int, fmt: str) -> list[dict]:
    K.set_num_threads(threads)
    rng = np.random.default_rng(0)
    out = []
    for rows, cols in ((576, 576), (192, 576), (1536, 576), (576, 1536)):
        w = rng.standard_normal((rows, cols)).astype(np.float32)
        a, b = quantize(w, fmt), quantize(w, fmt)
        b.pack()
        for M in (1, 2, 4, 8):
            x = rng.standard_normal((M, cols)).astype(np.float32)
            kp = K.padded(cols)
            s = (np.empty((M, kp), np.int8), np.empty((M, kp // 32), np.float32), np.empty((M, kp // 32), np.int32))
            y = np.empty((M, rows), np.float32)
            best = {}
            for _ in range(5):  # alternated rounds, best of each
                for name, mat in (("rows", a), ("packed", b)):
                    t0 = time.perf_counter()
                    for _ in range(500):
                        K.qlinear(x, mat, y, None, *s)
                    best[name] = min(best.get(name, 1e9), (time.perf_counter() - t0) / 500)
            out.append(dict(shape=f"{rows}x{cols}", tokens=M, rows_us=best["rows"] * 1e6,
                            packed_us=best["packed"] * 1e6, speedup=best["rows"] / best["packed"]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", help="an int4 or int8 model (converted directory or GGUF)")
    ap.add_argument("--format", default="int4", choices=("int4", "int4s", "int8"),
                    help="the model's format: what --synthetic writes, --kernels times and the path must pack")
    ap.add_argument("--synthetic", help="a seeded random-weight model instead: tiny, olmoe-mini, olmoe-1b-7b")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=400, help="decode steps of each setting")
    ap.add_argument("--prompt", type=int, default=128, help="context before the decode steps (per stream)")
    ap.add_argument("--streams", type=int, default=1, help="sequences per decode step")
    ap.add_argument("--kernels", action="store_true", help="also time single qlinear calls in cache")
    ap.add_argument("--prefill", type=int, default=0, metavar="N",
                    help="also time prefill steps of N tokens (alternated, 20 rounds)")
    ap.add_argument("--moves", action="store_true",
                    help="both settings pack their tiles; compare only the other dense rows mapped against "
                         "moved into huge pages (needs transparent huge pages)")
    ap.add_argument("--experts", action="store_true",
                    help="both settings pack their dense matrices; compare resident experts (int8, int4) in rows "
                         "against packed")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    if a.experts and (a.moves or a.kernels):
        sys.exit("bench_packing: --experts compares the experts alone (drop --moves and --kernels)")
    if a.moves and not huge_pages():
        sys.exit("bench_packing: --moves needs transparent huge pages, which this kernel does not give")
    tiles = quantize(np.ones((4, 32), np.float32), a.format).packed_bytes > 0
    if not tiles and not huge_pages() and not a.moves:
        sys.exit(f"bench_packing: the {K.simd_name()} path has no packed {a.format} tiles "
                 f"({'AVX-512 VNNI and AVX2 have' if a.format == 'int8' else 'AVX-512 VNNI, AVX-512 and AVX2 have'}) and this kernel "
                 "gives no transparent huge pages to move the rows into")
    if a.kernels and a.moves:
        sys.exit("bench_packing: --kernels times the packed tiles against rows, not where rows live (drop --moves)")
    if a.kernels and not tiles:
        sys.exit("bench_packing: --kernels times the packed tiles, which this path does not have for "
                 f"{a.format} (its decode steps compare mapped rows with rows moved into huge pages)")
    tmp = None
    path = a.model
    if a.synthetic:
        tmp = tempfile.TemporaryDirectory()
        path = str(synthetic.write_converted(a.synthetic, os.path.join(tmp.name, a.synthetic), a.format, seed=0))
    if not path:
        sys.exit("bench_packing: give -m MODEL or --synthetic NAME")
    os.environ.setdefault("COLI_ADAPTIVE_THREADS", "0")  # the same thread count all along
    engines = {pack: _load(path, a.threads, pack, a.moves, a.experts).engine for pack in (False, True)}
    res = dict(model=a.model or a.synthetic, format=a.format, moves=a.moves, experts=a.experts, simd=K.simd_name(),
               threads=a.threads,
               streams=a.streams,
               steps=a.steps, prompt=a.prompt, load=os.getloadavg()[0],
               decode=decode(engines, a.steps, a.prompt, a.streams))
    if a.prefill:
        res["prefill"] = prefill(engines, 20, a.prefill)
    if a.kernels:
        res["kernels"] = kernels(1, a.format)
    if a.json:
        print(json.dumps(res, indent=1))
        return
    d = res["decode"]
    a_, b_ = (("mapped rows", "moved rows") if a.moves else ("experts in rows", "experts packed") if a.experts
              else ("rows", "packed"))
    print(f"{res['model']} ({res['simd']}, {a.threads} threads, {a.streams} stream(s), load {res['load']:.1f}): "
          f"median step {a_} {d['rows_ms']:.3f} ms, {b_} {d['packed_ms']:.3f} ms: {d['speedup']:.3f}x "
          f"({d['tok_s_rows']:.1f} -> {d['tok_s_packed']:.1f} tok/s)")
    if "prefill" in res:
        f = res["prefill"]
        print(f"  prefill of {f['tokens']} tokens: {a_} {f['rows_tok_s']:.0f} tok/s, {b_} {f['packed_tok_s']:.0f} tok/s: "
              f"{f['speedup']:.3f}x")
    for k in res.get("kernels", []):
        print(f"  {k['shape']:>9} x {k['tokens']} tokens: rows {k['rows_us']:7.2f} us, packed {k['packed_us']:7.2f} us, "
              f"{k['speedup']:.2f}x")


if __name__ == "__main__":
    main()
