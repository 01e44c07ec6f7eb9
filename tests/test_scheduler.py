"""The scheduler with a fake engine: each admission rule of the spec, timeouts,
cancellation, priorities, batching and prefill chunking, and the metrics as the
spec defines them. No model, no threads, a fake clock."""
from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client import generate_latest

from coli.errors import InvalidRequestError
from coli.metrics import BUCKETS
from coli.scheduler import (ContextLengthExceededError, QueueFullError, Request, RequestCancelledError, Scheduler,
                            SchedulerClosedError, SchedulerConfig, SeqOutput, Status)


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def make(slots=1, max_queue=8, timeout=300.0, ctx=4096, chunk=256, histories=None):
    clock, seen = Clock(), []
    s = Scheduler(SchedulerConfig(kv_slots=slots, max_queue=max_queue, queue_timeout=timeout, ctx=ctx,
                                  prefill_chunk=chunk),
                  clock=clock, listener=lambda r: seen.append((r.request_id, r.status)), histories=histories)
    return s, clock, seen


def req(name, prompt=(1, 2, 3), max_tokens=4, slot=None) -> Request:
    return Request(list(prompt), max_tokens, slot, request_id=name)


def step(s: Scheduler, finish: set[str] = frozenset(), token=7):
    """One fake engine step: every sampling entry gets ``token``; names in ``finish`` stop."""
    plan = s.schedule()
    outs = {q.request.request_id: SeqOutput(token, "stop" if q.request.request_id in finish else None)
            for q in plan.seqs if q.sample}
    return plan, s.update_from_output(plan, outs)


def run_to_end(s: Scheduler, r: Request, limit=100):
    for _ in range(limit):
        if r.status.terminal:
            return
        step(s)
    raise AssertionError(f"{r.request_id} did not end in {limit} steps")


def value(s: Scheduler, name: str, **labels) -> float:
    v = s.metrics.value(f"colibri_scheduler_{name}", labels)
    return 0.0 if v is None else v


def occupy(s: Scheduler, *slots: int) -> list[Request]:
    """Admit one long-running request pinned to each given slot."""
    out = [s.add_request(req(f"busy{i}", max_tokens=1000, slot=i)) for i in slots]
    assert all(r.status is Status.RUNNING for r in out)
    return out


def release(s: Scheduler, r: Request) -> None:
    """Let ``r`` finish at the next step."""
    step(s, finish={r.request_id})
    assert r.status is Status.COMPLETED


# -- admission ------------------------------------------------------------------------------------


def test_free_slot_admits_at_once():
    s, _, seen = make()
    r = s.add_request(req("a"))
    assert r.status is Status.RUNNING and r.slot == 0 and r.queue_wait == 0
    assert seen == [("a", Status.RUNNING)]
    assert value(s, "active") == 1 and value(s, "queued") == 0


def test_waiters_are_served_fifo():
    s, _, _ = make(slots=1)
    (busy,) = occupy(s, 0)
    a, b = s.add_request(req("a")), s.add_request(req("b"))
    assert a.status is b.status is Status.WAITING and value(s, "queued") == 2
    release(s, busy)
    step(s)
    assert a.status is Status.RUNNING and b.status is Status.WAITING


def test_full_queue_rejects_with_queue_full():
    s, _, seen = make(slots=1, max_queue=1)
    occupy(s, 0)
    s.add_request(req("a"))
    with pytest.raises(QueueFullError, match="queue_full"):
        s.add_request(req("b"))
    assert value(s, "rejected_total") == 1 and value(s, "queued") == 1
    assert ("b", Status.REJECTED) not in seen  # refusals are raised, not streamed


def test_full_queue_admits_a_request_that_can_take_an_unreserved_free_slot():
    s, _, _ = make(slots=2, max_queue=1)
    occupy(s, 0)
    s.add_request(req("waits-for-0", slot=0))  # the queue is now full
    r = s.add_request(req("any"))
    assert r.status is Status.RUNNING and r.slot == 1
    assert value(s, "rejected_total") == 0


def test_max_queue_0_rejects_a_pinned_request_for_an_occupied_slot_even_if_another_is_free():
    s, _, _ = make(slots=2, max_queue=0)
    occupy(s, 0)
    with pytest.raises(QueueFullError):
        s.add_request(req("pinned", slot=0))
    assert s.add_request(req("any")).slot == 1  # slot 1 was free all along


def test_any_slot_request_uses_a_free_slot_not_reserved_by_an_earlier_waiter():
    s, _, _ = make(slots=2)
    busy0, busy1 = occupy(s, 0, 1)
    a = s.add_request(req("pinned0", slot=0))
    release(s, busy1)  # slot 1 frees: pinned0 must not take it, "any" may
    b = s.add_request(req("any"))
    assert a.status is Status.WAITING and b.status is Status.RUNNING and b.slot == 1


def test_earlier_pinned_request_keeps_priority_for_its_slot():
    s, _, _ = make(slots=2)
    busy0, busy1 = occupy(s, 0, 1)
    a = s.add_request(req("pinned0", slot=0))
    b = s.add_request(req("any"))
    c = s.add_request(req("pinned0-later", slot=0))
    release(s, busy0)
    step(s)
    assert a.status is Status.RUNNING and a.slot == 0
    assert b.status is Status.WAITING and c.status is Status.WAITING
    release(s, busy1)
    step(s)
    assert b.status is Status.RUNNING and b.slot == 1 and c.status is Status.WAITING


def test_earlier_any_slot_request_keeps_priority_across_all_slots():
    s, _, _ = make(slots=2)
    busy0, busy1 = occupy(s, 0, 1)
    a = s.add_request(req("any"))
    b = s.add_request(req("pinned1", slot=1))
    release(s, busy1)
    step(s)
    assert a.status is Status.RUNNING and a.slot == 1 and b.status is Status.WAITING


def test_a_new_pinned_request_does_not_overtake_an_any_slot_waiter():
    s, _, _ = make(slots=2)
    busy0, busy1 = occupy(s, 0, 1)
    a = s.add_request(req("any"))
    b = s.add_request(req("pinned0", slot=0))
    release(s, busy0)
    step(s)
    assert a.status is Status.RUNNING and a.slot == 0 and b.status is Status.WAITING


def test_queue_deadline_is_checked_before_slot_assignment():
    s, clock, seen = make(slots=1, timeout=10)
    (busy,) = occupy(s, 0)
    a = s.add_request(req("a"))
    release(s, busy)  # the slot is free ...
    clock.t += 11  # ... but "a" expires before the next pass assigns it
    assert s.slots[0].free and a.status is Status.WAITING
    step(s)
    assert a.status is Status.TIMED_OUT and a.error.code == "queue_timeout" and s.slots[0].free
    assert ("a", Status.TIMED_OUT) in seen
    assert value(s, "timed_out_total") == 1
    assert value(s, "admitted_total") == 1  # only "busy"
    assert value(s, "queue_wait_seconds_count") == 1


def test_waiter_times_out_while_slots_stay_busy():
    s, clock, _ = make(slots=1, timeout=5)
    occupy(s, 0)
    a = s.add_request(req("a"))
    clock.t += 4.9
    step(s)
    assert a.status is Status.WAITING
    clock.t += 0.2
    step(s)
    assert a.status is Status.TIMED_OUT and value(s, "queued") == 0


def test_expired_waiter_does_not_take_a_free_slot_from_a_new_request():
    s, clock, _ = make(slots=1, timeout=5)
    (busy,) = occupy(s, 0)
    a = s.add_request(req("a"))
    clock.t += 6
    s.cancel(busy)  # frees the slot outside a step
    b = s.add_request(req("b"))  # the pass it runs expires "a" first
    assert a.status is Status.TIMED_OUT and b.status is Status.RUNNING


def test_queue_wait_is_measured_per_request():
    s, clock, _ = make(slots=1)
    (busy,) = occupy(s, 0)
    a = s.add_request(req("a"))
    clock.t += 3
    release(s, busy)
    step(s)
    assert a.queue_wait == pytest.approx(3)
    assert value(s, "queue_wait_seconds_sum") == pytest.approx(3)
    assert value(s, "queue_wait_seconds_bucket", le="5.0") == 2 and value(s, "queue_wait_seconds_bucket", le="1.0") == 1


# -- cancellation ---------------------------------------------------------------------------------


def test_cancel_before_admission_counts_cancelled_not_admitted():
    s, _, seen = make(slots=1)
    (busy,) = occupy(s, 0)
    a = s.add_request(req("a"))
    assert s.cancel(a) is True
    assert a.status is Status.CANCELLED and a.error.code == "cancelled"
    assert ("a", Status.CANCELLED) in seen
    assert value(s, "cancelled_total") == 1 and value(s, "admitted_total") == 1 and value(s, "queued") == 0
    release(s, busy)
    assert value(s, "queue_wait_seconds_count") == 1 and value(s, "slot_duration_seconds_count") == 1
    assert s.cancel(a) is False


def test_cancelled_before_submission_is_refused_after_the_queue_full_check():
    s, _, _ = make(slots=1, max_queue=0)
    pre = req("pre")
    pre.cancel_requested = True
    with pytest.raises(RequestCancelledError):
        s.add_request(pre)
    assert value(s, "cancelled_total") == 1 and value(s, "admitted_total") == 0
    occupy(s, 0)
    full = req("full")
    full.cancel_requested = True
    with pytest.raises(QueueFullError):
        s.add_request(full)
    assert value(s, "cancelled_total") == 1 and value(s, "rejected_total") == 1


def test_cancel_while_running_frees_the_slot_within_one_step():
    s, _, seen = make(slots=1)
    a = s.add_request(req("a", max_tokens=100))
    b = s.add_request(req("b"))
    step(s)
    step(s)
    plan = s.schedule()  # "a" is in this step...
    s.cancel(a)  # ... when the client goes away
    assert a.status is Status.RUNNING  # the engine is still computing it
    s.update_from_output(plan, {})
    assert a.status is Status.CANCELLED and a.release_step - a.cancel_step <= 1
    step(s)
    assert b.status is Status.RUNNING and b.slot == 0
    assert value(s, "cancelled_total") == 1 and value(s, "completed_total") == 0
    assert value(s, "slot_duration_seconds_count") == 1 and value(s, "engine_call_seconds_count") == 1


def test_cancel_between_steps_frees_the_slot_at_once():
    s, _, _ = make(slots=1)
    a = s.add_request(req("a", max_tokens=100))
    step(s)
    s.cancel(a)
    assert a.status is Status.CANCELLED and s.slots[0].free and a.release_step == a.cancel_step


def test_cancelled_request_keeps_the_kv_it_computed():
    s, _, _ = make(slots=1)
    a = s.add_request(req("a", prompt=range(1, 11), max_tokens=100))
    step(s)
    step(s)
    s.cancel(a)
    assert s.slots[0].tokens == list(range(1, 11)) + [7]


# -- failures, completion, context --------------------------------------------------------------


def test_engine_failure_counts_failed_not_completed():
    s, _, seen = make(slots=2)
    a, b = s.add_request(req("a")), s.add_request(req("b"))
    plan = s.schedule()
    ended = s.fail_step(plan, "boom")
    assert set(ended) == {a, b} and a.status is Status.FAILED and a.error.code == "engine_error"
    assert value(s, "failed_total") == 2 and value(s, "completed_total") == 0
    assert s.slots[0].tokens == [] and s.slots[0].free


def test_sampling_error_fails_only_its_request():
    s, _, _ = make(slots=2)
    a, b = s.add_request(req("a")), s.add_request(req("b"))
    plan = s.schedule()
    s.update_from_output(plan, {"a": SeqOutput(error="nan logits"), "b": SeqOutput(5)})
    assert a.status is Status.FAILED and "nan logits" in str(a.error) and b.status is Status.RUNNING
    assert value(s, "failed_total") == 1


def test_completion_reasons_and_counts():
    s, _, _ = make(slots=3)
    a, b, c = (s.add_request(req(n, max_tokens=3)) for n in "abc")
    plan = s.schedule()
    s.update_from_output(plan, {"a": SeqOutput(None), "b": SeqOutput(4, "stop"), "c": SeqOutput(4)})
    assert (a.finish_reason, a.generated) == ("stop", 0)  # end of turn
    assert (b.finish_reason, b.generated) == ("stop", 1)  # a stop string
    run_to_end(s, c)
    assert (c.finish_reason, c.generated) == ("length", 3)
    assert value(s, "completed_total") == 3 and value(s, "engine_call_seconds_count") == 3


def test_prompt_that_does_not_fit_is_refused_and_not_counted():
    s, _, _ = make(ctx=8)
    with pytest.raises(ContextLengthExceededError, match="context_length_exceeded") as e:
        s.add_request(req("long", prompt=range(8)))
    assert isinstance(e.value, InvalidRequestError)
    assert value(s, "rejected_total") == 0 and value(s, "admitted_total") == 0


def test_max_tokens_is_clamped_to_the_context():
    s, _, _ = make(ctx=8)
    r = s.add_request(req("r", prompt=range(1, 6), max_tokens=100))
    assert r.max_tokens == 3
    run_to_end(s, r)
    assert r.finish_reason == "length" and r.generated == 3
    assert len(s.slots[0].tokens) <= 8


def test_bad_cache_slot_and_max_tokens():
    s, _, _ = make(slots=2)
    for bad in (2, -1, "1", True):
        with pytest.raises(InvalidRequestError, match="cache_slot"):
            s.add_request(req("x", slot=bad))
    with pytest.raises(InvalidRequestError, match="max_tokens"):
        s.add_request(req("x", max_tokens=0))


def test_closed_scheduler_refuses_and_cancels_what_it_holds():
    s, _, _ = make(slots=1)
    a = s.add_request(req("a", max_tokens=100))
    b = s.add_request(req("b"))
    s.close()
    assert a.status is Status.CANCELLED and b.status is Status.CANCELLED
    with pytest.raises(SchedulerClosedError):
        s.add_request(req("c"))
    assert value(s, "rejected_total") == 0 and not s.schedule()


# -- slots, prefix reuse, batching ---------------------------------------------------------------


def test_prefix_is_reused_and_the_rest_truncated():
    s, _, _ = make(slots=1, histories={0: [1, 2, 3, 4, 5, 6]})
    r = s.add_request(req("r", prompt=[1, 2, 3, 9, 9]))
    assert r.cached_tokens == 3
    plan, _ = step(s)
    (seq,) = plan.seqs
    assert (seq.start, seq.tokens) == (3, [9, 9]) and s.slots[0].tokens == [1, 2, 3, 9, 9]
    assert value(s, "cached_tokens_total") == 3 and value(s, "prompt_tokens_total") == 5
    assert value(s, "prefix_hits_total") == 1


def test_a_fully_cached_prompt_recomputes_its_last_token():
    s, _, _ = make(slots=1, histories={0: [1, 2, 3, 4]})
    r = s.add_request(req("r", prompt=[1, 2, 3]))
    plan, _ = step(s)
    assert r.cached_tokens == 2 and plan.seqs[0].tokens == [3] and plan.seqs[0].start == 2


def test_any_slot_request_takes_the_longest_matching_prefix():
    s, _, _ = make(slots=3, histories={0: [5, 5, 5], 1: [1, 2, 3, 4], 2: [1, 2]})
    r = s.add_request(req("r", prompt=[1, 2, 3, 4, 8]))
    assert r.slot == 1 and r.cached_tokens == 4


def test_without_a_match_the_least_recently_used_slot_is_taken():
    s, _, _ = make(slots=3)
    for name in ("a", "b", "c"):  # use slots 0, 1, 2 in that order ...
        r = s.add_request(req(name, prompt=[ord(name), 1]))
        run_to_end(s, r)
    s.add_request(req("x", prompt=[ord("b"), 2], max_tokens=1000))  # ... then reuse slot 1
    r = s.add_request(req("d", prompt=[50, 51]))
    assert r.slot == 0  # slot 0 is the least recently used free slot


def test_running_sequences_decode_together_in_one_step():
    s, _, _ = make(slots=3)
    rs = [s.add_request(req(n, prompt=[i + 1] * 4, max_tokens=50)) for i, n in enumerate("abc")]
    step(s)  # prefill of all three (within the chunk budget)
    plan, _ = step(s)
    assert sorted(q.request.request_id for q in plan.seqs) == ["a", "b", "c"]
    assert all(q.tokens == [7] and q.sample for q in plan.seqs)
    assert all(r.generated == 2 for r in rs)


def test_long_prefill_is_chunked_and_interleaved_with_decoding():
    s, _, _ = make(slots=2, chunk=256)
    a = s.add_request(req("a", prompt=[1, 2], max_tokens=50))
    step(s)
    b = s.add_request(req("b", prompt=list(range(1, 601)), max_tokens=5))
    chunks = []
    for _ in range(3):
        plan, _ = step(s)
        by = {q.request.request_id: q for q in plan.seqs}
        assert by["a"].tokens == [7]  # the running stream gets a token every step
        chunks.append((len(by["b"].tokens), by["b"].sample))
    assert chunks == [(256, False), (256, False), (88, True)]
    assert b.generated == 1 and a.generated == 4


def test_prefill_budget_is_shared_between_new_requests():
    s, _, _ = make(slots=2, chunk=10)
    s.add_request(req("a", prompt=range(1, 8)))
    s.add_request(req("b", prompt=range(1, 8)))
    plan = s.schedule()
    assert [len(q.tokens) for q in plan.seqs] == [7, 3] and [q.sample for q in plan.seqs] == [True, False]


def test_schedule_and_update_must_alternate():
    s, _, _ = make()
    s.add_request(req("a"))
    plan = s.schedule()
    with pytest.raises(RuntimeError):
        s.schedule()
    s.update_from_output(plan, {"a": SeqOutput(1)})
    with pytest.raises(RuntimeError):
        s.update_from_output(plan, {})


# -- metrics and configuration ---------------------------------------------------------------------

SPEC_SERIES = {
    "active": "gauge", "queued": "gauge", "capacity": "gauge", "max_queue": "gauge",
    "admitted": "counter", "completed": "counter", "failed": "counter", "rejected": "counter",
    "timed_out": "counter", "cancelled": "counter",
    "queue_wait_seconds": "histogram", "slot_duration_seconds": "histogram",
    "first_output_seconds": "histogram", "engine_call_seconds": "histogram",
}


def test_metrics_have_the_spec_names_types_and_buckets():
    s, clock, _ = make(slots=2, max_queue=3)
    r = s.add_request(req("a"))
    step(s)
    clock.t += 0.02
    s.note_first_output(r)
    families = {f.name: f for f in text_string_to_metric_families(generate_latest(s.metrics.registry).decode())}
    for suffix, kind in SPEC_SERIES.items():
        f = families.get("colibri_scheduler_" + suffix)
        assert f is not None and f.type == kind, suffix
        if kind == "histogram":
            les = [float(x.labels["le"]) for x in f.samples if x.name.endswith("_bucket")]
            assert les == list(BUCKETS), suffix
            assert {x.name for x in f.samples} >= {f.name + "_bucket", f.name + "_sum", f.name + "_count"}
    assert value(s, "capacity") == 2 and value(s, "max_queue") == 3
    assert value(s, "first_output_seconds_sum") == pytest.approx(0.02)
    assert not any(x.labels.keys() - {"le"} for f in families.values() for x in f.samples)  # no request labels


def test_first_output_is_observed_once():
    s, clock, _ = make()
    r = s.add_request(req("a"))
    step(s)
    s.note_first_output(r)
    s.note_first_output(r)
    assert value(s, "first_output_seconds_count") == 1


def test_config_reads_the_environment_and_checks_values():
    env = {"COLI_KV_SLOTS": "4", "COLI_MAX_QUEUE": "0", "COLI_QUEUE_TIMEOUT": "2.5"}
    c = SchedulerConfig.from_env(env)
    assert (c.kv_slots, c.max_queue, c.queue_timeout) == (4, 0, 2.5)
    assert SchedulerConfig.from_env(env, kv_slots=2).kv_slots == 2  # a flag wins over the environment
    assert SchedulerConfig.from_env({}).max_queue == 8 and SchedulerConfig.from_env({}).queue_timeout == 300
    for bad in ({"COLI_KV_SLOTS": "17"}, {"COLI_KV_SLOTS": "0"}, {"COLI_MAX_QUEUE": "-1"},
                {"COLI_QUEUE_TIMEOUT": "0"}, {"COLI_KV_SLOTS": "two"}):
        with pytest.raises(InvalidRequestError):
            SchedulerConfig.from_env(bad)


def test_snapshot_reports_counters_and_slots():
    s, _, _ = make(slots=2)
    occupy(s, 1)
    snap = s.snapshot()
    assert snap["active"] == 1 and snap["admitted"] == 1 and snap["capacity"] == 2
    assert [x["busy"] for x in snap["slots"]] == [False, True]
