"""The runner on a tiny real model: batched greedy equals sequential, prefix reuse
changes nothing but the work, cancellation frees the slot within one step, events
arrive in order through both the blocking and the asyncio interfaces."""
from __future__ import annotations

import asyncio
import threading

import pytest

import coli
from coli.runner import Runner, _greedy_picks, plan_context
from coli.sampling import SamplingParams
from coli.scheduler import (ContextLengthExceededError, Error, Finished, Profile, QueueFullError, Routing,
                            SchedulerClosedError, Started, TextDelta, Usage)

WAIT = 120  # seconds: a bound that only a hang reaches


@pytest.fixture(scope="module")
def model(hf_models):
    return coli.load(hf_models("qwen3_moe"), threads=1)


@pytest.fixture
def runner(model):
    made = []

    def make(**kw):
        kw.setdefault("persist", False)
        r = Runner(model, **kw)
        made.append(r)
        return r

    yield make
    for r in made:
        r.close()


def ids(model, text: str) -> list[int]:
    return model.tokenizer.encode(text)


PROMPTS = ["w3 w17 w42 w99 w5 w8", "w1 w2 w3", "w150 w7 w7 w7 w7 w9 w12 w60 w61 w62 w63", "w88"]


def alone(model, prompt: list[int], max_tokens: int) -> str:
    """The reference: Model.generate's own loop, one sequence, greedy."""
    return "".join(model.generate(model.tokenizer.decode(prompt), raw=True, max_tokens=max_tokens, temperature=0))


def test_concurrent_greedy_requests_batched_equal_sequential_runs(model, runner):
    r = runner(kv_slots=4)
    greedy = SamplingParams(temperature=0)
    prompts = [ids(model, p) for p in PROMPTS]
    with r.scheduler.paused():  # all four are admitted before the first step is planned
        handles = [r.submit(p, max_tokens=24, sampling=greedy, routing=True) for p in prompts]
    streams = [list(h.events(WAIT)) for h in handles]
    steps = [[e.step for e in evs if isinstance(e, Routing)] for evs in streams]
    assert len({s[0] for s in steps}) == 1  # they started in one step ...
    assert len({len(s) for s in steps}) == 1 and all(s == steps[0] for s in steps)  # ... and ran in the same steps
    assert len({next(e.slot for e in evs if isinstance(e, Started)) for evs in streams}) == 4
    for p, evs in zip(prompts, streams):
        assert isinstance(evs[-1], Finished)
        text = "".join(e.text for e in evs if isinstance(e, TextDelta))
        assert text == alone(model, p, 24)


def test_requests_share_steps(model, runner):
    """While one request decodes, another's prompt is prefilled in the same steps."""
    r = runner(kv_slots=2, prefill_chunk=4)
    greedy = SamplingParams(temperature=0)
    long_prompt = ids(model, " ".join(f"w{i}" for i in range(10, 40)))
    first = r.submit(ids(model, "w1 w2"), max_tokens=40, sampling=greedy, routing=True)
    events = first.events(WAIT)
    assert isinstance(next(events), Started)
    second = r.submit(long_prompt, max_tokens=3, sampling=greedy, routing=True)
    steps_of = lambda h: [ev.step for ev in h.events(WAIT) if isinstance(ev, Routing)]
    second_steps = steps_of(second)
    first_steps = [ev.step for ev in events if isinstance(ev, Routing)]
    shared = set(first_steps) & set(second_steps)
    assert len(shared) >= 2, (first_steps, second_steps)  # 30 prompt tokens in chunks of 4 overlap decoding
    assert r.scheduler.snapshot()["completed"] == 2


def test_second_turn_reuses_the_prefix_and_matches_a_cold_run(model, runner):
    r = runner(kv_slots=1)
    greedy = SamplingParams(temperature=0)
    turn1 = ids(model, PROMPTS[0])
    a = r.submit(turn1, max_tokens=8, sampling=greedy).result(timeout=WAIT)
    assert a.usage.cached_tokens == 0
    turn2 = turn1 + ids(model, a.text) + ids(model, "w11 w12")
    b = r.submit(turn2, max_tokens=8, sampling=greedy).result(timeout=WAIT)
    assert b.usage.cached_tokens == len(turn1) + 7  # the prompt and all but the last generated token
    assert b.started.cached_tokens == b.usage.cached_tokens
    assert b.text == alone(model, turn2, 8)
    assert r.metrics.value("colibri_scheduler_cached_tokens_total") == b.usage.cached_tokens


def test_a_diverging_prompt_truncates_the_slot(model, runner):
    r = runner(kv_slots=1)
    greedy = SamplingParams(temperature=0)
    base = ids(model, "w5 w6 w7 w8 w9 w10")
    r.submit(base, max_tokens=4, sampling=greedy).result(timeout=WAIT)
    other = base[:3] + ids(model, "w100 w101")
    res = r.submit(other, max_tokens=6, sampling=greedy).result(timeout=WAIT)
    assert res.usage.cached_tokens == 3
    assert res.text == alone(model, other, 6)


def test_cancellation_frees_the_slot_within_one_step(model, runner):
    r = runner(kv_slots=1, max_queue=1)
    greedy = SamplingParams(temperature=0)
    long = r.submit(ids(model, "w1 w2 w3"), max_tokens=200, sampling=greedy)
    waiting = r.submit(ids(model, "w4 w5"), max_tokens=2, sampling=greedy)
    for ev in long.events(WAIT):
        if isinstance(ev, TextDelta):
            assert long.cancel()
            break
    rest = list(long.events(WAIT))
    assert isinstance(rest[-1], Error) and rest[-1].code == "cancelled"
    req = long.request
    assert req.release_step - req.cancel_step <= 1
    done = waiting.result(timeout=WAIT)
    assert done.finish_reason == "length"
    assert r.metrics.value("colibri_scheduler_cancelled_total") == 1


def test_event_order_and_usage(model, runner):
    r = runner()
    h = r.submit(ids(model, PROMPTS[0]), max_tokens=5, sampling=SamplingParams(temperature=0))
    evs = list(h.events(WAIT))
    kinds = [type(e) for e in evs]
    assert kinds[0] is Started and kinds[-3:] == [Profile, Usage, Finished]
    assert set(kinds[1:-3]) == {TextDelta}
    usage = evs[-2]
    assert (usage.prompt_tokens, usage.completion_tokens) == (6, 5) and evs[-1].finish_reason == "length"
    prof = evs[-3]
    assert prof.prefill_tokens == 6 and prof.decode_tokens == 4 and prof.steps == 5
    assert r.metrics.value("colibri_scheduler_first_output_seconds_count") == 1


def test_stop_strings_end_the_answer(model, runner):
    r = runner()
    greedy = SamplingParams(temperature=0)
    prompt = ids(model, PROMPTS[0])
    full = r.submit(prompt, max_tokens=12, sampling=greedy).result(timeout=WAIT).text
    stop = " " + full.split()[4]
    got = r.submit(prompt, max_tokens=12, sampling=greedy, stop=[stop]).result(timeout=WAIT)
    assert got.text == full[: full.index(stop)] and got.finish_reason == "stop"
    before = r.metrics.value("colibri_scheduler_first_output_seconds_count")
    hidden = r.submit(prompt, max_tokens=12, sampling=greedy, stop=[full.split()[0]]).result(timeout=WAIT)
    assert hidden.text == "" and hidden.finish_reason == "stop"
    # the model did produce output: first output is observed before stop filtering (spec)
    assert r.metrics.value("colibri_scheduler_first_output_seconds_count") == before + 1


def test_seeded_sampling_is_reproducible_under_batching(model, runner):
    r = runner(kv_slots=3)
    params = SamplingParams(temperature=1.0, seed=5)
    prompt = ids(model, PROMPTS[2])
    hs = [r.submit(prompt, max_tokens=16, sampling=params) for _ in range(3)]
    texts = {h.result(timeout=WAIT).text for h in hs}
    assert len(texts) == 1


def test_batched_greedy_picks_equal_each_samplers_own(model, runner, monkeypatch):
    """A step whose sampling entries are all plain greedy takes one argmax over its logits
    (a request's logit_bias added to its row for it) instead of a Sampler call per request:
    the events are the same either way, and a step with a sampling request samples each row
    itself."""
    greedy = SamplingParams(temperature=0)
    prompts = [ids(model, p) for p in PROMPTS]

    def run(**extra):
        r = runner(kv_slots=4)
        with r.scheduler.paused():
            hs = [r.submit(p, max_tokens=10, sampling=greedy, logprobs=2 if i == 0 else None)
                  for i, p in enumerate(prompts[:3])]
            hs.append(r.submit(prompts[3], max_tokens=10, **extra))
        return [[e for e in h.events(WAIT) if not isinstance(e, (Started, Profile, Usage))] for h in hs]

    batched = []  # what each step's _greedy_picks returned
    monkeypatch.setattr(coli.runner, "_greedy_picks", lambda *a: batched.append(_greedy_picks(*a)) or batched[-1])
    fast = run(sampling=greedy)
    assert batched and all(p is not None for p in batched)
    batched.clear()
    bias = {5: 0.5, 7: 30.0}  # token 7 wins every step
    biased = run(sampling=greedy, logit_bias=bias)
    assert batched and all(p is not None for p in batched)  # the biased request is picked with the others
    batched.clear()
    mixed = run(sampling=SamplingParams(temperature=1.0, seed=3))
    assert batched and all(p is None for p in batched)  # the sampling request samples every step itself
    monkeypatch.setattr(coli.runner, "_greedy_picks", lambda *a: None)
    assert fast == run(sampling=greedy)
    assert biased == run(sampling=greedy, logit_bias=bias)
    assert biased[3] != fast[3] and biased[:3] == fast[:3] == mixed[:3]


def test_refusals_are_raised_at_submit(model, runner, monkeypatch):
    r = runner(kv_slots=1, max_queue=0, ctx=16)
    with pytest.raises(ContextLengthExceededError):
        r.submit(list(range(1, 17)))
    gate, step = threading.Event(), r.engine.step

    def held(*a, **kw):  # the request below holds the only slot until the refusal is checked
        gate.wait(WAIT)  # (its 14 tokens would otherwise take the tiny model a few ms)
        return step(*a, **kw)

    monkeypatch.setattr(r.engine, "step", held)
    h = r.submit(ids(model, "w1 w2"), max_tokens=100, sampling=SamplingParams(temperature=0))
    assert next(h.events(WAIT)).max_tokens == 14  # clamped to the context
    try:
        with pytest.raises(QueueFullError):
            r.submit(ids(model, "w3"), cache_slot=0)
    finally:
        gate.set()
    h.cancel()


def test_asyncio_stream(model, runner):
    r = runner(kv_slots=2)

    async def main():
        async def one(text):
            h = r.submit(ids(model, text), max_tokens=6, sampling=SamplingParams(temperature=0))
            return [ev async for ev in h]

        return await asyncio.wait_for(asyncio.gather(one(PROMPTS[0]), one(PROMPTS[1])), WAIT)

    for prompt, evs in zip(PROMPTS, asyncio.run(main())):
        assert isinstance(evs[-1], Finished)
        assert "".join(e.text for e in evs if isinstance(e, TextDelta)) == alone(model, ids(model, prompt), 6)


def test_blocking_generate_helper(model, runner):
    r = runner()
    text = "".join(r.generate(ids(model, PROMPTS[1]), max_tokens=7, sampling=SamplingParams(temperature=0)))
    assert text == alone(model, ids(model, PROMPTS[1]), 7)
    assert r.scheduler.idle()


def test_context_is_capped_to_memory(model):
    per_slot = 100 * 384  # 100 tokens of this model's KV (f16)
    ctx, note = plan_context(model.engine, 2, available=4 * per_slot)  # half of it for two slots
    assert ctx == 100 and "capped" in note
    ctx, note = plan_context(model.engine, 2, available=10**12)
    assert ctx == model.config.max_position_embeddings and "model's" in note
    ctx, note = plan_context(model.engine, 1, requested=10**6, available=10**12)
    assert ctx == model.config.max_position_embeddings and "more than the model's" in note


def test_engine_failure_fails_the_step_and_the_runner_goes_on(model, runner, monkeypatch):
    r = runner()
    real = r.engine.step
    calls = []

    def flaky(entries, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("out of memory")
        return real(entries, **kw)

    monkeypatch.setattr(r.engine, "step", flaky)
    h = r.submit(ids(model, PROMPTS[0]), max_tokens=5, sampling=SamplingParams(temperature=0))
    last = list(h.events(WAIT))[-1]
    assert isinstance(last, Error) and last.code == "engine_error" and "out of memory" in last.message
    assert r.metrics.value("colibri_scheduler_failed_total") == 1
    again = r.submit(ids(model, PROMPTS[0]), max_tokens=5, sampling=SamplingParams(temperature=0))
    assert again.result(timeout=WAIT).text == alone(model, ids(model, PROMPTS[0]), 5)


def test_a_broken_loop_ends_every_request(model, runner, monkeypatch):
    r = runner(kv_slots=1)
    monkeypatch.setattr(r, "_save", lambda ended: 1 / 0 if ended else None)
    waiting = []
    with r.scheduler.paused():
        a = r.submit(ids(model, "w1"), max_tokens=2, sampling=SamplingParams(temperature=0))
        waiting.append(r.submit(ids(model, "w2"), max_tokens=2))
    assert isinstance(list(a.events(WAIT))[-1], Finished)  # it completed; saving it broke the loop
    last = list(waiting[0].events(WAIT))[-1]
    assert isinstance(last, Error) and last.code == "engine_error" and "runner stopped" in last.message
    with pytest.raises(SchedulerClosedError):
        r.submit(ids(model, "w3"), max_tokens=2)


def test_result_gathers_the_answer_and_when_its_first_and_last_events_came():
    import threading
    import time

    from coli.scheduler.core import Request
    from coli.scheduler.stream import RequestHandle

    h = RequestHandle(Request([1, 2], 3), lambda req: False)
    prof = Profile(0.5, 1.0, 3, 2, 2)
    ticks = iter([10.0, 12.5])  # the cpu_clock: read once at Started, once at Finished

    def engine():
        h.put(Started(0, 2, 0, 0.0, 3))
        time.sleep(0.05)
        for ev in (TextDelta("a"), TextDelta("b"), prof, Usage(2, 2, 0, 0.0), Finished("length")):
            h.put(ev)

    t = threading.Thread(target=engine)
    before = time.perf_counter()
    t.start()
    c = h.result(WAIT, timings=True, cpu_clock=lambda: next(ticks))
    t.join()
    assert (c.text, c.finish_reason, c.usage, c.profile) == ("ab", "length", Usage(2, 2, 0, 0.0), prof)
    tm = c.timings
    assert before <= tm.started and tm.finished - tm.started >= 0.04 and (tm.started_cpu, tm.finished_cpu) == (10.0, 12.5)
    plain = RequestHandle(Request([1], 1), lambda req: False)
    for ev in (Started(0, 1, 0, 0.0, 1), Finished("stop")):
        plain.put(ev)
    assert plain.result(WAIT).timings is None  # only when asked


def test_batched_delivery_wakes_each_reader_once_at_the_end():
    """Inside batched_delivery the events are queued but no asyncio reader is woken; at its
    end the readers of one loop wake through one call into it. A reading thread wakes at once."""
    import threading

    from coli.scheduler.core import Request
    from coli.scheduler.stream import RequestHandle, batched_delivery

    async def main():
        loop = asyncio.get_running_loop()
        hs = [RequestHandle(Request([1], 2), lambda req: False) for _ in range(3)]
        readers = [loop.create_task(h.__anext__()) for h in hs]
        await asyncio.sleep(0)  # each reader now waits on its handle
        calls = []
        real = loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda *a: calls.append(a[0]) or real(*a)

        def engine():
            with batched_delivery():
                for h in hs:
                    h.put(TextDelta("a"))
                    h.put(TextDelta("b"))
                with batched_delivery():  # nested: still woken at the outer block's end
                    hs[0].put(TextDelta("c"))
                assert calls == [] and not any(r.done() for r in readers)
            hs[1].put(TextDelta("d"))  # outside the block: woken at once, as before

        t = threading.Thread(target=engine)
        t.start()
        await asyncio.to_thread(t.join)
        got = [await r for r in readers]
        rest = [[h._items.popleft().text for _ in range(len(h._items))] for h in hs]
        wakes = [f for f in calls if getattr(f, "__self__", None) in [h._ready for h in hs] or f.__name__ == "_set_all"]
        return wakes, got, rest

    wakes, got, rest = asyncio.run(main())
    assert len(wakes) == 2  # the block's one call for three readers, then the plain put's own
    assert [e.text for e in got] == ["a", "a", "a"] and rest == [["b", "c"], ["b", "d"], ["b"]]
    h = RequestHandle(Request([1], 2), lambda req: False)
    woke = threading.Event()
    t = threading.Thread(target=lambda: (next(h.events(WAIT)), woke.set()))
    t.start()
    with batched_delivery():
        h.put(TextDelta("x"))
        assert woke.wait(WAIT)  # a blocked reading thread is not deferred
    t.join()
    assert h.poll() is None  # poll: the next queued event, never waiting
    h.put(TextDelta("y"))
    assert h.poll().text == "y" and h.poll() is None
