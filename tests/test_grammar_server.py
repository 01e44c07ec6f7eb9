"""Structured outputs and constrained tool calls over real HTTP with the official clients.

The tiny random chat model (server_kit) writes noise by itself: every answer that
validates here does so because of the constraint. Schemas are bounded so that a random
model finishes well within max_tokens. The built-in model's plain ChatML template has no
tool calling: it gets the generic tool format.
"""
from __future__ import annotations

import json
from pathlib import Path

import anthropic
import jsonschema
import openai
import pytest
from pydantic import BaseModel, ConfigDict
from typing import Literal

import coli
from coli.api import DEFAULT_MODEL_DIR
from server_kit import Running, chat_model_dir, http, running  # noqa: F401 (fixtures)

USER = [{"role": "user", "content": "Give me the weather as JSON."}]
WEATHER = {"type": "object", "properties": {
    "city": {"enum": ["Paris", "Tokyo"]},
    "temps": {"type": "array", "items": {"type": "integer", "minimum": -20, "maximum": 40}, "minItems": 1,
              "maxItems": 3},
    "sunny": {"type": "boolean"}}, "required": ["city", "temps", "sunny"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "strict": True, "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Tokyo"]}, "days": {
        "type": "integer", "minimum": 1, "maximum": 7}}, "required": ["city", "days"], "additionalProperties": False}}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
             "additionalProperties": False}}}]


@pytest.fixture(scope="module")
def srv(chat_model_dir):
    yield from running(chat_model_dir, kv_slots=4, max_queue=8, ctx=1024)


@pytest.fixture(scope="module")
def client(srv):
    return srv.openai()


def chat(client, **kw):
    kw.setdefault("model", "tiny")
    kw.setdefault("messages", USER)
    kw.setdefault("max_tokens", 120)
    return client.chat.completions.create(**kw)


def json_schema(schema, strict=True):
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": strict}}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_chat_json_schema_every_choice_validates(client, temperature):
    r = chat(client, response_format=json_schema(WEATHER), n=3, temperature=temperature, seed=4)
    for c in r.choices:
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.message.content), WEATHER)
    chunks = list(chat(client, response_format=json_schema(WEATHER), n=2, temperature=temperature, seed=4,
                       stream=True))
    texts = {}
    for ch in chunks:
        for c in ch.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
    assert [texts[0], texts[1]] == [c.message.content for c in r.choices[:2]]  # streaming changes nothing


def test_json_object_and_unconstrained_neighbours(client):
    import concurrent.futures as cf

    with cf.ThreadPoolExecutor(3) as pool:
        free = pool.submit(chat, client, max_tokens=20, temperature=0)
        obj = pool.submit(chat, client, response_format={"type": "json_object"}, max_tokens=300, temperature=0)
        schema = pool.submit(chat, client, response_format=json_schema(WEATHER), temperature=1.0, seed=9)
        r = obj.result()
        assert r.choices[0].finish_reason in ("stop", "length")
        if r.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(r.choices[0].message.content), dict)
        else:
            assert r.choices[0].message.content.startswith("{")
        jsonschema.validate(json.loads(schema.result().choices[0].message.content), WEATHER)
        assert free.result().choices[0].finish_reason in ("stop", "length")


class Weather(BaseModel):
    model_config = ConfigDict(extra="forbid")
    city: Literal["Paris", "Tokyo"]
    sunny: bool


def test_openai_parse_with_pydantic(client):
    r = client.chat.completions.parse(model="tiny", messages=USER, response_format=Weather, max_tokens=60,
                                      temperature=1.0, seed=3)
    assert isinstance(r.choices[0].message.parsed, Weather)


def test_strict_tools_and_forced_choices(client):
    r = chat(client, tools=TOOLS, tool_choice="required", temperature=1.0, seed=2, parallel_tool_calls=False)
    (call,) = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls"
    params = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    jsonschema.validate(json.loads(call.function.arguments), params[call.function.name])
    r = chat(client, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}},
             temperature=1.0, seed=5, parallel_tool_calls=False)
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_time"
    jsonschema.validate(json.loads(call.function.arguments), params["get_time"])
    # streamed: the same call, in tool-call deltas
    chunks = list(chat(client, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}},
                       temperature=1.0, seed=5, parallel_tool_calls=False, stream=True))
    args = "".join(tc.function.arguments or "" for ch in chunks for c in ch.choices for tc in c.delta.tool_calls or [])
    assert args == call.function.arguments


def test_legacy_completions_and_the_grammar_field(client, srv):
    r = client.completions.create(model="tiny", prompt="Weather:", max_tokens=120, temperature=1.0, seed=1,
                                  extra_body={"response_format": json_schema(WEATHER)})
    jsonschema.validate(json.loads(r.choices[0].text), WEATHER)
    r = client.completions.create(model="tiny", prompt="Phone:", max_tokens=20, temperature=1.0, seed=1,
                                  extra_body={"x_colibri_grammar": {"type": "regex", "grammar": r"\d{3}-\d{4}"}})
    text = r.choices[0].text
    assert len(text) == 8 and text[3] == "-" and r.choices[0].finish_reason == "stop"
    r = chat(client, temperature=1.0, seed=1, extra_body={"x_colibri_grammar": 'start: "yes" | "no"'})
    assert r.choices[0].message.content in ("yes", "no")
    gbnf = 'root ::= "a" [0-9] "z"'
    r = chat(client, temperature=1.0, seed=1, extra_body={"x_colibri_grammar": {"type": "gbnf", "grammar": gbnf}})
    c = r.choices[0].message.content
    assert len(c) == 3 and c[0] == "a" and c[1].isdigit() and c[2] == "z"


@pytest.mark.parametrize("body, param", [
    ({"response_format": json_schema({"type": "strin"})}, "response_format.json_schema.schema"),
    ({"response_format": json_schema({"type": "string", "pattern": "(("})}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"x_colibri_grammar": "start: nowhere"}, "x_colibri_grammar"),
    ({"x_colibri_grammar": {"type": "regex", "grammar": "(("}}, "x_colibri_grammar"),
    ({"x_colibri_grammar": {"type": "gbnf", "grammar": "root ::= ("}}, "x_colibri_grammar"),
    ({"x_colibri_grammar": {"type": "cfg", "grammar": "x"}}, "x_colibri_grammar"),
])
def test_bad_schemas_and_grammars_are_400s_naming_the_field(srv, body, param):
    for path, base in (("/v1/chat/completions", {"messages": USER}), ("/v1/completions", {"prompt": "x"})):
        status, _, out = http(srv, "POST", path, {"model": "tiny", "max_tokens": 5, **base, **body})
        assert status == 400 and out["error"]["param"] == param, (path, out)
        assert out["error"]["type"] == "invalid_request_error"


def test_a_grammar_that_cannot_complete_is_a_400_or_an_error_event(srv, client):
    dead = {"x_colibri_grammar": 'start: "a" B\nB: /b/ & /c/'}  # compiles; nothing can follow "a"
    status, _, out = http(srv, "POST", "/v1/chat/completions", {"model": "tiny", "messages": USER, "max_tokens": 5,
                                                                **dead})
    assert status == 400 and out["error"]["code"] == "grammar_dead_end", out
    status, _, text = http(srv, "POST", "/v1/chat/completions", {"model": "tiny", "messages": USER, "max_tokens": 5,
                                                                 "stream": True, **dead})
    assert status == 200 and "grammar_dead_end" in text and text.rstrip().endswith("data: [DONE]")  # in-band


def test_anthropic_forced_tool_and_output_format(srv):
    client = srv.anthropic()
    tools = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in TOOLS]
    for choice in ({"type": "any", "disable_parallel_tool_use": True}, {"type": "tool", "name": "get_weather"}):
        m = client.messages.create(model="tiny", max_tokens=120, messages=USER, tools=tools, tool_choice=choice,
                                   extra_body={"seed": 6, "temperature": 1.0})
        assert m.stop_reason == "tool_use"
        use = [b for b in m.content if b.type == "tool_use"][0]
        assert choice["type"] == "any" or use.name == "get_weather"
        jsonschema.validate(use.input, next(t["input_schema"] for t in tools if t["name"] == use.name))
    m = client.messages.create(model="tiny", max_tokens=120, messages=USER, extra_body={"seed": 7, "temperature": 1.0},
                               output_config={"format": {"type": "json_schema", "schema": WEATHER}})
    jsonschema.validate(json.loads(m.content[0].text), WEATHER)
    parsed = client.messages.parse(model="tiny", max_tokens=60, messages=USER, output_format=Weather,
                                   extra_body={"seed": 3, "temperature": 1.0})
    assert isinstance(parsed.parsed_output, Weather)
    status, _, out = http(srv, "POST", "/v1/messages", {"model": "tiny", "max_tokens": 5, "messages": USER,
                                                        "output_config": {"format": {"type": "json_schema",
                                                                                     "schema": {"type": "strin"}}}})
    assert status == 400 and out["type"] == "error" and "does not compile" in out["error"]["message"]


@pytest.fixture(scope="module")
def builtin():
    srv = Running(DEFAULT_MODEL_DIR, kv_slots=2, ctx=512)
    yield srv
    srv.close()


def test_a_template_without_tool_calling_answers_a_forced_call(builtin):
    assert builtin.server.chat_format.tools is None  # plain ChatML: no tool calling of its own
    client = builtin.openai()
    tools = TOOLS[1:]  # (the built-in model's context is 512 tokens)
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Time in Paris?"}],
                                       tools=tools, tool_choice="required", max_tokens=80, temperature=0,
                                       parallel_tool_calls=False)
    (call,) = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "get_time"
    jsonschema.validate(json.loads(call.function.arguments), tools[0]["function"]["parameters"])
    # the call goes back with its result: rendered in the generic format, and answered
    follow = [{"role": "user", "content": "Time in Paris?"}, r.choices[0].message.model_dump(exclude_none=True),
              {"role": "tool", "tool_call_id": call.id, "content": "noon"}]
    r2 = client.chat.completions.create(model="tiny", messages=follow, tools=tools, max_tokens=8, temperature=0)
    assert r2.choices[0].finish_reason in ("stop", "length", "tool_calls")
    m = builtin.anthropic().messages.create(
        model="tiny", max_tokens=80, messages=[{"role": "user", "content": "Time?"}], tool_choice={"type": "any"},
        tools=[{"name": "get_time", "input_schema": TOOLS[1]["function"]["parameters"]}])
    assert m.stop_reason == "tool_use" and m.content[-1].input["zone"] in ("UTC", "CET")


def coli_cli(*args, stdin="", tmp=None):
    import os
    import subprocess
    import sys

    env = {**os.environ, "COLI_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "coli.cli", *args, "--no-kv-persist"], input=stdin, env=env,
                          capture_output=True, text=True, timeout=120)


def test_cli_run_json_schema_and_grammar(tmp_path):
    schema = tmp_path / "s.json"
    schema.write_text(json.dumps(WEATHER))
    r = coli_cli("run", "--json-schema", str(schema), "--temperature", "1", "--seed", "3", "Weather?")
    assert r.returncode == 0, r.stderr
    jsonschema.validate(json.loads(r.stdout), WEATHER)  # stdout is exactly the document (| jq . works)
    r = coli_cli("run", "--json-schema", '{"enum": ["up", "down"]}', "Which way?")
    assert r.returncode == 0 and json.loads(r.stdout) in ("up", "down")
    gbnf = tmp_path / "yn.gbnf"
    gbnf.write_text('root ::= "yes" | "no"\n')
    r = coli_cli("chat", "--grammar", str(gbnf), stdin="Is it?\n")  # piped chat
    assert r.returncode == 0 and r.stdout.strip() in ("yes", "no"), r.stderr
    bad = tmp_path / "bad.lark"
    bad.write_text('start: "x" nowhere\n')
    for args in (["--grammar", str(bad)], ["--json-schema", '{"type": "strin"}'], ["--json-schema", "missing.json"],
                 ["--json-schema", "{oops"]):
        r = coli_cli("run", *args, "hi")
        assert r.returncode == 2 and "Traceback" not in r.stderr and r.stderr.count("\n") <= 3, r.stderr
        assert ("--grammar" if args[0] == "--grammar" else "--json-schema") in r.stderr


def test_a_strict_tool_schema_that_does_not_compile_is_a_400_a_lax_one_any_object(srv):
    broken = {"type": "object", "properties": {"x": {"type": "strin"}}}
    tool = {"type": "function", "function": {"name": "f", "parameters": broken, "strict": True}}
    status, _, out = http(srv, "POST", "/v1/chat/completions", {"model": "tiny", "messages": USER, "max_tokens": 5,
                                                                "tools": [tool], "tool_choice": "required"})
    assert status == 400 and out["error"]["param"] == "tools[0].function.parameters", out
    lax = {"type": "function", "function": {"name": "f", "parameters": broken}}
    status, _, out = http(srv, "POST", "/v1/chat/completions", {"model": "tiny", "messages": USER, "max_tokens": 30,
                                                                "tools": [lax], "tool_choice": "required",
                                                                "temperature": 1.0, "seed": 3})
    assert status == 200 and out["choices"][0]["finish_reason"] in ("tool_calls", "length"), out
