"""The router's fencing, retries, cancellation and routing with a fake transport (no Ray)."""
from __future__ import annotations

import asyncio
import threading

import pytest

from coli.cluster import Balance, Catalog, ClusterConfig, ClusterRunner, PrefixIndex, StreamFence, block_hashes, choose
from coli.cluster.fencing import Message, RetryAfterDelivery
from coli.cluster.index import KVPublisher
from coli.cluster.router import WorkerLost
from coli.scheduler.events import Error, Finished, Profile, Started, TextDelta, Usage

WAIT = 30


def started(n=4, cached=0):
    return Started(0, n, cached, 0.0, 8)


def tail(prompt=4, completion=2, cached=0):
    return [Profile(0.0, 0.0, 1, prompt, completion), Usage(prompt, completion, cached, 0.0), Finished("stop")]


class FakeTransport:
    """Workers whose streams are scripts: ``scripts[worker](assignment) -> items``; an item is a
    Message, an Exception (raised), a float (sleep), or an Event (wait for it)."""

    def __init__(self, scripts: dict):
        self.scripts = scripts
        self.opened: list[tuple[str, str]] = []
        self.cancelled: list[tuple[str, str]] = []
        self.dead: set[str] = set()

    def names(self):
        return list(self.scripts)

    async def open(self, worker, assignment, prompt, options):
        self.opened.append((worker, assignment))
        for item in self.scripts[worker](assignment):
            if isinstance(item, BaseException):
                raise item
            if isinstance(item, (int, float)):
                await asyncio.sleep(item)
            elif isinstance(item, threading.Event):
                while not item.is_set():
                    await asyncio.sleep(0.01)
            else:
                yield item

    async def cancel(self, worker, assignment):
        self.cancelled.append((worker, assignment))
        return True

    async def status(self, worker):
        if worker in self.dead:
            raise WorkerLost("dead")
        return dict(name=worker, epoch="e-" + worker, steps=0, active=0, queued=0,
                    info=dict(ctx=256, vocab_size=100, kv_slots=2), kv_seq=0, kv_blocks=[])


def msgs(aid, events, start=0):
    return [Message(aid, start + i, ev) for i, ev in enumerate(events)]


@pytest.fixture
def make_runner():
    made = []

    def make(scripts, policy="round-robin", **kw):
        t = FakeTransport(scripts)
        r = ClusterRunner(t, ClusterConfig(policy=policy, heartbeat=3600, drain_timeout=0.2, **kw))
        made.append(r)
        return r, t

    yield make
    for r in made:
        r.close()


def run(handle):
    return list(handle.events(timeout=WAIT))


def text(events):
    return "".join(e.text for e in events if isinstance(e, TextDelta))


def dropped(r, worker, reason):
    return r.metrics.value("colibri_cluster_fenced_dropped_total", {"worker": worker, "reason": reason}) or 0


def test_fence_unit():
    f = StreamFence()
    f.assign("a", "w0")
    assert f.accept("a", 0) and not f.accept("a", 0) and not f.accept("a", 3) and not f.accept("b", 1)
    assert f.accept("a", 1)
    f.assign("b", "w1")  # nothing delivered yet: a retry is allowed
    assert not f.accept("a", 2) and f.accept("b", 0)
    f.delivered_delta()
    with pytest.raises(RetryAfterDelivery):
        f.assign("c", "w2")
    f.close()
    assert not f.accept("b", 1)
    assert dict(f.dropped) == {"duplicate": 1, "reordered": 1, "stale": 2, "late": 1}


def test_duplicates_stale_reordered_and_late_never_reach_the_client(make_runner):
    def w0(aid):
        return [Message(aid, 0, started()), Message(aid, 1, TextDelta("a")),
                Message(aid, 1, TextDelta("a")),  # duplicate
                Message("old-assignment", 2, TextDelta("STALE")),  # stale
                Message(aid, 5, TextDelta("AHEAD")),  # reordered (ahead of the next index)
                Message(aid, 2, TextDelta("b")), *msgs(aid, tail(), 3),
                Message(aid, 6, TextDelta("LATE")), Message(aid, 3, TextDelta("LATE"))]  # after the end

    r, t = make_runner({"w0": w0})
    events = run(r.submit([1, 2, 3, 4], max_tokens=8))
    assert text(events) == "ab"
    assert isinstance(events[0], Started) and isinstance(events[-1], Finished)
    assert sum(isinstance(e, Started) for e in events) == 1
    for reason in ("duplicate", "stale", "reordered"):
        assert dropped(r, "w0", reason) == 1
    # the late ones are read after Finished was delivered
    for _ in range(200):
        if dropped(r, "w0", "late") == 2:
            break
        threading.Event().wait(0.01)
    assert dropped(r, "w0", "late") == 2


def test_worker_lost_before_first_token_retries_elsewhere(make_runner):
    def w0(aid):
        return [Message(aid, 0, started()), WorkerLost("killed")]

    def w1(aid):
        return [Message("stale-from-somewhere", 0, TextDelta("X")),
                *msgs(aid, [started(), TextDelta("hello"), TextDelta(" world"), *tail()])]

    r, t = make_runner({"w0": w0, "w1": w1})
    events = run(r.submit([1, 2, 3], max_tokens=8))
    assert text(events) == "hello world"
    assert isinstance(events[-1], Finished)
    assert sum(isinstance(e, Started) for e in events) == 1
    assert [w for w, _ in t.opened] == ["w0", "w1"]
    assert r.metrics.value("colibri_cluster_retried_total", {"worker": "w0"}) == 1
    assert dropped(r, "w1", "stale") == 1
    assert "w0" not in r.alive  # left the routing table
    assert r.metrics.value("colibri_cluster_worker_up", {"worker": "w0"}) == 0


def test_worker_lost_after_first_token_ends_with_an_error(make_runner):
    def w0(aid):
        return [*msgs(aid, [started(), TextDelta("par")]), WorkerLost("killed")]

    def w1(aid):
        raise AssertionError("a stream with delivered output must never move to another worker")

    r, t = make_runner({"w0": w0, "w1": w1})
    events = run(r.submit([1, 2, 3], max_tokens=8))
    assert text(events) == "par"
    assert isinstance(events[-1], Error) and events[-1].code == "engine_error"
    assert "not continued" in events[-1].message
    assert [w for w, _ in t.opened] == ["w0"]
    assert not r.metrics.value("colibri_cluster_retried_total", {"worker": "w0"})


def test_stall_before_first_token_retries(make_runner):
    def w0(aid):
        return [Message(aid, 0, started()), 5.0]

    def w1(aid):
        return msgs(aid, [started(), TextDelta("ok"), *tail()])

    r, t = make_runner({"w0": w0, "w1": w1}, stall_timeout=0.3)
    events = run(r.submit([1, 2], max_tokens=4))
    assert text(events) == "ok" and isinstance(events[-1], Finished)
    assert ("w0", t.opened[0][1]) in t.cancelled  # the stalled assignment was cancelled on its worker


def test_refusal_goes_to_the_next_worker_and_the_last_refusal_is_returned(make_runner):
    def full(aid):
        return [Message(aid, 0, Error("queue_full", "full"))]

    r, t = make_runner({"w0": full, "w1": lambda aid: msgs(aid, [started(), TextDelta("x"), *tail()])})
    assert text(run(r.submit([1], max_tokens=2))) == "x"
    r2, _ = make_runner({"w0": full, "w1": full})
    events = run(r2.submit([1], max_tokens=2))
    assert len(events) == 1 and events[0].code == "queue_full"


def test_cancel_cancels_the_assignment_on_its_worker(make_runner):
    gate = threading.Event()

    def w0(aid):
        return [*msgs(aid, [started(), TextDelta("a")]), gate]

    r, t = make_runner({"w0": w0})
    h = r.submit([1, 2], max_tokens=100)
    it = h.events(timeout=WAIT)
    assert isinstance(next(it), Started) and next(it) == TextDelta("a")
    assert h.cancel()
    rest = list(it)
    assert len(rest) == 1 and rest[0].code == "cancelled"
    for _ in range(300):
        if t.cancelled:
            break
        threading.Event().wait(0.01)
    assert t.cancelled == [("w0", t.opened[0][1])]
    gate.set()


def test_usage_is_the_workers_count(make_runner):
    r, _ = make_runner({"w0": lambda aid: msgs(aid, [started(cached=0), TextDelta("x"), *tail(8, 1, cached=7)])})
    events = run(r.submit(list(range(8)), max_tokens=2))
    usage = next(e for e in events if isinstance(e, Usage))
    assert usage.cached_tokens == 7
    assert r.metrics.value("colibri_cluster_prefix_cache_hit_rate") == pytest.approx(7 / 8)


def test_sticky_cache_slot_and_session(make_runner):
    def ok(aid):
        return msgs(aid, [started(), TextDelta("x"), *tail()])

    r, t = make_runner({"w0": ok, "w1": ok, "w2": ok})
    for _ in range(3):
        run(r.submit([1, 2], max_tokens=2, cache_slot=1))
    for _ in range(3):
        run(r.submit([1, 2], max_tokens=2, session="abc"))
    workers = [w for w, _ in t.opened]
    assert len(set(workers[:3])) == 1 and len(set(workers[3:])) == 1


# -- the index and the policy -------------------------------------------------------------------------


def test_block_hashes_name_whole_prefixes():
    a = block_hashes(list(range(40)), 16)
    assert len(a) == 2 and a == block_hashes(list(range(32)) + [9] * 10, 16)
    assert block_hashes([0] + list(range(1, 40)), 16) == a
    assert block_hashes([5] + list(range(1, 40)), 16)[1] != a[1]  # a later block depends on earlier ones


def test_index_events_and_match():
    idx = PrefixIndex(4)
    pub = KVPublisher(4)
    seq, stored, evicted = pub.diff([list(range(12))])
    assert idx.apply("w0", seq, stored, evicted)
    assert not idx.apply("w0", seq, stored, evicted)  # not the next batch: ignored
    assert idx.match(list(range(10)), ["w0", "w1"]) == {"w0": 8, "w1": 0}
    seq, stored, evicted = pub.diff([list(range(4))])
    assert idx.apply("w0", seq, stored, evicted) and idx.match(list(range(10)), ["w0"]) == {"w0": 4}
    idx.drop("w0")
    assert idx.match(list(range(10)), ["w0"]) == {"w0": 0} and not idx.holders


def test_choose_cache_balance_and_others():
    prompt = list(range(64))
    loads = {"a": 1, "b": 0}
    assert choose("cache-aware", prompt, loads, {"a": 48, "b": 0}).order[0] == "a"  # cache wins while balanced
    assert choose("cache-aware", prompt, loads, {"a": 8, "b": 0}).order[0] == "b"  # below the threshold
    busy = {"a": 9, "b": 1}
    c = choose("cache-aware", prompt, busy, {"a": 64}, Balance(balance_abs=4, balance_rel=1.5))
    assert c.order[0] == "b" and c.reason == "balance"
    assert choose("least-loaded", prompt, busy, {}).order == ["b", "a"]
    assert [choose("round-robin", prompt, loads, {}, rr=i).order[0] for i in range(3)] == ["a", "b", "a"]


def test_sqlite_catalog_survives_a_restart(tmp_path):
    c = Catalog(tmp_path, block=4)
    c.register("w0", "e1", {"node": "n"})
    c.apply("w0", 1, block_hashes(list(range(8)), 4), [])
    c.close()
    c2 = Catalog(tmp_path, block=4)
    assert c2.workers["w0"]["epoch"] == "e1" and c2.match(list(range(8)), ["w0"]) == {"w0": 8}
    c2.register("w0", "e2", {})  # a new incarnation: its old entries are gone
    assert c2.match(list(range(8)), ["w0"]) == {"w0": 0}
    c2.close()


def test_without_ray_the_command_says_how_to_install_it(monkeypatch):
    import sys

    from typer.testing import CliRunner

    from coli.cli.main import app

    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError
    result = CliRunner().invoke(app, ["cluster", "status"])
    assert result.exit_code == 2
    assert "pip install 'coli[cluster]'" in result.output


def test_serve_cluster_without_ray_says_how_to_install_it(monkeypatch):
    import sys

    from typer.testing import CliRunner

    from coli.cli.main import app

    monkeypatch.setitem(sys.modules, "ray", None)
    result = CliRunner().invoke(app, ["serve", "--cluster", "auto", "--port", "0"])
    assert result.exit_code == 2 and "pip install 'coli[cluster]'" in result.output
