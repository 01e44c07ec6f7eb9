"""`coli web`: `coli serve` plus opening the dashboard in a browser once the model is ready.

Both commands serve the dashboard (coli/web_dist, built from web/) on the API's port; this
one only adds the browser. It takes every option of `coli serve` and --no-browser. No
browser is opened on a headless host (Linux without $DISPLAY or $WAYLAND_DISPLAY).
"""
from __future__ import annotations

import inspect
import os
import sys
import threading
from contextlib import contextmanager
from typing import Annotated

import typer

from coli.cli.serve import serve

NoBrowserOpt = Annotated[bool, typer.Option("--no-browser", envvar="COLI_NO_BROWSER", show_envvar=True, help="Do not open a browser (print the address only).")]


def headless() -> bool:
    """True where no browser can be shown: Linux/BSD without a display server."""
    if sys.platform.startswith(("linux", "freebsd", "openbsd", "netbsd")):
        return not (os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY"))
    return False


def browsable(url: str) -> str:
    """The address to give a browser: a wildcard bind is reached through localhost."""
    for wildcard in ("//0.0.0.0:", "//[::]:"):
        url = url.replace(wildcard, "//localhost:")
    return url + "/"


def open_browser(url: str) -> None:
    import webbrowser

    # in a thread: some browsers' launchers block until the window closes
    threading.Thread(target=webbrowser.open, args=(url,), name="coli-browser", daemon=True).start()


@contextmanager
def _on_ready(callback):
    """Runs ``callback(url)`` after `coli serve`'s own ready message, once it is listening."""
    import coli.server as server_pkg

    original = server_pkg.serve

    async def serve_then(server, on_ready=None, **kw):
        def ready(url: str) -> None:
            if on_ready is not None:
                on_ready(url)
            callback(url)

        await original(server, on_ready=ready, **kw)

    server_pkg.serve = serve_then
    try:
        yield
    finally:
        server_pkg.serve = original


def web(**options) -> None:
    no_browser = options.pop("no_browser", False)

    def ready(url: str) -> None:
        page = browsable(url)
        typer.echo(f"coli web: the dashboard is at {page}", err=True)
        if no_browser:
            return
        if headless():
            typer.echo("coli web: no display here, so no browser was opened; open the address above from "
                       "another machine (or use --no-browser)", err=True)
            return
        open_browser(page)

    with _on_ready(ready):
        serve(**options)


# `coli web` takes exactly `coli serve`'s options, plus --no-browser.
_params = list(inspect.signature(serve, eval_str=True).parameters.values())
web.__signature__ = inspect.Signature(
    _params[:1] + [inspect.Parameter("no_browser", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=False,
                                     annotation=NoBrowserOpt)] + _params[1:])
web.__doc__ = """Serve the model and open the web dashboard (Chat, Brio, Brain, Profiling) in a browser.

Same options as coli serve; the dashboard is on the same port. Examples: coli web  ·  coli web -m ~/models/OLMoE --no-browser
"""
