"""Pieces every command shares: option definitions, exit codes, model loading, errors."""
from __future__ import annotations

import functools
import sys
from enum import IntEnum
from typing import Annotated, Literal, Optional

import typer
from rich.console import Console

from coli.errors import ColiError
from coli.quant import FORMATS


class ExitCode(IntEnum):
    OK = 0
    ERROR = 1  # something failed while running (not the user's input)
    USAGE = 2  # bad input: a wrong path, a corrupt file, a malformed prompt or option
    INTERRUPTED = 130


# Not a terminal (a pipe, a log file, a test): messages stay one line each, however long (a
# script greps them; rich would otherwise break them at 80 columns).
stderr = Console(stderr=True, highlight=False, soft_wrap=not sys.stderr.isatty())

ModelOpt = Annotated[Optional[str], typer.Option(
    "--model", "-m", envvar="COLI_MODEL", show_envvar=True,
    help="Model: a Hugging Face or converted directory, a .gguf file, or a hub name pulled with coli pull "
         "(ORG/MODEL). Default: $COLI_MODEL, else the built-in model.")]
ThreadsOpt = Annotated[Optional[int], typer.Option(
    "--threads", "-t", envvar="COLI_THREADS", show_envvar=True, min=1,
    help="Compute threads: the most the kernels use (fewer while a busy machine makes fewer faster; "
         "COLI_ADAPTIVE_THREADS=0 keeps exactly this many). Default: the usable cores.")]
MaxTokensOpt = Annotated[int, typer.Option("--max-tokens", "-n", min=1, help="Most tokens to generate.")]
TemperatureOpt = Annotated[Optional[float], typer.Option(
    "--temperature", min=0.0, help="Sampling temperature; 0 is greedy. Default: the model's generation_config.json, else 0.")]
TopPOpt = Annotated[Optional[float], typer.Option("--top-p", min=0.0, max=1.0, help="Nucleus sampling mass.")]
TopKOpt = Annotated[Optional[int], typer.Option("--top-k", min=0, help="Sample from the k likeliest tokens (0: off).")]
SeedOpt = Annotated[Optional[int], typer.Option("--seed", help="Seed that makes sampled output reproducible.")]
SystemOpt = Annotated[Optional[str], typer.Option("--system", "-s", help="System prompt.")]
Quant = Literal[FORMATS]  # a choice list in --help and in errors
QuantOpt = Annotated[Optional[Quant], typer.Option(
    "--quant", "-q", envvar="COLI_QUANT", show_envvar=True,
    help="Weight format: f32, bf16, int8, int4 (5-bit asymmetric groups) or int4s (Q4_0-like). Default: f32 for a Hugging Face directory, the converted one's own.")]
RamBudgetOpt = Annotated[Optional[str], typer.Option(
    "--ram-budget", envvar="COLI_RAM_BUDGET", show_envvar=True,
    help="Memory for the whole process, e.g. 2G: weights, KV cache and buffers; a converted MoE model streams "
         "the experts that do not fit from disk. Default: what is available (a cgroup limit included).")]
KvCacheDtype = Literal["f16", "f32"]
KvCacheDtypeOpt = Annotated[Optional[KvCacheDtype], typer.Option(
    "--kv-cache-dtype", envvar="COLI_KV_CACHE_DTYPE", show_envvar=True,
    help="What the KV cache stores: f16 (half the memory, and half the bytes attention reads per token) "
         "or f32 (the values as computed). Default: f16.")]
PinOpt = Annotated[Optional[str], typer.Option(
    "--pin", envvar="COLI_PIN", show_envvar=True, help="Part of the RAM budget kept for the hot experts learned from .coli_usage. Default: half. "
                  "auto: half, the hot set ranked by the model's expert atlas (coli atlas) as well.")]


CtxOpt = Annotated[Optional[int], typer.Option(
    "--ctx", envvar="COLI_CTX", show_envvar=True, min=2, help="Context tokens per KV slot. Default: the model's, capped to what memory holds.")]
KvDirOpt = Annotated[Optional[str], typer.Option(
    "--kv-dir", envvar="COLI_KV_DIR", help="Where KV slot state (.coli_kv, .coli_kv.1, ...) is saved and restored.")]
PersistOpt = Annotated[bool, typer.Option(
    "--kv-persist/--no-kv-persist", envvar="COLI_KV_PERSIST", show_envvar=True, help="Save KV slots so a restart reuses cached prefixes.")]
SpeculativeOpt = Annotated[Optional[str], typer.Option(
    "--speculative", envvar="COLI_SPECULATIVE", show_envvar=True,
    help="Speculative decoding (same output, more tokens per pass over the weights): auto (the model's MTP "
         "layers, else the draft model, else prompt lookup; off per request when it does not pay), off, ngram, "
         "draft, mtp. Default: auto.")]
DraftModelOpt = Annotated[Optional[str], typer.Option(
    "--draft-model", envvar="COLI_DRAFT_MODEL", show_envvar=True,
    help="A small model with the same tokenizer that drafts tokens for --speculative draft (and auto).")]


def open_runner(model, *, ctx=None, kv_dir=None, persist=True, kv_slots=1, speculative=None, draft_model=None):
    """The scheduler every front end shares, with its start-up notes on stderr.
    ``speculative``/``draft_model``: the --speculative and --draft-model options."""
    from coli.runner import Runner

    mode, draft = speculation(speculative, draft_model, model)
    return Runner(model, kv_slots=kv_slots, ctx=ctx, kv_dir=kv_dir, persist=persist, speculative=mode,
                  draft_model=draft,
                  notice=lambda text: stderr.print(f"[dim]{text}[/]", soft_wrap=True) if stderr.is_terminal else None)


def speculation(speculative: str | None, draft_model: str | None, model) -> tuple[str, object | None]:
    """The --speculative mode (default auto) and the loaded --draft-model (None without one)."""
    from coli.speculate import resolve_mode

    mode = resolve_mode(speculative, default="auto")
    if mode == "draft" and not draft_model:
        raise fail("--speculative draft needs --draft-model DIR")
    if not draft_model or mode == "off":
        return mode, None
    import coli

    return mode, coli.load(draft_model, threads=model.engine.threads, kv_cache_dtype=model.engine.kv_cache_dtype)


def load_options(quant=None, ram_budget=None, pin=None, kv_cache_dtype=None) -> dict:
    return {k: v for k, v in dict(quant=quant, process_budget=ram_budget, pin=pin,
                                  kv_cache_dtype=kv_cache_dtype).items() if v is not None}


def fail(message: str, code: ExitCode = ExitCode.USAGE) -> typer.Exit:
    """Print one error line on stderr and return the Exit to raise."""
    stderr.print(f"[bold red]error:[/] {message}", soft_wrap=True)
    return typer.Exit(int(code))


def user_errors(fn):
    """Turn ColiError into one stderr line and exit 2, Ctrl-C into exit 130: never a traceback."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except ColiError as e:
            raise fail(str(e)) from None
        except KeyboardInterrupt:
            sys.stdout.flush()
            raise typer.Exit(int(ExitCode.INTERRUPTED)) from None
        except BrokenPipeError:  # `coli run ... | head`: the reader left, nothing is wrong
            raise typer.Exit(int(ExitCode.OK)) from None

    return wrapper


def load_model(model: str | None, threads: int | None, **options):
    """Load with a progress line on stderr when it is a terminal (nothing extra in pipes):
    the tensors read and quantized so far, then it goes away."""
    import coli

    if not stderr.is_terminal:
        return coli.load(model, threads=threads, **options)
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    columns = (SpinnerColumn(), TextColumn("Loading model"), BarColumn(), MofNCompleteColumn(),
               TextColumn("tensors"), TimeElapsedColumn())
    with Progress(*columns, console=stderr, transient=True) as bar:
        task = bar.add_task("load", total=None)
        return coli.load(model, threads=threads, progress=lambda done, total: bar.update(task, completed=done,
                                                                                          total=total), **options)


def messages_for(prompt: str, system: str | None) -> list[dict]:
    msgs = [{"role": "system", "content": system}] if system else []
    return msgs + [{"role": "user", "content": prompt}]
