"""/v1/responses through the official `openai` client over a real TCP listener: plain and
item input, the streamed event sequence the SDK accumulates, reasoning and function-call
items (scripted answers, see server_kit), a tool round trip by items and by
previous_response_id (with the previous turn's KV reused), the stored responses
(GET, DELETE, input_items, cancel), max_output_tokens, and refusals."""
from __future__ import annotations

import json

import openai
import pytest
from pydantic import BaseModel
from server_kit import SCRIPTS, chat_model_dir, http, running  # noqa: F401 (fixtures)

from coli.server.responses import Store, Stored

TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather of a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture(scope="module")
def srv(chat_model_dir):
    yield from running(chat_model_dir, kv_slots=2, ctx=512)


@pytest.fixture(scope="module")
def client(srv):
    return srv.openai()


def test_string_input_and_usage(client, srv):
    SCRIPTS[9001] = "Sunny in Paris."
    r = client.responses.create(model="tiny", input="Weather in Paris?", instructions="Be terse.",
                                extra_body={"seed": 9001}, reasoning={"effort": "none"})
    assert r.object == "response" and r.status == "completed" and r.model == "tiny"
    assert r.output_text == "Sunny in Paris."
    assert [i.type for i in r.output] == ["message"] and r.output[0].content[0].type == "output_text"
    expected = srv.tokenizer.apply_chat_template([{"role": "system", "content": "Be terse."},
                                                  {"role": "user", "content": "Weather in Paris?"}],
                                                 enable_thinking=False)
    assert r.usage.input_tokens == len(srv.tokenizer.encode(expected, add_special_tokens=False))
    assert r.usage.output_tokens > 0 and r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.instructions == "Be terse." and r.store is True


def test_stream_event_sequence(client):
    SCRIPTS[9002] = "<think>\nA weather question.\n</think>\n\nIt is sunny."
    with client.responses.stream(model="tiny", input="Weather?", extra_body={"seed": 9002}) as s:
        evs = list(s)
        final = s.get_final_response()
    kinds = [e.type for e in evs]
    runs = [k for i, k in enumerate(kinds) if i == 0 or kinds[i - 1] != k]
    assert runs == ["response.created", "response.in_progress",
                    "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
                    "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
                    "response.output_item.added", "response.content_part.added", "response.output_text.delta",
                    "response.output_text.done", "response.content_part.done", "response.output_item.done",
                    "response.completed"]
    assert [e.sequence_number for e in evs] == list(range(len(evs)))
    assert [i.type for i in final.output] == ["reasoning", "message"]
    assert final.output[0].content[0].text == "A weather question." and final.output_text == "It is sunny."
    done = [e for e in evs if e.type == "response.output_text.done"][0]
    assert done.text == "It is sunny."
    assert final.usage.output_tokens_details.reasoning_tokens > 0


def test_tool_round_trip_by_items_and_by_previous_response(client, srv):
    SCRIPTS[9003] = CALL
    r = client.responses.create(model="tiny", input="Weather in Paris?", tools=TOOLS, extra_body={"seed": 9003})
    (call,) = [i for i in r.output if i.type == "function_call"]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    assert call.call_id and call.id.startswith("fc_") and call.status == "completed"
    # streamed: the arguments arrive as deltas, the done event carries them whole
    with client.responses.stream(model="tiny", input="Weather in Paris?", tools=TOOLS,
                                 extra_body={"seed": 9003}) as s:
        evs = list(s)
        final = s.get_final_response()
    assert any(e.type == "response.function_call_arguments.delta" for e in evs)
    (done,) = [e for e in evs if e.type == "response.function_call_arguments.done"]
    assert json.loads(done.arguments) == {"city": "Paris"} and final.output[-1].type == "function_call"
    # the result as items (what Codex sends: the whole history, store false)
    SCRIPTS[9004] = "It is 18 degrees."
    items = [{"role": "user", "content": "Weather in Paris?"},
             {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
             {"type": "function_call_output", "call_id": call.call_id, "output": "18 degrees"}]
    by_items = client.responses.create(model="tiny", input=items, tools=TOOLS, store=False, extra_body={"seed": 9004})
    assert by_items.output_text == "It is 18 degrees." and by_items.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(by_items.id)
    # the same by previous_response_id: the same prompt, and the stored turn's KV reused
    by_id = client.responses.create(model="tiny", previous_response_id=r.id, tools=TOOLS, extra_body={"seed": 9004},
                                    input=[{"type": "function_call_output", "call_id": call.call_id,
                                            "output": "18 degrees"}])
    assert by_id.output_text == "It is 18 degrees." and by_id.previous_response_id == r.id
    assert by_id.usage.input_tokens == by_items.usage.input_tokens
    assert by_id.usage.input_tokens_details.cached_tokens >= r.usage.input_tokens


def test_codex_tools_namespace_and_web_search(client):
    """Codex groups tools in a namespace and always sends web_search: the namespace's
    functions are offered (a call names its namespace), web search is not offered."""
    SCRIPTS[9007] = CALL
    tools = [{"type": "namespace", "name": "weather", "description": "Weather tools", "tools": TOOLS},
             {"type": "web_search", "external_web_access": False}]
    r = client.responses.create(model="tiny", input="Weather in Paris?", tools=tools, extra_body={"seed": 9007})
    (call,) = [i for i in r.output if i.type == "function_call"]
    assert call.name == "get_weather" and call.to_dict()["namespace"] == "weather"
    assert r.usage.input_tokens > client.responses.create(model="tiny", input="Weather in Paris?", tools=[
        {"type": "web_search"}], extra_body={"seed": 9007}).usage.input_tokens


def test_parse_with_a_pydantic_function_tool(client):
    class GetWeather(BaseModel):
        city: str

    SCRIPTS[9005] = '<tool_call>\n{"name": "GetWeather", "arguments": {"city": "Lima"}}\n</tool_call>'
    r = client.responses.parse(model="tiny", input="Weather in Lima?",
                               tools=[openai.pydantic_function_tool(GetWeather)],
                               extra_body={"seed": 9005})
    (call,) = [i for i in r.output if i.type == "function_call"]
    assert isinstance(call.parsed_arguments, GetWeather) and call.parsed_arguments.city == "Lima"


def test_stored_responses(client, srv):
    SCRIPTS[9006] = "Stored."
    r = client.responses.create(model="tiny", input=[{"role": "user", "content": [
        {"type": "input_text", "text": "one"}]}, {"role": "user", "content": "two"}], extra_body={"seed": 9006})
    got = client.responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == "Stored." and got.status == "completed"
    page = client.responses.input_items.list(r.id, order="asc")
    assert [i.content[0].text for i in page.data] == ["one", "two"]
    assert [i.content[0].text for i in client.responses.input_items.list(r.id).data] == ["two", "one"]
    status, _, body = http(srv, "POST", f"/v1/responses/{r.id}/cancel")
    assert status == 400 and body["error"]["code"] == "response_not_running"
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="tiny", input="again", previous_response_id=r.id)
    assert e.value.code == "previous_response_not_found"


def test_store_is_a_bounded_lru():
    store = Store(limit=2)
    for rid in ("a", "b"):
        store.put(rid, Stored({"id": rid}, [], []))
    store.get("a")  # now "b" is the least recently used
    store.put("c", Stored({"id": "c"}, [], []))
    assert store.get("a").response["id"] == "a" and store.get("c").response["id"] == "c"
    with pytest.raises(Exception, match="no response"):
        store.get("b")


def test_max_output_tokens_is_incomplete(client):
    SCRIPTS[9010] = "One, two, three, four, five, six, seven, eight, nine, ten."  # longer than 3 tokens
    r = client.responses.create(model="tiny", input="Count to ten.", max_output_tokens=3, extra_body={"seed": 9010},
                                reasoning={"effort": "none"})
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3


def test_text_format_json_schema_constrains_the_answer(client):
    """text.format json_schema (here through responses.parse with a Pydantic model): the
    random-weight model's answer is valid JSON of the schema, streamed or not."""
    from typing import Literal

    from pydantic import BaseModel, Field

    class Reading(BaseModel):
        unit: Literal["celsius", "fahrenheit"]
        degrees: int = Field(ge=-50, le=50)

    r = client.responses.parse(model="tiny", input="Weather in Lima?", text_format=Reading, max_output_tokens=200,
                               temperature=0)
    assert r.status == "completed" and isinstance(r.output_parsed, Reading), r.output_text
    with client.responses.stream(model="tiny", input="And in Quito?", text_format=Reading, max_output_tokens=200,
                                 temperature=1.0) as stream:
        final = stream.get_final_response()
    assert isinstance(final.output_parsed, Reading), final.output_text


def test_refusals_are_clear_400s(client):
    cases = [
        ({"tools": [{"type": "file_search", "vector_store_ids": ["vs_1"]}]}, "hosted tools"),
        ({"text": {"format": {"type": "xml"}}}, "text.format.type"),
        ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "no-such-type"}}}},
         "text.format.schema"),
        ({"background": True}, "background"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
         "images are not supported"),
        ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "not supported"),
        ({"tool_choice": {"type": "file_search"}}, "hosted tools"),
        ({"reasoning": {"effort": "extreme"}}, "reasoning.effort"),
    ]
    for extra, words in cases:
        body = {"model": "tiny", "input": "hi", **extra}
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(**body) if "background" not in extra else client.post(
                "/responses", body=body, cast_to=object)
        assert words in e.value.message, (extra, e.value.message)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="other", input="hi")


def test_cancel_a_running_response(srv):
    """POST .../cancel while it streams: the stream ends with response.failed (cancelled),
    the stored response says cancelled, and the slot is free again."""
    from http.client import HTTPConnection
    from urllib.parse import urlsplit

    # a scripted answer far longer than the time the cancel takes to arrive (sampled freely, the
    # tiny model could end its answer after a token or two, before the cancel)
    SCRIPTS[9107] = " ".join(["once"] * 390)
    u = urlsplit(srv.url)
    conn = HTTPConnection(u.hostname, u.port, timeout=60)
    conn.request("POST", "/v1/responses", body=json.dumps({
        "model": "tiny", "input": "Write a long story.", "stream": True, "temperature": 1.0, "seed": 9107,
        "max_output_tokens": 400, "reasoning": {"effort": "none"}}), headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    first = b""
    while b"\n\n" not in first:
        first += resp.read1(65536)
    rid = json.loads(first.split(b"data: ", 1)[1].split(b"\n", 1)[0])["response"]["id"]
    status, _, cancelled = http(srv, "POST", f"/v1/responses/{rid}/cancel")
    assert status == 200 and cancelled["status"] == "cancelled"
    rest = (first + resp.read()).decode()
    conn.close()
    kinds = [line[7:] for line in rest.splitlines() if line.startswith("event: ")]
    assert kinds[-2:] == ["error", "response.failed"], kinds[-3:]
    failed = json.loads(rest.rsplit("data: ", 1)[1])
    assert failed["response"]["status"] == "cancelled" and failed["response"]["error"]["code"] == "cancelled"
    status, _, got = http(srv, "GET", f"/v1/responses/{rid}")
    assert got["status"] == "cancelled"
    status, _, health = http(srv, "GET", "/health")
    assert health["active"] == 0
