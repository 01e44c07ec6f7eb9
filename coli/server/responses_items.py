"""The Responses API's items: input items to chat messages, tools, and output items.

``coli/server/responses.py`` serves the endpoints; this module translates. Input items
(``message``, ``function_call``, ``function_call_output``, ``reasoning``) become the chat
messages every template renders; tools (function tools, also inside a ``namespace``)
become chat tools; answers become ``reasoning`` / ``message`` / ``function_call`` items.
"""
from __future__ import annotations

import json
import uuid

from coli.scheduler import Usage
from coli.server import params as P
from coli.server.errors import invalid, unsupported
from coli.server.openai import EFFORTS
from coli.server.prompts import FUNCTION_NAME, join_text


TOOL_CHOICES = ("none", "auto", "required")
SUMMARIES = ("auto", "concise", "detailed")
IGNORED_TOOLS = ("web_search", "web_search_preview")  # not offered to the model (see chat_tools)
MESSAGE_ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = {"input_text": "text", "output_text": "text", "text": "text", "refusal": "refusal",
              "reasoning_text": "text", "summary_text": "text"}
MEDIA_PARTS = {"input_image": "images are", "input_file": "files are", "input_audio": "audio is"}

def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


# -- input items to chat messages -------------------------------------------------------------


def _text(content, where: str) -> str:
    return join_text(content, where, text=TEXT_PARTS, refused=MEDIA_PARTS)


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


def listed_item(it):
    """An input item as GET .../input_items lists it: with an id, a type and text parts."""
    if not isinstance(it, dict):
        return it
    kind = it.get("type", "message" if "role" in it else None)
    out = {**it, "type": kind, "id": it.get("id") or new_id("msg" if kind == "message" else "item")}
    if kind == "message" and isinstance(it.get("content"), str):
        part = "output_text" if it.get("role") == "assistant" else "input_text"
        out["content"] = [{"type": part, "text": it["content"]}]
        out.setdefault("status", "completed")
    return out


def input_list(body: dict) -> list[dict]:
    given = body.get("input")
    if isinstance(given, str):
        return [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": given}]}]
    if not isinstance(given, list):
        raise invalid("input: expected a string or an array of input items", "input")
    return given


# -- tools and other fields -------------------------------------------------------------------


def chat_tools(body: dict) -> tuple[list[dict] | None, dict[str, str]]:
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


def tool_choice_of(body: dict):
    tc = body.get("tool_choice")
    if tc is None or tc in TOOL_CHOICES:
        return tc
    if isinstance(tc, dict) and tc.get("type") == "function" and isinstance(tc.get("name"), str):
        return tc["name"]
    if isinstance(tc, dict) and isinstance(tc.get("type"), str) and tc["type"] not in ("function", "allowed_tools"):
        raise unsupported(f"tool_choice: hosted tools ({tc['type']!r}) are not supported", "tool_choice")
    raise invalid("tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'name'}", "tool_choice")


def effort_of(body: dict) -> str | None:
    reasoning = P.get(body, "reasoning", dict, {})
    effort = P.get(reasoning, "effort", str, param="reasoning.effort")
    if effort is not None and effort not in EFFORTS:
        raise invalid(f"reasoning.effort must be one of {', '.join(EFFORTS)}, got {effort!r}", "reasoning.effort")
    summary = P.get(reasoning, "summary", str, param="reasoning.summary")
    if summary is not None and summary not in SUMMARIES:
        raise invalid(f"reasoning.summary must be one of {', '.join(SUMMARIES)}, got {summary!r}", "reasoning.summary")
    return effort


def refuse_unsupported(body: dict) -> None:
    if P.get(body, "background", bool, False):
        raise unsupported("background: responses run while the request is open; send background: false "
                          "(or leave it out)", "background")
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
    return {"type": "message", "id": mid or new_id("msg"), "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def reasoning_item(text: str, rid: str | None = None) -> dict:
    return {"type": "reasoning", "id": rid or new_id("rs"), "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": "completed"}


def call_item(call_id: str | None, name: str, arguments: str, status: str = "completed",
              fid: str | None = None) -> dict:
    return {"type": "function_call", "id": fid or new_id("fc"), "call_id": call_id or new_id("call"), "name": name,
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


def text_format(body: dict):
    """``text.format`` as a structured-output request (coli.server.structured): ``text``,
    ``json_object`` or ``json_schema`` (``name``, ``schema``, ``strict`` beside ``type``)."""
    from coli.server.structured import Answer

    text = P.get(body, "text", dict, {})
    fmt = P.get(text, "format", dict, param="text.format")
    if fmt is None or fmt.get("type") == "text":
        return Answer()
    if fmt.get("type") == "json_object":
        return Answer({"type": "object"}, param="text.format")
    if fmt.get("type") != "json_schema":
        raise invalid("text.format.type must be text, json_object or json_schema", "text.format.type")
    schema = fmt.get("schema")
    if not isinstance(schema, dict):
        raise invalid("text.format.schema must be a JSON schema (an object)", "text.format.schema")
    strict = fmt.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise invalid("text.format.strict must be a boolean", "text.format.strict")
    return Answer(schema, strict is not False, param="text.format.schema")
