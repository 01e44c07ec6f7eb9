"""The OpenAI Responses API: POST /v1/responses and the stored responses behind it.

What Codex CLI, ``client.responses.create`` and the OpenAI Agents SDK speak. ``input`` (a
string or items: ``message`` with text parts, ``function_call``, ``function_call_output``,
``reasoning``) and ``instructions`` become the same chat the other endpoints render;
function ``tools``, ``tool_choice``, ``parallel_tool_calls``, ``max_output_tokens``,
``temperature``/``top_p``, ``reasoning.effort`` are honoured. Hosted tools (web search,
file search, code interpreter, ...) and ``background`` are refused with a 400 naming them;
``text.format`` other than text is refused until structured outputs land.

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

import json
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field

from aiohttp import web

from coli.scheduler import Finished, ReasoningDelta, TextDelta, ToolCallDelta, Usage
from coli.server import params as P
from coli.server.errors import ApiError, invalid, unsupported
from coli.server.generation import GenSpec, Generation, collect
from coli.server.openai import EFFORTS, sampling_fields
from coli.server.prompts import FUNCTION_NAME, implicit_stops, render
from coli.server.state import server_of
from coli.server.streaming import run_stream, sse

MAX_STORED = 256  # responses kept per server (least recently used dropped first)
TOOL_CHOICES = ("none", "auto", "required")
SUMMARIES = ("auto", "concise", "detailed")
IGNORED_TOOLS = ("web_search", "web_search_preview")  # not offered to the model (see _tools)
MESSAGE_ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = {"input_text": "text", "output_text": "text", "text": "text", "refusal": "refusal",
              "reasoning_text": "text", "summary_text": "text"}
MEDIA_PARTS = {"input_image": "images", "input_file": "files", "input_audio": "audio"}


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


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


# -- input items to chat messages -------------------------------------------------------------


def _text(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(f"{where}: expected a string or an array of content parts", where)
    out = []
    for j, part in enumerate(content):
        at = f"{where}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in MEDIA_PARTS:
            raise unsupported(f"{at}: {MEDIA_PARTS[kind]} are not supported: this server is text-only", at)
        key = TEXT_PARTS.get(kind)
        if key is None or not isinstance(part.get(key), str):
            raise invalid(f"{at}: expected an input_text part with a string text, got {kind!r}", at)
        out.append(part[key])
    return "\n".join(out)


def _arguments(args: str):
    try:
        value = json.loads(args)
    except ValueError:
        return args
    return value if isinstance(value, dict) else args


def input_messages(items: list, where: str = "input") -> list[dict]:
    """Chat messages from Responses input items (reasoning attaches to the next assistant turn)."""
    out: list[dict] = []
    reasoning: list[str] = []

    def assistant() -> dict:
        last = out[-1] if out else None
        if last is None or last["role"] != "assistant" or reasoning:
            last = {"role": "assistant", "content": ""}
            out.append(last)
        if reasoning:
            last["reasoning_content"] = "\n".join(reasoning)
            reasoning.clear()
        return last

    for i, it in enumerate(items):
        at = f"{where}[{i}]"
        if not isinstance(it, dict):
            raise invalid(f"{at}: expected an input item object", at)
        kind = it.get("type", "message" if "role" in it else None)
        if kind == "message":
            role = it.get("role")
            if role not in MESSAGE_ROLES:
                raise invalid(f"{at}.role must be one of {', '.join(MESSAGE_ROLES)}, got {role!r}", f"{at}.role")
            text = _text(it.get("content"), f"{at}.content")
            if role == "assistant":
                msg = assistant()
                msg["content"] = (msg["content"] + "\n" + text) if msg["content"] else text
            else:
                out.append({"role": "system" if role == "developer" else role, "content": text})
        elif kind == "function_call":
            for key in ("call_id", "name", "arguments"):
                if not isinstance(it.get(key), str):
                    raise invalid(f"{at}.{key} must be a string", f"{at}.{key}")
            msg = assistant()
            msg.setdefault("tool_calls", []).append({"id": it["call_id"], "type": "function", "function": {
                "name": it["name"], "arguments": _arguments(it["arguments"])}})
        elif kind == "function_call_output":
            if not isinstance(it.get("call_id"), str):
                raise invalid(f"{at}.call_id must be a string", f"{at}.call_id")
            out.append({"role": "tool", "tool_call_id": it["call_id"], "content": _text(it.get("output"),
                                                                                       f"{at}.output")})
        elif kind == "reasoning":
            texts = {}
            for key in ("content", "summary"):
                parts = it.get(key)
                if parts is not None and not isinstance(parts, list):
                    raise invalid(f"{at}.{key}: expected an array of text parts", f"{at}.{key}")
                texts[key] = _text(parts or [], f"{at}.{key}")
            text = texts["content"] or texts["summary"]
            if text:
                reasoning.append(text)
        elif isinstance(kind, str):
            raise unsupported(f"{at}: input items of type {kind!r} are not supported (message, function_call, "
                              "function_call_output and reasoning are)", at)
        else:
            raise invalid(f"{at}: an input item needs a type or a role", at)
    return out


def _listed(it):
    """An input item as GET .../input_items lists it: with an id, a type and text parts."""
    if not isinstance(it, dict):
        return it
    kind = it.get("type", "message" if "role" in it else None)
    out = {**it, "type": kind, "id": it.get("id") or _id("msg" if kind == "message" else "item")}
    if kind == "message" and isinstance(it.get("content"), str):
        part = "output_text" if it.get("role") == "assistant" else "input_text"
        out["content"] = [{"type": part, "text": it["content"]}]
        out.setdefault("status", "completed")
    return out


def _input(body: dict) -> list[dict]:
    given = body.get("input")
    if isinstance(given, str):
        return [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": given}]}]
    if not isinstance(given, list):
        raise invalid("input: expected a string or an array of input items", "input")
    return given


# -- tools and other fields -------------------------------------------------------------------


def _tools(body: dict) -> tuple[list[dict] | None, dict[str, str]]:
    """(chat tools, {function name: its namespace}). Function tools, also inside a
    ``namespace`` tool (Codex groups some so); web search is not offered to the model (as
    if it never chose to search: clients such as Codex always send it); every other hosted
    tool is refused."""
    tools = P.get(body, "tools", list)
    out: list[dict] = []
    spaces: dict[str, str] = {}

    def add(t, at: str, space: str | None = None) -> None:
        kind = t.get("type") if isinstance(t, dict) else None
        if kind == "namespace" and space is None and isinstance(t.get("name"), str) \
                and isinstance(t.get("tools"), list):
            for j, inner in enumerate(t["tools"]):
                add(inner, f"{at}.tools[{j}]", t["name"])
            return
        if kind in IGNORED_TOOLS and space is None:
            return
        if kind != "function":
            if isinstance(kind, str):
                raise unsupported(f"{at}: hosted tools ({kind!r}) are not supported: this server runs no tools "
                                  "itself; send function tools and run them in the client", at)
            raise invalid(f"{at}: expected {{'type': 'function', 'name', 'parameters'}}", at)
        if not isinstance(t.get("name"), str) or not FUNCTION_NAME.match(t["name"]):
            raise invalid(f"{at}.name must be 1-64 letters, digits, '_', '.' or '-'", f"{at}.name")
        params = t.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise invalid(f"{at}.parameters must be a JSON schema object", f"{at}.parameters")
        fn = {"name": t["name"], "parameters": params or {"type": "object", "properties": {}}}
        if isinstance(t.get("description"), str):
            fn["description"] = t["description"]
        out.append({"type": "function", "function": fn})
        if space is not None:
            spaces[t["name"]] = space

    for i, t in enumerate(tools or []):
        add(t, f"tools[{i}]")
    return out or None, spaces


def _tool_choice(body: dict):
    tc = body.get("tool_choice")
    if tc is None or tc in TOOL_CHOICES:
        return tc
    if isinstance(tc, dict) and tc.get("type") == "function" and isinstance(tc.get("name"), str):
        return tc["name"]
    if isinstance(tc, dict) and isinstance(tc.get("type"), str) and tc["type"] not in ("function", "allowed_tools"):
        raise unsupported(f"tool_choice: hosted tools ({tc['type']!r}) are not supported", "tool_choice")
    raise invalid("tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'name'}", "tool_choice")


def _effort(body: dict) -> str | None:
    reasoning = P.get(body, "reasoning", dict, {})
    effort = P.get(reasoning, "effort", str, param="reasoning.effort")
    if effort is not None and effort not in EFFORTS:
        raise invalid(f"reasoning.effort must be one of {', '.join(EFFORTS)}, got {effort!r}", "reasoning.effort")
    summary = P.get(reasoning, "summary", str, param="reasoning.summary")
    if summary is not None and summary not in SUMMARIES:
        raise invalid(f"reasoning.summary must be one of {', '.join(SUMMARIES)}, got {summary!r}", "reasoning.summary")
    return effort


def _refuse(body: dict) -> None:
    if P.get(body, "background", bool, False):
        raise unsupported("background: responses run while the request is open; send background: false "
                          "(or leave it out)", "background")
    text = P.get(body, "text", dict, {})
    fmt = P.get(text, "format", dict, param="text.format")
    if fmt is not None and fmt.get("type") != "text":
        raise unsupported("text.format: only {'type': 'text'} is supported (no structured outputs yet)",
                          "text.format")
    for name in ("prompt", "conversation"):
        if body.get(name) is not None:
            raise unsupported(f"{name}: stored prompts and conversations are not supported; send input "
                              "(and previous_response_id)", name)


# -- building the answer ----------------------------------------------------------------------


def usage_body(server, u: Usage | None, reasoning: str = "") -> dict:
    prompt, cached, out = (u.prompt_tokens, u.cached_tokens, u.completion_tokens) if u else (0, 0, 0)
    thought = len(server.model.tokenizer.encode(reasoning, add_special_tokens=False)) if reasoning else 0
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens": out,
            "output_tokens_details": {"reasoning_tokens": min(thought, out)}, "total_tokens": prompt + out}


def message_item(text: str, status: str = "completed", mid: str | None = None) -> dict:
    return {"type": "message", "id": mid or _id("msg"), "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def reasoning_item(text: str, rid: str | None = None) -> dict:
    return {"type": "reasoning", "id": rid or _id("rs"), "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": "completed"}


def call_item(call_id: str | None, name: str, arguments: str, status: str = "completed",
              fid: str | None = None) -> dict:
    return {"type": "function_call", "id": fid or _id("fc"), "call_id": call_id or _id("call"), "name": name,
            "arguments": arguments, "status": status}


def output_message(output: list[dict]) -> dict:
    """This response's output as the assistant turn of the stored conversation."""
    msg = {"role": "assistant", "content": ""}
    for it in output:
        if it["type"] == "message":
            msg["content"] += it["content"][0]["text"]
        elif it["type"] == "reasoning":
            msg["reasoning_content"] = it["content"][0]["text"]
        elif it["type"] == "function_call":
            msg.setdefault("tool_calls", []).append({"id": it["call_id"], "type": "function", "function": {
                "name": it["name"], "arguments": _arguments(it["arguments"])}})
    return msg


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
    _refuse(body)
    items = [_listed(it) for it in _input(body)]
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
    effort = _effort(body)
    kwargs = {"enable_thinking": effort != "none"} if effort is not None else {}
    tools, spaces = _tools(body)
    prompt = render(server, ([{"role": "system", "content": instructions}] if instructions else []) + messages,
                    tools=tools, tool_choice=_tool_choice(body),
                    parallel=P.get(body, "parallel_tool_calls", bool, True), template_kwargs=kwargs, api_param="tools")
    sampling, bias = sampling_fields(server, body)
    max_tokens = P.integer(body, "max_output_tokens", 1) or server.runner.ctx
    stops, stop_ids = implicit_stops(server)
    spec = GenSpec([prompt.ids], max_tokens, sampling, 1, stops, True, stop_ids, None, bias,
                   P.integer(body, "cache_slot", 0), lambda: prompt.parser(server))
    P.get(body, "stream", bool)
    P.choice(body, "truncation", ("auto", "disabled"))
    P.get(body, "metadata", dict)
    P.get(body, "user", str)
    return Request(_id("resp"), body, model_id, items, messages, prompt, spec, effort,
                   P.get(body, "store", bool, True), spaces)


# -- the endpoints ----------------------------------------------------------------------------


async def create(request: web.Request) -> web.StreamResponse:
    server = server_of(request)
    store = request.app[STORE]
    body = await P.read_json(request)
    req = parse(server, body, store)
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
