"""Cluster mode: Ray workers with their own engines, a KV-aware router, fenced token streams.

    runner = coli.cluster.start(model_path, workers=2)     # a ClusterRunner (Ray)
    handle = runner.submit(prompt_ids, max_tokens=64)      # the same events as coli.runner.Runner

See docs/CLUSTER.md. Ray is optional (pip install 'coli[cluster]'); only
``coli.cluster.ray_backend`` imports it.
"""
from __future__ import annotations

from coli.cluster.catalog import Catalog
from coli.cluster.fencing import Message, StreamFence
from coli.cluster.index import POLICIES, Balance, PrefixIndex, block_hashes, choose
from coli.cluster.router import ClusterConfig, ClusterMetrics, ClusterRunner, WorkerLost

__all__ = ["Balance", "Catalog", "ClusterConfig", "ClusterMetrics", "ClusterRunner", "Message", "POLICIES",
           "PrefixIndex", "StreamFence", "WorkerLost", "block_hashes", "choose", "start"]


def start(model_path=None, *, workers: int = 2, address: str | None = "auto", worker_cpus: float = 1,
          load_options: dict | None = None, runner_options: dict | None = None, config: ClusterConfig | None = None,
          state_dir=None, cluster: str = "coli", block: int | None = None, num_cpus: int | None = None,
          start_timeout: float = 300.0, max_restarts: int = 3) -> ClusterRunner:
    """Connect to Ray (``address``), start ``workers`` actors and return their router.
    ``max_restarts``: how often Ray restarts each worker that dies (-1: always)."""
    from coli.cluster import ray_backend
    from coli.cluster.index import DEFAULT_BLOCK

    ray_backend.connect(address, num_cpus=num_cpus)
    handles = ray_backend.start_workers(workers, None if model_path is None else str(model_path),
                                        load_options=load_options, runner_options=runner_options,
                                        worker_cpus=worker_cpus, block=block, cluster=cluster,
                                        max_restarts=max_restarts)
    catalog = Catalog(state_dir, block or DEFAULT_BLOCK)
    return ClusterRunner(ray_backend.RayTransport(handles), config, catalog=catalog, start_timeout=start_timeout)
