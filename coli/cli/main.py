"""The `coli` command: one Typer app; each command lives in its own module."""
from __future__ import annotations

from typing import Annotated, Optional

import typer

import coli
from coli.cli.atlas import atlas
from coli.cli.bench import bench
from coli.cli.chat import chat
from coli.cli.cluster import app as cluster_app
from coli.cli.convert import convert
from coli.cli.kv import app as kv_app
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
    app()
