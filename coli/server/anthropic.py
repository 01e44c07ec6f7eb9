"""Anthropic Messages API: POST /v1/messages and /v1/messages/count_tokens.

Requests are translated into the same chat the OpenAI endpoint renders (system blocks,
tool_use / tool_result, thinking blocks as reasoning) and answered with Anthropic's
content blocks, stop reasons, usage names and, when streaming, its named events, with
``ping`` events while a long prompt is being read. ``stop_sequences`` and ``top_k`` are
applied. Errors use Anthropic's envelope (the middleware picks it by path).

What current clients (Claude Code 2.x) send is accepted: ``system``-role messages inside
``messages`` render as system turns in place where the template keeps them, else they
are folded, in order, into the system prompt (``_prompt``); ``thinking`` (``enabled``,
``adaptive``: the reasoning switch on; ``disabled``: off) and ``output_config.effort``
(like OpenAI's ``reasoning_effort``); ``cache_control``, ``context_management``,
``metadata``, ``container``, ``service_tier`` and other unknown fields are ignored; the
``?beta=true`` query and ``anthropic-beta`` header need nothing. ``max_tokens`` above the
context is a ceiling, as on the OpenAI endpoints: the reply ends with ``max_tokens`` when
the context is full (llama-server's behaviour; only a prompt that does not fit is refused).
"""
from __future__ import annotations

import json
import uuid

from aiohttp import web

from coli.scheduler import Finished, ReasoningDelta, TextDelta, ToolCallDelta, Usage
from coli.server import params as P
from coli.server import structured
from coli.server.errors import ApiError, invalid, unsupported
from coli.server.generation import GenSpec, Generation, collect, speculative_field
from coli.server.limits import off_loop
from coli.server.state import server_of
from coli.server.streaming import run_stream, sse
from coli.server.prompts import FUNCTION_NAME, implicit_stops, join_text, render

MAX_STOP_SEQUENCES = 16
UNSUPPORTED_BLOCKS = {"image": "images are", "document": "documents are", "search_result": "search results are",
                      "container_upload": "file uploads are"}


# -- the request ------------------------------------------------------------------------------


def _text(content, where: str) -> str:
    """A string, or text blocks joined; any other block is refused."""
    return join_text(content, where, text={"text": "text"}, refused=UNSUPPORTED_BLOCKS, noun="content blocks")


def _block_error(kind, where: str, allowed: str):
    if isinstance(kind, str) and kind in UNSUPPORTED_BLOCKS:
        return unsupported(f"{where}: {UNSUPPORTED_BLOCKS[kind]} not supported: this server is text-only", where)
    return invalid(f"{where}: expected a {allowed} block, got {kind!r}", where)


def chat_messages(body: dict) -> list[dict]:
    out = []
    system = body.get("system")
    if system is not None:
        out.append({"role": "system", "content": _text(system, "system")})
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid("messages: expected a non-empty array of messages", "messages")
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant", "system"):
            raise invalid(f"{where}: expected an object with role 'user', 'assistant' or 'system'", where)
        content = m.get("content")
        if m["role"] == "system":  # Claude Code's mid-conversation system messages
            out.append({"role": "system", "content": _text(content, f"{where}.content")})
            continue
        if isinstance(content, str):
            out.append({"role": m["role"], "content": content})
            continue
        if not isinstance(content, list):
            raise invalid(f"{where}.content: expected a string or an array of content blocks", f"{where}.content")
        if m["role"] == "assistant":
            out.append(_assistant(content, f"{where}.content"))
        else:
            out.extend(_user(content, f"{where}.content"))
    return out


def _assistant(blocks: list, where: str) -> dict:
    text, reasoning, calls = [], [], []
    for j, b in enumerate(blocks):
        kind = b.get("type") if isinstance(b, dict) else None
        at = f"{where}[{j}]"
        if kind == "text" and isinstance(b.get("text"), str):
            text.append(b["text"])
        elif kind == "thinking" and isinstance(b.get("thinking"), str):
            reasoning.append(b["thinking"])
        elif kind == "redacted_thinking":
            continue
        elif kind == "tool_use" and isinstance(b.get("name"), str) and isinstance(b.get("id"), str) \
                and isinstance(b.get("input"), dict):
            calls.append({"id": b.get("id"), "type": "function",
                          "function": {"name": b["name"], "arguments": b.get("input", {})}})
        else:
            raise _block_error(kind, at, "text, thinking or tool_use")
    msg = {"role": "assistant", "content": "".join(text)}
    if reasoning:
        msg["reasoning_content"] = "\n".join(reasoning)
    if calls:
        msg["tool_calls"] = calls
    return msg


def _user(blocks: list, where: str) -> list[dict]:
    out, text = [], []
    for j, b in enumerate(blocks):
        kind = b.get("type") if isinstance(b, dict) else None
        at = f"{where}[{j}]"
        if kind == "text" and isinstance(b.get("text"), str):
            text.append(b["text"])
        elif kind == "tool_result":
            if not isinstance(b.get("tool_use_id"), str):
                raise invalid(f"{at}.tool_use_id must be a string", f"{at}.tool_use_id")
            if b.get("is_error") is not None and not isinstance(b["is_error"], bool):
                raise invalid(f"{at}.is_error must be a boolean", f"{at}.is_error")
            if text:
                out.append({"role": "user", "content": "\n".join(text)})
                text = []
            result = b.get("content", "")
            out.append({"role": "tool", "tool_call_id": b.get("tool_use_id"),
                        "content": _text(result, f"{at}.content") if result is not None else ""})
        else:
            raise _block_error(kind, at, "text or tool_result")
    if text or not out:
        out.append({"role": "user", "content": "\n".join(text)})
    return out


def _tools(body: dict) -> list[dict] | None:
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise invalid("tools: expected an array", "tools")
    out = []
    for i, t in enumerate(tools):
        at = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type", "custom") != "custom":
            raise unsupported(f"{at}: only client tools (name, description, input_schema) are supported", at)
        if not isinstance(t.get("name"), str) or not FUNCTION_NAME.match(t["name"]):
            raise invalid(f"{at}.name must be 1-64 letters, digits, '_', '.' or '-'", f"{at}.name")
        schema = t.get("input_schema", {"type": "object"})
        if not isinstance(schema, dict):
            raise invalid(f"{at}.input_schema must be a JSON schema object", f"{at}.input_schema")
        fn = {"name": t["name"], "parameters": schema}
        if isinstance(t.get("description"), str):
            fn["description"] = t["description"]
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(body: dict) -> tuple[str | None, bool]:
    """(tool_choice as render() takes it, parallel calls allowed)."""
    tc = body.get("tool_choice")
    if tc is None:
        return None, True
    if not isinstance(tc, dict) or tc.get("type") not in ("auto", "any", "tool", "none"):
        raise invalid("tool_choice must be {'type': 'auto' | 'any' | 'tool' | 'none'}", "tool_choice")
    parallel = not P.get(tc, "disable_parallel_tool_use", bool, False, param="tool_choice.disable_parallel_tool_use")
    kind = tc["type"]
    if kind == "tool":
        if not isinstance(tc.get("name"), str):
            raise invalid("tool_choice of type 'tool' needs a name", "tool_choice.name")
        return tc["name"], parallel
    return {"auto": "auto", "any": "required", "none": "none"}[kind], parallel


EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")


def _thinking(body: dict) -> dict:
    """The template's reasoning switch: ``thinking`` wins; else ``output_config.effort``
    turns it on (as ``reasoning_effort`` does on the OpenAI side); else off (Anthropic's
    default: no thinking unless asked)."""
    th = body.get("thinking")
    config = P.get(body, "output_config", dict, {})
    effort = P.get(config, "effort", str, param="output_config.effort")
    if effort is not None and effort not in EFFORTS:
        raise invalid(f"output_config.effort must be one of {', '.join(EFFORTS)}, got {effort!r}",
                      "output_config.effort")
    if th is None:
        return {"enable_thinking": effort is not None and effort != "none"}
    if not isinstance(th, dict) or th.get("type") not in ("enabled", "disabled", "adaptive"):
        raise invalid("thinking must be {'type': 'enabled', 'budget_tokens': N}, {'type': 'adaptive'} or "
                      "{'type': 'disabled'}", "thinking")
    P.integer(th, "budget_tokens", 1)
    return {"enable_thinking": th["type"] != "disabled" and effort != "none"}


def fold_system(messages: list[dict]) -> list[dict]:
    """Every system message joined, in order, into one leading system prompt."""
    system = [m["content"] for m in messages if m["role"] == "system" and m["content"]]
    rest = [m for m in messages if m["role"] != "system"]
    return ([{"role": "system", "content": "\n\n".join(system)}] if system else []) + rest


def _prompt(server, body: dict):
    """The rendered prompt. System messages after the first position stay in place when the
    template renders them there (Qwen3, ChatML); a template that refuses them or drops
    their text gets them folded into the leading system prompt instead."""
    messages = chat_messages(body)
    choice, parallel = _tool_choice(body)
    kw = dict(tools=_tools(body), tool_choice=choice, parallel=parallel, template_kwargs=_thinking(body))
    later = [m["content"] for m in messages[1:] if m["role"] == "system" and m["content"]]
    if not later:
        return render(server, messages, **kw)
    try:
        prompt = render(server, messages, **kw)
        if all(text in prompt.text for text in later):
            return prompt
    except ApiError as e:
        if e.code is not None:  # unsupported tools etc.: not about the system turns
            raise
    return render(server, fold_system(messages), **kw)


def _model(server, body: dict) -> str:
    if body.get("model") is None:
        raise invalid("model: required", "model")
    return server.check_model(body)


# -- the endpoints ----------------------------------------------------------------------------


async def count_tokens(request: web.Request) -> web.Response:
    server = server_of(request)
    body = await P.read_json(request)
    _model(server, body)
    # tools are counted as rendered: natively, or in the generic format (coli.grammar.tools)
    return web.json_response({"input_tokens": len((await off_loop(_prompt, server, body)).ids)})


def stop_reason(finish: str, stop: str | None, client_stops: list[str]) -> tuple[str, str | None]:
    if finish == "tool_calls":
        return "tool_use", None
    if finish == "length":
        return "max_tokens", None
    if stop is not None and stop in client_stops:
        return "stop_sequence", stop
    return "end_turn", None


def usage_body(prompt_tokens: int, cached: int, output_tokens: int) -> dict:
    return {"input_tokens": prompt_tokens - cached, "output_tokens": output_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}


async def messages(request: web.Request) -> web.StreamResponse:
    server = server_of(request)
    body = await P.read_json(request)
    model_id = _model(server, body)
    max_tokens = P.integer(body, "max_tokens", 1)
    if max_tokens is None:
        raise invalid("max_tokens: required", "max_tokens")
    stream = P.get(body, "stream", bool, False)
    top_k = P.integer(body, "top_k", 0)
    seed = P.get(body, "seed", int)
    sampling = server.model.sampling_params(temperature=P.number(body, "temperature", 0, 1),
                                            top_p=P.number(body, "top_p", 0, 1), top_k=top_k,
                                            seed=None if seed is None else seed % 2**63)
    if sampling.top_p == 0:
        raise invalid("top_p must be more than 0", "top_p")
    stops = P.stop_list(body, "stop_sequences", MAX_STOP_SEQUENCES)
    answer = structured.anthropic_answer(body)
    prompt = await off_loop(_prompt, server, body)
    run_stops, stop_ids, leading = stops, frozenset(), False
    if not stops:
        (run_stops, stop_ids), leading = implicit_stops(server), True
    spec = GenSpec([prompt.ids], max_tokens, sampling, 1, run_stops, leading, stop_ids,
                   cache_slot=P.integer(body, "cache_slot", 0), parser=lambda: prompt.parser(server),
                   constraint=structured.constraint(server, answer, prompt))
    spec.speculative = speculative_field(body)
    gen = Generation(server, spec)
    try:
        await gen.start()
        msg_id = f"msg_{uuid.uuid4().hex[:24]}"
        if stream:
            return await _stream(request, server, gen, msg_id, model_id, stops)
        (c,) = await collect(gen)
        content = []
        if c.reasoning:
            content.append({"type": "thinking", "thinking": "".join(c.reasoning), "signature": ""})
        if c.text:
            content.append({"type": "text", "text": "".join(c.text)})
        for _, call in sorted(c.calls.items()):
            content.append({"type": "tool_use", "id": _tool_id(call["id"]), "name": call["name"],
                            "input": json.loads(call["arguments"] or "{}")})
        reason, seq = stop_reason(c.finish_reason, c.stop, stops)
        u = c.usage
        return web.json_response({"id": msg_id, "type": "message", "role": "assistant", "model": model_id,
                                  "content": content, "stop_reason": reason, "stop_sequence": seq,
                                  "usage": usage_body(u.prompt_tokens, u.cached_tokens, u.completion_tokens)},
                                 headers=gen.headers)
    finally:
        gen.cancel()


def _tool_id(call_id: str | None) -> str:
    return "toolu_" + (call_id or uuid.uuid4().hex).removeprefix("call_")


async def _stream(request, server, gen: Generation, msg_id: str, model_id: str, stops: list[str]):
    started = gen.started[0]
    state = {"index": -1, "kind": None, "usage": None}

    def event(kind: str, data: dict) -> bytes:
        return sse({"type": kind, **data}, event=kind)

    def close_block() -> bytes:
        if state["kind"] is None:
            return b""
        state["kind"] = None
        return event("content_block_stop", {"index": state["index"]})

    def open_block(kind: str, block: dict) -> bytes:
        out = close_block()
        state["index"] += 1
        state["kind"] = kind
        return out + event("content_block_start", {"index": state["index"], "content_block": block})

    def delta(d: dict) -> bytes:
        return event("content_block_delta", {"index": state["index"], "delta": d})

    async def on_event(i: int, ev) -> bytes | None:
        if isinstance(ev, ReasoningDelta):
            out = b"" if state["kind"] == "thinking" else open_block(
                "thinking", {"type": "thinking", "thinking": "", "signature": ""})
            return out + delta({"type": "thinking_delta", "thinking": ev.text})
        if isinstance(ev, TextDelta):
            out = b"" if state["kind"] == "text" else open_block("text", {"type": "text", "text": ""})
            return out + delta({"type": "text_delta", "text": ev.text})
        if isinstance(ev, ToolCallDelta):
            out = b""
            if ev.name is not None:
                out = open_block("tool_use", {"type": "tool_use", "id": _tool_id(ev.id), "name": ev.name,
                                              "input": {}})
            if ev.arguments:
                out += delta({"type": "input_json_delta", "partial_json": ev.arguments})
            return out
        if isinstance(ev, Usage):
            state["usage"] = ev
        elif isinstance(ev, Finished):
            reason, seq = stop_reason(ev.finish_reason, ev.stop, stops)
            u = state["usage"]
            return close_block() + event("message_delta", {
                "delta": {"stop_reason": reason, "stop_sequence": seq},
                "usage": {"output_tokens": u.completion_tokens if u else 0}})
        return None

    first = event("message_start", {"message": {
        "id": msg_id, "type": "message", "role": "assistant", "model": model_id, "content": [],
        "stop_reason": None, "stop_sequence": None,
        "usage": usage_body(started.prompt_tokens, started.cached_tokens, 0)}})
    return await run_stream(request, server, gen, first, on_event, lambda: event("message_stop", {}),
                            event("ping", {}), lambda e: sse(e.anthropic(), event="error"))

