"""/v1/messages through the official `anthropic` client over a real TCP listener: the event
sequence, thinking and tool_use blocks (scripted answers, see server_kit), stop_sequences
and top_k, count_tokens, continuation, pings during a long prefill, the error envelope."""
from __future__ import annotations

import http.client as httplib
import json
import threading
from urllib.parse import urlsplit

import anthropic
import pytest
from server_kit import SCRIPTS, WAIT, chat_model_dir, http, running  # noqa: F401 (fixtures)

USER = [{"role": "user", "content": "What is the weather in Paris?"}]
# (this SDK version takes temperature, top_p and top_k only through extra_body; the API still reads them)
TOOLS = [{"name": "get_weather", "description": "Weather of a city",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]


@pytest.fixture(scope="module")
def srv(chat_model_dir):
    yield from running(chat_model_dir, kv_slots=2, ctx=512, config={"keepalive": 0.05})


@pytest.fixture(scope="module")
def client(srv):
    return srv.anthropic()


def create(client, **kw):
    kw.setdefault("model", "tiny")
    kw.setdefault("max_tokens", 16)
    kw.setdefault("messages", USER)
    return client.messages.create(**kw)


def events(client, **kw):
    kw.setdefault("model", "tiny")
    kw.setdefault("max_tokens", 16)
    kw.setdefault("messages", USER)
    with client.messages.stream(**kw) as s:
        evs = list(s)
        final = s.get_final_message()
    return evs, final


def test_plain_message_and_usage(client, srv):
    m = create(client, system="You are terse.", extra_body={"temperature": 0})
    assert m.type == "message" and m.role == "assistant" and m.model == "tiny"
    assert m.stop_reason in ("end_turn", "max_tokens")
    assert [b.type for b in m.content] == ["text"]
    expected = srv.tokenizer.apply_chat_template([{"role": "system", "content": "You are terse."}, *USER],
                                                 enable_thinking=False)
    total_in = m.usage.input_tokens + m.usage.cache_read_input_tokens
    assert total_in == len(srv.tokenizer.encode(expected, add_special_tokens=False))
    again = create(client, system="You are terse.", extra_body={"temperature": 0})
    assert again.usage.cache_read_input_tokens > 0 and again.content[0].text == m.content[0].text


def test_stream_event_sequence(client):
    SCRIPTS[8001] = "<think>\nWeather question.\n</think>\n\nIt is sunny."
    evs, final = events(client, max_tokens=100, metadata={"user_id": "u"}, extra_body={"seed": 8001},
                        thinking={"type": "enabled", "budget_tokens": 1024})
    kinds = [e.type for e in evs if e.type not in ("ping", "text", "thinking", "signature", "input_json")]
    runs = [k for i, k in enumerate(kinds) if i == 0 or kinds[i - 1] != k]  # collapse runs of deltas
    assert runs == ["message_start", "content_block_start", "content_block_delta", "content_block_stop",
                    "content_block_start", "content_block_delta", "content_block_stop", "message_delta",
                    "message_stop"]
    assert [b.type for b in final.content] == ["thinking", "text"]
    assert final.content[0].thinking == "Weather question." and final.content[1].text == "It is sunny."
    assert final.stop_reason == "end_turn"
    blocks = [e.index for e in evs if e.type == "content_block_start"]
    assert blocks == [0, 1]


def test_tool_use_round_trip(client, srv):
    SCRIPTS[8002] = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    m = create(client, tools=TOOLS, max_tokens=100, extra_body={"seed": 8002})
    assert m.stop_reason == "tool_use"
    (use,) = [b for b in m.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.input == {"city": "Paris"} and use.id.startswith("toolu_")
    evs, final = events(client, tools=TOOLS, max_tokens=100, extra_body={"seed": 8002})
    assert [b.type for b in final.content] == ["tool_use"] and final.content[0].input == {"city": "Paris"}
    assert any(e.type == "content_block_delta" and e.delta.type == "input_json_delta" for e in evs)
    # the result goes back as a tool_result block
    followup = USER + [{"role": "assistant", "content": [b.model_dump() for b in m.content]},
                       {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                     "content": "18 degrees"}, {"type": "text", "text": "Thanks"}]}]
    SCRIPTS[8003] = "It is 18 degrees in Paris."
    r = create(client, messages=followup, tools=TOOLS, max_tokens=100, extra_body={"seed": 8003})
    assert r.content[0].text == "It is 18 degrees in Paris." and r.stop_reason == "end_turn"
    n = client.messages.count_tokens(model="tiny", messages=followup, tools=TOOLS).input_tokens
    assert n == r.usage.input_tokens + r.usage.cache_read_input_tokens


def test_tool_choice_any_and_named(client):
    SCRIPTS[8004] = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
    m = create(client, tools=TOOLS, tool_choice={"type": "any"}, max_tokens=100, extra_body={"seed": 8004})
    assert m.stop_reason == "tool_use" and m.content[-1].input == {"city": "Rome"}
    SCRIPTS[8005] = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lima"}}\n</tool_call>'
    m = create(client, tools=TOOLS, tool_choice={"type": "tool", "name": "get_weather"}, max_tokens=100,
               extra_body={"seed": 8005})
    assert m.content[-1].input == {"city": "Lima"}
    SCRIPTS[8006] = "No tools today."
    m = create(client, tools=TOOLS, tool_choice={"type": "none"}, max_tokens=100, extra_body={"seed": 8006})
    assert m.content[0].text == "No tools today."


def test_stop_sequences_and_top_k(client):
    SCRIPTS[8007] = "one two three four"
    m = create(client, stop_sequences=["three"], max_tokens=50, extra_body={"seed": 8007, "top_k": 5})
    assert m.content[0].text == "one two " and m.stop_reason == "stop_sequence" and m.stop_sequence == "three"
    evs, final = events(client, stop_sequences=["three"], max_tokens=50, extra_body={"seed": 8007})
    delta = [e for e in evs if e.type == "message_delta"][0]
    assert delta.delta.stop_reason == "stop_sequence" and delta.delta.stop_sequence == "three"
    m = create(client, max_tokens=3, extra_body={"top_k": 1, "temperature": 1.0})
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 3


def test_trailing_assistant_turn_is_continued(client):
    SCRIPTS[8008] = " Paris."
    convo = [{"role": "user", "content": "Capital of France?"}, {"role": "assistant", "content": "It is"}]
    m = create(client, messages=convo, max_tokens=20, extra_body={"seed": 8008})
    assert m.content[0].text == " Paris."


def test_non_text_blocks_and_bad_fields_use_the_anthropic_envelope(client, srv):
    image = [{"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                       "data": "AA=="}}]}]
    with pytest.raises(anthropic.BadRequestError) as e:
        create(client, messages=image)
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    assert "images are not supported" in e.value.body["error"]["message"]
    status, _, body = http(srv, "POST", "/v1/messages", {"model": "tiny", "messages": USER})
    assert status == 400 and body["error"]["message"] == "max_tokens: required"
    status, _, body = http(srv, "POST", "/v1/messages", {"model": "tiny", "max_tokens": 2, "messages": USER,
                                                         "temperature": 1.5})
    assert status == 400 and body["type"] == "error"
    with pytest.raises(anthropic.NotFoundError):
        create(client, model="claude-sonnet")


def test_pings_during_a_long_prefill(srv, monkeypatch):
    """The engine is held at its first step (a stand-in for a long prefill): the stream
    carries ping events until the first content arrives. (Raw HTTP: the SDK hides pings.)"""
    gate = threading.Event()
    real = srv.runner.engine.step

    def held(entries, **kw):
        gate.wait(WAIT)
        return real(entries, **kw)

    monkeypatch.setattr(srv.runner.engine, "step", held)
    u = urlsplit(srv.url)
    conn = httplib.HTTPConnection(u.hostname, u.port, timeout=WAIT)
    conn.request("POST", "/v1/messages", json.dumps({"model": "tiny", "max_tokens": 4, "stream": True,
                                                     "messages": USER}), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    seen = []
    try:
        for line in resp:
            if line.startswith(b"event: "):
                seen.append(line[7:].strip().decode())
                if seen.count("ping") == 2:
                    gate.set()
    finally:
        gate.set()
        conn.close()
    first_content = seen.index("content_block_start")
    assert seen[0] == "message_start" and seen[1:3] == ["ping", "ping"] and first_content >= 3
    assert seen[-1] == "message_stop"


def test_raw_stream_frames_name_their_events(srv):
    status, headers, text = http(srv, "POST", "/v1/messages", {"model": "tiny", "max_tokens": 3, "stream": True,
                                                               "messages": USER})
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    assert "x-colibri-queue-wait-ms" in headers
    frames = [f for f in text.split("\n\n") if f.strip()]
    for f in frames:
        event, data = f.split("\n", 1)
        assert event.startswith("event: ") and data.startswith("data: ")
        assert json.loads(data[6:])["type"] == event[7:]


def test_what_claude_code_sends(srv):
    """Claude Code 2.x: ?beta=true, anthropic-beta, a system message inside messages,
    cache_control, context_management, metadata, thinking adaptive, output_config.effort,
    and max_tokens far above the context (clamped: answered, ending at the context)."""
    system = [{"type": "text", "text": "You are a coding agent.", "cache_control": {"type": "ephemeral"}}]
    convo = [{"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}]},
             {"role": "system", "content": "The user is in /tmp."}]
    body = {"model": "tiny", "max_tokens": 32000, "system": system, "messages": convo, "metadata": {"user_id": "u"},
            "tools": [{**TOOLS[0], "cache_control": {"type": "ephemeral"}}], "thinking": {"type": "adaptive"},
            "output_config": {"effort": "high"}, "context_management": {"edits": [{"type": "clear_thinking_20251015",
                                                                                  "keep": "all"}]}}
    headers = {"anthropic-beta": "claude-code-20250219,mid-conversation-system-2026-04-07,effort-2025-11-24",
               "anthropic-version": "2023-06-01"}
    status, _, counted = http(srv, "POST", "/v1/messages/count_tokens?beta=true", body, headers)
    assert status == 200
    chat = [{"role": "system", "content": "You are a coding agent."}, {"role": "user", "content": "hi"},
            {"role": "system", "content": "The user is in /tmp."}]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": TOOLS[0]["input_schema"],
                                               "description": TOOLS[0]["description"]}}]
    thinking = srv.tokenizer.apply_chat_template(chat, tools=tools, enable_thinking=True)
    assert "<|im_start|>system\nThe user is in /tmp.<|im_end|>" in thinking  # in place, as a system turn
    assert counted["input_tokens"] == len(srv.tokenizer.encode(thinking, add_special_tokens=False))
    SCRIPTS[8020] = "Hi."
    status, _, m = http(srv, "POST", "/v1/messages?beta=true", {**body, "seed": 8020}, headers)
    assert status == 200 and m["content"][-1]["text"] == "Hi." and m["stop_reason"] == "end_turn"
    assert m["usage"]["input_tokens"] + m["usage"]["cache_read_input_tokens"] == counted["input_tokens"]
    # thinking disabled (and effort none) turn the switch off: the template's empty think block
    off = srv.tokenizer.apply_chat_template(chat, tools=tools, enable_thinking=False)
    for switch in ({"thinking": {"type": "disabled"}}, {"thinking": None, "output_config": {"effort": "none"}}):
        status, _, n = http(srv, "POST", "/v1/messages/count_tokens", {**body, **switch})
        assert status == 200 and n["input_tokens"] == len(srv.tokenizer.encode(off, add_special_tokens=False))
    status, _, err = http(srv, "POST", "/v1/messages", {**body, "output_config": {"effort": "extreme"}})
    assert status == 400 and "output_config.effort" in err["error"]["message"]
    # a long answer stops at the context, not at a refusal
    status, _, m = http(srv, "POST", "/v1/messages", {**body, "tools": None, "temperature": 1.0,
                                                      "thinking": {"type": "disabled"}})
    assert status == 200 and m["stop_reason"] in ("max_tokens", "end_turn")


def test_system_messages_fold_into_the_system_prompt():
    from coli.server.anthropic import fold_system

    msgs = [{"role": "system", "content": "A"}, {"role": "user", "content": "hi"},
            {"role": "system", "content": "B"}, {"role": "assistant", "content": "yo"}]
    assert fold_system(msgs) == [{"role": "system", "content": "A\n\nB"}, {"role": "user", "content": "hi"},
                                 {"role": "assistant", "content": "yo"}]


# a ChatML template without tool calling that renders only a leading system message
PLAIN = ("{%- for m in messages %}{%- if m.role != 'system' or loop.first %}"
         "{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
         "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}")


@pytest.fixture(scope="module")
def plain(chat_model_dir, tmp_path_factory):
    import shutil

    out = tmp_path_factory.mktemp("plain") / "model"
    shutil.copytree(chat_model_dir, out)
    config = json.loads((out / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": PLAIN}))
    yield from running(out, kv_slots=1, ctx=512)


def test_a_template_that_drops_system_turns_gets_them_folded(plain):
    convo = [{"role": "user", "content": "hi"}, {"role": "system", "content": "The user is in /tmp."}]
    status, _, n = http(plain, "POST", "/v1/messages/count_tokens", {"model": "tiny", "system": "Be brief.",
                                                                     "messages": convo})
    folded = plain.tokenizer.apply_chat_template([{"role": "system", "content": "Be brief.\n\nThe user is in /tmp."},
                                                  {"role": "user", "content": "hi"}])
    assert status == 200 and n["input_tokens"] == len(plain.tokenizer.encode(folded, add_special_tokens=False))


def test_count_tokens_counts_tools_on_a_template_without_tool_calling(plain):
    """The tools count as rendered: in the generic tool format (coli.grammar.tools) on a
    template without tool calling, so the count is what a real request's prompt holds."""
    body = {"model": "tiny", "messages": USER}
    _, _, bare = http(plain, "POST", "/v1/messages/count_tokens", body)
    status, _, with_tools = http(plain, "POST", "/v1/messages/count_tokens", {**body, "tools": TOOLS})
    tools_json = len(plain.tokenizer.encode(json.dumps(TOOLS[0]["input_schema"]), add_special_tokens=False))
    assert status == 200 and with_tools["input_tokens"] > bare["input_tokens"] + tools_json
    status, _, reply = http(plain, "POST", "/v1/messages", {**body, "tools": TOOLS, "max_tokens": 1})
    assert status == 200 and reply["usage"]["input_tokens"] == with_tools["input_tokens"]
