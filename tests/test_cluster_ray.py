"""Cluster mode on a real local Ray cluster: 2 workers on the built-in model, 1 thread each.

Covers routing to the prefix holder (cached_tokens > 0, through the HTTP server too), a worker
killed before its first token (the other one answers in full), one killed after its first
token (an error event, no duplicated text), a client disconnect freeing the worker's slot,
and `coli cluster status`.
"""
from __future__ import annotations

import http.client
import json
import time

import pytest

ray = pytest.importorskip("ray")

import coli  # noqa: E402
import coli.cluster  # noqa: E402
from coli.sampling import SamplingParams  # noqa: E402
from coli.scheduler.events import Error, Finished, Started, TextDelta, Usage  # noqa: E402

WAIT = 120  # seconds: a bound only a hang reaches
GREEDY = SamplingParams(temperature=0)


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=4, include_dashboard=False, namespace="coli", log_to_driver=False)
    runner = None
    try:
        runner = coli.cluster.start(None, workers=2, address="auto", load_options=dict(threads=1),
                                    runner_options=dict(kv_slots=2), start_timeout=WAIT,
                                    max_restarts=20)  # the tests kill workers several times
        yield runner
    finally:
        if runner is not None:
            runner.close()
        ray.shutdown()


@pytest.fixture(scope="module")
def model():
    m = coli.load(threads=1)
    yield m
    m.close()


@pytest.fixture
def healthy(cluster):
    """Both workers up, no faults, before and after each test."""
    def settle():
        end = time.monotonic() + WAIT
        while len(cluster.alive) < 2 and time.monotonic() < end:
            time.sleep(0.2)
        assert len(cluster.alive) == 2, "a worker did not come back"
        for h in cluster.transport.handles.values():
            for fault in ("hold_before", "hold_after_first", "slow_steps"):
                ray.get(h.set_fault.remote(fault, False), timeout=WAIT)
    settle()
    yield cluster
    settle()


def prompt(model, *turns):
    msgs = [{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(turns)]
    return model.prompt_ids(msgs)


def events(handle):
    return list(handle.events(timeout=WAIT))


def text(evs):
    return "".join(e.text for e in evs if isinstance(e, TextDelta))


def worker_of(runner, before: dict) -> str:
    after = {w["name"]: w["routed"] for w in runner.snapshot()["cluster"]["workers"]}
    changed = [w for w in after if after[w] != before.get(w, 0)]
    assert len(changed) == 1, (before, after)
    return changed[0]


def routed(runner) -> dict:
    return {w["name"]: w["routed"] for w in runner.snapshot()["cluster"]["workers"]}


def wait_for(cond, what: str):
    end = time.monotonic() + WAIT
    while time.monotonic() < end:
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def test_second_turn_goes_to_the_worker_holding_its_prefix(healthy, model):
    r = healthy
    first = [prompt(model, f"Tell me about the {thing} in the garden, please, in a few words.")
             for thing in ("cat", "dog")]
    h = [r.submit(p, max_tokens=24, sampling=GREEDY) for p in first]  # concurrently: one per worker
    answers = [events(x) for x in h]
    assert all(isinstance(a[-1], Finished) for a in answers)
    time.sleep(0.2)
    owners = set()
    for p_ids, a, thing in zip(first, answers, ("cat", "dog")):
        second = prompt(model, f"Tell me about the {thing} in the garden, please, in a few words.", text(a),
                        "And what does it eat?")
        assert second[:len(p_ids)] == p_ids
        holders = [w for w, n in r.catalog.match(second, r.alive).items() if n > 0]
        assert len(holders) == 1
        before = routed(r)
        evs = events(r.submit(second, max_tokens=8, sampling=GREEDY))
        usage = next(e for e in evs if isinstance(e, Usage))
        assert worker_of(r, before) == holders[0]
        assert usage.cached_tokens > 0  # the worker's own count of restored tokens
        owners.add(holders[0])
    assert owners == set(r.alive)  # the two conversations lived on different workers
    assert r.metrics.value("colibri_cluster_routing_hit_rate") > 0


def test_killed_before_the_first_token_the_other_worker_answers(healthy, model):
    r = healthy
    p2 = prompt(model, "Describe a mountain lake at dawn in a sentence.")
    reference2 = text(events(r.submit(p2, max_tokens=20, sampling=GREEDY)))  # greedy: any worker writes this
    assert reference2
    victim = r.route(p2, None)[0][0]
    actor = r.transport.handles[victim]
    ray.get(actor.set_fault.remote("hold_before", True), timeout=WAIT)
    status = ray.get(actor.status.remote(), timeout=WAIT)
    taken, taken_epoch = status["taken"], status["epoch"]
    handle = r.submit(p2, max_tokens=20, sampling=GREEDY)
    wait_for(lambda: ray.get(actor.status.remote(), timeout=WAIT)["taken"] > taken, "the held assignment")
    ray.kill(actor, no_restart=False)
    evs = events(handle)
    assert isinstance(evs[-1], Finished), evs[-1]
    assert text(evs) == reference2
    assert sum(isinstance(e, Started) for e in evs) == 1
    assert r.metrics.value("colibri_cluster_retried_total", {"worker": victim}) >= 1
    assert victim not in r.alive or r.status[victim]["epoch"] != taken_epoch  # left the table (or came back anew)


def test_killed_after_the_first_token_the_stream_ends_with_an_error(healthy, model):
    r = healthy
    p = prompt(model, "Name three kinds of trees and say why they matter.")
    victim = r.route(p, None)[0][0]
    actor = r.transport.handles[victim]
    ray.get(actor.set_fault.remote("hold_after_first", True), timeout=WAIT)
    retried = r.metrics.value("colibri_cluster_retried_total", {"worker": victim}) or 0
    handle = r.submit(p, max_tokens=30, sampling=GREEDY)
    it = handle.events(timeout=WAIT)
    seen = []
    for ev in it:
        seen.append(ev)
        if isinstance(ev, TextDelta):
            break
    ray.kill(actor, no_restart=False)
    rest = list(it)
    assert not any(isinstance(e, TextDelta) for e in rest)  # nothing after the kill, nothing twice
    assert isinstance(rest[-1], Error) and rest[-1].code == "engine_error"
    assert text(seen) and sum(isinstance(e, TextDelta) for e in seen) == 1
    assert (r.metrics.value("colibri_cluster_retried_total", {"worker": victim}) or 0) == retried


@pytest.fixture(scope="module")
def server_url(cluster, model):
    from coli.server import Server, ServerThread

    server = Server(model, cluster)
    with ServerThread(server) as url:
        yield url


def post(url: str, body: dict) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=WAIT)
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    return conn, conn.getresponse()


def test_http_second_turn_reports_the_workers_cached_tokens(healthy, server_url):
    msgs = [{"role": "user", "content": "Say something about apples and pears in the autumn."}]
    conn, resp = post(server_url, {"messages": msgs, "max_tokens": 16, "temperature": 0})
    first = json.loads(resp.read())
    conn.close()
    assert resp.status == 200, first
    msgs += [{"role": "assistant", "content": first["choices"][0]["message"]["content"]},
             {"role": "user", "content": "And plums?"}]
    conn, resp = post(server_url, {"messages": msgs, "max_tokens": 8, "temperature": 0})
    second = json.loads(resp.read())
    conn.close()
    assert resp.status == 200, second
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    conn = http.client.HTTPConnection(*server_url.removeprefix("http://").split(":"), timeout=WAIT)
    conn.request("GET", "/metrics")
    body = conn.getresponse().read().decode()
    conn.close()
    assert "colibri_cluster_routed_total" in body and "colibri_cluster_fenced_dropped" in body
    first = sorted(healthy.transport.handles)[0]  # coli-<model key>-worker-0
    assert f'colibri_cluster_worker_scheduler_completed{{worker="{first}"}}' in body


def test_client_disconnect_frees_the_workers_slot(healthy, server_url):
    r = healthy
    for h in r.transport.handles.values():
        ray.get(h.set_fault.remote("slow_steps", True), timeout=WAIT)
    before = routed(r)
    cancelled = {n: ray.get(h.status.remote(), timeout=WAIT)["cancelled"] for n, h in r.transport.handles.items()}
    conn, resp = post(server_url, {"messages": [{"role": "user", "content": "Write a long story about a ship."}],
                                   "max_tokens": 300, "stream": True, "temperature": 0,
                                   "logit_bias": {"2": -100}})
    assert resp.status == 200
    while b'"content"' not in resp.readline():  # the first delta arrived
        pass
    worker = worker_of(r, before)
    actor = r.transport.handles[worker]
    assert ray.get(actor.status.remote(), timeout=WAIT)["active"] == 1
    conn.sock.close()  # the client goes away mid-stream
    conn.close()
    wait_for(lambda: ray.get(actor.status.remote(), timeout=WAIT)["active"] == 0, "the slot to be freed")
    assert ray.get(actor.status.remote(), timeout=WAIT)["cancelled"] == cancelled[worker] + 1


def test_cluster_status_lists_both_workers(healthy):
    from typer.testing import CliRunner

    from coli.cli.main import app

    result = CliRunner().invoke(app, ["cluster", "status", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    names = {w["name"] for w in data["workers"]}
    assert names == set(healthy.transport.handles) and all(n.endswith(("-worker-0", "-worker-1")) for n in names)
    assert all(w["health"] == "up" for w in data["workers"])
    table = CliRunner().invoke(app, ["cluster", "status"])
    assert table.exit_code == 0 and all(n in table.output for n in names)


def test_http_stream_killed_after_the_first_token_ends_with_an_error_frame(healthy, server_url, model):
    r = healthy
    msgs = [{"role": "user", "content": "Count the colours of the rainbow slowly."}]
    victim = r.route(prompt(model, msgs[0]["content"]), None)[0][0]
    actor = r.transport.handles[victim]
    ray.get(actor.set_fault.remote("hold_after_first", True), timeout=WAIT)
    conn, resp = post(server_url, {"messages": msgs, "max_tokens": 30, "stream": True, "temperature": 0})
    assert resp.status == 200
    head = []
    while True:
        line = resp.readline()
        head.append(line)
        if b'"content"' in line and b'"content":""' not in line.replace(b" ", b""):
            break
    ray.kill(actor, no_restart=False)
    rest = resp.read().decode()  # the server ends the stream
    conn.close()
    frames = [f for f in rest.split("\n\n") if f.strip()]
    assert any("engine_error" in f for f in frames), rest
    assert not any('"content"' in f and "engine_error" not in f for f in frames), rest  # no text after the kill


def test_score_runs_on_a_worker(healthy, model):
    from coli.scheduler.events import PromptLogprobs

    ids = prompt(model, "Is the sky blue?")
    evs = events(healthy.score(ids, 3))
    assert isinstance(evs[-1], Finished)
    scores = next(e for e in evs if isinstance(e, PromptLogprobs))
    assert len(scores.logprobs) == len(ids) - 3 and all(x <= 0 for x in scores.logprobs)


def test_a_dead_worker_leaves_the_table_loses_its_index_and_is_restarted(healthy, model):
    r = healthy
    p = prompt(model, "A long enough question about the history of bridges and tunnels, please.")
    before = routed(r)
    assert isinstance(events(r.submit(p, max_tokens=4, sampling=GREEDY))[-1], Finished)
    victim = worker_of(r, before)
    wait_for(lambda: r.catalog.counts().get(victim, 0) > 0, "the index to learn the prefix")
    epoch = r.status[victim]["epoch"]
    ray.kill(r.transport.handles[victim], no_restart=False)
    wait_for(lambda: victim not in r.alive or r.status[victim]["epoch"] != epoch, "the heartbeat to notice")
    assert r.catalog.match(p, [victim])[victim] == 0  # its entries were dropped
    wait_for(lambda: victim in r.alive and r.status[victim]["epoch"] != epoch, "Ray to restart it")
    assert r.catalog.counts().get(victim, 0) == 0  # a new incarnation starts empty
