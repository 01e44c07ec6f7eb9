"""`coli pull`, `coli list`, `coli show`, `coli rm`, `coli ps` and `coli plan`: the models a
user has, by the names they know them by (see docs/MODELS.md)."""
from __future__ import annotations

import json
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table

from coli.cli.common import CtxOpt, KvCacheDtypeOpt, ModelOpt, QuantOpt, RamBudgetOpt, fail, stderr, user_errors

stdout = Console(highlight=False, soft_wrap=True)
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")]


def _size(n: int | None) -> str:
    if n is None:
        return "-"
    for unit, div in (("G", 2**30), ("M", 2**20), ("K", 2**10)):
        if n >= div:
            return f"{n / div:.1f}{unit}"
    return f"{n}B"


def _count(n: int | None) -> str:
    if not n:
        return "-"
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.0f}M" if n >= 1e6 else f"{n / 1e3:.0f}K"


@user_errors
def pull(
    name: Annotated[str, typer.Argument(help="Hub name: ORG/MODEL or ORG/MODEL@REVISION.")],
    file: Annotated[Optional[str], typer.Option(
        "--file", "-f", help="Download only this GGUF file of the repository (every part of a split one).")] = None,
    quant: Annotated[Optional[str], typer.Option(
        "--quant", "-q", help="Also convert into coli's models directory at this format (int4, int8, bf16).")] = None,
) -> None:
    """Download a model from the Hugging Face hub into the local cache (shared with transformers).

    Only what coli loads is fetched: config, tokenizer and safetensors files, or the one GGUF
    named by --file. An interrupted download resumes. HF_TOKEN, HF_ENDPOINT and HF_HUB_OFFLINE
    are honoured. Afterwards `-m NAME` finds it without the network.

    Examples: coli pull Qwen/Qwen3-0.6B  ·  coli pull bartowski/Qwen_Qwen3-0.6B-GGUF --file Qwen_Qwen3-0.6B-Q4_0.gguf
    """
    from coli.hub import pull as do_pull
    from coli.quant import check_format

    if quant:
        check_format(quant)
    path = do_pull(name, file=file, quant=quant, progress=stderr.is_terminal)
    stderr.print(f"{name}: ready at {path}", soft_wrap=True)


@user_errors
def list_models(as_json: JsonOpt = False) -> None:
    """List every model coli can see: the Hugging Face cache, coli's converted models and the
    GGUF files loaded by path (-m FILE.gguf).

    Columns: name, architecture, parameters (total / active for MoE), format, size on disk,
    and whether it fits in this machine's memory at its format."""
    from coli.models_cache import scan

    def row(m: dict) -> tuple:
        params = _count(m["params"]) + (f" / {_count(m['active_params'])}" if m.get("active_params") else "")
        fits = {True: "yes", False: "no", None: "?"}[m.get("fits")]
        return m["name"], m.get("arch") or "?", params, m.get("format") or "?", _size(m["size"]), fits

    _print(scan(fit=True), as_json, "no models found (coli pull ORG/MODEL downloads one)",
           ("NAME", "ARCH", "PARAMS", "FORMAT", "SIZE", "FITS"), row)


def _print(items: list[dict], as_json: bool, empty: str, columns: tuple[str, ...], row) -> None:
    """``items`` as JSON, or as a table of ``columns`` (``row(item)`` gives a row's cells)."""
    if as_json:
        typer.echo(json.dumps(items, indent=2))
        return
    if not items:
        stderr.print(empty)
        return
    t = Table(box=None, pad_edge=False)
    for i, col in enumerate(columns):
        t.add_column(col, overflow="fold" if i == 0 else "ellipsis")  # a GGUF's name is its path: shown whole
    for item in items:
        t.add_row(*row(item))
    stdout.print(t)


@user_errors
def show(name: Annotated[str, typer.Argument(help="A model name from `coli list`, a hub name or a path.")],
         as_json: JsonOpt = False) -> None:
    """Show a model: configuration, chat template, tool-call and reasoning support, tensor
    formats and expert layout."""
    from coli.models_cache import describe, find

    info = {"name": (entry := find(name))["name"], **describe(entry["path"], full=True)}
    if as_json:
        typer.echo(json.dumps(info, indent=2))
        return
    for key, value in info.items():
        if key == "chat_template":
            continue
        if isinstance(value, dict):
            value = ", ".join(f"{k} {v}" for k, v in value.items())
        stdout.print(f"[bold]{key:>14}[/]  {value}")
    if info.get("chat_template"):
        stdout.print("[bold]chat template[/]")
        stdout.print(info["chat_template"], markup=False)


@user_errors
def rm(name: Annotated[str, typer.Argument(help="A model name from `coli list`.")],
       yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask.")] = False) -> None:
    """Delete a model from the disk (the Hugging Face cache entry or coli's converted directory).

    A GGUF that was loaded by path is only taken off the list: the file stays."""
    from coli.models_cache import find, remove

    entry = find(name)
    mine = entry["source"] == "gguf"  # a GGUF loaded by path: forgotten, the file is the user's
    if not yes:
        question = f"remove {entry['name']} from the list (the file stays)?" if mine else \
            f"delete {entry['name']} ({_size(entry['size'])} at {entry['path']})?"
        if not typer.confirm(question, err=True):
            raise fail("not deleted", code=1)
    remove(entry)
    stderr.print(f"forgot {entry['name']} (the file stays)" if mine else f"deleted {entry['name']}")


@user_errors
def ps(as_json: JsonOpt = False) -> None:
    """List the `coli serve` processes running on this machine: model, address, memory, slots."""
    from coli.models_cache import running

    _print(running(), as_json, "no coli serve running", ("PID", "MODEL", "URL", "RSS", "SLOTS", "CONTEXT"),
           lambda p: (str(p["pid"]), p["model"], p["url"], _size(p.get("rss")), str(p.get("kv_slots")),
                      str(p.get("ctx"))))


@user_errors
def plan(model: ModelOpt = None, quant: QuantOpt = None, ram_budget: RamBudgetOpt = None, ctx: CtxOpt = None,
         kv_slots: Annotated[int, typer.Option("--kv-slots", min=1, max=16, help="KV slots to plan for.")] = 1,
         kv_cache_dtype: KvCacheDtypeOpt = None, as_json: JsonOpt = False) -> None:
    """Print the memory plan of loading a model (weights, KV cache, buffers against usable
    memory) without loading it. Exits 2 when it would not fit."""
    from coli.api import resolve_model_path
    from coli.plan import make_plan, parse_size

    try:
        budget = parse_size(ram_budget) if ram_budget else None
    except ValueError as e:
        raise fail(f"--ram-budget: {e}") from None
    p = make_plan(resolve_model_path(model), quant=quant, ctx=ctx, kv_slots=kv_slots, ram_budget=budget,
                  kv_cache_dtype=kv_cache_dtype)
    if as_json:
        typer.echo(json.dumps(p.as_dict(), indent=2))
    else:
        t = Table(box=None, pad_edge=False, title=p.model, title_justify="left")
        for col in ("PART", "MEMORY", "DETAIL"):
            t.add_column(col)
        for row in p.rows():
            t.add_row(*row)
        stdout.print(t)
        for note in p.notes:
            stdout.print(note)
    if not p.fits:
        raise fail(p.refusal())
