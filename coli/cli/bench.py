"""`coli bench`: measure a model (or a seeded synthetic one) and print a table or JSON."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from coli.cli.common import (KvCacheDtypeOpt, DraftModelOpt, ModelOpt, PinOpt, Quant, RamBudgetOpt, ThreadsOpt, fail, speculation,
                             stderr, user_errors)
from coli.synthetic import SPECS


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


@user_errors
def bench(
    model: ModelOpt = None,
    synthetic: Annotated[Optional[str], typer.Option(
        "--synthetic", help=f"Benchmark a seeded random-weight model instead: {', '.join(SPECS)}.")] = None,
    quant: Annotated[Optional[Quant], typer.Option("--quant", "-q",
                                                 help="The weight format.")] = None,
    threads: ThreadsOpt = None,
    ram_budget: RamBudgetOpt = None,
    pin: PinOpt = None,
    kv_cache_dtype: KvCacheDtypeOpt = None,
    prompt_tokens: Annotated[int, typer.Option("--prompt-tokens", min=1)] = 128,
    gen_tokens: Annotated[int, typer.Option("--gen-tokens", min=1)] = 64,
    repeats: Annotated[int, typer.Option("--repeats", min=1)] = 3,
    prefetch: Annotated[bool, typer.Option(
        "--prefetch/--no-prefetch", help="Read the next layer's likely experts ahead (streamed experts only).")] = False,
    io: Annotated[str, typer.Option("--io", help="direct (bypass the page cache) or buffered.")] = "direct",
    decode: Annotated[str, typer.Option(
        "--decode", help="greedy: feed back the argmax. random: feed a seeded random continuation, so a "
                         "random-weight model's routing varies like real text's (use it for cache A/Bs).")] = "greedy",
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of a table.")] = False,
    constrained: Annotated[bool, typer.Option(
        "--constrained", help="Decode under a JSON schema (a realistic nested one, or --schema) vs unconstrained: "
                              "tok/s, mask time per token, forced-token share, steps saved by folding; "
                              "--gen-tokens caps each answer (400 when left at 64).")] = False,
    schema: Annotated[Optional[Path], typer.Option("--schema", metavar="FILE",
                                                   help="The JSON schema for --constrained.")] = None,
    batch: Annotated[int, typer.Option("--batch", min=1, help="Requests decoded together (--constrained).")] = 1,
    speculative: Annotated[Optional[str], typer.Option(
        "--speculative", help="Also decode the prompts through the runner without and with this speculative mode "
                              "(auto, ngram, draft, mtp): acceptance rate, tokens per step, tok/s both ways.")] = None,
    draft_model: DraftModelOpt = None,
) -> None:
    """Prefill and decode tok/s, TTFT, expert hit rate, bytes read per token and peak RSS.

    Medians over --repeats runs, each with its own random prompt, after one warm-up run. The
    decode roofline is memory bandwidth (probed after each run) over the bytes a token reads:
    its weights and the KV cache at the runs' mean context."""
    import coli
    from coli import bench as B
    from coli import synthetic as S

    if synthetic and model:
        raise fail("pass either --model or --synthetic, not both")
    if decode not in B.DECODE_MODES:
        raise fail(f"--decode must be one of: {', '.join(B.DECODE_MODES)}")
    if speculative is not None:  # checked before the long part
        from coli.speculate import resolve_mode

        resolve_mode(speculative)
    opts = {k: v for k, v in dict(process_budget=ram_budget, pin=pin, kv_cache_dtype=kv_cache_dtype).items()
            if v is not None}
    if synthetic:
        if synthetic not in SPECS:
            raise fail(f"unknown synthetic model {synthetic!r}; choose one of: {', '.join(SPECS)}")
        q = quant or "int4"
        with stderr.status(f"Preparing synthetic {synthetic} ({q}) in {S.cache_dir()}…", spinner="dots"):
            path = S.ensure(synthetic, q)
        if constrained:  # a word-level tokenizer cannot write JSON (coli.grammar.bench)
            from coli.grammar.bench import text_tokenizer_dir

            path = text_tokenizer_dir(path)
        m = coli.load(path, threads=threads, io=io, prefetch=prefetch, **opts)
        label = f"synthetic:{synthetic}"
    else:
        m = coli.load(model, threads=threads, quant=quant, io=io, prefetch=prefetch, **opts)
        label = str(m.path)
    if constrained:
        return _constrained(m, label, schema, batch, gen_tokens, repeats, as_json)
    spec = None
    try:
        res = B.run(m, prompt_tokens=prompt_tokens, gen_tokens=gen_tokens, repeats=repeats, label=label,
                    decode=decode)
        if speculative is not None:
            spec = _speculative(m, speculative, draft_model, prompt_tokens, gen_tokens, repeats)
    finally:
        m.close()
    if as_json:
        d = res.to_dict()
        if spec is not None:
            d["speculative"] = spec
        typer.echo(json.dumps(d, indent=1))
        return
    used = f" ({res.threads_in_use} in use: the machine is busy)" if res.threads_in_use != res.threads else ""
    t = Table(title=f"coli bench · {label} · {res.quant} · {res.threads} threads{used} · {res.simd} · KV {res.kv_cache_dtype}"
                    + (" · random decode input" if decode == "random" else ""))
    t.add_column("metric")
    t.add_column("median", justify="right")
    t.add_column("min … max", justify="right")
    rows = [("prefill tok/s", "prefill_tok_s", "{:.1f}"), ("decode tok/s", "decode_tok_s", "{:.1f}"),
            ("TTFT", "ttft_s", "{:.3f} s"), ("expert hit rate", "hit_rate", "{:.1%}"),
            ("bytes read / token", "bytes_read_per_token", None), ("I/O wait / run", "io_wait_s", "{:.3f} s")]
    for name, key, fmtstr in rows:
        lo, hi = res.spread(key)
        f = fmtstr.format if fmtstr else _gb
        t.add_row(name, f(res.median(key)), f"{f(lo)} … {f(hi)}")
    t.add_row("peak RSS", _gb(res.peak_rss_bytes), "")
    t.add_row("experts: pinned / cached / disk",
              " / ".join(_gb(res.resident[k]) for k in ("pinned", "cached", "disk")), "")
    ratio = res.kv_bytes_per_token_expanded / res.kv_bytes_per_token
    t.add_row("KV bytes / token", f"{res.kv_bytes_per_token:,}",
              f"expanded K/V: {res.kv_bytes_per_token_expanded:,} ({ratio:.0f}x)" if ratio > 1 else "")
    t.add_row("weights read / token", _gb(res.weight_bytes_per_token), "")
    t.add_row("KV cache read / token", _gb(res.kv_bytes_read_per_token), f"{res.prompt_tokens + res.gen_tokens / 2:.0f} positions (mean)")
    lo, hi = res.spread("bandwidth_bytes_s")
    t.add_row("memory bandwidth", f"{res.bandwidth_bytes_s / 1e9:.1f} GB/s", f"{lo / 1e9:.1f} … {hi / 1e9:.1f} GB/s")
    lo, hi = res.spread("roofline_fraction")
    t.add_row("decode roofline", f"{res.roofline_tok_s:.1f} tok/s",
              f"decode at {res.median('roofline_fraction'):.0%} of it ({lo:.0%} … {hi:.0%})")
    if spec is not None:
        t.add_row(f"speculative ({spec['mode']}) tok/s", f"{spec['decode_tok_s_with']:.1f}",
                  f"without: {spec['decode_tok_s_without']:.1f} ({spec['speedup']:.2f}x)")
        t.add_row("acceptance · tokens/step", f"{spec['acceptance_rate']:.1%} · {spec['tokens_per_step']:.2f}",
                  "same text" if spec["identical"] else "TEXT DIFFERS")
    stderr.print(t)


def _constrained(m, label, schema_file, batch, gen_tokens, repeats, as_json) -> None:
    from coli.grammar.bench import run

    schema = None
    if schema_file is not None:
        try:
            schema = json.loads(schema_file.read_text())
        except (OSError, ValueError) as e:
            raise fail(f"--schema: {schema_file}: {e}") from None
    try:
        res = run(m, schema=schema, batch=batch, gen_tokens=gen_tokens if gen_tokens != 64 else 400, repeats=repeats)
        res["threads"] = m.engine.threads
    finally:
        m.close()
    if as_json:
        typer.echo(json.dumps(res, indent=1))
        return
    t = Table(title=f"coli bench --constrained · {label} · batch {batch} · {res['threads']} threads")
    t.add_column("run")
    t.add_column("decode tok/s", justify="right")
    t.add_column("engine steps", justify="right")
    t.add_column("tokens", justify="right")
    for name in ("unconstrained", "constrained", "constrained_folded"):
        r = res[name]
        t.add_row(name.replace("_", ", "), f"{r['decode_tok_s']:.1f}", f"{r['steps']:.0f}", f"{r['tokens']:.0f}")
    stderr.print(t)
    stderr.print(f"mask time {res['mask_us_per_token']:.0f} µs per constrained token (on a worker thread, "
                 f"overlapping the engine) · forced tokens {res['forced_share']:.0%} · "
                 f"{res['steps_saved']:.0f} steps saved by folding · constraint cost "
                 f"{res['cost_vs_unconstrained']:+.1%} unfolded, folded at {res['folded_vs_unconstrained']:.2f}x "
                 f"unconstrained · {res['finished']}")


def _speculative(m, mode: str, draft_model: str | None, prompt_tokens: int, gen_tokens: int, repeats: int) -> dict:
    """The runner's decode without and with speculation on the bench's kind of prompt:
    seeded random tokens whose start is repeated at the end, so prompt lookup has something
    to find (a copy-heavy request: the model is shown text it may write again)."""
    import numpy as np

    from coli.speculate.bench import compare

    if mode == "off":
        raise fail("--speculative off: nothing to compare; pass auto, ngram, draft or mtp")
    mode, draft = speculation(mode, draft_model, m)
    rng = np.random.default_rng(1)
    V = m.config.vocab_size
    size = max(1, prompt_tokens * 2 // 3)  # a random text, then its first part again: the rest may be copied
    prompts = []
    for _ in range(repeats):
        part = rng.integers(2, V, size=size).tolist()
        prompts.append(part + part[: prompt_tokens - size])
    try:
        return compare(m, prompts, mode, max_tokens=gen_tokens, draft_model=draft)
    finally:
        if draft is not None:
            draft.close()
