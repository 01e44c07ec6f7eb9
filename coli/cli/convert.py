"""`coli convert`: quantize a Hugging Face directory into a converted coli directory."""
from __future__ import annotations

from typing import Annotated, Optional

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from coli.cli.common import stderr, user_errors


@user_errors
def convert(
    src: Annotated[str, typer.Argument(help="Hugging Face model directory (config.json, *.safetensors, tokenizer).")],
    dst: Annotated[str, typer.Argument(help="Directory to create.")],
    quant: Annotated[str, typer.Option("--quant", "-q", help="int4, int4s, int8 or bf16 (or f32).")] = "int4",
    head_quant: Annotated[Optional[str], typer.Option(
        "--head-quant", help="Format of the LM head and embeddings. Default: int8 under int4, else --quant.")] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace DST if it exists.")] = False,
) -> None:
    """Convert a model: quantized dense tensors ready to map, each expert packed for one read.

    The result loads with `--model DST` and streams experts from disk when they do not fit
    `--ram-budget`. The format is described in docs/FORMAT.md."""
    from coli.weights.convert import convert as do_convert, count_tensors

    total = count_tensors(src)
    with Progress(TextColumn("[bold]converting[/] {task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=stderr, transient=False, disable=not stderr.is_terminal) as bar:
        task = bar.add_task(f"{src} → {dst} ({quant})", total=total)
        out = do_convert(src, dst, quant, head_quant=head_quant, force=force,
                         progress=lambda n: bar.advance(task, n))
        bar.update(task, completed=total)
    stderr.print(f"wrote {out}")
