"""The OpenAI-compatible endpoints through the official `openai` client, over a real TCP
listener on 127.0.0.1. Tests with a scripted answer (see server_kit) prove the serving
path for that answer; the others run the tiny random model as it is."""
from __future__ import annotations

import asyncio
import json
import math

import openai
import pytest
from server_kit import SCRIPTS, WAIT, chat_model_dir, http, running  # noqa: F401 (fixtures)

USER = [{"role": "user", "content": "The weather in Paris is"}]


@pytest.fixture(scope="module")
def srv(chat_model_dir):
    yield from running(chat_model_dir, kv_slots=4, max_queue=8, ctx=512)


@pytest.fixture(scope="module")
def client(srv):
    return srv.openai()


def chat(client, **kw):
    kw.setdefault("model", "tiny")
    kw.setdefault("messages", USER)
    return client.chat.completions.create(**kw)


def streamed(client, **kw):
    """(content, reasoning, tool calls by index, finish reasons, chunks) of a streamed chat."""
    chunks = list(chat(client, stream=True, **kw))
    content, reasoning, calls, finish = {}, {}, {}, {}
    for ch in chunks:
        for c in ch.choices:
            d = c.delta
            content[c.index] = content.get(c.index, "") + (d.content or "")
            extra = d.model_extra or {}
            reasoning[c.index] = reasoning.get(c.index, "") + (extra.get("reasoning_content") or "")
            for tc in d.tool_calls or []:
                entry = calls.setdefault((c.index, tc.index), {"id": None, "name": None, "arguments": ""})
                if tc.id:
                    entry["id"] = tc.id
                if tc.function and tc.function.name:
                    entry["name"] = tc.function.name
                entry["arguments"] += (tc.function.arguments or "") if tc.function else ""
            if c.finish_reason is not None:
                assert c.index not in finish, "finish_reason must appear exactly once per choice"
                finish[c.index] = c.finish_reason
    return content, reasoning, calls, finish, chunks


def test_models_listing(client):
    ids = [m.id for m in client.models.list()]
    assert ids == ["tiny"]
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-4")
    assert e.value.code == "model_not_found"


def test_streamed_and_plain_chat_agree_at_temperature_zero(client):
    plain = chat(client, max_tokens=24, temperature=0)
    content, _, _, finish, chunks = streamed(client, max_tokens=24, temperature=0)
    assert plain.choices[0].message.content == content[0]
    assert plain.choices[0].finish_reason == finish[0] == "length"
    assert chunks[0].choices[0].delta.role == "assistant"
    assert plain.usage.completion_tokens == 24


def test_usage_reports_the_reused_prefix(client, srv):
    convo = [{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": "Say something."}]
    first = chat(client, messages=convo, max_tokens=4, temperature=0, extra_body={"cache_slot": 3})
    again = chat(client, messages=convo + [{"role": "assistant", "content": first.choices[0].message.content},
                                           {"role": "user", "content": "More."}],
                 max_tokens=4, temperature=0, extra_body={"cache_slot": 3}, stream=False)
    assert first.usage.prompt_tokens_details.cached_tokens < first.usage.prompt_tokens
    # the second turn starts with the first turn's prompt and answer, which slot 3 holds
    assert again.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 1
    s = list(chat(client, messages=convo, max_tokens=4, temperature=0, stream=True,
                  stream_options={"include_usage": True}, extra_body={"cache_slot": 3}))
    assert s[-1].choices == [] and s[-1].usage.prompt_tokens_details.cached_tokens == len(
        srv.model.prompt_ids(convo)) - 1
    assert all(ch.usage is None for ch in s[:-1])


def test_stop_sequences_spanning_tokens_are_removed_in_both_modes(client, srv):
    text = "The weather in Paris is sunny today, with a light wind from the west."
    SCRIPTS[9100] = text
    ids = srv.tokenizer.encode(text, add_special_tokens=False)
    ends = [len(srv.tokenizer.decode(ids[: i + 1])) for i in range(len(ids))]  # where each token's text ends
    # a stop string that starts inside one token and ends inside a later one
    i = next(i for i in range(3, len(ids) - 1) if ends[i] - ends[i - 1] >= 2 and ends[i + 1] - ends[i] >= 2)
    stop = text[ends[i] - 1: ends[i] + 1]
    assert len(srv.tokenizer.encode(stop, add_special_tokens=False)) >= 2
    expected = text[: text.index(stop)]
    got = chat(client, seed=9100, max_tokens=40, stop=[stop, "never-seen-1"])
    assert got.choices[0].message.content == expected and got.choices[0].finish_reason == "stop"
    content, _, _, finish, chunks = streamed(client, seed=9100, max_tokens=40, stop=stop)
    assert content[0] == expected and finish[0] == "stop"
    assert not any(stop[:1] == (c.delta.content or "")[-1:] for ch in chunks for c in ch.choices if c.delta.content
                   and stop not in expected)  # the partial match was held back, never sent
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, max_tokens=4, stop=["a", "b", "c", "d", "e"])
    assert e.value.body["param"] == "stop"


def test_max_tokens_is_a_ceiling_clamped_to_the_context(client, srv):
    long = [{"role": "user", "content": "Hello " * 100}]
    n = len(srv.model.prompt_ids(long))
    assert n < srv.runner.ctx
    r = chat(client, messages=long, max_tokens=10**6, temperature=0, logit_bias=no_end(srv))
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == srv.runner.ctx - n
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, messages=[{"role": "user", "content": "Hello " * 600}], max_tokens=1)
    assert e.value.code == "context_length_exceeded"


def test_seed_gives_the_same_text_also_while_other_requests_run(srv):
    async def main():
        c = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=WAIT)
        kw = dict(model="tiny", messages=USER, max_tokens=20, temperature=1.0)
        alone = (await c.chat.completions.create(seed=1234, **kw)).choices[0].message.content
        together = await asyncio.gather(*[c.chat.completions.create(seed=s, **kw) for s in (1234, 77, 1234, 99)])
        return alone, [r.choices[0].message.content for r in together]

    alone, texts = asyncio.run(main())
    assert texts[0] == texts[2] == alone
    assert texts[1] != alone  # (a different seed samples differently: a sanity check of the test)


def test_logprobs_invariants(client, srv):
    r = chat(client, max_tokens=12, temperature=0, logprobs=True, top_logprobs=5)
    content = r.choices[0].logprobs.content
    assert len(content) == 12
    text = r.choices[0].message.content
    assert b"".join(bytes(e.bytes) for e in content).decode("utf-8", "replace") == text
    for e in content:
        assert e.logprob <= 0 and len(e.top_logprobs) == 5
        tops = [t.logprob for t in e.top_logprobs]
        assert tops == sorted(tops, reverse=True) and sum(math.exp(t) for t in tops) <= 1 + 1e-4
        assert e.top_logprobs[0].token == e.token and e.top_logprobs[0].logprob == pytest.approx(e.logprob)
    sampled = chat(client, max_tokens=12, temperature=1.0, seed=3, logprobs=True, top_logprobs=2)
    for e in sampled.choices[0].logprobs.content:
        assert e.logprob <= e.top_logprobs[0].logprob + 1e-6
    s = list(chat(client, max_tokens=12, temperature=0, logprobs=True, top_logprobs=5, stream=True))
    streamed_lps = [e.logprob for ch in s for c in ch.choices if c.logprobs for e in c.logprobs.content]
    assert streamed_lps == pytest.approx([e.logprob for e in content])
    with pytest.raises(openai.BadRequestError):
        chat(client, max_tokens=2, top_logprobs=3)  # without logprobs: true


def no_end(srv) -> dict:
    """A logit_bias that keeps the random model from ending its turn early."""
    return {str(t): -100 for t in srv.tokenizer.special_token_ids}


def test_n_choices(client, srv):
    r = chat(client, n=3, max_tokens=8, temperature=1.0, seed=5, logit_bias=no_end(srv))
    assert [c.index for c in r.choices] == [0, 1, 2]
    texts = [c.message.content for c in r.choices]
    assert len(set(texts)) > 1
    assert r.usage.completion_tokens == 24
    again = chat(client, n=3, max_tokens=8, temperature=1.0, seed=5, logit_bias=no_end(srv))
    assert [c.message.content for c in again.choices] == texts
    content, _, _, finish, _ = streamed(client, n=3, max_tokens=8, temperature=1.0, seed=5, logit_bias=no_end(srv))
    assert [content[i] for i in range(3)] == texts and sorted(finish) == [0, 1, 2]


def test_penalties_and_sampling_fields_are_applied(client):
    base = dict(max_tokens=24, temperature=0)
    plain = chat(client, **base).choices[0].message.content
    penalized = chat(client, frequency_penalty=2.0, presence_penalty=2.0, **base).choices[0].message.content
    assert penalized != plain  # the tiny model repeats itself; penalties change that
    assert chat(client, top_p=0.5, extra_body={"top_k": 3, "min_p": 0.1, "repetition_penalty": 1.3},
                max_tokens=4, temperature=0.7).choices[0].finish_reason in ("stop", "length")


def test_unknown_fields_are_ignored_and_bad_values_refused(client):
    r = chat(client, max_tokens=3, extra_body={"frobnicate": {"x": 1}, "service_tier": "flex"}, user="me")
    assert r.choices[0].finish_reason == "length"
    for bad, param in [({"temperature": 3}, "temperature"), ({"temperature": "hot"}, "temperature"),
                       ({"max_tokens": 0}, "max_tokens"), ({"n": 0}, "n"), ({"top_p": 0}, "top_p"),
                       ({"reasoning_effort": "extreme"}, "reasoning_effort"), ({"seed": 1.5}, "seed"),
                       ({"stream": "yes"}, "stream"), ({"logit_bias": {"x": 1}}, "logit_bias")]:
        with pytest.raises(openai.BadRequestError) as e:
            chat(client, **{"max_tokens": 3, **bad}) if "logit_bias" not in bad else chat(client, max_tokens=3, **bad)
        assert e.value.body["type"] == "invalid_request_error" and e.value.body["param"] == param, bad


def test_images_and_audio_are_refused_explicitly(client):
    image = [{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                          {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}]}]
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, messages=image, max_tokens=3)
    assert "images are not supported" in e.value.message and e.value.body["param"] == "messages[0].content[1]"
    audio = [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "AA==", "format": "wav"}}]}]
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, messages=audio, max_tokens=3)
    assert "audio is not supported" in e.value.message
    # text parts are fine
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]}]
    assert chat(client, messages=parts, max_tokens=2).choices[0].finish_reason == "length"


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}},
         {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
CALLS = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
         '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')


def test_tool_calls_parsed_streamed_and_round_tripped(client, srv):
    SCRIPTS[9001] = "Let me check.\n" + CALLS
    r = chat(client, tools=TOOLS, seed=9001, max_tokens=200)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content == "Let me check.\n"
    calls = [(t.function.name, json.loads(t.function.arguments)) for t in c.message.tool_calls]
    assert calls == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    content, _, streamed_calls, finish, _ = streamed(client, tools=TOOLS, seed=9001, max_tokens=200)
    assert finish[0] == "tool_calls" and content[0] == "Let me check.\n"
    assert [(v["name"], json.loads(v["arguments"])) for _, v in sorted(streamed_calls.items())] == calls
    assert all(v["id"].startswith("call_") for v in streamed_calls.values())
    # the results go back as tool messages, rendered with the template
    followup = USER + [c.message.model_dump(exclude_none=True)] + [
        {"role": "tool", "tool_call_id": t.id, "content": "sunny"} for t in c.message.tool_calls]
    r2 = chat(client, messages=followup, tools=TOOLS, max_tokens=3, temperature=0)
    assert r2.choices[0].finish_reason in ("stop", "length")
    prompt = srv.tokenizer.apply_chat_template(followup, tools=TOOLS)
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in prompt and "<tool_response>\nsunny" in prompt


def test_one_call_when_parallel_calls_are_off(client):
    SCRIPTS[9002] = CALLS + "\nand some trailing words"
    r = chat(client, tools=TOOLS, seed=9002, max_tokens=200, parallel_tool_calls=False)
    assert [t.function.name for t in r.choices[0].message.tool_calls] == ["get_weather"]
    assert r.choices[0].finish_reason == "tool_calls" and r.usage.completion_tokens < 40


def test_tool_choice_modes(client, srv):
    SCRIPTS[9003] = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    r = chat(client, tools=TOOLS, seed=9003, max_tokens=100,
             tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert [(t.function.name, t.function.arguments) for t in r.choices[0].message.tool_calls] == [
        ("get_weather", '{"city": "Oslo"}')]
    SCRIPTS[9004] = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    r = chat(client, tools=TOOLS, seed=9004, max_tokens=100, tool_choice="required")
    assert r.choices[0].message.tool_calls[0].function.name == "get_time"
    SCRIPTS[9005] = CALLS
    r = chat(client, tools=TOOLS, seed=9005, max_tokens=200, tool_choice="none")
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content == CALLS
    with pytest.raises(openai.BadRequestError):
        chat(client, tools=TOOLS, max_tokens=2, tool_choice={"type": "function", "function": {"name": "nope"}})
    with pytest.raises(openai.BadRequestError):
        chat(client, max_tokens=2, tool_choice="required")


def test_a_model_that_would_write_a_malformed_call_is_kept_to_the_grammar(client):
    # the Hermes tool-call syntax has a grammar (coli.grammar): a call cannot be malformed, the
    # scripted "model" is held to it (the parser's salvage of malformed calls is unit-tested for
    # formats without a grammar in test_server_chat_format.py)
    bad = 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par\n</tool_call>'
    SCRIPTS[9006] = bad
    r = chat(client, tools=TOOLS, seed=9006, max_tokens=60)
    assert r.choices[0].finish_reason in ("tool_calls", "length")  # never malformed_tool_call
    assert r.choices[0].message.content.startswith("Sure.")
    for t in r.choices[0].message.tool_calls or []:
        assert isinstance(json.loads(t.function.arguments)["city"], str)


def test_thinking_goes_to_reasoning_content(client, srv):
    SCRIPTS[9007] = "<think>\nThe user asks about weather.\n</think>\n\nIt is sunny."
    r = chat(client, seed=9007, max_tokens=100, reasoning_effort="high")
    m = r.choices[0].message
    assert m.content == "It is sunny."
    assert m.model_extra["reasoning_content"] == m.model_extra["reasoning"] == "The user asks about weather."
    content, reasoning, _, _, _ = streamed(client, seed=9007, max_tokens=100, extra_body={"enable_thinking": True})
    assert content[0] == "It is sunny." and reasoning[0] == "The user asks about weather."
    # enable_thinking: false renders the template's empty think block into the prompt
    off = srv.tokenizer.apply_chat_template(USER, enable_thinking=False)
    assert off.endswith("<think>\n\n</think>\n\n")
    _, _, p_off = http(srv, "POST", "/tokenize", {"messages": USER, "enable_thinking": False})
    assert p_off["tokens"] == srv.tokenizer.encode(off, add_special_tokens=False)


def test_a_trailing_assistant_message_is_continued(client, srv):
    SCRIPTS[9008] = " Paris."
    convo = [{"role": "user", "content": "What is the capital of France?"},
             {"role": "assistant", "content": "The capital of France is"}]
    r = chat(client, messages=convo, seed=9008, max_tokens=20)
    assert r.choices[0].message.content == " Paris."
    expected = srv.tokenizer.apply_chat_template(convo, add_generation_prompt=False, continue_final_message=True)
    assert r.usage.prompt_tokens == len(srv.tokenizer.encode(expected, add_special_tokens=False))
    assert expected.endswith("The capital of France is")
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, messages=[*convo[:1], {"role": "assistant", "content": "It is "}], max_tokens=2)
    assert "whitespace" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, messages=convo, tools=TOOLS, max_tokens=2)
    assert "tools" in e.value.message


def test_continuation_switch_restores_a_fresh_turn(srv, monkeypatch):
    from dataclasses import replace

    monkeypatch.setattr(srv.server, "config", replace(srv.server.config, continue_assistant=False))
    convo = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    r = srv.openai().chat.completions.create(model="tiny", messages=convo, max_tokens=1)
    fresh = srv.tokenizer.apply_chat_template(convo, add_generation_prompt=True)
    assert r.usage.prompt_tokens == len(srv.tokenizer.encode(fresh, add_special_tokens=False))


def test_leading_stop_is_ignored_when_asked(client):
    SCRIPTS[9009] = "\nEND\nThe answer.END more"
    r = chat(client, seed=9009, max_tokens=40, stop=["END"], extra_body={"x_colibri_ignore_leading_stop": True})
    assert r.choices[0].message.content == "\n\nThe answer." and r.choices[0].finish_reason == "stop"
    strict = chat(client, seed=9009, max_tokens=40, stop=["END"])
    assert strict.choices[0].message.content == "\n"


def test_implicit_role_marker_stops(client, srv):
    # a model that starts a new turn ends at the marker, except where the marker leads the answer
    assert srv.tokenizer.token_to_id("<|im_start|>") in srv.tokenizer.special_token_ids  # a stop token id
    SCRIPTS[9010] = "Done.<|im_start|>user\nmore"
    r = chat(client, seed=9010, max_tokens=40)
    assert r.choices[0].message.content == "Done." and r.choices[0].finish_reason == "stop"
    SCRIPTS[9011] = "<|im_start|>Answer."
    r = chat(client, seed=9011, max_tokens=40)
    assert r.choices[0].message.content == "Answer."
    # client stops replace the implicit ones
    r = chat(client, seed=9010, max_tokens=40, stop=["never"])
    assert r.choices[0].message.content == "Done.user\nmore"


def test_legacy_completions(client, srv):
    r = client.completions.create(model="tiny", prompt="The capital of France is", max_tokens=6, temperature=0,
                                  logprobs=2, echo=True)
    c = r.choices[0]
    assert c.text.startswith("The capital of France is") and c.finish_reason == "length"
    assert len(c.logprobs.tokens) == 6 and all(len(t) == 2 for t in c.logprobs.top_logprobs)
    batch = client.completions.create(model="tiny", prompt=["one", "two three"], max_tokens=3, temperature=0, n=2)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert batch.choices[0].text == batch.choices[1].text  # greedy: n copies agree
    plain = client.completions.create(model="tiny", prompt="one", max_tokens=3, temperature=0)
    assert plain.choices[0].text == batch.choices[0].text
    s = list(client.completions.create(model="tiny", prompt="one", max_tokens=3, temperature=0, stream=True))
    assert "".join(ch.choices[0].text for ch in s if ch.choices) == plain.choices[0].text
    ids = srv.tokenizer.encode("one")
    assert client.completions.create(model="tiny", prompt=ids, max_tokens=3, temperature=0).choices[0].text == \
        plain.choices[0].text


def test_tokenize_and_detokenize(client, srv):
    _, _, t = http(srv, "POST", "/tokenize", {"prompt": "Hello there"})
    assert t["tokens"] == srv.tokenizer.encode("Hello there") and t["count"] == len(t["tokens"])
    _, _, d = http(srv, "POST", "/detokenize", {"tokens": t["tokens"]})
    assert d["prompt"] == "Hello there"


def test_a_family_without_tool_calling_gets_the_generic_tool_format(srv, monkeypatch):
    from coli.chat_format import FORMATS

    monkeypatch.setattr(srv.server, "chat_format", FORMATS["chatml"])  # e.g. a ChatML template without tools
    client = srv.openai()
    bounded = [{"type": "function", "function": {"name": "pick", "parameters": {
        "type": "object", "properties": {"color": {"enum": ["red", "blue"]}}, "required": ["color"],
        "additionalProperties": False}}}]
    r = chat(client, tools=bounded, max_tokens=60, tool_choice="required", temperature=1.0, seed=5,
             parallel_tool_calls=False)
    (call,) = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "pick"
    assert json.loads(call.function.arguments)["color"] in ("red", "blue")
    # declared but switched off: not active, so accepted (and not rendered)
    assert chat(client, tools=TOOLS, tool_choice="none", max_tokens=2).choices[0].finish_reason in ("stop", "length")
    m = srv.anthropic().messages.create(model="tiny", max_tokens=60, messages=USER, tool_choice={"type": "any"},
                                        tools=[{"name": "f", "input_schema": {"type": "object", "properties": {
                                            "n": {"type": "integer", "minimum": 0, "maximum": 9}},
                                            "required": ["n"], "additionalProperties": False}}])
    assert m.stop_reason == "tool_use" and m.content[-1].name == "f" and 0 <= m.content[-1].input["n"] <= 9


