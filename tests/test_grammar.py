"""Grammar-constrained decoding (coli.grammar) through the real runner and engine.

The model is the tiny seeded random Qwen3-style chat model of server_kit: by itself it
writes noise, so every valid JSON answer here is the constraint's doing. Schemas are
bounded (maxLength, maxItems, enums, additionalProperties: false) so that a random model
finishes within max_tokens; answers that hit max_tokens must be a valid prefix.
"""
from __future__ import annotations

import json

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import coli
from coli.grammar import Constraint, GrammarError
from coli.grammar import tools as T
from coli.runner import Runner
from coli.sampling import SamplingParams
from coli.scheduler import Error, Finished, TextDelta, TokenLogprob
from server_kit import build_chat_model

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {
        "city": {"enum": ["Paris", "Tokyo", "Lima"]},
        "temps": {"type": "array", "items": {"type": "number", "minimum": -50, "maximum": 50},
                  "minItems": 1, "maxItems": 3},
        "unit": {"type": "string", "enum": ["c", "f"]},
        "ok": {"type": "boolean"}},
     "required": ["city", "temps"], "additionalProperties": False},
    {"type": "object", "properties": {
        "point": {"type": "object", "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9},
                                                   "y": {"type": "integer", "minimum": -9, "maximum": 9}},
                  "required": ["x", "y"], "additionalProperties": False},
        "tag": {"anyOf": [{"type": "null"}, {"type": "string", "pattern": "^[a-z]{1,4}$"}]}},
     "required": ["point", "tag"], "additionalProperties": False},
    {"type": "array", "items": {"type": "string", "enum": ["red", "green", "blue"]}, "minItems": 2, "maxItems": 4},
]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return coli.load(build_chat_model(tmp_path_factory.getbasetemp()), threads=1)


@pytest.fixture(scope="module")
def runner(model):
    r = Runner(model, kv_slots=4, ctx=512, persist=False, notice=lambda t: None)
    yield r
    r.close()


def prompt(model, text="Describe it as JSON."):
    return model.prompt_ids([{"role": "user", "content": text}], enable_thinking=False)


def answer(handle):
    text, finish, lps = [], None, []
    for ev in handle:
        if isinstance(ev, TextDelta):
            text.append(ev.text)
        elif isinstance(ev, TokenLogprob):
            lps.append(ev)
        elif isinstance(ev, Finished):
            finish = ev.finish_reason
        elif isinstance(ev, Error):
            raise AssertionError(ev.message)
    return "".join(text), finish, lps


def check(schema, text, finish):
    assert finish == "stop", (finish, text)
    jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize("schema", SCHEMAS, ids=["person", "weather", "nested-anyof", "array-enum"])
@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_constrained_answers_validate(model, runner, schema, temperature):
    c = Constraint.json_schema(schema)
    handles = [runner.submit(prompt(model), max_tokens=120, constraint=c,
                             sampling=SamplingParams(temperature=temperature, seed=seed)) for seed in (1, 2)]
    for h in handles:
        check(schema, *answer(h)[:2])


def test_batched_with_unconstrained_requests_and_n_copies(model, runner):
    schema = SCHEMAS[1]
    c = Constraint.json_schema(schema)
    free = runner.submit(prompt(model), max_tokens=20, sampling=SamplingParams(temperature=0))
    with runner.scheduler.paused():  # all in one step
        guided = [runner.submit(prompt(model), max_tokens=120, constraint=c,
                                sampling=SamplingParams(temperature=0.8, seed=7 + j)) for j in range(3)]
    for h in guided:
        check(schema, *answer(h)[:2])
    alone_text = "".join(runner.generate(prompt(model), max_tokens=20, sampling=SamplingParams(temperature=0)))
    assert answer(free)[0] == alone_text  # an unconstrained neighbour is not disturbed


def test_seeded_constrained_sampling_is_reproducible(model, runner):
    c = Constraint.json_schema(SCHEMAS[0])
    texts = [answer(runner.submit(prompt(model), max_tokens=120, constraint=c,
                                  sampling=SamplingParams(temperature=1.0, seed=42)))[0] for _ in range(2)]
    assert texts[0] == texts[1]


def test_logprobs_are_of_the_constrained_distribution(model, runner):
    c = Constraint.json_schema(SCHEMAS[1])
    text, finish, lps = answer(runner.submit(prompt(model), max_tokens=120, constraint=c, logprobs=5,
                                             sampling=SamplingParams(temperature=0)))
    check(SCHEMAS[1], text, finish)
    vocab = runner.vocabulary
    assert lps and any(lp.logprob == 0.0 and lp.top == ((lp.token, 0.0),) for lp in lps)  # forced tokens
    for lp in lps:
        assert lp.top and lp.top[0][1] == max(v for _, v in lp.top)
        assert all(v > float("-inf") for _, v in lp.top)  # no disallowed token among the alternatives
        mass = sum(2.718281828459045 ** v for _, v in lp.top)
        assert mass <= 1.0 + 1e-4
    assert vocab.size >= model.config.vocab_size


def test_max_tokens_inside_a_value_is_length_and_a_valid_prefix(model, runner):
    schema = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}
    c = Constraint.json_schema(schema)
    text, finish, _ = answer(runner.submit(prompt(model), max_tokens=12, constraint=c,
                                           sampling=SamplingParams(temperature=1.0, seed=3)))
    assert finish == "length"
    assert text.startswith('{"text": "')
    # a prefix of some valid answer: a matcher accepts it token by token
    g = coli.grammar.Guide(c, runner.vocabulary)
    for t in model.tokenizer.encode(text, add_special_tokens=False):
        g.consume(t)


def test_stop_strings_and_regex_and_lark(model, runner):
    r = Constraint.regex(r"[0-9]{3}-[0-9]{4}")
    text, finish, _ = answer(runner.submit(prompt(model), max_tokens=30, constraint=r,
                                           sampling=SamplingParams(temperature=1.0, seed=5)))
    assert finish == "stop" and len(text) == 8 and text[3] == "-" and text.replace("-", "").isdigit()
    text, finish, _ = answer(runner.submit(prompt(model), max_tokens=30, constraint=r, stop=["-"],
                                           sampling=SamplingParams(temperature=1.0, seed=5)))
    assert finish == "stop" and len(text) == 3
    lark = Constraint.lark('start: "yes" | "no" | "maybe"')
    text, finish, _ = answer(runner.submit(prompt(model), max_tokens=10, constraint=lark,
                                           sampling=SamplingParams(temperature=1.0, seed=9)))
    assert text in ("yes", "no", "maybe") and finish == "stop"


def test_bad_grammars_name_the_field_and_the_reason(runner):
    cases = [Constraint.json_schema({"type": "strin"}, param="response_format"),
             Constraint.regex("((", param="x_colibri_grammar"),
             Constraint.lark("start: missing", param="x_colibri_grammar")]
    for c in cases:
        with pytest.raises(GrammarError) as e:
            runner.submit([1, 2, 3], max_tokens=4, constraint=c)
        assert e.value.param == c.param and str(e.value).startswith(c.param) and "compile" in str(e.value)


def test_a_dead_end_ends_with_an_error_not_a_hang(model, runner):
    c = Constraint.lark("start: \"a\" B\nB: /b/ & /c/")  # compiles, but nothing can follow "a"
    events = list(runner.submit(prompt(model), max_tokens=5, constraint=c))
    err = [e for e in events if isinstance(e, Error)]
    assert err and err[0].code == "grammar_dead_end" and "dead end" in err[0].message, events


def test_forced_tokens_fold_into_one_step_and_change_nothing(model):
    c = Constraint.json_schema(SCHEMAS[2])
    out = {}
    for fold in (True, False):
        r = Runner(model, kv_slots=1, ctx=512, persist=False, notice=lambda t: None, fold_forced=fold)
        try:
            steps0 = r.steps
            text, finish, _ = answer(r.submit(prompt(model), max_tokens=120, constraint=c,
                                              sampling=SamplingParams(temperature=0)))
            out[fold] = (text, finish, r.steps - steps0, r.grammar_stats)
        finally:
            r.close()
    assert out[True][:2] == out[False][:2]
    check(SCHEMAS[2], *out[True][:2])
    stats = out[True][3]
    assert stats.folded > 0 and out[True][2] <= out[False][2] - stats.folded


def test_tool_grammar_forces_a_parseable_call(model, runner):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Paris", "Tokyo"]}}, "required": ["city"],
        "additionalProperties": False}}},
             {"type": "function", "function": {"name": "add", "parameters": {
                 "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
                 "required": ["a"], "additionalProperties": False}}}]
    from coli.chat_format import HERMES
    for choice in ("required", "add"):
        c = T.tool_constraint(tools, choice, parallel=False, tokens=runner.vocabulary.added)
        text, finish, _ = answer(runner.submit(prompt(model), max_tokens=80, constraint=c,
                                               sampling=SamplingParams(temperature=1.0, seed=11)))
        assert finish == "stop" and text.startswith(HERMES.begin) and text.endswith(HERMES.end), text
        (name, args), = HERMES.parse(text[len(HERMES.begin):-len(HERMES.end)].strip())
        assert choice == "required" or name == choice
        schema = next(t["function"]["parameters"] for t in tools if t["function"]["name"] == name)
        jsonschema.validate(json.loads(args), schema)


_leaf = st.one_of(
    st.builds(lambda n: {"type": "integer", "minimum": -n, "maximum": n}, st.integers(0, 50)),
    st.builds(lambda k: {"type": "string", "maxLength": k}, st.integers(0, 5)),
    st.just({"type": "boolean"}), st.just({"type": "null"}),
    st.lists(st.sampled_from(["a", "b", "c", 1, 2, True]), min_size=1, max_size=3, unique=True).map(
        lambda v: {"enum": v}),
)
_schema = st.recursive(_leaf, lambda inner: st.one_of(
    st.builds(lambda items, lo, extra: {"type": "array", "items": items, "minItems": lo, "maxItems": lo + extra},
              inner, st.integers(0, 2), st.integers(0, 2)),
    st.dictionaries(st.sampled_from(["a", "b", "c", "d"]), inner, min_size=1, max_size=3).flatmap(
        lambda props: st.builds(lambda req: {"type": "object", "properties": props, "required": sorted(req),
                                             "additionalProperties": False},
                                st.sets(st.sampled_from(sorted(props))))),
    st.lists(inner, min_size=2, max_size=2).map(lambda xs: {"anyOf": xs}),
), max_leaves=5)


@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(schema=_schema, seed=st.integers(0, 1000))
def test_generated_schemas_validate(model, runner, schema, seed):
    c = Constraint.json_schema(schema)
    text, finish, _ = answer(runner.submit(prompt(model), max_tokens=150, constraint=c,
                                           sampling=SamplingParams(temperature=1.0, seed=seed)))
    check(schema, text, finish)


def test_a_reused_prefix_gives_the_same_constrained_answer(model, runner):
    c = Constraint.json_schema(SCHEMAS[0])
    ids = prompt(model, "Who is it?")
    cold = runner.submit(ids, max_tokens=120, constraint=c, cache_slot=3, sampling=SamplingParams(temperature=0))
    first = answer(cold)
    warm = runner.submit(ids, max_tokens=120, constraint=c, cache_slot=3, sampling=SamplingParams(temperature=0))
    events = list(warm)
    started = events[0]
    assert started.cached_tokens > 0  # the prompt's KV came from the slot
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == first[0]
    check(SCHEMAS[0], *first[:2])


def test_a_tokenizer_llguidance_cannot_read_is_a_clear_error(tmp_path):
    from conftest import write_tokenizer

    from coli.grammar import Vocabulary
    from coli.tokenizer import Tokenizer

    write_tokenizer(tmp_path, 50, eos=1)  # word-level: no bytes for a grammar to match
    with pytest.raises(GrammarError, match="cannot be used for constrained decoding"):
        Vocabulary(Tokenizer.from_dir(tmp_path).to_json(), 50, [1])
