"""Ray: connecting, starting worker actors, and the transport the router uses.

Workers are named actors ``{cluster}-{model key}-worker-{i}`` in the Ray namespace
``coli``, each reserving ``--worker-cpus`` CPUs, restarted by Ray when they die
(``max_restarts``); the router does its own retries (``max_task_retries=0``), because only
it knows whether output already reached the client. The model key (``model_key``) binds a
worker to the model and options it loaded: two servers on one Ray instance share workers
only when they serve the same model the same way, never one another's.

Ray puts the driver's working directory on every worker's import path; ``connect`` starts
Ray from an empty directory instead, so workers import the installed ``coli`` even when the
server was started from a source checkout that is not built in place.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import os
import tempfile

from coli.cluster.router import WorkerLost

NAMESPACE = "coli"
INSTALL_HINT = "cluster mode needs Ray: pip install 'coli[cluster]'"


def require_ray():
    try:
        import ray
    except ImportError:
        raise ImportError(INSTALL_HINT) from None
    return ray


def connect(address: str | None = "auto", num_cpus: int | None = None, start_local: bool = True):
    """Join a Ray cluster: "auto" joins a running one (`ray start --head`) or, if there is
    none and ``start_local``, starts a local one; "ray://host:10001" goes through Ray Client."""
    ray = require_ray()
    if ray.is_initialized():
        return ray
    kw = dict(namespace=NAMESPACE, include_dashboard=False, log_to_driver=False)
    here, neutral = os.getcwd(), tempfile.mkdtemp(prefix="coli-ray-")
    os.chdir(neutral)  # Ray adds the driver's working directory to the workers' sys.path
    try:
        _init(ray, address, num_cpus, start_local, kw)
    finally:
        os.chdir(here)
        os.rmdir(neutral)
    return ray


def _init(ray, address, num_cpus, start_local, kw) -> None:
    if address in (None, "", "local"):
        _start_private(ray, num_cpus, kw)
    elif address == "auto":
        try:
            ray.init(address="auto", **kw)
        except (ConnectionError, RuntimeError):
            if not start_local:
                raise ConnectionError("no running Ray cluster found (ray start --head, or pass --address)") from None
            _start_private(ray, num_cpus, kw)
            return
        if _is_private(ray):  # another coli process started it for itself: it ends when that one does
            ray.shutdown()
            if not start_local:
                raise ConnectionError("the only Ray instance here belongs to another coli serve; start a shared "
                                      "one with `ray start --head`")
            _start_private(ray, num_cpus, kw)
    else:
        kw.pop("include_dashboard")
        ray.init(address=address, **kw)


PRIVATE = b"coli:private-instance"  # internal-KV key marking a Ray instance a coli process started for itself


def _start_private(ray, num_cpus, kw) -> None:
    """A new local Ray instance of this process alone: it stops when this process exits, so
    other servers must not place workers on it (they start their own)."""
    ray.init(address="local", num_cpus=num_cpus, **kw)
    from ray.experimental.internal_kv import _internal_kv_put

    _internal_kv_put(PRIVATE, str(os.getpid()).encode(), namespace=NAMESPACE)


def _is_private(ray) -> bool:
    from ray.experimental.internal_kv import _internal_kv_get

    try:
        return _internal_kv_get(PRIVATE, namespace=NAMESPACE) is not None
    except Exception:  # an older Ray, or Ray Client: nothing marked
        return False


def model_key(model_path: str | None, load_options: dict | None, runner_options: dict | None) -> str:
    """A short hash of what a worker loads: the model (its resolved path) and the options."""
    path = os.path.realpath(os.path.expanduser(model_path)) if model_path else "<built-in>"
    spec = json.dumps([path, load_options or {}, runner_options or {}], sort_keys=True, default=str)
    return hashlib.sha256(spec.encode()).hexdigest()[:10]


def start_workers(n: int, model_path: str | None, *, load_options: dict | None = None,
                  runner_options: dict | None = None, worker_cpus: float = 1, block: int | None = None,
                  cluster: str = "coli", max_restarts: int = 3) -> dict:
    """Create (or find, by name) ``n`` worker actors; returns name -> actor handle."""
    ray = require_ray()
    from coli.cluster.index import DEFAULT_BLOCK
    from coli.cluster.worker import Worker

    actor = ray.remote(Worker)
    env = {k: v for k, v in os.environ.items() if k.startswith("COLI_")}
    handles = {}
    key = model_key(model_path, load_options, runner_options)
    for i in range(n):
        name = f"{cluster}-{key}-worker-{i}"  # found by name only by a server of the same model
        handles[name] = actor.options(
            name=name, namespace=NAMESPACE, get_if_exists=True, num_cpus=worker_cpus, max_restarts=max_restarts,
            max_task_retries=0, max_concurrency=1000, runtime_env={"env_vars": env} if env else None,
        ).remote(name, model_path, load_options or {}, runner_options or {}, block or DEFAULT_BLOCK)
    return handles


def find_workers(cluster: str | None = None) -> dict:
    """The worker actors of running clusters (by name), for `coli cluster status`."""
    ray = require_ray()
    out = {}
    for entry in ray.util.list_named_actors(all_namespaces=True):
        name, ns = entry["name"], entry["namespace"]
        if ns == NAMESPACE and "-worker-" in name and (cluster is None or name.startswith(f"{cluster}-")):
            out[name] = ray.get_actor(name, namespace=NAMESPACE)
    return dict(sorted(out.items()))


class RayTransport:
    """The router's transport over Ray actor calls (see coli.cluster.router)."""

    def __init__(self, handles: dict):
        self.handles = dict(handles)
        self._ray = require_ray()

    def names(self) -> list[str]:
        return list(self.handles)

    async def open(self, worker: str, assignment: str, prompt: list[int], options: dict):
        ex = self._ray.exceptions
        lost = (ex.RayActorError, ex.ActorUnavailableError, ex.ActorDiedError, ex.ObjectLostError)
        try:
            gen = self.handles[worker].generate.options(num_returns="streaming").remote(assignment, prompt, options)
            async for ref in gen:
                yield await ref
        except lost as e:
            raise WorkerLost(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
        except ex.RayTaskError as e:
            raise WorkerLost(f"the worker failed: {e.cause!r}") from None

    async def cancel(self, worker: str, assignment: str) -> bool:
        return await self.handles[worker].cancel.remote(assignment)

    async def status(self, worker: str) -> dict:
        return await self.handles[worker].status.remote()

    async def call(self, worker: str, method: str, *args):
        return await getattr(self.handles[worker], method).remote(*args)


def status_all(handles: dict, timeout: float = 10.0) -> list[dict]:
    """Every worker's status, or its error (health "down"), straight from the actors."""
    ray = require_ray()

    async def one(name, h):
        try:
            s = await asyncio.wait_for(h.status.remote(), timeout)
            return {**s, "health": "up"}
        except Exception as e:
            return dict(name=name, health="down", error=f"{type(e).__name__}")

    async def gather():
        return await asyncio.gather(*(one(n, h) for n, h in handles.items()))

    del ray
    return asyncio.run(gather())
