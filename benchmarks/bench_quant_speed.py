#!/usr/bin/env python
"""Decode and prefill tok/s of coli's formats vs llama.cpp's on one real dense model (e.g.
SmolLM2-135M), from the same f32 weights, side by side: the speed half of
benchmarks/quant_quality.py's table.

    python benchmarks/hf_from_gguf.py SRC.gguf HF_DIR
    PYTHONPATH=/work/llama/site-native python benchmarks/bench_quant_speed.py \\
        --model HF_DIR --llama-gguf SRC.gguf --threads 2 --rounds 3 \\
        --runs coli:int8,llama:q8_0,coli:int4,llama:q4_0

coli loads HF_DIR and quantizes at load (``coli:FORMAT`` or ``coli:FORMAT/HEAD``); llama.cpp
runs SRC dequantized to an F32 GGUF and requantized by its own quantizer
(benchmarks/llamacpp_quality.py; ``llama:TYPE``, KV cache f16, its default). Each run is a
fresh process (one OpenMP pool per process) that does a warm-up and --repeats timed
repeats: prefill of --prompt-tokens random ids (coli: in PREFILL_CHUNK chunks; llama.cpp: one
eval), then --gen-tokens greedy decode steps. Runs take turns, in an order reversed every
round, so drifting load hits all alike. Reported: medians (min-max) and CPU seconds.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _worker(spec: str, path: str, threads: int, prompt: int, gen: int, repeats: int) -> dict:
    import numpy as np

    rng = np.random.default_rng(0)
    engine, _, fmt = spec.partition(":")
    if engine == "coli":
        import coli
        from coli._engine import kernels as K
        from coli.api import PREFILL_CHUNK

        quant, _, head = fmt.partition("/")
        eng = coli.load(path, quant=quant, head_quant=head or None, threads=threads).engine
        info = {"simd": K.simd_name(), "head": eng.weights.head_quant if hasattr(eng, "weights") else head}

        def run(ids):
            cache = eng.new_cache(len(ids) + gen + 1)
            c0, t0 = _cpu(), time.perf_counter()
            for i in range(0, len(ids), PREFILL_CHUNK):
                lg = eng.step([(cache, ids[i:i + PREFILL_CHUNK])])
            tok = int(np.argmax(lg[-1]))
            c1, t1 = _cpu(), time.perf_counter()
            for _ in range(gen):
                tok = int(np.argmax(eng.step([(cache, [tok])])[0]))
            return t1 - t0, time.perf_counter() - t1, c1 - c0, _cpu() - c1
    else:
        import llama_cpp

        llm = llama_cpp.Llama(model_path=path, n_ctx=prompt + gen + 16, n_batch=512, n_threads=threads,
                              n_threads_batch=threads, n_gpu_layers=0, verbose=False)
        info = {"llama_cpp_python": llama_cpp.__version__,
                "system_info": llama_cpp.llama_print_system_info().decode(errors="replace").strip()}
        V = llm.n_vocab()

        def last():
            return np.ctypeslib.as_array(llm._ctx.get_logits_ith(-1), shape=(V,))

        def run(ids):
            llm.reset()
            c0, t0 = _cpu(), time.perf_counter()
            llm.eval(ids)
            tok = int(np.argmax(last()))
            c1, t1 = _cpu(), time.perf_counter()
            for _ in range(gen):
                llm.eval([tok])
                tok = int(np.argmax(last()))
            return t1 - t0, time.perf_counter() - t1, c1 - c0, _cpu() - c1
    out = []
    for r in range(repeats + 1):
        ids = [int(t) for t in rng.integers(100, 40000, prompt)]
        p, d, pc, dc = run(ids)
        if r:  # the first is a warm-up
            out.append({"prefill_tps": prompt / p, "decode_tps": gen / d, "prefill_cpu_s": pc, "decode_cpu_s": dc})
    return {"spec": spec, "info": info, "runs": out}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="the f32 Hugging Face directory (coli)")
    ap.add_argument("--llama-gguf", help="a GGUF of the same model (llama.cpp runs its F32 requantized)")
    ap.add_argument("--runs", default="coli:int8,llama:q8_0,coli:int4,llama:q4_0")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--gen-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2, help="timed repeats per process (after one warm-up)")
    ap.add_argument("--rounds", type=int, default=3, help="processes per run, taking turns")
    ap.add_argument("--workdir", help="where llama.cpp's GGUFs go (default: beside --llama-gguf)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--_worker", nargs=2, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a._worker:
        spec, path = a._worker
        print(json.dumps(_worker(spec, path, a.threads, a.prompt_tokens, a.gen_tokens, a.repeats)))
        return
    specs = [s for s in a.runs.split(",") if s]
    paths = {}
    for s in specs:
        engine, _, fmt = s.partition(":")
        if engine == "coli":
            paths[s] = a.model
            continue
        if not a.llama_gguf:
            sys.exit("bench_quant_speed: llama: runs need --llama-gguf")
        sys.path.insert(0, str(HERE))
        import llamacpp_quality as L

        src = Path(a.llama_gguf)
        work = Path(a.workdir or src.parent)
        work.mkdir(parents=True, exist_ok=True)
        f32 = work / (src.stem + ".f32.gguf")
        if not f32.exists():
            L.f32_gguf(src, f32)
        g = f32 if fmt == "f32" else work / (src.stem + f".{fmt}.gguf")
        if not g.exists():
            L.quantize(f32, g, fmt, a.threads)
        paths[s] = str(g)
    res: dict[str, list] = {s: [] for s in specs}
    infos = {}
    for r in range(a.rounds):
        for s in (specs if r % 2 == 0 else specs[::-1]):
            cmd = [sys.executable, __file__, "--model", a.model, "--threads", str(a.threads), "--prompt-tokens",
                   str(a.prompt_tokens), "--gen-tokens", str(a.gen_tokens), "--repeats", str(a.repeats),
                   "--_worker", s, paths[s]]
            p = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ))
            if p.returncode:
                sys.exit(f"{s} failed:\n{p.stderr[-3000:]}")
            d = json.loads(p.stdout.strip().splitlines()[-1])
            res[s] += d["runs"]
            infos[s] = d["info"]
    rows = []
    for s in specs:
        runs = res[s]
        row = {"run": s, "info": infos[s], "n": len(runs)}
        for k in ("prefill_tps", "decode_tps", "prefill_cpu_s", "decode_cpu_s"):
            v = [x[k] for x in runs]
            row[k] = statistics.median(v)
            row[k + "_range"] = (min(v), max(v))
        rows.append(row)
    if a.json:
        print(json.dumps({"threads": a.threads, "prompt_tokens": a.prompt_tokens, "gen_tokens": a.gen_tokens,
                          "rows": rows}, indent=1))
        return
    print(f"{a.threads} threads, prompt {a.prompt_tokens}, {a.gen_tokens} greedy tokens, {a.rounds} rounds x "
          f"{a.repeats} repeats; medians (min-max)")
    print("| run | decode tok/s | prefill tok/s | decode CPU s | prefill CPU s |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['run']} | {r['decode_tps']:.1f} ({r['decode_tps_range'][0]:.1f}-{r['decode_tps_range'][1]:.1f}) | "
              f"{r['prefill_tps']:.1f} ({r['prefill_tps_range'][0]:.1f}-{r['prefill_tps_range'][1]:.1f}) | "
              f"{r['decode_cpu_s']:.3f} | {r['prefill_cpu_s']:.3f} |")


if __name__ == "__main__":
    main()
