#!/usr/bin/env python
"""Prefill and decode tok/s of coli vs Hugging Face transformers, side by side.

Both engines run the same seeded random fp32 checkpoint (written by transformers
itself), the same prompt, the same number of threads, in the same invocation:

    python benchmarks/bench_vs_transformers.py --threads 2

The default shape is a realistic small MoE ("olmoe" model_type): hidden 1024,
8 layers, 16 heads x head_dim 64, 32 experts top-4, expert intermediate 512,
vocab 50304. The checkpoint is written once to --workdir and reused.

What is timed (per repeat, fresh KV cache each time):

* prefill: the whole --prompt-tokens prompt in one forward pass into an empty KV
  cache, up to and including the logits of the last prompt position and their
  argmax (the first generated token). That is what a generation needs; pass
  --all-logits to make both engines compute the logits of every prompt position
  instead (coli: ``step(all_logits=True)``, transformers: ``logits_to_keep=0``).
* decode: --gen-tokens greedy steps through the KV cache, each one forward pass
  of one token plus an argmax. The prefill is not part of it. transformers runs
  a manual loop, ``model(input_ids=tok, cache=cache, use_cache=True)`` (a DynamicCache)
  under ``torch.inference_mode()`` — the same work coli's ``engine.step`` loop does,
  without ``generate``'s logits processors and stopping criteria.

Each engine lives in its own worker process (spawned; the coli worker never
imports torch), so the two OpenMP runtimes and allocators never share a process,
and the workers take turns: every repeat runs coli then transformers (alternating
which goes first), so drifting background load hits both alike. One warm-up
repeat per engine is run and discarded. Reported: medians over --repeats, with
min and max, plus each engine's CPU time: "cpu util" (CPU s / (wall s x threads)) and
tokens per CPU-second. At one thread a util well below 1 means the engine waited for
the CPU (a busy machine) and its wall-clock numbers should not be quoted.

Both engines must produce the same greedy tokens (the comparison is of equal
work); agreement and the max |difference| of the last prefill logits are printed.
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

SHAPE = dict(
    model_type="olmoe",
    hidden_size=1024,
    num_hidden_layers=8,
    num_attention_heads=16,
    num_key_value_heads=16,
    head_dim=64,
    num_experts=32,
    num_experts_per_tok=4,
    intermediate_size=512,  # olmoe: the per-expert intermediate size
    vocab_size=50304,
    max_position_embeddings=4096,
    norm_topk_prob=False,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)
INIT_STD = 0.03  # weight init: wide enough that greedy argmax is decisive, small enough to stay tame


# ---------------------------------------------------------------- checkpoint

def checkpoint_spec(seed: int) -> dict:
    return {"shape": SHAPE, "seed": seed, "init_std": INIT_STD, "version": 1}


def write_tokenizer(model_dir: Path, vocab_size: int) -> None:
    """A word-level tokenizer over 'w0'..'w{n}' (the engine's loader needs tokenizer.json)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab_size)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    tok.save(str(model_dir / "tokenizer.json"))
    (model_dir / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "w0"}))


def build_checkpoint(out: str, seed: int) -> None:
    """Seeded random model written by transformers' own save_pretrained (runs in a worker)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    out_p = Path(out)
    torch.manual_seed(seed)
    kw = {k: v for k, v in SHAPE.items() if k != "model_type"}
    cfg = AutoConfig.for_model(SHAPE["model_type"], **kw)
    cfg.eos_token_id = cfg.bos_token_id = cfg.pad_token_id = None
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif p.dim() >= 2:
                p.normal_(0.0, INIT_STD)
            else:
                p.normal_(0.0, 0.02)
    out_p.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_p)
    write_tokenizer(out_p, cfg.vocab_size)
    (out_p / "bench_spec.json").write_text(json.dumps(checkpoint_spec(seed), indent=1))


def ensure_checkpoint(workdir: Path, seed: int, log) -> Path:
    spec = checkpoint_spec(seed)
    marker = workdir / "bench_spec.json"
    ok = (marker.exists() and (workdir / "tokenizer.json").exists() and (workdir / "config.json").exists()
          and any(workdir.glob("*.safetensors")))
    if ok:
        try:
            ok = json.loads(marker.read_text()) == spec
        except ValueError:
            ok = False
    if ok:
        log(f"reusing checkpoint in {workdir}")
        return workdir
    log(f"writing the seeded checkpoint to {workdir} (once) ...")
    ctx = mp.get_context("spawn")
    p = ctx.Process(target=build_checkpoint, args=(str(workdir), seed))
    p.start()
    p.join()
    if p.exitcode != 0:
        raise SystemExit(f"building the checkpoint failed (exit {p.exitcode})")
    return workdir


# ---------------------------------------------------------------- engine workers

def cpu_seconds() -> float:
    """User + system CPU time of this process, all its threads."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


class ColiRunner:
    name = "coli"

    def __init__(self, model_dir: str, threads: int, all_logits: bool, quant: str):
        import numpy as np

        import coli
        from coli._engine import kernels as K
        from coli.api import PREFILL_CHUNK

        self.np, self.chunk, self.all_logits = np, PREFILL_CHUNK, all_logits
        self.model = coli.load(model_dir, threads=threads, **({} if quant == "f32" else {"quant": quant}))
        self.engine = self.model.engine
        self.info = {"simd": K.simd_name(), "threads": K.get_num_threads(),
                     "coli_version": getattr(coli, "__version__", None), "quant": quant,
                     "coli_path": str(Path(coli.__file__).resolve().parent.parent)}

    def run(self, ids: list[int], gen: int) -> dict:
        np, eng = self.np, self.engine
        cache = eng.new_cache(len(ids) + gen + 1)
        c0, t0 = cpu_seconds(), time.perf_counter()
        for i in range(0, len(ids), self.chunk):
            logits = eng.step([(cache, ids[i:i + self.chunk])], all_logits=self.all_logits)
        tok = int(np.argmax(logits[-1]))
        c1, t1 = cpu_seconds(), time.perf_counter()
        last = np.array(logits[-1], dtype=np.float32)
        toks = [tok]
        for _ in range(gen):
            logits = eng.step([(cache, [tok])])
            tok = int(np.argmax(logits[0]))
            toks.append(tok)
        c2, t2 = cpu_seconds(), time.perf_counter()
        return {"prefill_s": t1 - t0, "decode_s": t2 - t1, "prefill_cpu_s": c1 - c0, "decode_cpu_s": c2 - c1,
                "tokens": toks, "last_logits": last}


class HFRunner:
    name = "transformers"

    def __init__(self, model_dir: str, threads: int, all_logits: bool, experts_impl: str | None):
        import torch
        from transformers import AutoModelForCausalLM, DynamicCache
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        torch.set_num_threads(threads)
        self.torch, self.DynamicCache, self.all_logits = torch, DynamicCache, all_logits
        kw = {"experts_implementation": experts_impl} if experts_impl else {}
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **kw).eval()
        cfg = self.model.config
        self.info = {"threads": torch.get_num_threads(),
                     "attn_implementation": getattr(cfg, "_attn_implementation", None),
                     "experts_implementation": getattr(cfg, "_experts_implementation", None)}

    def run(self, ids: list[int], gen: int) -> dict:
        torch, model = self.torch, self.model
        with torch.inference_mode():
            x = torch.tensor([ids], dtype=torch.long)
            cache = self.DynamicCache(config=model.config)
            c0, t0 = cpu_seconds(), time.perf_counter()
            out = model(input_ids=x, cache=cache, use_cache=True, logits_to_keep=0 if self.all_logits else 1)
            tok = int(out.logits[0, -1].argmax())
            c1, t1 = cpu_seconds(), time.perf_counter()
            last = out.logits[0, -1].float().numpy().copy()
            toks = [tok]
            for _ in range(gen):
                out = model(input_ids=torch.tensor([[tok]], dtype=torch.long), cache=cache, use_cache=True)
                tok = int(out.logits[0, -1].argmax())
                toks.append(tok)
            c2, t2 = cpu_seconds(), time.perf_counter()
        return {"prefill_s": t1 - t0, "decode_s": t2 - t1, "prefill_cpu_s": c1 - c0, "decode_cpu_s": c2 - c1,
                "tokens": toks, "last_logits": last}


def worker(kind: str, conn, model_dir: str, threads: int, all_logits: bool, experts_impl: str | None,
           quant: str) -> None:
    try:
        runner = ColiRunner(model_dir, threads, all_logits, quant) if kind == "coli" else \
            HFRunner(model_dir, threads, all_logits, experts_impl)
        conn.send(("ready", runner.info))
        while True:
            msg = conn.recv()
            if msg[0] == "stop":
                break
            _, ids, gen = msg
            conn.send(("ok", runner.run(ids, gen)))
    except BaseException as e:  # report, don't hang the parent
        import traceback
        conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        conn.close()


class Worker:
    def __init__(self, kind: str, *args):
        ctx = mp.get_context("spawn")
        self.kind = kind
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=worker, args=(kind, child, *args), daemon=True)
        self.proc.start()
        child.close()
        self.info = self._get()

    def _get(self):
        status, payload = self.conn.recv()
        if status == "error":
            raise SystemExit(f"{self.kind} worker failed:\n{payload}")
        return payload

    def run(self, ids, gen):
        self.conn.send(("run", ids, gen))
        return self._get()

    def stop(self):
        try:
            self.conn.send(("stop",))
        except (BrokenPipeError, OSError):
            pass
        self.proc.join(timeout=30)


# ---------------------------------------------------------------- environment

def _sh(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=REPO).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""


def machine_info() -> dict:
    cpu, flags = "", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and not cpu:
                cpu = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    simd = [f for f in ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx_vnni",
                        "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8") if f in flags]
    mem_gib = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                mem_gib = round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return {"cpu": cpu or platform.processor(), "logical_cpus": os.cpu_count(),
            "usable_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
            "simd_flags": simd, "mem_gib": mem_gib, "kernel": platform.release(),
            "python": platform.python_version()}


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for pkg in ("torch", "transformers", "numpy", "tokenizers", "Cython"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = None
    return out


def git_commit(coli_path: str | None) -> str:
    """Short commit of the coli source that was measured, '+dirty' when that tree has
    uncommitted engine changes. The coli measured is the one ``import coli`` finds: this
    checkout, or e.g. a clean ``git worktree`` of a commit put first on PYTHONPATH."""
    where = Path(coli_path) if coli_path else REPO
    c = _sh(["git", "-C", str(where), "rev-parse", "--short", "HEAD"])
    dirty = _sh(["git", "-C", str(where), "status", "--porcelain", "--untracked-files=no", "--",
                 "coli", "setup.py"])
    out = (c or "unknown") + ("+dirty" if c and dirty else "")
    return out if where == REPO else f"{out} (coli from {where})"


# ---------------------------------------------------------------- main

def summarize(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "all": xs}


def agreement(a: list[int], b: list[int]) -> dict:
    n = min(len(a), len(b))
    first = next((i for i in range(n) if a[i] != b[i]), None)
    return {"compared": n, "identical": sum(x == y for x, y in zip(a, b)),
            "first_divergence": first, "all_equal": first is None and len(a) == len(b)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2, help="threads for both engines (default 2)")
    ap.add_argument("--prompt-tokens", type=int, default=128, help="prefill length (default 128)")
    ap.add_argument("--gen-tokens", type=int, default=64, help="greedy decode steps timed (default 64)")
    ap.add_argument("--repeats", type=int, default=3, help="measured repeats per engine (default 3)")
    ap.add_argument("--seed", type=int, default=0, help="torch.manual_seed of the checkpoint (default 0)")
    ap.add_argument("--workdir", type=Path,
                    default=Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "coli" / "bench"
                    / "olmoe-h1024-l8-e32k4-i512",
                    help="where the checkpoint is written (reused if present)")
    ap.add_argument("--all-logits", action="store_true",
                    help="prefill computes logits of every prompt position (default: the last one)")
    ap.add_argument("--hf-experts", default=None, choices=["eager", "grouped_mm", "batched_mm"],
                    help="transformers experts_implementation (default: transformers' own default)")
    ap.add_argument("--coli-quant", default="f32", choices=["f32", "bf16", "int8", "int4"],
                    help="coli weight format (default f32, the like-for-like comparison; others are "
                         "not equal work and will not reproduce transformers' tokens exactly)")
    ap.add_argument("--engines", default="coli,transformers", help="comma list (default both)")
    ap.add_argument("--json", action="store_true", help="print the results as JSON on stdout")
    ap.add_argument("--save", type=Path, default=None, help="also write the JSON report to this file")
    args = ap.parse_args(argv)

    from rich.console import Console
    from rich.table import Table

    console = Console(stderr=args.json, width=None if sys.stdout.isatty() else 120)
    log = (lambda s: console.print(f"[dim]{s}[/dim]"))
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = str(args.threads)  # inherited by the spawned workers

    model_dir = ensure_checkpoint(args.workdir.expanduser().resolve(), args.seed, log)
    import numpy as np

    ids = [int(t) for t in np.random.default_rng(args.seed + 1).integers(0, SHAPE["vocab_size"],
                                                                        size=args.prompt_tokens)]
    kinds = [k.strip() for k in args.engines.split(",") if k.strip()]
    load0 = os.getloadavg()
    workers = {}
    try:
        for kind in kinds:
            t = time.perf_counter()
            workers[kind] = Worker(kind, str(model_dir), args.threads, args.all_logits, args.hf_experts,
                                   args.coli_quant)
            log(f"{kind}: loaded in {time.perf_counter() - t:.1f}s {workers[kind].info}")
        runs = {k: [] for k in kinds}
        for r in range(args.repeats + 1):  # repeat 0 is the warm-up
            order = kinds if r % 2 == 0 else kinds[::-1]
            for kind in order:
                res = workers[kind].run(ids, args.gen_tokens)
                if r > 0:
                    runs[kind].append(res)
                log(f"{'warm-up' if r == 0 else f'repeat {r}'} {kind}: prefill {res['prefill_s'] * 1e3:.0f} ms, "
                    f"decode {res['decode_s'] / args.gen_tokens * 1e3:.1f} ms/token")
    finally:
        for w in workers.values():
            w.stop()
    load1 = os.getloadavg()
    workers_info = {k: w.info for k, w in workers.items()}

    results = {}
    for kind in kinds:
        rs = runs[kind]
        results[kind] = {
            "prefill_tok_s": summarize([args.prompt_tokens / x["prefill_s"] for x in rs]),
            "decode_tok_s": summarize([args.gen_tokens / x["decode_s"] for x in rs]),
            "prefill_ms": summarize([x["prefill_s"] * 1e3 for x in rs]),
            "decode_ms_per_token": summarize([x["decode_s"] / args.gen_tokens * 1e3 for x in rs]),
            # CPU seconds / (wall seconds x threads): near 1 when the engine had its cores to
            # itself and kept them busy; well below 1 means it waited (other load, idle threads).
            # tokens per CPU-second: at 1 thread, the speed the engine has while it holds the
            # core, so it is robust to other processes taking turns on a shared machine.
            "prefill_tok_per_cpu_s": summarize([args.prompt_tokens / x["prefill_cpu_s"] for x in rs]),
            "decode_tok_per_cpu_s": summarize([args.gen_tokens / x["decode_cpu_s"] for x in rs]),
            "prefill_cpu_util": summarize([x["prefill_cpu_s"] / (x["prefill_s"] * args.threads) for x in rs]),
            "decode_cpu_util": summarize([x["decode_cpu_s"] / (x["decode_s"] * args.threads) for x in rs]),
            "tokens": rs[0]["tokens"],
            "deterministic": all(x["tokens"] == rs[0]["tokens"] for x in rs),
            "info": workers[kind].info,
        }
    report = {
        "benchmark": "bench_vs_transformers",
        "command": " ".join(["python", "benchmarks/bench_vs_transformers.py", *(argv or sys.argv[1:])]),
        "commit": git_commit(workers_info.get("coli", {}).get("coli_path")), "machine": machine_info(), "versions": versions(),
        "threads": args.threads, "prompt_tokens": args.prompt_tokens, "gen_tokens": args.gen_tokens,
        "repeats": args.repeats, "all_logits": args.all_logits, "seed": args.seed, "coli_quant": args.coli_quant,
        "shape": SHAPE,
        "model_dir": str(model_dir), "loadavg_before": load0, "loadavg_after": load1,
        "results": {k: {kk: vv for kk, vv in v.items() if kk != "tokens"} for k, v in results.items()},
    }
    if "coli" in results and "transformers" in results:
        c, h = results["coli"], results["transformers"]
        report["speedup"] = {
            "prefill": c["prefill_tok_s"]["median"] / h["prefill_tok_s"]["median"],
            "decode": c["decode_tok_s"]["median"] / h["decode_tok_s"]["median"],
            "prefill_per_cpu_s": c["prefill_tok_per_cpu_s"]["median"] / h["prefill_tok_per_cpu_s"]["median"],
            "decode_per_cpu_s": c["decode_tok_per_cpu_s"]["median"] / h["decode_tok_per_cpu_s"]["median"],
        }
        report["greedy_agreement"] = agreement(c["tokens"], h["tokens"])
        report["prefill_last_logits_max_abs_diff"] = float(
            np.max(np.abs(runs["coli"][0]["last_logits"] - runs["transformers"][0]["last_logits"])))

    if args.save:
        args.save.write_text(json.dumps(report, indent=1) + "\n")
    if args.json:
        print(json.dumps(report, indent=1))
        return 0

    def med(s: dict, fmt: str = "{:.1f}") -> str:
        return fmt.format(s["median"])

    def spread(s: dict, fmt: str = "{:.1f}") -> str:
        return f"[dim]{fmt.format(s['min'])}–{fmt.format(s['max'])}[/dim]"

    m = report["machine"]
    title = (f"{SHAPE['model_type']} h{SHAPE['hidden_size']} l{SHAPE['num_hidden_layers']} "
             f"e{SHAPE['num_experts']}k{SHAPE['num_experts_per_tok']} i{SHAPE['intermediate_size']} fp32"
             f"{'' if args.coli_quant == 'f32' else f' (coli {args.coli_quant})'} · "
             f"{args.threads} thread(s) · prompt {args.prompt_tokens} · gen {args.gen_tokens} · "
             f"median (min–max) of {args.repeats}")
    table = Table(title=title)
    for col in ("engine", "prefill tok/s", "min–max", "decode tok/s", "min–max", "prefill ms", "decode ms/tok",
                "cpu util p/d", "tok/cpu-s p/d"):
        table.add_column(col, justify="left" if col == "engine" else "right")
    for kind in kinds:
        r = results[kind]
        table.add_row(kind, med(r["prefill_tok_s"]), spread(r["prefill_tok_s"]), med(r["decode_tok_s"]),
                      spread(r["decode_tok_s"]), med(r["prefill_ms"], "{:.0f}"),
                      med(r["decode_ms_per_token"], "{:.2f}"),
                      f"{r['prefill_cpu_util']['median']:.2f}/{r['decode_cpu_util']['median']:.2f}",
                      f"{r['prefill_tok_per_cpu_s']['median']:.0f}/{r['decode_tok_per_cpu_s']['median']:.1f}")
    if "speedup" in report:
        table.add_row("[bold]coli / transformers[/bold]", f"[bold]{report['speedup']['prefill']:.2f}x[/bold]", "",
                      f"[bold]{report['speedup']['decode']:.2f}x[/bold]", "", "", "",
                      f"{report['speedup']['prefill_per_cpu_s']:.2f}x/{report['speedup']['decode_per_cpu_s']:.2f}x")
    console.print(table)
    console.print(f"machine: {m['cpu']}, {m['usable_cpus']} usable CPUs, {m['mem_gib']} GiB, "
                  f"SIMD {' '.join(m['simd_flags'])}; commit {report['commit']}; "
                  + ", ".join(f"{k} {v}" for k, v in report["versions"].items()))
    console.print(f"load average before {tuple(round(x, 2) for x in load0)}, after {tuple(round(x, 2) for x in load1)}")
    if "greedy_agreement" in report:
        a = report["greedy_agreement"]
        verdict = "[green]identical[/green]" if a["all_equal"] else \
            f"[red]diverge at token {a['first_divergence']}[/red]"
        console.print(f"greedy tokens: {a['identical']}/{a['compared']} equal, {verdict}; "
                      f"last prefill logits max |diff| {report['prefill_last_logits_max_abs_diff']:.2e}")
    low = [] if args.threads != 1 else [k for k in kinds if min(results[k]["prefill_cpu_util"]["median"], results[k]["decode_cpu_util"]["median"]) < 0.9]
    if low:
        console.print(f"[yellow]cpu util below 0.9 for {', '.join(low)}: the engine waited for CPU (other load?); "
                      "wall-clock numbers are unreliable, compare tok/cpu-s or rerun on a quiet machine[/yellow]")
    for kind in kinds:
        if not results[kind]["deterministic"]:
            console.print(f"[yellow]{kind}: greedy tokens differed between repeats[/yellow]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
