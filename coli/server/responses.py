"""The OpenAI Responses API: POST /v1/responses and the stored responses behind it.

What Codex CLI, ``client.responses.create`` and the OpenAI Agents SDK speak. ``input`` (a
string or items: ``message`` with text parts, ``function_call``, ``function_call_output``,
``reasoning``) and ``instructions`` become the same chat the other endpoints render;
function ``tools``, ``tool_choice``, ``parallel_tool_calls``, ``max_output_tokens``,
``temperature``/``top_p``, ``reasoning.effort`` are honoured. Hosted tools (web search,
file search, code interpreter, ...) and ``background`` are refused with a 400 naming them;
``text.format`` (``json_object`` / ``json_schema``) constrains the answer like the chat
endpoints' ``response_format`` (coli.server.structured). The items
themselves are translated in responses_items.py.

``store`` (default true) keeps the response in an in-memory LRU of ``MAX_STORED``
responses per server, for GET/DELETE, ``input_items`` and ``previous_response_id``: a
follow-up continues the stored conversation (its instructions are not carried over, as
OpenAI documents), and the scheduler's prefix reuse finds the previous turn's KV, so
only the new tokens are computed (``usage.input_tokens_details.cached_tokens``).

Streaming sends OpenAI's typed events, each with ``sequence_number``: response.created,
response.in_progress, then per output item output_item.added / content_part.added /
output_text.delta (reasoning_text.delta, function_call_arguments.delta) and their
``.done`` events, and response.completed (response.incomplete when max_output_tokens cut
it short); an error after the headers is an ``error`` event then response.failed.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field

from aiohttp import web

from coli.scheduler import Finished, ReasoningDelta, TextDelta, ToolCallDelta, Usage
from coli.server import params as P
from coli.server.errors import ApiError, invalid, unsupported
from coli.server.generation import GenSpec, Generation, collect
from coli.server import structured
from coli.server.limits import off_loop
from coli.server.openai import sampling_fields
from coli.server.prompts import implicit_stops, render
from coli.server.responses_items import (call_item, chat_tools, effort_of, input_list, input_messages, listed_item,
                                         message_item, new_id, output_message, reasoning_item, refuse_unsupported,
                                         text_format, tool_choice_of, usage_body)
from coli.server.state import server_of
from coli.server.streaming import run_stream, sse

MAX_STORED = 256  # responses kept per server (least recently used dropped first)


@dataclass
class Stored:
    response: dict
    messages: list[dict]  # the conversation through this response's output (no instructions)
    items: list[dict]  # its input items, with ids (GET .../input_items)
    gen: Generation | None = None  # while it runs (cancel)
    cancelled: bool = False


class Store:
    """Responses by id, least recently used dropped past ``limit``."""

    def __init__(self, limit: int = MAX_STORED):
        self.limit = limit
        self._items: OrderedDict[str, Stored] = OrderedDict()

    def put(self, rid: str, entry: Stored) -> None:
        self._items[rid] = entry
        self._items.move_to_end(rid)
        while len(self._items) > self.limit:
            self._items.popitem(last=False)

    def get(self, rid: str) -> Stored:
        entry = self._items.get(rid)
        if entry is None:
            raise ApiError(404, f"no response with id {rid!r} is stored here (responses live in memory, at most "
                                f"{self.limit}, until the server restarts)", code="response_not_found")
        self._items.move_to_end(rid)
        return entry

    def pop(self, rid: str) -> Stored:
        entry = self.get(rid)
        del self._items[rid]
        return entry


STORE = web.AppKey("responses", Store)


def add_routes(app: web.Application) -> None:
    app[STORE] = Store()
    app.add_routes([web.post("/v1/responses", create), web.get("/v1/responses/{id}", retrieve),
                    web.delete("/v1/responses/{id}", delete), web.post("/v1/responses/{id}/cancel", cancel),
                    web.get("/v1/responses/{id}/input_items", input_items)])


@dataclass
class Request:
    """One parsed POST /v1/responses."""

    rid: str
    body: dict
    model_id: str
    items: list[dict]
    messages: list[dict]  # without instructions
    prompt: object
    spec: GenSpec
    effort: str | None
    store: bool
    spaces: dict[str, str] = field(default_factory=dict)  # function name -> its namespace tool
    created: int = field(default_factory=lambda: int(time.time()))

    def call(self, call_id: str | None, name: str, arguments: str, status: str = "completed") -> dict:
        item = call_item(call_id, name, arguments, status)
        if name in self.spaces:
            item["namespace"] = self.spaces[name]
        return item

    def response(self, status: str, output: list[dict], usage: dict | None, error: dict | None = None,
                 incomplete: str | None = None) -> dict:
        b, s = self.body, self.spec.sampling
        return {"id": self.rid, "object": "response", "created_at": self.created, "status": status,
                "background": False, "error": error,
                "incomplete_details": {"reason": incomplete} if incomplete else None,
                "instructions": b.get("instructions"), "max_output_tokens": b.get("max_output_tokens"),
                "model": self.model_id, "output": output, "parallel_tool_calls": self.prompt.parallel,
                "previous_response_id": b.get("previous_response_id"),
                "reasoning": {"effort": self.effort, "summary": None}, "store": self.store,
                "temperature": s.temperature, "text": {"format": {"type": "text"}},
                "tool_choice": b.get("tool_choice") or "auto", "tools": b.get("tools") or [], "top_p": s.top_p,
                "truncation": b.get("truncation") or "disabled", "usage": usage, "user": b.get("user"),
                "metadata": b.get("metadata") or {}}

    def status(self, finish: str | None) -> tuple[str, str | None]:
        return ("incomplete", "max_output_tokens") if finish == "length" else ("completed", None)


def parse(server, body: dict, store: Store) -> Request:
    model_id = server.check_model(body)
    refuse_unsupported(body)
    items = [listed_item(it) for it in input_list(body)]
    prev_id = P.get(body, "previous_response_id", str)
    history = []
    if prev_id is not None:
        try:
            history = store.get(prev_id).messages
        except ApiError as e:  # OpenAI's answer: a 400 about the field
            raise invalid(e.message, "previous_response_id", code="previous_response_not_found") from None
    messages = history + input_messages(items)
    if not messages:
        raise invalid("input: expected at least one item", "input")
    instructions = P.get(body, "instructions", str)
    effort = effort_of(body)
    kwargs = {"enable_thinking": effort != "none"} if effort is not None else {}
    tools, spaces = chat_tools(body)
    answer, tool_choice = text_format(body), tool_choice_of(body)
    prompt = render(server, ([{"role": "system", "content": instructions}] if instructions else []) + messages,
                    tools=tools, tool_choice=tool_choice, parallel=P.get(body, "parallel_tool_calls", bool, True),
                    template_kwargs=structured.default_thinking(answer, tool_choice, kwargs), api_param="tools")
    constraint = structured.constraint(server, answer, prompt)
    sampling, bias = sampling_fields(server, body)
    max_tokens = P.integer(body, "max_output_tokens", 1) or server.runner.ctx
    stops, stop_ids = implicit_stops(server)
    spec = GenSpec([prompt.ids], max_tokens, sampling, 1, stops, True, stop_ids, None, bias,
                   P.integer(body, "cache_slot", 0), lambda: prompt.parser(server), constraint)
    P.get(body, "stream", bool)
    P.choice(body, "truncation", ("auto", "disabled"))
    P.get(body, "metadata", dict)
    P.get(body, "user", str)
    return Request(new_id("resp"), body, model_id, items, messages, prompt, spec, effort,
                   P.get(body, "store", bool, True), spaces)


# -- the endpoints ----------------------------------------------------------------------------


async def create(request: web.Request) -> web.StreamResponse:
    server = server_of(request)
    store = request.app[STORE]
    body = await P.read_json(request)
    req = await off_loop(parse, server, body, store)  # rendering and tokenizing off the event loop
    gen = Generation(server, req.spec)
    entry = Stored(req.response("in_progress", [], None), req.messages, req.items, gen)
    if req.store:
        store.put(req.rid, entry)
    try:
        await gen.start()
        if P.get(body, "stream", bool, False):
            return await _stream(request, server, req, gen, entry)
        try:
            (c,) = await collect(gen)
        except ApiError:
            if entry.cancelled:
                return web.json_response(entry.response, headers=gen.headers)
            raise
        output = []
        reasoning = "".join(c.reasoning)
        if reasoning:
            output.append(reasoning_item(reasoning))
        text = "".join(c.text)
        if text or not c.calls:
            output.append(message_item(text))
        output += [req.call(v["id"], v["name"], v["arguments"]) for _, v in sorted(c.calls.items())]
        status, why = req.status(c.finish_reason)
        _finish(entry, req.response(status, output, usage_body(server, c.usage, reasoning), incomplete=why))
        return web.json_response(entry.response, headers=gen.headers)
    except BaseException:
        if entry.response["status"] == "in_progress":
            entry.response = {**entry.response, "status": "failed"}
            entry.gen = None
        raise
    finally:
        gen.cancel()


def _finish(entry: Stored, response: dict) -> None:
    entry.response, entry.gen = response, None
    entry.messages = entry.messages + [output_message(response["output"])]


async def _stream(request, server, req: Request, gen: Generation, entry: Stored) -> web.StreamResponse:
    s = _Events(req)
    started = gen.started[0]
    usage: dict = {}

    async def on_event(i: int, ev) -> bytes | None:
        if isinstance(ev, TextDelta):
            return s.text(ev.text)
        if isinstance(ev, ReasoningDelta):
            return s.reasoning(ev.text)
        if isinstance(ev, ToolCallDelta):
            return s.call(ev)
        if isinstance(ev, Usage):
            usage["u"] = ev
        elif isinstance(ev, Finished):
            status, why = req.status(ev.finish_reason)
            out = s.close(empty_message=True)
            thought = "".join(it["content"][0]["text"] for it in s.output if it["type"] == "reasoning")
            _finish(entry, req.response(status, s.output, usage_body(server, usage.get("u"), thought),
                                        incomplete=why))
            return out + s.event(f"response.{status}", response=entry.response)
        return None

    def failed(e: ApiError) -> bytes:
        code = "cancelled" if entry.cancelled else (e.code or "server_error")
        entry.response = req.response("cancelled" if entry.cancelled else "failed", s.output, None,
                                      error={"code": code, "message": e.message})
        entry.gen = None
        return s.event("error", code=code, message=e.message, param=e.param) + \
            s.event("response.failed", response=entry.response)

    first = s.event("response.created", response=req.response("in_progress", [], None))
    first += s.event("response.in_progress", response=req.response("in_progress", [], None))
    del started
    return await run_stream(request, server, gen, first, on_event, lambda: b"", b": keepalive\n\n", failed)


class _Events:
    """The streamed events of one response, and the output items they build."""

    def __init__(self, req: Request):
        self.req = req
        self.seq = 0
        self.output: list[dict] = []
        self.open: str | None = None  # the kind of the last item while it is still open

    def event(self, kind: str, **data) -> bytes:
        frame = sse({"type": kind, "sequence_number": self.seq, **data}, event=kind)
        self.seq += 1
        return frame

    def _add(self, item: dict) -> bytes:
        out = self.close()
        self.output.append(item)
        self.open = item["type"]
        return out + self.event("response.output_item.added", output_index=len(self.output) - 1, item=item)

    def _where(self) -> dict:
        return {"item_id": self.output[-1]["id"], "output_index": len(self.output) - 1}

    def text(self, delta: str) -> bytes:
        out = b""
        if self.open != "message":
            out = self._add({**message_item("", "in_progress"), "content": []})
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            self.output[-1]["content"].append(part)
            out += self.event("response.content_part.added", **self._where(), content_index=0, part=part)
        self.output[-1]["content"][0]["text"] += delta
        return out + self.event("response.output_text.delta", **self._where(), content_index=0, delta=delta,
                                logprobs=[])

    def reasoning(self, delta: str) -> bytes:
        out = b""
        if self.open != "reasoning":
            out = self._add({**reasoning_item(""), "content": [], "status": "in_progress"})
            part = {"type": "reasoning_text", "text": ""}
            self.output[-1]["content"].append(part)
            out += self.event("response.content_part.added", **self._where(), content_index=0, part=part)
        self.output[-1]["content"][0]["text"] += delta
        return out + self.event("response.reasoning_text.delta", **self._where(), content_index=0, delta=delta)

    def call(self, ev: ToolCallDelta) -> bytes:
        out = b""
        if ev.name is not None:
            out = self._add(self.req.call(ev.id, ev.name, "", "in_progress"))
        if ev.arguments:
            self.output[-1]["arguments"] += ev.arguments
            out += self.event("response.function_call_arguments.delta", **self._where(), delta=ev.arguments)
        return out

    def close(self, empty_message: bool = False) -> bytes:
        """End the open item (its .done events); at the end, an answer with no item gets an
        empty message, as the non-streaming answer has."""
        if self.open is None and empty_message and not self.output:
            return self.text("") + self.close()
        if self.open is None:
            return b""
        item, where = self.output[-1], self._where()
        out = b""
        if item["type"] == "message":
            part = item["content"][0]
            out += self.event("response.output_text.done", **where, content_index=0, text=part["text"], logprobs=[])
            out += self.event("response.content_part.done", **where, content_index=0, part=part)
        elif item["type"] == "reasoning":
            part = item["content"][0]
            out += self.event("response.reasoning_text.done", **where, content_index=0, text=part["text"])
            out += self.event("response.content_part.done", **where, content_index=0, part=part)
        else:
            out += self.event("response.function_call_arguments.done", **where, name=item["name"],
                              arguments=item["arguments"])
        item["status"] = "completed"
        self.open = None
        return out + self.event("response.output_item.done", output_index=where["output_index"], item=item)


async def retrieve(request: web.Request) -> web.Response:
    if request.query.get("stream") in ("true", "1"):
        raise unsupported("stream: replaying a stored response as events is not supported; GET it without "
                          "stream", "stream")
    return web.json_response(request.app[STORE].get(request.match_info["id"]).response)


async def delete(request: web.Request) -> web.Response:
    entry = request.app[STORE].pop(request.match_info["id"])
    if entry.gen is not None:
        entry.cancelled = True
        entry.gen.cancel()
    return web.json_response({"id": request.match_info["id"], "object": "response", "deleted": True})


async def cancel(request: web.Request) -> web.Response:
    """Cancels a response still running (its request ends with status cancelled); a
    finished one cannot be cancelled, as on OpenAI's API."""
    entry = request.app[STORE].get(request.match_info["id"])
    if entry.gen is None:
        raise invalid(f"the response {request.match_info['id']!r} has finished ({entry.response['status']}); "
                      "only a response still running can be cancelled", code="response_not_running")
    entry.cancelled = True
    entry.response = {**entry.response, "status": "cancelled"}
    entry.gen.cancel()
    return web.json_response(entry.response)


async def input_items(request: web.Request) -> web.Response:
    entry = request.app[STORE].get(request.match_info["id"])
    q = request.query
    order = q.get("order", "desc")
    if order not in ("asc", "desc"):
        raise invalid("order must be 'asc' or 'desc'", "order")
    try:
        limit = int(q.get("limit", "20"))
    except ValueError:
        limit = 0
    if not 1 <= limit <= 100:
        raise invalid("limit must be an integer from 1 to 100", "limit")
    items = entry.items if order == "asc" else entry.items[::-1]
    after = q.get("after")
    if after is not None:
        ids = [it.get("id") for it in items]
        if after not in ids:
            raise invalid(f"after: no input item {after!r} in this response", "after")
        items = items[ids.index(after) + 1:]
    page = items[:limit]
    return web.json_response({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                              "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit})
