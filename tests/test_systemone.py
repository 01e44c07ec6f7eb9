"""POST /v1/systemone through the official client (typesafe-sdk) against the real server
over TCP, the reference formulas, the semantics clients rely on, and Brio on the batched
scoring path (same numbers as the per-option loop it replaced)."""
from __future__ import annotations

import math
import threading

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from coli.sampling import logprobs as log_softmax
from coli.scheduler import PromptLogprobs, Started
from coli.scheduler.events import RequestCancelledError
from coli.server import systemone as S
from server_kit import WAIT, Running, chat_model_dir, http, running  # noqa: F401 (fixtures)

ts = pytest.importorskip("typesafe_sdk", reason="pip install typesafe-sdk (in the test extra) to run these")

UNICODE = ["café", "日本語", "🙂 smile", "a\u0301", "Ünïcödé Ω", "tab\there", "quote \" and \\ back"]


@pytest.fixture(scope="module")
def srv(chat_model_dir):
    yield from running(chat_model_dir, kv_slots=2, max_queue=4, ctx=1024)


def client(srv, **kw):
    return ts.TypeSafeClient(base_url=srv.url, api_key=kw.pop("api_key", "local"), compression=False,
                             retry=ts.RetryPolicy(max_retries=0), timeout=WAIT, **kw)


def post(srv, body, headers=None):
    return http(srv, "POST", "/v1/systemone", body, headers)


def check_answer(a: dict, q: dict) -> None:
    """Every invariant of one answer, from the spec."""
    assert a["type"] == q["type"]
    if a["type"] == "noul":
        assert 0 <= a["noul"] <= 1 and math.isfinite(a["noul"])
        return
    p = a["probabilities"]
    if a["type"] == "choice":
        assert list(p) == list(q["criteria"])  # the names as sent, byte for byte, in order
        assert a["choice"] == max(p, key=p.get)
        n = len(p)
        assert a["confidence"] == pytest.approx((max(p.values()) - 1 / n) / (1 - 1 / n), abs=1e-12)
    else:
        n = len(q["criteria"])
        assert list(p) == [str(i) for i in range(n)]
        assert a["legend"] == {str(i): c for i, c in enumerate(q["criteria"])}
        assert a["score"] == pytest.approx(sum(i * p[str(i)] for i in range(n)), abs=1e-12)
        m = max(range(n), key=lambda i: p[str(i)])
        u = sum(abs(i - (n - 1) / 2) for i in range(n)) / n
        assert a["confidence"] == pytest.approx(max(0.0, 1 - sum(p[str(i)] * abs(i - m) for i in range(n)) / u),
                                                abs=1e-12)
    assert all(0 <= x <= 1 and math.isfinite(x) for x in p.values())
    assert sum(p.values()) == pytest.approx(1.0, abs=1e-9)
    assert 0 <= a["confidence"] <= 1


QUESTIONS = {
    "refund": {"type": "noul", "instructions": "Does the customer ask for a refund?",
               "criteria": {"true": "asks for money back", "false": "anything else"}},
    "team": {"type": "choice", "instructions": "Which team should handle this?",
             "criteria": {"billing": "payments, invoices", "technical": "bugs, outages", "other": None}},
    "urgency": {"type": "score", "instructions": "How urgent is it?",
                "criteria": ["Can wait", "This week", "Today"]},
}


# -- the official client ----------------------------------------------------------------------


@pytest.mark.parametrize("state", ["I was charged twice. Please fix this ASAP.",
                                   {"subject": "Duplicate charge", "message": "Please help.", "n": [1, 2]},
                                   ["first message", {"role": "agent"}, 3]])
def test_client_gets_every_answer_type(srv, state):
    with client(srv) as c:
        r = c.system_one(state=state, questions={
            "refund": ts.Noul(instructions="Does the customer ask for a refund?",
                              criteria={"true": "asks for money back", "false": "anything else"}),
            "team": ts.Choice(instructions="Which team?", criteria={"billing": "payments", "technical": None}),
            "urgency": ts.Score(instructions="How urgent?", criteria=["Can wait", "This week", "Today"])})
    assert r.model == "tiny" and r.usage.output_tokens == 0 and r.usage.input_tokens > 0
    assert set(r.answers) == {"refund", "team", "urgency"}
    assert 0 <= r.nouls["refund"].noul <= 1
    assert r.choices["team"].choice in ("billing", "technical")
    assert set(r.scores["urgency"].probabilities) == {0, 1, 2} and 0 <= r.scores["urgency"].score <= 2
    assert r.scores["urgency"].legend == {0: "Can wait", 1: "This week", 2: "Today"}


def test_client_sizes_unicode_names_and_one_sided_nouls(srv):
    many = {f"option {i}": None for i in range(255)}
    questions = {
        "two": ts.Choice(criteria={"yes": None, "no": None}),
        "many": ts.Choice(instructions="Pick one.", criteria=many),
        "unicode": ts.Choice(instructions="Which?", criteria={n: None for n in UNICODE}),
        "described": ts.Choice(criteria={n: f"about {n}" for n in UNICODE[:3]}),
        "levels2": ts.Score(criteria=["low", "high"]),
        "levels10": ts.Score(instructions="Rate it.", criteria=[f"level {i}" for i in range(10)]),
        "only_true": ts.Noul(instructions="Is it about money?", criteria={"true": "money is mentioned"}),
        "only_false": ts.Noul(criteria={"false": "nothing about money"}),
        "bare": ts.Noul(instructions="Is it polite?"),
        "json_text": ts.Noul(instructions={"task": "spam?"}, criteria={"true": ["ads", "scams"], "false": None}),
        "": None,
    }
    del questions[""]
    with client(srv) as c:
        r = c.system_one(state="Please refund the 30 euros you charged twice.", questions=questions,
                         model="jev-latest", extra_body={"x_unknown": {"a": 1}, "temperature": 3})
    assert list(r.answers) == list(questions)
    assert list(r.choices["many"].probabilities) == list(many)
    assert list(r.choices["unicode"].probabilities) == UNICODE
    assert r.choices["unicode"].choice in UNICODE
    assert set(r.scores["levels10"].probabilities) == set(range(10))
    # the raw body: every answer checked against the formulas, keys byte for byte
    status, _, body = post(srv, {"state": "x", "questions": {k: v.model_dump() for k, v in questions.items()},
                                 "model": "tiny"})
    assert status == 200
    for k, q in questions.items():
        check_answer(body["answers"][k], q.model_dump())


def test_client_models_list(srv):
    with client(srv) as c:
        models = c.models.list()
    names = [m.name for m in models.models]
    assert names == ["tiny", "jev-latest"] and all(len(m.release_date) == 10 for m in models.models)
    # the OpenAI list is in the same body
    status, _, body = http(srv, "GET", "/v1/models")
    assert status == 200 and body["object"] == "list" and body["data"][0]["id"] == "tiny"


@pytest.mark.parametrize("extra,loc", [
    ({"questions": {"q": {"type": "choice", "criteria": {"only": None}}}}, ["body", "questions", "q", "criteria"]),
    ({"questions": {"q": {"type": "choice", "criteria": {f"o{i}": None for i in range(256)}}}},
     ["body", "questions", "q", "criteria"]),
    ({"questions": {"q": {"type": "score", "criteria": ["one"]}}}, ["body", "questions", "q", "criteria"]),
    ({"questions": {"q": {"type": "score", "criteria": [str(i) for i in range(11)]}}},
     ["body", "questions", "q", "criteria"]),
    ({"questions": {"q": {"type": "score", "criteria": {"0": "low", "1": "high"}}}},
     ["body", "questions", "q", "criteria"]),
    ({"questions": {"q": {"type": "noul"}}}, ["body", "questions", "q", "instructions"]),
    ({"questions": {"q": {"type": "noul", "criteria": {"maybe": "x"}, "instructions": "?"}}},
     ["body", "questions", "q", "criteria", "maybe"]),
    ({"questions": {"q": {"type": "guess"}}}, ["body", "questions", "q", "type"]),
    ({"questions": {}}, ["body", "questions"]),
    ({"state": 3}, ["body", "state"]),
])
def test_client_validation_errors_are_422_with_detail(srv, extra, loc):
    with client(srv) as c, pytest.raises(ts.TypeSafeUnprocessableEntityError) as e:
        c.system_one(state="x", questions={"q": ts.Noul(instructions="?")}, extra_body=extra)
    assert e.value.status == 422
    assert any(d["loc"] == loc and d["msg"] and d["type"] for d in e.value.body["detail"]), e.value.body


def test_missing_state_and_bad_bodies(srv):
    for body, loc in (({"questions": {"q": {"type": "noul", "instructions": "?"}}}, ["body", "state"]),
                      ({"state": "x"}, ["body", "questions"])):
        status, _, err = post(srv, body)
        assert status == 422 and err["detail"][0]["loc"] == loc and err["detail"][0]["type"] == "missing"
    status, _, err = http(srv, "POST", "/v1/systemone", raw=b"{nope")
    assert status == 422 and err["detail"][0]["type"] == "json_invalid"
    status, _, err = http(srv, "POST", "/v1/systemone", raw=b"[1]")
    assert status == 422 and isinstance(err["detail"], list)


def test_images_and_boxes_are_refused_with_a_4xx(srv):
    with client(srv) as c:
        with pytest.raises(ts.TypeSafeBadRequestError) as e:
            c.system_one(state="x", questions={"where": ts.Box(instructions="The dog")})
        assert e.value.body["detail"]["error_type"] == "invalid_request_error" and "text-only" in str(e.value)
        with pytest.raises(ts.TypeSafeBadRequestError):
            c.system_one(state="x", questions={"q": ts.Noul(instructions="?")},
                         extra_body={"assets": {"img": {"type": "image", "format": "png", "data_base64": "AAAA"}}})
    status, _, err = http(srv, "POST", "/v1/systemone", raw=b"--b\r\n\r\n--b--",
                          headers={"Content-Type": "multipart/form-data; boundary=b"})
    assert status == 400 and "text-only" in err["detail"]["message"]


def test_unknown_model_is_404(srv):
    with client(srv) as c, pytest.raises(ts.TypeSafeNotFoundError) as e:
        c.system_one(state="x", questions={"q": ts.Noul(instructions="?")}, model="jev-2099")
    assert e.value.body["detail"]["error_type"] == "not_found_error"


def test_api_key(chat_model_dir):
    s = Running(chat_model_dir, kv_slots=1, config={"api_key": "s3cret"})
    try:
        with client(s, api_key="wrong") as c, pytest.raises(ts.TypeSafeAuthenticationError) as e:
            c.system_one(state="x", questions={"q": ts.Noul(instructions="?")})
        assert e.value.status == 401 and e.value.body["detail"]["error_type"] == "authentication_error"
        with client(s, api_key="s3cret") as c:
            assert 0 <= c.system_one(state="x", questions={"q": ts.Noul(instructions="?")}).nouls["q"].noul <= 1
    finally:
        s.close()


def test_queue_full_is_429_with_retry_after(chat_model_dir):
    """With the only slot busy and no queue, the call is refused with 429 and Retry-After.
    The busy request (400 tokens of the tiny test model) can end before the client's request
    arrives on a loaded machine; then the call rightly gets through, and the pair is tried
    again, up to 5 times: a server that admitted calls while the slot is busy fails all 5."""
    s = Running(chat_model_dir, kv_slots=1, max_queue=0)
    try:
        refused = None
        for _ in range(5):
            busy = s.runner.submit(s.tokenizer.encode("hello"), max_tokens=400, logit_bias={5: 100.0})
            next(iter(busy.events(WAIT)))  # Started: it holds the only slot
            with client(s) as c:
                try:
                    c.system_one(state="x", questions={"q": ts.Noul(instructions="?")})
                except ts.TypeSafeRateLimitError as e:
                    refused = e
            busy.cancel()
            try:  # ended or cancelled: the slot is free for the next try
                busy.result(timeout=WAIT)
            except RequestCancelledError:
                pass
            if refused is not None:
                break
        assert refused is not None, "never refused while the only slot was busy"
        assert refused.retry_after_ms is not None and refused.body["detail"]["error_type"] == "rate_limit_error"
    finally:
        s.close()


# -- semantics ----------------------------------------------------------------------------------


def reference(srv, state: str, q: dict) -> list[float]:
    """The probabilities from full forward passes over the documented prompt."""
    tok, model = srv.tokenizer, srv.model
    head, tail = S._split(srv.server, state)
    ask = S._question("q", q, [])
    prefix = tok.encode(head, add_special_tokens=False) + tok.encode(ask.text + tail, add_special_tokens=False)
    scores = []
    for label in ask.labels:
        ids = tok.encode(label, add_special_tokens=False)
        lp = log_softmax(model.forward(prefix + ids))
        scores.append(sum(lp[len(prefix) - 1 + j, t] for j, t in enumerate(ids)) / len(ids))
    return S.probabilities(scores)


def test_answers_are_what_the_model_computes(srv):
    state = "The order arrived broken and I want my money back."
    status, _, body = post(srv, {"state": state, "questions": QUESTIONS})
    assert status == 200
    for k, q in QUESTIONS.items():
        a, want = body["answers"][k], reference(srv, state, q)
        got = [a["noul"]] if k == "refund" else list(a["probabilities"].values())
        assert got == pytest.approx(want[:len(got)], abs=1e-4)


def test_the_state_is_computed_once_and_reused(srv):
    state = "A long enough state to be worth keeping: " + "words and more words " * 10
    m = "colibri_scheduler_cached_tokens_total"
    post(srv, {"state": state, "questions": {"a": QUESTIONS["refund"]}})
    before = srv.metric(m)
    status, _, body = post(srv, {"state": state, "questions": {"b": QUESTIONS["team"]}})
    assert status == 200 and srv.metric(m) - before >= 40


@settings(max_examples=6, deadline=None, database=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
@given(names=st.lists(st.text(min_size=1, max_size=8), min_size=3, max_size=3, unique=True),
       order=st.permutations([0, 1, 2]))
def test_renaming_and_reordering_questions_changes_nothing(srv, names, order):
    state = "I was charged twice."
    base = post(srv, {"state": state, "questions": QUESTIONS})[2]["answers"]
    keys = list(QUESTIONS)
    renamed = {names[i]: QUESTIONS[keys[i]] for i in order}
    status, _, body = post(srv, {"state": state, "questions": renamed})
    assert status == 200
    assert list(body["answers"]) == list(renamed)
    for i in order:
        assert body["answers"][names[i]] == base[keys[i]]
    # alone, its rows run in a smaller batch: the kernels may round differently in the last bits,
    # and the f16 KV cache can turn such a difference into one of a half's rounding steps (2^-11)
    alone = post(srv, {"state": state, "questions": {"x": QUESTIONS[keys[order[0]]]}})[2]["answers"]["x"]
    want = base[keys[order[0]]]
    assert alone.keys() == want.keys() and alone.get("choice") == want.get("choice")
    for k, v in alone.items():
        if isinstance(v, float):
            assert v == pytest.approx(want[k], abs=2e-5)
        elif k == "probabilities":
            assert v.keys() == want[k].keys() and list(v.values()) == pytest.approx(list(want[k].values()), abs=2e-5)


def test_concurrent_requests_all_answer(srv):
    out, errors = [], []

    def one(i):
        try:
            out.append(post(srv, {"state": f"message {i}", "questions": QUESTIONS})[0])
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT)
    assert not errors and sorted(out) == [200] * 4


# -- the formulas, as properties ---------------------------------------------------------------

scores_st = st.lists(st.floats(min_value=-80, max_value=0, allow_nan=False), min_size=2, max_size=255)


@settings(max_examples=200, deadline=None, database=None, derandomize=True)
@given(scores=scores_st)
def test_probabilities_are_finite_and_sum_to_one(scores):
    p = S.probabilities(scores)
    assert all(math.isfinite(x) and 0 <= x <= 1 for x in p) and math.fsum(p) == pytest.approx(1.0, abs=1e-12)
    assert p[max(range(len(scores)), key=scores.__getitem__)] == max(p)  # the likeliest outcome is the best scored
    c = S.choice_confidence(p)
    assert 0 <= c <= 1 and c == pytest.approx((max(p) - 1 / len(p)) / (1 - 1 / len(p)), abs=1e-12)


@settings(max_examples=200, deadline=None, database=None, derandomize=True)
@given(scores=st.lists(st.floats(min_value=-80, max_value=0, allow_nan=False), min_size=2, max_size=10))
def test_score_is_the_expectation_and_confidence_the_formula(scores):
    p = S.probabilities(scores)
    n = len(p)
    assert S.expected_score(p) == pytest.approx(sum(i * x for i, x in enumerate(p)), abs=1e-12)
    m = int(np.argmax(p))
    u = sum(abs(i - (n - 1) / 2) for i in range(n)) / n
    c = S.score_confidence(p)
    assert 0 <= c <= 1 and c == pytest.approx(max(0.0, 1 - sum(x * abs(i - m) for i, x in enumerate(p)) / u),
                                              abs=1e-12)


def test_confidence_extremes():
    assert S.choice_confidence([1.0, 0.0, 0.0]) == 1 and S.choice_confidence([0.5, 0.5]) == 0
    assert S.score_confidence([0, 0, 1.0]) == 1 and S.score_confidence([0.5, 0, 0.5]) == 0


# -- Brio on the batched path --------------------------------------------------------------------


def test_brio_matches_the_per_option_loop(srv):
    options = ["Paris", "Tokyo", "London is big", "café 日本"]
    status, _, r = http(srv, "POST", "/v1/brio", {"model": "tiny", "state": "The capital of France.",
                                                  "question": "Which city?", "options": options})
    assert status == 200
    prefix = srv.model.prompt_ids([{"role": "user", "content": "The capital of France.\n\nWhich city?"}],
                                  enable_thinking=False)
    slot, sums = 0, []  # the loop /v1/brio ran before: one scoring request per option, in one slot
    for o in options:
        ids = srv.tokenizer.encode(o, add_special_tokens=False)
        evs = list(srv.runner.score(prefix + ids, len(prefix), cache_slot=slot).events(WAIT))
        slot = next(e for e in evs if isinstance(e, Started)).slot
        sums.append(sum(next(e for e in evs if isinstance(e, PromptLogprobs)).logprobs))
    assert [c["logprob"] for c in r["choices"]] == pytest.approx(sums, abs=1e-5)
    p = S.probabilities([s / c["tokens"] for s, c in zip(sums, r["choices"])])
    assert [c["p"] for c in r["choices"]] == pytest.approx(p, abs=1e-5)


def test_a_runner_without_batched_scoring_gets_the_same_numbers(srv):
    """The cluster router has no score_branches: /v1/brio and /v1/systemone fall back to
    one scoring request per option, with the same log-probabilities."""
    import asyncio
    import types

    from coli.scoring import Question
    from coli.server.brio import score

    class OnlyScore:
        def __init__(self, runner):
            self.score = runner.score

    tok = srv.tokenizer
    prefix = tok.encode("<|im_start|>user\nA state.\n\n", add_special_tokens=False)
    qs = [Question.of(tok.encode("Is it? Answer Yes or No.<|im_end|>\n<|im_start|>assistant\n",
                                 add_special_tokens=False), [tok.encode(x, add_special_tokens=False)
                                                             for x in ("Yes", "No", "maybe not")])]
    batched, _ = asyncio.run(score(srv.server, prefix, qs, None))
    each, _ = asyncio.run(score(types.SimpleNamespace(runner=OnlyScore(srv.runner)), prefix, qs, None))
    assert len(each[0]) == 3
    for a, b in zip(batched[0], each[0]):
        assert a == pytest.approx(b, abs=1e-5)


def test_counted_like_every_endpoint(srv):
    """Per-endpoint request counts, the scheduler's counters and /health see System One calls."""
    registry = srv.server.telemetry.metrics.registry
    count = lambda status: registry.get_sample_value("colibri_server_requests_total",  # noqa: E731
                                                     {"endpoint": "/v1/systemone", "status": status}) or 0
    ok, bad = count("200"), count("422")
    completed = http(srv, "GET", "/health")[2]["completed"]
    assert post(srv, {"state": "x", "questions": {"q": QUESTIONS["team"]}})[0] == 200
    assert post(srv, {"state": "x", "questions": {}})[0] == 422
    assert count("200") == ok + 1 and count("422") == bad + 1
    health = http(srv, "GET", "/health")[2]
    assert health["completed"] == completed + 1 and health["active"] == 0
