"""The requests real clients sent (recorded by tests/record_clients.py), replayed byte for
byte against the server: every one is answered 200, and the answer parses with the
official SDKs' types (anthropic for /v1/messages, openai for chat completions and the
Responses API), streamed or not. The server runs the agent test model (server_kit:
a 64k context whose tokenizer knows the recorded prompts) with a fixed scripted answer,
and a context of 16k, so Claude Code's max_tokens 32000 is clamped, not refused."""
from __future__ import annotations

import json
from pathlib import Path

import anthropic.types as A
import pytest
from openai.types import CompletionUsage  # noqa: F401 (the SDK's types, imported as the clients use them)
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter
from server_kit import SCRIPTS, ScriptedSampler, WAIT, build_agent_model, running  # noqa: F401

FIXTURES = sorted((Path(__file__).parent / "fixtures" / "clients").glob("*.json"))
ANSWER = "Hello from coli."
# the first answer of a recorded tool round trip: a call of one of the client's own tools
CALLS = {"claude_code_tools": ("Glob", {"pattern": "*.txt"}), "codex_tools": ("exec_command", {"cmd": "ls"})}


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    yield from running(build_agent_model(tmp_path_factory.getbasetemp()), default_script=ANSWER, ctx=16384,
                       kv_slots=2)


def replay(srv, req: dict) -> tuple[int, str, str]:
    import http.client
    from urllib.parse import urlsplit

    u = urlsplit(srv.url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=WAIT)
    headers = {k: v for k, v in req["headers"].items() if v != "REDACTED"}
    headers["Authorization"] = "Bearer local"
    conn.request(req["method"], req["path"], body=json.dumps(req["body"]).encode(), headers=headers)
    resp = conn.getresponse()
    text = resp.read().decode()
    conn.close()
    return resp.status, resp.getheader("Content-Type", ""), text


def sse_events(text: str) -> list[tuple[str | None, dict | str]]:
    out = []
    for frame in text.split("\n\n"):
        event, data = None, []
        for line in frame.splitlines():
            if line.startswith("event:"):
                event = line[6:].strip()
            elif line.startswith("data:"):
                data.append(line[5:].strip())
        if data:
            joined = "\n".join(data)
            out.append((event, joined if joined == "[DONE]" else json.loads(joined)))
    return out


def check_messages(body: dict, ctype: str, text: str) -> str:
    """The answer's text, after every event / the message validates as Anthropic's types."""
    if not body.get("stream"):
        m = A.Message.model_validate_json(text)
        return "".join(b.text for b in m.content if b.type == "text") + "".join(
            json.dumps(b.input) for b in m.content if b.type == "tool_use")
    assert ctype.startswith("text/event-stream")
    adapter = TypeAdapter(A.RawMessageStreamEvent)
    out = []
    for event, data in sse_events(text):
        if event == "ping":  # a keepalive while the prompt is read (the SDK skips them too)
            continue
        ev = adapter.validate_python(data)
        assert ev.type == event
        if ev.type == "content_block_delta":
            out.append(getattr(ev.delta, "text", None) or getattr(ev.delta, "partial_json", ""))
    assert [e for e, _ in sse_events(text)][-1] == "message_stop"
    return "".join(out)


def check_chat(body: dict, ctype: str, text: str) -> str:
    if not body.get("stream"):
        c = ChatCompletion.model_validate_json(text)
        return c.choices[0].message.content or ""
    events = sse_events(text)
    assert events[-1][1] == "[DONE]"
    chunks = [ChatCompletionChunk.model_validate(d) for _, d in events[:-1]]
    return "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)


def check_responses(body: dict, ctype: str, text: str) -> str:
    """The answer's text, or its function call's arguments."""
    if not body.get("stream"):
        r = Response.model_validate_json(text)
    else:
        adapter = TypeAdapter(ResponseStreamEvent)
        events = [adapter.validate_python(d) for _, d in sse_events(text)]
        assert events[0].type == "response.created" and events[-1].type == "response.completed"
        r = events[-1].response
    return r.output_text + "".join(i.arguments for i in r.output if i.type == "function_call")


CHECKS = {"/v1/messages": check_messages, "/v1/chat/completions": check_chat, "/v1/responses": check_responses}


@pytest.mark.parametrize("fixture", FIXTURES, ids=lambda p: p.stem)
def test_recorded_requests_replay(srv, fixture):
    record = json.loads(fixture.read_text())
    posts = [r for r in record["requests"] if r["method"] == "POST"]
    assert posts, f"{fixture.name} recorded no request"
    for req in posts:
        path = req["path"].split("?")[0]
        expected = ANSWER
        ScriptedSampler.default[:] = [ANSWER]
        if fixture.stem in CALLS and req is posts[0]:
            name, args = CALLS[fixture.stem]
            ScriptedSampler.default[:] = [f'<tool_call>\n{json.dumps({"name": name, "arguments": args})}\n</tool_call>',
                                          ANSWER]
            expected = json.dumps(args)
        status, ctype, text = replay(srv, req)
        assert status == 200, (fixture.name, req["path"], text[:500])
        answer = CHECKS[path](req["body"], ctype, text)
        assert answer.replace(" ", "") == expected.replace(" ", ""), (fixture.name, answer)
