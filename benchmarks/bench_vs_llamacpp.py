#!/usr/bin/env python
"""Decode and prefill tok/s of coli vs llama.cpp on the same weights, side by side.

The model is coli's seeded synthetic ``olmoe-mini`` (``coli.synthetic.write_hf``: hidden
1024, 8 layers, 16 heads, 32 experts top-4, expert intermediate 512, vocab 50304). llama.cpp
(the ``llama-cpp-python`` package, built from source) runs GGUFs of those very weights
written by ``benchmarks/gguf_from_hf.py``; coli loads the Hugging Face directory and
quantizes at load. In one run, same machine, same thread count:

    engine      format                     bytes like
    llama.cpp   Q4_0 (every matrix, incl. token_embd and output), flash attention off / on
    llama.cpp   Q4_1 (every matrix), flash attention off / on
    llama.cpp   Q8_0 (every matrix), flash attention off / on
    coli        int4s, head int4s          = Q4_0  (32-element groups, f16 scale, q-8; 4.5 bits)
    coli        int4, head int4            = Q4_1  (32-element groups, f16 scale and min; 5 bits)
    coli        int8, head int8            = Q8_0
    coli        int4, head int8 (coli's default under int4; extra line, more head bytes)

    python benchmarks/bench_vs_llamacpp.py --threads 2            # table
    python benchmarks/bench_vs_llamacpp.py --threads 2 --json     # JSON on stdout
    python benchmarks/bench_vs_llamacpp.py --check                # correctness check only
    python benchmarks/bench_vs_llamacpp.py --markdown REPORT.json # a saved --save report as Markdown

**Correctness first** (``--check``; the benchmark runs it too unless ``--no-check``):
llama.cpp's F32 GGUF vs ``coli.load(hf_dir, quant="f32")`` on one 16-token prompt: max
|logit difference| over all 16 positions, then 16 greedy decode steps of each engine,
compared token by token. The quantized pairs (Q4_0 vs coli int4s, Q4_1 vs coli int4, Q8_0
vs coli int8, each with the same head format) are compared the same way, for information.

**What is timed**, per repeat, from an empty KV cache, with a fresh random prompt (the
same prompts for every engine):

* prefill: ``--prompt-tokens`` ids in one forward pass (llama.cpp: one ``llama_decode`` of
  the whole prompt, ``n_batch = n_ubatch = 512``; coli: ``engine.step`` in
  ``coli.api.PREFILL_CHUNK`` chunks) up to and including the argmax of the last logits;
* decode: ``--gen-tokens`` greedy steps after that, one token per forward pass plus an
  argmax of its logits (llama.cpp: ``Llama.eval([tok])`` then argmax over
  ``llama_get_logits_ith(-1)``; coli: ``engine.step``).

llama.cpp runs each format twice, flash attention off (llama-cpp-python's default) and on
(``+FA``; llama.cpp's own CLI default on CPU), KV cache f16 (its default); each ratio
compares coli with the faster of the two for that metric. coli's KV cache is f16 too (its
default; ``COLI_KV_CACHE_DTYPE``).

Each engine+format lives in its own spawned worker process (two OpenMP thread pools never
share a process) and the workers take turns: every repeat runs all of them, in an order
rotated each repeat, so drifting background load hits all alike. One warm-up repeat is
discarded. Reported: median over ``--repeats`` with min-max, CPU utilisation, and the
ratios coli / llama.cpp at equal bytes.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))

# name -> (engine, format, coli head format or llama.cpp flash attention)
ENGINES = {
    "llama.cpp Q4_0": ("llama.cpp", "q4_0", False),
    "llama.cpp Q4_0 +FA": ("llama.cpp", "q4_0", True),
    "llama.cpp Q4_1": ("llama.cpp", "q4_1", False),
    "llama.cpp Q4_1 +FA": ("llama.cpp", "q4_1", True),
    "llama.cpp Q8_0": ("llama.cpp", "q8_0", False),
    "llama.cpp Q8_0 +FA": ("llama.cpp", "q8_0", True),
    "coli int4s (head int4s)": ("coli", "int4s", "int4s"),
    "coli int4 (head int4)": ("coli", "int4", "int4"),
    "coli int8": ("coli", "int8", "int8"),
    "coli int4 (head int8)": ("coli", "int4", "int8"),
}
# coli line vs llama.cpp at the same bytes: the faster llama.cpp line of each metric
# (flash attention off -- llama-cpp-python's default -- or on, llama.cpp's CLI default "auto" on CPU)
RATIOS = [("coli int4s (head int4s)", "Q4_0"), ("coli int4 (head int4)", "Q4_1"), ("coli int8", "Q8_0"),
          ("coli int4 (head int8)", "Q4_1")]
CHECK_PAIRS = [("f32", "f32", "f32"), ("q4_0", "int4s", "int4s"), ("q4_1", "int4", "int4"), ("q8_0", "int8", "int8")]


def cache_root() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "coli"


def ensure_hf(hf_dir: Path | None, log) -> Path:
    from coli.synthetic import cache_dir, write_hf

    d = hf_dir or cache_dir() / "olmoe-mini-hf-s0"
    if not (d / "config.json").exists():
        log(f"writing the synthetic olmoe-mini checkpoint to {d} (once) ...")
        write_hf("olmoe-mini", d, seed=0)
    return d


def ensure_gguf(hf_dir: Path, gguf_dir: Path, qtype: str, log) -> Path:
    """The GGUF of hf_dir at qtype, written once (keyed by the HF weights file's size and mtime)."""
    import gguf_from_hf

    st = next(iter(sorted(hf_dir.glob("*.safetensors"))))
    tag = f"{hf_dir.name}-{qtype}"
    out = gguf_dir / f"{tag}.gguf"
    stamp = gguf_dir / f"{tag}.source.json"
    src = {"hf_dir": str(hf_dir), "size": st.stat().st_size, "mtime": st.stat().st_mtime,
           "writer": (REPO / "benchmarks" / "gguf_from_hf.py").stat().st_size}
    if out.exists() and stamp.exists() and json.loads(stamp.read_text()) == src:
        return out
    gguf_dir.mkdir(parents=True, exist_ok=True)
    log(f"writing {out} ...")
    gguf_from_hf.convert(hf_dir, out, qtype, log=log)
    stamp.write_text(json.dumps(src))
    return out


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


# ---------------------------------------------------------------- runners (in worker processes)

class LlamaRunner:
    def __init__(self, gguf_path: str, threads: int, n_ctx: int, *, logits_all: bool = False,
                 f32_kv: bool = False, flash_attn: bool = False, n_ubatch: int = 512, use_mmap: bool = True):
        import llama_cpp
        import numpy as np

        self.np, self.llama_cpp = np, llama_cpp
        kw = dict(type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32) if f32_kv else {}
        self.llm = llama_cpp.Llama(model_path=gguf_path, n_ctx=n_ctx, n_batch=512, n_ubatch=n_ubatch,
                                   n_threads=threads, n_threads_batch=threads, n_gpu_layers=0,
                                   logits_all=logits_all, flash_attn=flash_attn, use_mmap=use_mmap,
                                   verbose=False, **kw)
        self.V = self.llm.n_vocab()
        self.info = {"llama_cpp_python": llama_cpp.__version__, "gguf": gguf_path, "n_ctx": n_ctx,
                     "n_batch": 512, "n_ubatch": n_ubatch, "flash_attn": flash_attn, "use_mmap": use_mmap,
                     "kv_type": "f32" if f32_kv else "f16 (llama.cpp default)",
                     "system_info": llama_cpp.llama_print_system_info().decode(errors="replace").strip()}

    def _last_logits(self):
        # the logits of the batch's last token (llama_get_logits_ith(ctx, -1))
        return self.np.ctypeslib.as_array(self.llm._ctx.get_logits_ith(-1), shape=(self.V,))

    def run(self, ids: list[int], gen: int) -> dict:
        np, llm = self.np, self.llm
        llm.reset()
        c0, t0 = cpu_seconds(), time.perf_counter()
        llm.eval(ids)
        tok = int(np.argmax(self._last_logits()))
        c1, t1 = cpu_seconds(), time.perf_counter()
        toks = [tok]
        for _ in range(gen):
            llm.eval([tok])
            tok = int(np.argmax(self._last_logits()))
            toks.append(tok)
        c2, t2 = cpu_seconds(), time.perf_counter()
        return {"prefill_s": t1 - t0, "decode_s": t2 - t1, "prefill_cpu_s": c1 - c0, "decode_cpu_s": c2 - c1,
                "tokens": toks}

    def all_logits(self, ids: list[int]):
        """(T, V) logits of every prompt position (needs logits_all=True)."""
        self.llm.reset()
        self.llm.eval(ids)
        return np_copy(self.llm.scores[: len(ids)])


class ColiRunner:
    def __init__(self, hf_dir: str, threads: int, quant: str, head_quant: str):
        import numpy as np

        import coli
        from coli._engine import kernels as K
        from coli.api import PREFILL_CHUNK

        self.np, self.chunk = np, PREFILL_CHUNK
        self.model = coli.load(hf_dir, threads=threads, quant=quant, head_quant=head_quant)
        self.engine = self.model.engine
        self.info = {"simd": K.simd_name(), "threads": K.get_num_threads(), "quant": quant,
                     "head_quant": head_quant, "prefill_chunk": PREFILL_CHUNK,
                     "resident_bytes": self.engine.resident_bytes(),
                     "weight_bytes_per_token": _weight_bytes_per_token(self.model),
                     "coli_path": str(Path(coli.__file__).resolve().parent.parent)}

    def run(self, ids: list[int], gen: int) -> dict:
        np, eng = self.np, self.engine
        cache = eng.new_cache(len(ids) + gen + 1)
        c0, t0 = cpu_seconds(), time.perf_counter()
        for i in range(0, len(ids), self.chunk):
            logits = eng.step([(cache, ids[i:i + self.chunk])])
        tok = int(np.argmax(logits[-1]))
        c1, t1 = cpu_seconds(), time.perf_counter()
        toks = [tok]
        for _ in range(gen):
            logits = eng.step([(cache, [tok])])
            tok = int(np.argmax(logits[0]))
            toks.append(tok)
        c2, t2 = cpu_seconds(), time.perf_counter()
        return {"prefill_s": t1 - t0, "decode_s": t2 - t1, "prefill_cpu_s": c1 - c0, "decode_cpu_s": c2 - c1,
                "tokens": toks}

    def all_logits(self, ids: list[int]):
        return np_copy(self.model.forward(ids))


def _weight_bytes_per_token(model) -> int:
    """Bytes of weights one decode token reads: LM head, final norm, and per layer the
    attention projections, norms, router and num_experts_per_tok experts (the embedding
    table is one row). Counted here from the built olmoe wiring, so that the number does
    not depend on the coli version measured (coli.bench.weight_bytes_per_token left the
    LM head out before commit 7d6ebf7)."""
    net = model.engine.model
    total = net.lm_head.mat.nbytes + net.norm.nbytes
    for layer in net.layers:
        a, mlp = layer.attn, layer.mlp
        total += sum(getattr(a, n).mat.nbytes for n in ("q_proj", "k_proj", "v_proj", "o_proj"))
        total += sum(getattr(a, n).nbytes for n in ("q_norm", "k_norm") if hasattr(a, n))
        total += layer.input_norm.nbytes + layer.post_norm.nbytes
        total += mlp.router.nbytes + mlp.k * sum(m.nbytes for m in mlp.table.get(0))
    return int(total)


def _bandwidth() -> float | None:
    try:
        from coli.bench import memory_bandwidth
    except ImportError:
        return None
    return memory_bandwidth()


def np_copy(a):
    import numpy as np

    return np.array(a, dtype=np.float32, copy=True)


def worker(conn, engine: str, args: tuple, kwargs: dict) -> None:
    try:
        runner = LlamaRunner(*args, **kwargs) if engine == "llama.cpp" else ColiRunner(*args, **kwargs)
        conn.send(("ready", runner.info))
        while True:
            msg = conn.recv()
            if msg[0] == "stop":
                break
            if msg[0] == "run":
                conn.send(("ok", runner.run(msg[1], msg[2])))
            elif msg[0] == "logits":
                conn.send(("ok", runner.all_logits(msg[1])))
            elif msg[0] == "bandwidth":
                conn.send(("ok", _bandwidth()))
    except BaseException as e:  # report, don't hang the parent
        import traceback
        conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        conn.close()


class Worker:
    def __init__(self, name: str, engine: str, *args, **kwargs):
        ctx = mp.get_context("spawn")
        self.name = name
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=worker, args=(child, engine, args, kwargs), daemon=True)
        self.proc.start()
        child.close()
        self.info = self._get()

    def _get(self):
        status, payload = self.conn.recv()
        if status == "error":
            raise SystemExit(f"{self.name} worker failed:\n{payload}")
        return payload

    def run(self, ids, gen):
        self.conn.send(("run", ids, gen))
        return self._get()

    def logits(self, ids):
        self.conn.send(("logits", ids))
        return self._get()

    def bandwidth(self):
        self.conn.send(("bandwidth",))
        return self._get()

    def stop(self):
        try:
            self.conn.send(("stop",))
        except (BrokenPipeError, OSError):
            pass
        self.proc.join(timeout=30)


# ---------------------------------------------------------------- correctness check

def agreement(a: list[int], b: list[int]) -> dict:
    n = min(len(a), len(b))
    first = next((i for i in range(n) if a[i] != b[i]), None)
    return {"compared": n, "identical": sum(x == y for x, y in zip(a, b)), "first_divergence": first,
            "all_equal": first is None and len(a) == len(b)}


def check(hf_dir: Path, gguf_dir: Path, threads: int, pairs, log, prompt_len: int = 16, steps: int = 16,
          seed: int = 1234) -> list[dict]:
    """llama.cpp vs coli on one prompt: logits of every position, then greedy decode."""
    import numpy as np

    V = json.loads((hf_dir / "config.json").read_text())["vocab_size"]
    ids = [int(t) for t in np.random.default_rng(seed).integers(2, V, size=prompt_len)]
    out = []
    for gtype, cquant, chead in pairs:
        path = ensure_gguf(hf_dir, gguf_dir, gtype, log)
        lw = Worker(f"llama.cpp {gtype}", "llama.cpp", str(path), threads, 256, logits_all=True, f32_kv=True)
        try:
            l_logits = lw.logits(ids)
            l_run = lw.run(ids, steps - 1)
        finally:
            lw.stop()
        cw = Worker(f"coli {cquant}", "coli", str(hf_dir), threads, cquant, chead)
        try:
            c_logits = cw.logits(ids)
            c_run = cw.run(ids, steps - 1)
        finally:
            cw.stop()
        diff = np.abs(l_logits - c_logits)
        scale = float(np.abs(c_logits).max())
        rel = float(np.linalg.norm(l_logits - c_logits) / np.linalg.norm(c_logits))
        r = {"llama_cpp": gtype, "coli": f"{cquant} (head {chead})", "prompt_tokens": prompt_len,
             "max_abs_diff": float(diff.max()), "max_abs_logit": scale, "rel_l2_diff": rel,
             "prompt_argmax_agree": int((l_logits.argmax(1) == c_logits.argmax(1)).sum()),
             "greedy": agreement(l_run["tokens"], c_run["tokens"]),
             "llama_tokens": l_run["tokens"], "coli_tokens": c_run["tokens"]}
        log(f"check {gtype} vs coli {cquant}/{chead}: max|diff| {r['max_abs_diff']:.2e} "
            f"(max|logit| {scale:.2f}, rel L2 {rel:.2e}); prompt argmax {r['prompt_argmax_agree']}/{prompt_len}; "
            f"greedy {r['greedy']['identical']}/{r['greedy']['compared']}")
        out.append(r)
    return out


# ---------------------------------------------------------------- environment

def _sh(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=REPO).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""


def machine_info() -> dict:
    cpu, flags = "", set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name") and not cpu:
            cpu = line.split(":", 1)[1].strip()
        elif line.startswith("flags") and not flags:
            flags = set(line.split(":", 1)[1].split())
    simd = [f for f in ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx_vnni",
                        "avx512_bf16", "avx512_fp16", "amx_tile", "amx_int8") if f in flags]
    return {"cpu": cpu or platform.processor(), "logical_cpus": os.cpu_count(),
            "usable_cpus": len(os.sched_getaffinity(0)), "simd_flags": simd,
            "kernel": platform.release(), "python": platform.python_version()}


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for pkg in ("llama_cpp_python", "gguf", "numpy"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = None
    return out


def busy_processes(min_cpu: float = 20.0) -> list[str]:
    """Other processes using the CPU right now (``ps``'s %CPU is a lifetime average)."""
    rows = _sh(["ps", "-eo", "pid,pcpu,etimes,args", "--sort=-pcpu"]).splitlines()[1:]
    me = os.getpid()
    out = []
    for row in rows[:10]:
        pid, pcpu, _, cmd = row.split(None, 3)
        if float(pcpu) >= min_cpu and int(pid) != me:
            out.append(f"{pid} {pcpu}% {cmd[:80]}")
    return out


def git_commit(coli_path: str | None = None) -> str:
    """Short commit of the coli source measured ('+dirty' with uncommitted engine changes).
    The coli measured is the one ``import coli`` finds: this checkout, or e.g. a clean
    ``git worktree`` of a commit put first on PYTHONPATH."""
    where = Path(coli_path) if coli_path else REPO
    c = _sh(["git", "-C", str(where), "rev-parse", "--short", "HEAD"])
    dirty = _sh(["git", "-C", str(where), "status", "--porcelain", "--untracked-files=no", "--", "coli", "setup.py"])
    out = (c or "unknown") + ("+dirty" if c and dirty else "")
    return out if where.resolve() == REPO.resolve() else f"{out} (coli from {where})"


def summarize(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "all": xs}


def markdown(report: dict) -> str:
    """The results and ratios of a saved report as Markdown tables."""
    def cell(x: dict, fmt: str = "{:.1f}") -> str:
        return f"{fmt.format(x['median'])} ({fmt.format(x['min'])}–{fmt.format(x['max'])})"

    out = ["| engine | decode tok/s | prefill tok/s | TTFT ms | weight MB / token | decode roofline tok/s |",
           "|---|---:|---:|---:|---:|---:|"]
    for n, r in report["results"].items():
        wb, roof = r.get("weight_bytes_per_token"), r.get("decode_roofline_tok_s")
        out.append(f"| {n} | {cell(r['decode_tok_s'])} | {cell(r['prefill_tok_s'])} | {cell(r['ttft_ms'], '{:.0f}')} "
                   f"| {wb / 1e6:.1f} | {roof:.0f} |" if wb and roof else
                   f"| {n} | {cell(r['decode_tok_s'])} | {cell(r['prefill_tok_s'])} | {cell(r['ttft_ms'], '{:.0f}')} | | |")
    out += ["", "| ratio (median / median) | decode | prefill |", "|---|---:|---:|"]
    for k, v in report["ratios"].items():
        out.append(f"| {k} | **{v['decode']:.2f}x** (vs {v['decode_vs']}) | **{v['prefill']:.2f}x** (vs {v['prefill_vs']}) |")
    return "\n".join(out)


# ---------------------------------------------------------------- main

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2, help="threads for every engine (default 2)")
    ap.add_argument("--prompt-tokens", type=int, default=128, help="prefill length (default 128)")
    ap.add_argument("--gen-tokens", type=int, default=64, help="greedy decode steps timed (default 64)")
    ap.add_argument("--repeats", type=int, default=3, help="measured repeats (default 3; one warm-up more)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the prompts (default 0)")
    ap.add_argument("--hf-dir", type=Path, default=None,
                    help="Hugging Face OLMoE directory (default: the synthetic olmoe-mini, seed 0)")
    ap.add_argument("--gguf-dir", type=Path, default=cache_root() / "gguf", help="where GGUFs are written")
    ap.add_argument("--engines", default=",".join(ENGINES),
                    help=f"comma list of lines to run (default all: {', '.join(ENGINES)})")
    ap.add_argument("--llama-ubatch", type=int, default=512, help="llama.cpp n_ubatch (default 512)")
    ap.add_argument("--llama-no-mmap", action="store_true",
                    help="llama.cpp reads the GGUF into anonymous memory instead of mapping it")
    ap.add_argument("--check", action="store_true", help="run only the correctness check")
    ap.add_argument("--no-check", action="store_true", help="skip the F32 correctness check before timing")
    ap.add_argument("--json", action="store_true", help="print the report as JSON on stdout")
    ap.add_argument("--save", type=Path, default=None, help="also write the JSON report to this file")
    ap.add_argument("--markdown", type=Path, default=None, metavar="REPORT.json",
                    help="print a saved report as Markdown tables (for BENCHMARKS.md) and exit")
    args = ap.parse_args(argv)
    if args.markdown:
        print(markdown(json.loads(args.markdown.read_text())))
        return 0

    from rich.console import Console
    from rich.table import Table

    if str(REPO) not in sys.path:
        sys.path.append(str(REPO))  # after PYTHONPATH: a worktree put first there wins
    console = Console(stderr=args.json, width=None if sys.stdout.isatty() else 170)
    log = (lambda s: console.print(f"[dim]{s}[/dim]", highlight=False))
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "COLI_THREADS"):
        os.environ[var] = str(args.threads)  # inherited by the spawned workers
    import numpy as np

    hf_dir = ensure_hf(args.hf_dir, log).resolve()
    gguf_dir = args.gguf_dir.expanduser().resolve()
    report = {"benchmark": "bench_vs_llamacpp",
              "command": " ".join(["python", "benchmarks/bench_vs_llamacpp.py", *(argv or sys.argv[1:])]),
              "commit": git_commit(), "machine": machine_info(), "versions": versions(),
              "threads": args.threads, "hf_dir": str(hf_dir),
              "busy_processes_before": busy_processes(), "loadavg_before": os.getloadavg()}

    if args.check or not args.no_check:
        pairs = CHECK_PAIRS if args.check else CHECK_PAIRS[:1]
        report["check"] = check(hf_dir, gguf_dir, args.threads, pairs, log)
        f32 = report["check"][0]
        if not f32["greedy"]["all_equal"]:
            console.print(f"[red]llama.cpp F32 and coli f32 disagree: {f32}[/red]")
        if args.check:
            if args.save:
                args.save.write_text(json.dumps(report, indent=1) + "\n")
            if args.json:
                print(json.dumps(report, indent=1))
            return 0 if f32["greedy"]["all_equal"] else 1

    names = [n.strip() for n in args.engines.split(",") if n.strip()]
    for n in names:
        if n not in ENGINES:
            raise SystemExit(f"unknown engine line {n!r}; choose from {', '.join(ENGINES)}")
    V = json.loads((hf_dir / "config.json").read_text())["vocab_size"]
    rng = np.random.default_rng(args.seed)
    prompts = [[int(t) for t in rng.integers(2, V, size=args.prompt_tokens)] for _ in range(args.repeats + 1)]
    n_ctx = args.prompt_tokens + args.gen_tokens + 16
    workers: dict[str, Worker] = {}
    runs: dict[str, list] = {n: [] for n in names}
    load_s = {}
    try:
        for n in names:
            engine, fmt, head = ENGINES[n]
            t = time.perf_counter()
            if engine == "llama.cpp":
                path = ensure_gguf(hf_dir, gguf_dir, fmt, log)
                workers[n] = Worker(n, engine, str(path), args.threads, n_ctx,
                                    flash_attn=head, n_ubatch=args.llama_ubatch, use_mmap=not args.llama_no_mmap)
            else:
                workers[n] = Worker(n, engine, str(hf_dir), args.threads, fmt, head)
            load_s[n] = time.perf_counter() - t
            log(f"{n}: loaded in {load_s[n]:.1f}s")
        for r in range(args.repeats + 1):  # repeat 0 is the warm-up
            k = r % len(names)
            order = names[k:] + names[:k]
            for n in order:
                res = workers[n].run(prompts[r], args.gen_tokens)
                if r > 0:
                    runs[n].append(res)
                log(f"{'warm-up ' if r == 0 else f'repeat {r}'} {n:24s} prefill {args.prompt_tokens / res['prefill_s']:7.1f} "
                    f"tok/s  decode {args.gen_tokens / res['decode_s']:6.1f} tok/s")
        coli_lines = [n for n in names if ENGINES[n][0] == "coli"]
        if coli_lines:  # memory read bandwidth, coli's probe (coli.bench.memory_bandwidth), same threads
            report["bandwidth_bytes_s"] = workers[coli_lines[0]].bandwidth()
    finally:
        for w in workers.values():
            w.stop()
    report["loadavg_after"] = os.getloadavg()
    report["busy_processes_after"] = busy_processes()
    report.update(prompt_tokens=args.prompt_tokens, gen_tokens=args.gen_tokens, repeats=args.repeats,
                  seed=args.seed, llama_ubatch=args.llama_ubatch, llama_mmap=not args.llama_no_mmap)
    results = {}
    for n in names:
        rs = runs[n]
        results[n] = {
            "prefill_tok_s": summarize([args.prompt_tokens / x["prefill_s"] for x in rs]),
            "decode_tok_s": summarize([args.gen_tokens / x["decode_s"] for x in rs]),
            "ttft_ms": summarize([x["prefill_s"] * 1e3 for x in rs]),
            "decode_ms_per_token": summarize([x["decode_s"] / args.gen_tokens * 1e3 for x in rs]),
            "prefill_cpu_util": summarize([x["prefill_cpu_s"] / (x["prefill_s"] * args.threads) for x in rs]),
            "decode_cpu_util": summarize([x["decode_cpu_s"] / (x["decode_s"] * args.threads) for x in rs]),
            # tokens per CPU-second: at 1 thread, the speed while the engine holds the core,
            # robust to other processes taking turns on a busy machine
            "prefill_tok_per_cpu_s": summarize([args.prompt_tokens / x["prefill_cpu_s"] for x in rs]),
            "decode_tok_per_cpu_s": summarize([args.gen_tokens / x["decode_cpu_s"] for x in rs]),
            "load_s": load_s[n], "info": workers[n].info,
            "weight_bytes_per_token": workers[n].info.get("weight_bytes_per_token"),
            "tokens": [x["tokens"] for x in rs],
        }
    report["results"] = results
    # decode roofline: memory bandwidth / bytes of weights one decode token reads. A Q4_0 / Q8_0
    # GGUF reads the same bytes as coli int4 head int4 / int8 (same blocks, norms and routers f32).
    same_bytes = {"q4_0": "coli int4s (head int4s)", "q4_1": "coli int4 (head int4)", "q8_0": "coli int8"}
    bw = report.get("bandwidth_bytes_s")
    for n, r in results.items():
        if r["weight_bytes_per_token"] is None and ENGINES[n][0] == "llama.cpp" and same_bytes[ENGINES[n][1]] in results:
            r["weight_bytes_per_token"] = results[same_bytes[ENGINES[n][1]]]["weight_bytes_per_token"]
        wb = r["weight_bytes_per_token"]
        r["decode_roofline_tok_s"] = bw / wb if bw and wb else None
    coli_paths = [r["info"]["coli_path"] for r in results.values() if "coli_path" in r["info"]]
    report["commit"] = git_commit(coli_paths[0] if coli_paths else None)
    report["ratios"] = {}
    for a, fmt in RATIOS:
        peers = [n for n in results if n.startswith(f"llama.cpp {fmt}")]
        if a not in results or not peers:
            continue
        ratio = {}
        for metric in ("prefill", "decode"):
            best = max(peers, key=lambda n: results[n][f"{metric}_tok_s"]["median"])
            ratio[metric] = results[a][f"{metric}_tok_s"]["median"] / results[best][f"{metric}_tok_s"]["median"]
            ratio[f"{metric}_vs"] = best
            ratio[f"{metric}_per_cpu_s"] = (results[a][f"{metric}_tok_per_cpu_s"]["median"]
                                            / results[best][f"{metric}_tok_per_cpu_s"]["median"])
        ratio["greedy_agreement"] = [agreement(x, y)["identical"] for x, y in
                                     zip(results[a]["tokens"], results[peers[0]]["tokens"])]
        report["ratios"][f"{a} / llama.cpp {fmt}"] = ratio
    if args.save:
        args.save.write_text(json.dumps(report, indent=1) + "\n")
    if args.json:
        print(json.dumps(report, indent=1))
        return 0

    def cell(s: dict, fmt: str = "{:.1f}") -> str:
        return f"{fmt.format(s['median'])} [dim]({fmt.format(s['min'])}–{fmt.format(s['max'])})[/dim]"

    model = "olmoe-mini" if args.hf_dir is None else hf_dir.name  # the checkpoint timed, not always olmoe-mini
    title = (f"{model} · {args.threads} thread(s) · prompt {args.prompt_tokens} · gen {args.gen_tokens} · "
             f"median (min–max) of {args.repeats}")
    table = Table(title=title)
    for col in ("engine", "decode tok/s", "prefill tok/s", "TTFT ms", "cpu util p/d", "tok/cpu-s p/d",
                "weight MB/tok", "roofline tok/s"):
        table.add_column(col, justify="left" if col == "engine" else "right")
    for n in names:
        r = results[n]
        table.add_row(n, cell(r["decode_tok_s"]), cell(r["prefill_tok_s"]), cell(r["ttft_ms"], "{:.0f}"),
                      f"{r['prefill_cpu_util']['median']:.2f}/{r['decode_cpu_util']['median']:.2f}",
                      f"{r['prefill_tok_per_cpu_s']['median']:.0f}/{r['decode_tok_per_cpu_s']['median']:.1f}",
                      f"{r['weight_bytes_per_token'] / 1e6:.1f}" if r["weight_bytes_per_token"] else "",
                      f"{r['decode_roofline_tok_s']:.0f}" if r["decode_roofline_tok_s"] else "")
    for k, v in report["ratios"].items():
        fa = lambda m: " [dim](vs +FA)[/dim]" if v[f"{m}_vs"].endswith("+FA") else ""  # noqa: E731
        table.add_row(f"[bold]{k}[/bold]", f"[bold]{v['decode']:.2f}x[/bold]{fa('decode')}",
                      f"[bold]{v['prefill']:.2f}x[/bold]{fa('prefill')}",
                      "", "", f"{v['prefill_per_cpu_s']:.2f}x/{v['decode_per_cpu_s']:.2f}x", "", "")
    console.print(table)
    m = report["machine"]
    console.print(f"machine: {m['cpu']}, {m['usable_cpus']} usable CPUs, SIMD {' '.join(m['simd_flags'])}; "
                  f"commit {report['commit']}; " + ", ".join(f"{k} {v}" for k, v in report["versions"].items()))
    console.print(f"load average before {tuple(round(x, 2) for x in report['loadavg_before'])}, "
                  f"after {tuple(round(x, 2) for x in report['loadavg_after'])}; busy before: "
                  f"{report['busy_processes_before'] or 'none'}")
    if bw:
        console.print(f"memory read bandwidth {bw / 1e9:.1f} GB/s ({args.threads} threads, coli.bench.memory_bandwidth); "
                      "roofline = bandwidth / weight bytes one decode token reads")
    if "check" in report:
        c = report["check"][0]
        console.print(f"check F32: max |logit diff| {c['max_abs_diff']:.2e} over {c['prompt_tokens']} positions "
                      f"(max |logit| {c['max_abs_logit']:.2f}); greedy {c['greedy']['identical']}/{c['greedy']['compared']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
