"""`coli bench`: measure a model (or a seeded synthetic one) and print a table or JSON."""
from __future__ import annotations

import json
from typing import Annotated, Optional

import typer
from rich.table import Table

from coli.cli.common import ModelOpt, PinOpt, RamBudgetOpt, ThreadsOpt, fail, stderr, user_errors
from coli.synthetic import SPECS


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


@user_errors
def bench(
    model: ModelOpt = None,
    synthetic: Annotated[Optional[str], typer.Option(
        "--synthetic", help=f"Benchmark a seeded random-weight model instead: {', '.join(SPECS)}.")] = None,
    quant: Annotated[Optional[str], typer.Option("--quant", "-q", help="f32, bf16, int8, int4 or int4s.")] = None,
    threads: ThreadsOpt = None,
    ram_budget: RamBudgetOpt = None,
    pin: PinOpt = None,
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
) -> None:
    """Prefill and decode tok/s, TTFT, expert hit rate, bytes read per token and peak RSS.

    Medians over --repeats runs, each with its own random prompt, after one warm-up run."""
    import coli
    from coli import bench as B
    from coli import synthetic as S

    if synthetic and model:
        raise fail("pass either --model or --synthetic, not both")
    if decode not in B.DECODE_MODES:
        raise fail(f"--decode must be one of: {', '.join(B.DECODE_MODES)}")
    opts = {k: v for k, v in dict(ram_budget=ram_budget, pin=pin).items() if v is not None}
    if synthetic:
        if synthetic not in SPECS:
            raise fail(f"unknown synthetic model {synthetic!r}; choose one of: {', '.join(SPECS)}")
        q = quant or "int4"
        with stderr.status(f"Preparing synthetic {synthetic} ({q}) in {S.cache_dir()}…", spinner="dots"):
            path = S.ensure(synthetic, q)
        m = coli.load(path, threads=threads, io=io, prefetch=prefetch, **opts)
        label = f"synthetic:{synthetic}"
    else:
        m = coli.load(model, threads=threads, quant=quant, io=io, prefetch=prefetch, **opts)
        label = str(m.path)
    try:
        res = B.run(m, prompt_tokens=prompt_tokens, gen_tokens=gen_tokens, repeats=repeats, label=label,
                    decode=decode)
    finally:
        m.close()
    if as_json:
        typer.echo(json.dumps(res.to_dict(), indent=1))
        return
    t = Table(title=f"coli bench · {label} · {res.quant} · {res.threads} threads · {res.simd}"
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
    t.add_row("memory bandwidth", f"{res.bandwidth_bytes_s / 1e9:.1f} GB/s", "")
    t.add_row("decode roofline", f"{res.roofline_tok_s:.1f} tok/s",
              f"decode at {res.median('decode_tok_s') / res.roofline_tok_s:.0%} of it")
    stderr.print(t)
