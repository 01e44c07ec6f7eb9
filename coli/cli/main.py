"""The `coli` command: one Typer app; each command lives in its own module."""
from __future__ import annotations

from typing import Annotated, Optional

import sys

import typer
from rich.markup import escape

import coli
from coli.cli.atlas import atlas
from coli.cli.bench import bench
from coli.cli.chat import chat
from coli.cli.cluster import app as cluster_app
from coli.cli.common import stderr
from coli.cli.convert import convert
from coli.cli.decide import decide
from coli.cli.kv import app as kv_app
from coli.cli.models import list_models, plan, ps, pull, rm, show
from coli.cli.run import run
from coli.cli.serve import serve
from coli.cli.web import web

app = typer.Typer(
    name="coli",
    help="colibri: run Mixture-of-Experts and dense transformer models on your own CPU.",
    no_args_is_help=True,
    add_completion=True,
    rich_markup_mode="rich",
    pretty_exceptions_enable=False,
)
app.command()(run)
app.command()(chat)
app.command()(convert)
app.command()(bench)
app.command()(serve)
app.command()(web)
app.command()(pull)
app.command("list")(list_models)
app.command()(show)
app.command()(rm)
app.command()(ps)
app.command()(plan)
app.command()(decide)
app.command()(atlas)
app.add_typer(kv_app, name="kv")
app.add_typer(cluster_app, name="cluster")


def _version(value: bool) -> None:
    if value:
        typer.echo(f"coli {coli.__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[Optional[bool], typer.Option("--version", callback=_version, is_eager=True,
                                                    help="Print the version and exit.")] = None,
) -> None:
    """colibri: run Mixture-of-Experts and dense transformer models on your own CPU."""


def main() -> None:
    """Run the CLI; a usage error (a bad option value, a missing argument) is one line on
    stderr and exit 2, not a box."""
    try:
        code = app(standalone_mode=False)
    except Exception as e:
        if not (hasattr(e, "format_message") and hasattr(e, "exit_code")):  # not the CLI parser's: a bug
            raise
        ctx = getattr(e, "ctx", None)
        if type(e).__name__ == "NoArgsIsHelpError":  # `coli kv` alone: the help is shown already
            sys.exit(e.exit_code)
        hint = f" (see {ctx.command_path} --help)" if ctx is not None else ""
        stderr.print(f"[bold red]error:[/] {escape(e.format_message())}{hint}", soft_wrap=True)
        sys.exit(e.exit_code)
    except BaseException as e:
        if type(e).__name__ == "Abort":
            sys.exit(1)
        raise
    sys.exit(code if isinstance(code, int) else 0)
