"""`coli convert`: quantize a Hugging Face directory or a GGUF file into a converted coli directory."""
from __future__ import annotations

from typing import Annotated, Optional

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from coli.cli.common import Quant, fail, stderr, user_errors


@user_errors
def convert(
    src: Annotated[str, typer.Argument(
        help="Hugging Face model directory (config.json, *.safetensors, tokenizer) or a .gguf file.")],
    dst: Annotated[str, typer.Argument(help="Directory to create.")],
    quant: Annotated[Quant, typer.Option("--quant", "-q",
                                       help="The format of the dense weights.")] = "int4",
    head_quant: Annotated[Optional[Quant], typer.Option(
        "--head-quant", help="Format of the LM head and embeddings. Default: int8 under int4, else --quant.")] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace DST if it exists.")] = False,
    calibration: Annotated[Optional[str], typer.Option(
        "--calibration", metavar="FILE",
        help="Run SRC in f32 over this text first (.jsonl of {\"text\": ...} lines, or plain text; "
             "'default': the corpus of coli atlas) and round int4 layers by GPTQ against the "
             "statistics of their inputs (docs/QUANTIZATION.md). Hugging Face directories, int4 only.")] = None,
) -> None:
    """Convert a model: quantized dense tensors ready to map, each expert packed for one read.

    The result loads with `--model DST` and streams experts from disk when they do not fit
    `--ram-budget`. The format is described in docs/FORMAT.md."""
    from pathlib import Path

    from coli.weights.convert import convert as do_convert, count_tensors

    from coli.weights.gguf import is_gguf

    if not Path(src).is_dir() and not (Path(src).is_file() and is_gguf(src)):
        raise fail(f"{src}: neither a directory nor a GGUF file (pass a Hugging Face model directory or a .gguf)"
                   if Path(src).exists() else f"{src}: no such directory or file")
    texts = None
    if calibration is not None:
        from coli import calibration as cal

        texts = cal.default_texts() if calibration == "default" else cal.read_texts(calibration)
    total = count_tensors(src)
    with Progress(TextColumn("[bold]converting[/] {task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=stderr, transient=False, disable=not stderr.is_terminal) as bar:
        cal_task = None

        def calibrating(done: int, of: int) -> None:
            nonlocal cal_task
            if cal_task is None:
                cal_task = bar.add_task(f"calibration: {len(texts)} texts in f32", total=of)
            bar.update(cal_task, completed=done)

        task = bar.add_task(f"{src} → {dst} ({quant})", total=total)
        out = do_convert(src, dst, quant, head_quant=head_quant, force=force,
                         progress=lambda n: bar.advance(task, n), calibration=texts,
                         calibration_progress=calibrating)
        bar.update(task, completed=total)
    stderr.print(f"wrote {out}")
