"""`coli kv`: look at the KV slot state files (`.coli_kv`, `.coli_kv.1`, ...)."""
from __future__ import annotations

import datetime
import json
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from coli.cli.common import fail, user_errors

app = typer.Typer(name="kv", help="Inspect the saved KV slot state.", no_args_is_help=True)


@app.command()
@user_errors
def inspect(
    file: Annotated[Optional[Path], typer.Argument(help="One state file (.coli_kv or .coli_kv.N).")] = None,
    kv_dir: Annotated[Optional[Path], typer.Option(
        "--kv-dir", envvar="COLI_KV_DIR", show_envvar=True,
        help="A state directory: report every slot file in it.")] = None,
    model: Annotated[Optional[Path], typer.Option(
        "--model", "-m", envvar="COLI_MODEL", show_envvar=True,
        help="The model to check the files against and decode their text with; alone, its default state "
             "directory is inspected. Default: $COLI_MODEL, else the built-in model.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
) -> None:
    """Show each KV slot file: tokens, size, whether it fits the model, when it was saved, and its text.

    Examples: coli kv inspect --model ./Qwen3-0.6B  ·  coli kv inspect ~/.cache/coli/kv/3f2a…/.coli_kv.1 --json
    """
    from coli.kv.inspect import inspect_file, model_reference, slot_files
    from coli.kv.store import default_state_dir

    if file is not None and kv_dir is not None:
        raise fail("give a FILE or --kv-dir DIR, not both")
    if file is None and kv_dir is None and model is None:  # like every command: the built-in model
        from coli.api import resolve_model_path

        model = resolve_model_path(None)
    fingerprint = tokenizer = None
    if model is not None:
        if not (model / "config.json").is_file():
            raise fail(f"{model} is not a model directory (no config.json)")
        fingerprint, tokenizer = model_reference(model)
        if fingerprint is None:
            raise fail(f"cannot read the model in {model}")
    if file is not None:
        if not file.is_file():
            raise fail(f"{file}: no such file")
        files = [file]
    else:
        directory = kv_dir if kv_dir is not None else (default_state_dir(model, fingerprint) if model else None)
        if directory is None:
            raise fail("nothing to inspect: give a state FILE, --kv-dir DIR or --model DIR")
        if kv_dir is not None and not directory.is_dir():
            raise fail(f"{directory}: no such directory")
        files = slot_files(directory) if directory.is_dir() else []  # a model that never saved any: nothing
    reports = [inspect_file(f, fingerprint=fingerprint, tokenizer=tokenizer) for f in files]
    if file is not None and not reports[0].valid:
        raise fail(f"{file}: {reports[0].problem}")
    if as_json:
        json.dump([r.to_json() for r in reports], sys.stdout, indent=2)
        sys.stdout.write("\n")
        return
    if not reports:
        Console(stderr=True).print(f"no KV state files in {directory}")
        return
    table = Table(title="KV slots", title_justify="left", box=box.SIMPLE_HEAD)
    for col, just in (("slot", "right"), ("tokens", "right"), ("size", "right"), ("B/token", "right"),
                      ("model", "left"), ("weights", "left"), ("saved", "left")):
        table.add_column(col, justify=just, no_wrap=True)
    table.add_column("cached text (first … last)", overflow="fold", min_width=16)
    for r in reports:
        match = {True: "[green]✓ match[/]", False: "[red]✗ other[/]", None: "[dim]?[/]"}[r.fingerprint_match]
        if not r.valid:
            match = "[red]✗ invalid[/]"
        saved = datetime.datetime.fromtimestamp(r.saved_at).strftime("%m-%d %H:%M") if r.saved_at else "—"
        text = (f"{_plain(r.head)} …\n… {_plain(r.tail)}" if r.head is not None
                else f"[red]{escape(r.problem or '')}[/]")
        table.add_row(str(r.slot if r.slot is not None else Path(r.file).name), str(r.tokens), _size(r.bytes),
                      f"{r.bytes_per_token:,.0f}" if r.bytes_per_token else "—", match, r.weight_format or "—",
                      saved, text)
    Console(highlight=False).print(table)


def _plain(text: str | None) -> str:
    return "—" if text is None else escape(text.replace("\n", "⏎"))


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
