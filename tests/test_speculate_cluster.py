"""Cluster workers (coli.cluster) take --speculative and --draft-model and honour a
request's own mode: the router passes it through, the worker's runner speculates, and the
greedy text is the one plain decoding gives. In-process workers behind a transport that
calls them directly (the Ray transport carries the same calls)."""
from __future__ import annotations

import pytest

import coli
from coli.cluster import ClusterConfig, ClusterRunner
from coli.cluster.worker import Worker
from coli.errors import InvalidRequestError
from coli.runner import Runner
from coli.sampling import SamplingParams
from coli.scheduler import Finished, Profile, TextDelta

GREEDY = SamplingParams(temperature=0)
LOOP = [5, 9, 14, 3, 77, 21, 5, 9, 14, 3, 77, 21, 5, 9, 14, 3, 60, 61, 5, 9, 14]


class LocalTransport:
    """The router's transport over Worker objects in this process."""

    def __init__(self, workers: dict[str, Worker]):
        self.workers = workers
        self.options: list[dict] = []

    def names(self):
        return list(self.workers)

    async def open(self, worker, assignment, prompt, options):
        self.options.append(dict(options))
        async for m in self.workers[worker].generate(assignment, prompt, options):
            yield m

    async def cancel(self, worker, assignment):
        return self.workers[worker].cancel(assignment)

    async def status(self, worker):
        return self.workers[worker].status()


def _events(handle):
    evs = list(handle.events(120))
    assert isinstance(evs[-1], Finished), evs[-1]
    return "".join(e.text for e in evs if isinstance(e, TextDelta)), next(e for e in evs if isinstance(e, Profile))


def test_workers_speculate_as_told_and_requests_override_it(hf_models, tmp_path):
    from coli.cli.cluster import cluster_speculation

    path = hf_models("qwen3_moe")
    model = coli.load(path, threads=1)
    opts = cluster_speculation("ngram", None)
    assert opts == {"speculative": "ngram"}
    with_draft = cluster_speculation("draft", str(path))  # a worker loads its draft model from the path
    assert with_draft["draft_model"] == str(path.resolve())
    worker = Worker("w0", model=model, runner_options=opts)
    drafted = Worker("w1", model=model, runner_options=with_draft)
    try:
        assert worker.runner.speculator.mode == "ngram"
        assert drafted.runner.speculator.draft is not None and drafted.runner.speculator.mode == "draft"
        with Runner(model, persist=False, speculative="off") as plain:
            want = _events(plain.submit(LOOP, max_tokens=30, sampling=GREEDY))[0]
        t = LocalTransport({"w0": worker})
        with ClusterRunner(t, ClusterConfig(policy="round-robin", heartbeat=3600)) as r:
            text, prof = _events(r.submit(LOOP, max_tokens=30, sampling=GREEDY))
            assert text == want and prof.draft_tokens > 0  # the worker's --speculative ngram
            text, prof = _events(r.submit(LOOP, max_tokens=30, sampling=GREEDY, speculative="off"))
            assert text == want and prof.draft_tokens == 0  # the request's own mode
            assert t.options[-1]["speculative"] == "off"
            with pytest.raises(InvalidRequestError, match="speculative"):
                r.submit(LOOP, max_tokens=4, speculative="sometimes")
        t = LocalTransport({"w1": drafted})
        with ClusterRunner(t, ClusterConfig(policy="round-robin", heartbeat=3600)) as r:
            text, prof = _events(r.submit(LOOP, max_tokens=30, sampling=GREEDY))
            assert text == want and prof.accepted_tokens > 0  # a twin drafts its own greedy text
    finally:
        worker.shutdown()
        drafted.shutdown()
