"""`coli cluster`: cluster mode on Ray (see docs/CLUSTER.md); `coli serve --cluster` uses
``open_cluster_runner`` from here."""
from __future__ import annotations

import json
import math
import os
from typing import Annotated, Optional

import typer

from coli.cli.common import ExitCode, fail, stderr, user_errors

app = typer.Typer(help="Cluster mode on Ray: workers, their load, cached prefixes and health.",
                  no_args_is_help=True)

INSTALL = "cluster mode needs Ray: pip install 'coli[cluster]'"


def require_cluster() -> None:
    """Exit 2 with the install line when Ray is missing."""
    _ray_backend()


def _ray_backend():
    try:
        import ray  # noqa: F401
    except ImportError:
        from rich.markup import escape

        raise fail(escape(INSTALL)) from None
    from coli.cluster import ray_backend

    return ray_backend


def cluster_speculation(speculative: str | None, draft_model: str | None) -> dict:
    """The workers' Runner options for --speculative / --draft-model (each worker loads the
    draft model itself, from the path)."""
    from coli.speculate import resolve_mode

    mode = resolve_mode(speculative, default="auto")
    if mode == "draft" and not draft_model:
        raise fail("--speculative draft needs --draft-model DIR")
    opts = {"speculative": mode}
    if draft_model and mode != "off":
        path = os.path.expanduser(draft_model)
        opts["draft_model"] = os.path.abspath(path) if os.path.exists(path) else draft_model  # a path or a name
    return opts


def open_cluster_runner(address: str | None, workers: int, *, model: str | None, threads: int | None = None,
                        load_options: dict | None = None, runner_options: dict | None = None,
                        worker_cpus: float = 1, routing: str = "cache-aware", state_dir: str | None = None,
                        cluster: str = "coli"):
    """A ClusterRunner for `coli serve --cluster ADDRESS --workers N` (Ray missing: exit 2 with the hint).
    ``address``: "auto" (a running cluster, else a local one), "ray://HOST:PORT", or None: $COLI_CLUSTER."""
    _ray_backend()
    import coli.cluster
    from coli.cluster import ClusterConfig

    from coli.cluster.index import POLICIES

    if routing not in POLICIES:
        raise fail(f"--routing must be one of {', '.join(POLICIES)}, got {routing!r}")
    address = address or os.environ.get("COLI_CLUSTER") or "auto"
    if workers < 1:
        raise fail(f"--workers must be at least 1, got {workers}")
    load = {**(load_options or {}), **({"threads": threads} if threads else {})}
    if model is not None:
        model = os.path.abspath(os.path.expanduser(model)) if os.path.exists(os.path.expanduser(model)) else model
    local_cpus = max(os.cpu_count() or 1, math.ceil(workers * worker_cpus))  # only if a local cluster starts
    try:
        return coli.cluster.start(model, workers=workers, address=address, worker_cpus=worker_cpus,
                                  load_options=load, runner_options=runner_options,
                                  config=ClusterConfig(policy=routing), state_dir=state_dir, cluster=cluster,
                                  num_cpus=local_cpus)
    except RuntimeError as e:
        raise fail(str(e), ExitCode.ERROR) from None


def _rows_from_url(url: str, api_key: str | None) -> dict:
    import urllib.request

    req = urllib.request.Request(url.rstrip("/") + "/health")
    if api_key:
        req.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            body = json.loads(r.read())
    except OSError as e:
        raise fail(f"cannot read {url}/health: {e}", ExitCode.ERROR) from None
    if "cluster" not in body:
        raise fail(f"{url} is not a cluster (coli serve was started without --cluster)")
    return body["cluster"]


def _rows_from_ray(address: str, cluster: str | None) -> dict:
    rb = _ray_backend()
    try:
        rb.connect(address, start_local=False)
    except ConnectionError as e:
        raise fail(f"{e}; or ask a server: coli cluster status --url http://HOST:PORT", ExitCode.ERROR) from None
    handles = rb.find_workers(cluster)
    workers = []
    for s in rb.status_all(handles):
        info = s.get("info", {})
        blocks = len(s.get("kv_blocks", ()))
        workers.append(dict(name=s["name"], health=s["health"], node=info.get("node"), pid=info.get("pid"),
                            epoch=s.get("epoch"), active=s.get("active", 0), queued=s.get("queued", 0),
                            capacity=info.get("kv_slots", 0), prefix_blocks=blocks,
                            cached_tokens=blocks * info.get("block", 0), steps=s.get("steps", 0),
                            error=s.get("error")))
    return dict(workers=workers)


@app.command()
@user_errors
def status(
    url: Annotated[Optional[str], typer.Option(
        "--url", help="Ask a running `coli serve --cluster` (its /health) instead of Ray.")] = None,
    address: Annotated[Optional[str], typer.Option(
        "--address", envvar="COLI_CLUSTER", show_envvar=True,
        help="The Ray cluster: auto (default) or ray://HOST:PORT.")] = None,
    cluster: Annotated[Optional[str], typer.Option("--cluster-name", help="Only this cluster's workers.")] = None,
    api_key: Annotated[Optional[str], typer.Option("--api-key", envvar="COLI_API_KEY")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
) -> None:
    """Show the cluster's workers: health, load, cached prefixes.

    Examples: coli cluster status  ·  coli cluster status --url http://127.0.0.1:8000 --json
    """
    data = _rows_from_url(url, api_key) if url else _rows_from_ray(address or "auto", cluster)
    workers = data.get("workers", [])
    if as_json:
        typer.echo(json.dumps(data, indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    if not workers:
        stderr.print("no cluster workers found", soft_wrap=True)
        raise typer.Exit(int(ExitCode.ERROR))
    t = Table(title="coli cluster", title_justify="left")
    for col in ("worker", "health", "node", "active", "queued", "slots", "blocks", "cached", "steps"):
        t.add_column(col, justify="right" if col not in ("worker", "health", "node") else "left",
                     no_wrap=col in ("worker", "node"))
    for w in workers:
        health = "[green]up[/]" if w["health"] == "up" else f"[red]{w['health']}[/]"
        t.add_row(w["name"], health, str(w.get("node") or "-"), str(w.get("active", 0)),
                  str(w.get("queued", 0)), str(w.get("capacity", 0)), str(w.get("prefix_blocks", 0)),
                  str(w.get("cached_tokens", 0)), str(w.get("steps", 0)))
    Console().print(t)
    typer.echo("blocks: prefix blocks in the workers' KV slots; cached: the tokens they cover")
    if "routing_hit_rate" in data:
        typer.echo(f"routing: {data.get('policy')}, hit rate {data['routing_hit_rate']:.2f}, "
                   f"prefix-cache hit rate {data['prefix_cache_hit_rate']:.2f}")
