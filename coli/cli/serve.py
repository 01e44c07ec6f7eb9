"""`coli serve`: the OpenAI- and Anthropic-compatible HTTP server."""
from __future__ import annotations

import asyncio
import os
import time
from typing import Annotated, Optional

import typer

from coli.cli.common import (KvCacheDtypeOpt, CtxOpt, DraftModelOpt, KvDirOpt, ModelOpt, PersistOpt, PinOpt, QuantOpt, RamBudgetOpt,
                             SpeculativeOpt, ThreadsOpt, fail, load_model, load_options, speculation, stderr,
                             user_errors)


@user_errors
def serve(
    model: ModelOpt = None,
    host: Annotated[str, typer.Option("--host", envvar="COLI_HOST", show_envvar=True,
                                      help="Address to listen on. Keep 127.0.0.1 unless you set an API key.")]
    = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", "-p", envvar="COLI_PORT", show_envvar=True, min=0, max=65535,
                                      help="Port (0: any free port).")] = 8000,
    model_id: Annotated[Optional[str], typer.Option(
        "--model-id", envvar="COLI_MODEL_ID", show_envvar=True,
        help="The model name clients send. Default: the model directory's name.")] = None,
    kv_slots: Annotated[Optional[int], typer.Option(
        "--kv-slots", envvar="COLI_KV_SLOTS", show_envvar=True, min=1, max=16,
        help="Independent KV contexts (concurrent requests). Default: 1.")] = None,
    max_queue: Annotated[Optional[int], typer.Option(
        "--max-queue", envvar="COLI_MAX_QUEUE", show_envvar=True, min=0,
        help="Requests that may wait for a slot; more get 429. Default: 8.")] = None,
    queue_timeout: Annotated[Optional[float], typer.Option(
        "--queue-timeout", envvar="COLI_QUEUE_TIMEOUT", show_envvar=True,
        help="Seconds a request may wait for a slot before a 429. Default: 300.")] = None,
    api_key: Annotated[Optional[str], typer.Option(
        "--api-key", envvar="COLI_API_KEY", show_envvar=True,
        help="Require this key (Authorization: Bearer KEY or x-api-key) on every endpoint but /health.")] = None,
    allowed_host: Annotated[Optional[list[str]], typer.Option(
        "--allowed-host", help="Also accept this Host header (repeatable; or COLI_ALLOWED_HOSTS=a,b). "
                               "localhost and loopback addresses always are.")] = None,
    cors_origin: Annotated[Optional[list[str]], typer.Option(
        "--cors-origin", help="Also allow this browser origin, exactly (repeatable; or COLI_CORS_ORIGINS=a,b; "
                              "'*' allows any). The Vite dev server and Tauri origins are allowed by default.")]
    = None,
    max_body: Annotated[Optional[str], typer.Option(
        "--max-body", envvar="COLI_MAX_BODY", show_envvar=True,
        help="Largest request body, e.g. 16M (larger ones get 413). Default: 4M.")] = None,
    request_timeout: Annotated[Optional[float], typer.Option(
        "--request-timeout", envvar="COLI_REQUEST_TIMEOUT", show_envvar=True, min=0.001,
        help="Seconds a client has to send a request's head after connecting, then its body. Default: 30.")] = None,
    idle_timeout: Annotated[Optional[float], typer.Option(
        "--idle-timeout", envvar="COLI_IDLE_TIMEOUT", show_envvar=True, min=0.001,
        help="Seconds a keep-alive connection may sit idle between requests. Default: 30.")] = None,
    max_connections: Annotated[Optional[int], typer.Option(
        "--max-connections", envvar="COLI_MAX_CONNECTIONS", show_envvar=True, min=1,
        help="Open connections at most (kept below the open-file limit); past it the idlest is closed. "
             "Default: 512.")] = None,
    log_format: Annotated[Optional[str], typer.Option(
        "--log-format", envvar="COLI_LOG_FORMAT", show_envvar=True,
        help="The access log on stderr, one line per request: text, json or off. Default: text.")] = None,
    threads: ThreadsOpt = None,
    quant: QuantOpt = None,
    ram_budget: RamBudgetOpt = None,
    pin: PinOpt = None,
    kv_cache_dtype: KvCacheDtypeOpt = None,
    ctx: CtxOpt = None,
    kv_dir: KvDirOpt = None,
    kv_persist: PersistOpt = True,
    speculative: SpeculativeOpt = None,
    draft_model: DraftModelOpt = None,
    cluster: Annotated[Optional[str], typer.Option(
        "--cluster", envvar="COLI_CLUSTER", show_envvar=True, rich_help_panel="Cluster (Ray)",
        help="Generate on Ray workers: auto (a running cluster, else a local one) or ray://HOST:PORT.")] = None,
    workers: Annotated[int, typer.Option("--workers", envvar="COLI_WORKERS", show_envvar=True, min=1,
                                         rich_help_panel="Cluster (Ray)",
                                         help="Worker actors, each with its own engine and KV slots.")] = 2,
    worker_cpus: Annotated[float, typer.Option("--worker-cpus", envvar="COLI_WORKER_CPUS", show_envvar=True, min=0,
                                               rich_help_panel="Cluster (Ray)",
                                               help="CPUs Ray reserves per worker.")] = 1,
    routing: Annotated[str, typer.Option("--routing", envvar="COLI_ROUTING", show_envvar=True,
                                         rich_help_panel="Cluster (Ray)",
                                         help="cache-aware, round-robin or least-loaded.")] = "cache-aware",
    state_dir: Annotated[Optional[str], typer.Option(
        "--state-dir", envvar="COLI_STATE_DIR", show_envvar=True, rich_help_panel="Cluster (Ray)",
        help="Keep the worker registry and prefix index in DIR/cluster.sqlite (default: in memory).")] = None,
) -> None:
    """Serve a model over an OpenAI- and Anthropic-compatible HTTP API.

    Examples: coli serve -m ~/models/Qwen3-0.6B  ·  COLI_API_KEY=secret coli serve --host 0.0.0.0 --kv-slots 4
    """
    from coli.experts.store import parse_size
    from coli.runner import Runner
    from coli.server import Server, ServerConfig, serve as run_server
    from coli.server.config import split_list
    from coli.server.connections import check_port

    hosts = tuple(allowed_host or ()) + split_list(os.environ.get("COLI_ALLOWED_HOSTS", ""))
    origins = tuple(cors_origin or ()) + split_list(os.environ.get("COLI_CORS_ORIGINS", ""))
    try:
        body_limit = parse_size(max_body) if max_body else None
    except ValueError as e:
        raise fail(f"--max-body: {e}") from None
    config = ServerConfig.from_env(host=host, port=port, model_id=model_id, api_key=api_key, allowed_hosts=hosts,
                                   cors_origins=origins, max_body=body_limit, request_timeout=request_timeout,
                                   idle_timeout=idle_timeout, max_connections=max_connections,
                                   log_format=log_format)
    check_port(host, port)  # a port in use is one line now, not a traceback after loading
    if cluster:  # cluster mode (coli.cluster): the same front end over Ray workers
        from coli.cli.cluster import cluster_speculation, open_cluster_runner, require_cluster

        require_cluster()
        runner = open_cluster_runner(cluster, workers, model=model, threads=threads, worker_cpus=worker_cpus,
                                     load_options=load_options(quant, ram_budget, pin, kv_cache_dtype), routing=routing,
                                     runner_options=dict(kv_slots=kv_slots, max_queue=max_queue,
                                                         queue_timeout=queue_timeout, ctx=ctx,
                                                         **cluster_speculation(speculative, draft_model)),
                                     state_dir=state_dir)
    m = load_model(model, threads, **load_options(quant, ram_budget, pin, kv_cache_dtype))
    mode, draft = (None, None) if cluster else speculation(speculative, draft_model, m)  # (workers load theirs)
    runner = runner if cluster else Runner(m, kv_slots=kv_slots, max_queue=max_queue, queue_timeout=queue_timeout, ctx=ctx, kv_dir=kv_dir,
                    persist=kv_persist, notice=lambda text: stderr.print(f"[dim]{text}[/]", soft_wrap=True),
                    speculative=mode, draft_model=draft)
    server = Server(m, runner, config)

    def ready(url: str) -> None:
        from coli.models_cache import register_server  # for coli ps; removed below at exit

        register_server({"model": server.model_id, "path": str(m.path), "url": url,
                         "kv_slots": runner.config.kv_slots, "ctx": runner.ctx, "started": time.time()})
        key = "an API key" if config.api_key else "no API key"
        typer.echo(f"coli serve: {server.model_id} ({m.config.model_type}, {runner.config.kv_slots} KV slot(s), "
                   f"context {runner.ctx}, {key}) listening on {url} (OpenAI base URL {url}/v1)", err=True)
        if config.api_key is None and host not in ("127.0.0.1", "localhost", "::1"):
            stderr.print("[yellow]warning:[/] listening beyond this machine without --api-key", soft_wrap=True)

    def stopping() -> None:
        typer.echo("coli serve: stopping: ending open requests and saving KV slots (press Ctrl+C again to "
                   "stop at once)", err=True)

    try:
        asyncio.run(run_server(server, on_ready=ready, on_stopping=stopping))
    except KeyboardInterrupt:
        pass
    except OSError as e:  # the port was taken between the check and the bind
        raise fail(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    finally:
        from coli.models_cache import unregister_server

        unregister_server()
        runner.close()
        m.close()
