"""From API messages to prompt token ids, the same way for both APIs.

``normalize_openai`` / the Anthropic module turn a request's messages into the plain
dicts chat templates expect (string contents, tool calls with object arguments);
``render`` applies the model's template with tools and template switches, continues a
trailing assistant turn, appends a forced tool-call opening, and says how to parse the
output (``Prompt.parser``).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

from coli.chat_format import HERMES, ChatFormat, OutputParser, forced_prefix, opens_reasoning
from coli.errors import InvalidRequestError
from coli.grammar.tools import generic_messages
from coli.server.errors import invalid, unsupported
from coli.server.limits import BIG_INPUT, check_length, release_memory

ROLES = ("system", "developer", "user", "assistant", "tool")
RESERVED_TEMPLATE_KWARGS = {"messages", "tools", "documents", "add_generation_prompt", "continue_final_message",
                            "chat_template", "tokenize"}
FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
IMAGE_PARTS = {"image_url", "input_image", "image"}
AUDIO_PARTS = {"input_audio", "audio"}


@dataclass
class Prompt:
    ids: list[int]
    text: str
    tools: bool  # tool calls are parsed from the output
    in_reasoning: bool  # the prompt leaves the model inside a reasoning block
    primed: str = ""  # a forced tool-call opening at the end of the prompt
    parallel: bool = True
    continued: bool = False  # a trailing assistant turn is being continued
    chat_format: ChatFormat | None = None  # how the output is parsed (the generic tool format: Hermes calls)
    tool_list: list[dict] | None = None  # the active tools
    tool_choice: str | None = None
    tool_grammar: bool = False  # the calls' syntax has a grammar (coli.server.structured constrains them)
    thinking: bool = True  # the template was not told enable_thinking=False: the answer may open reasoning

    def parser(self, server) -> OutputParser:
        return OutputParser(self.chat_format or server.chat_format, tools=self.tools, in_reasoning=self.in_reasoning,
                            parallel=self.parallel, primed=self.primed)


# -- OpenAI messages --------------------------------------------------------------------------


def join_text(content, where: str, *, text: dict, refused: dict, noun: str = "content parts",
              unknown_unsupported: bool = False) -> str:
    """A string, or an array of typed parts joined into one string, for every API's content.

    ``text`` maps each text part type to the key that holds its text; ``refused`` maps the
    media part types this text-only server refuses to how the error names them ("images are");
    any other part is invalid (or unsupported, with ``unknown_unsupported``)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(f"{where}: expected a string or an array of {noun}", where)
    texts = []
    for j, part in enumerate(content):
        at = f"{where}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if not isinstance(kind, str):
            raise invalid(f"{at}: a content part must be an object with a type", at)
        if kind in refused:
            raise unsupported(f"{at}: {refused[kind]} not supported: this server is text-only", at)
        key = text.get(kind)
        if key is None:
            if unknown_unsupported:
                raise unsupported(f"{at}: content parts of type {kind!r} are not supported (only text)", at)
            raise invalid(f"{at}: expected a text part, got {kind!r}", at)
        if not isinstance(part.get(key), str):
            raise invalid(f"{at}: a {kind} part needs a string {key}", at)
        texts.append(part[key])
    return "\n".join(texts)


OPENAI_TEXT = {"text": "text", "input_text": "text", "refusal": "refusal"}
OPENAI_REFUSED = {**{k: "images are" for k in IMAGE_PARTS}, **{k: "audio is" for k in AUDIO_PARTS}}


def text_of(content, where: str) -> str:
    """An OpenAI message content as one string; null is empty (an assistant turn that only
    calls tools)."""
    if content is None:
        return ""
    return join_text(content, where, text=OPENAI_TEXT, refused=OPENAI_REFUSED, unknown_unsupported=True)


def normalize_openai(messages) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise invalid("messages: expected a non-empty array of messages", "messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise invalid(f"{where}: expected an object", where)
        role = m.get("role")
        if role == "function":
            raise unsupported(f"{where}: the 'function' role is deprecated; send tool results with role 'tool'",
                              where)
        if role not in ROLES:
            raise invalid(f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}", f"{where}.role")
        msg = {"role": "system" if role == "developer" else role}
        msg["content"] = text_of(m.get("content"), f"{where}.content")
        for key in ("name", "tool_call_id", "reasoning_content", "reasoning"):
            if m.get(key) is not None and not isinstance(m[key], str):
                raise invalid(f"{where}.{key} must be a string", f"{where}.{key}")
        calls = _tool_calls(m["tool_calls"], f"{where}.tool_calls") if m.get("tool_calls") is not None else None
        if m.get("name") is not None:
            msg["name"] = m["name"]
        if role == "assistant":
            reasoning = m.get("reasoning_content", m.get("reasoning"))
            if reasoning is not None:
                msg["reasoning_content"] = reasoning
            if calls is not None:
                msg["tool_calls"] = calls
        if role == "tool":
            msg["tool_call_id"] = m.get("tool_call_id")
        out.append(msg)
    return out


def _tool_calls(calls, where: str) -> list[dict]:
    if not isinstance(calls, list):
        raise invalid(f"{where}: expected an array", where)
    out = []
    for j, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not isinstance(fn.get("arguments"), str) \
                or c.get("type") != "function" or not isinstance(c.get("id") or "", str):
            raise invalid(f"{where}[{j}]: expected {{'id', 'type': 'function', 'function': {{'name', 'arguments' "
                          "(a JSON string)}}}}", f"{where}[{j}]")
        out.append({"id": c.get("id"), "type": "function",
                    "function": {"name": fn["name"], "arguments": _arguments_object(fn.get("arguments"))}})
    return out


def _arguments_object(args):
    """Templates render arguments as an object (as transformers does); a JSON string is parsed."""
    if isinstance(args, str):
        try:
            value = json.loads(args)
        except ValueError:
            return args
        return value if isinstance(value, dict) else args
    return args if args is not None else {}


def openai_tools(tools, where: str = "tools") -> list[dict]:
    if not isinstance(tools, list):
        raise invalid(f"{where}: expected an array of tools", where)
    out = []
    for i, t in enumerate(tools):
        at = f"{where}[{i}]"
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(t.get("function"),
                                                                                                 dict):
            raise invalid(f"{at}: expected {{'type': 'function', 'function': {{'name', 'description', "
                          "'parameters'}}}} (only function tools are supported)", at)
        name = t["function"].get("name")
        if not isinstance(name, str) or not FUNCTION_NAME.match(name):
            raise invalid(f"{at}.function.name must be 1-64 letters, digits, '_', '.' or '-'", f"{at}.function.name")
        params = t["function"].get("parameters")
        if params is not None and not isinstance(params, dict):
            raise invalid(f"{at}.function.parameters must be a JSON schema object", f"{at}.function.parameters")
        out.append({"type": "function", "function": t["function"]})
    return out


# -- rendering --------------------------------------------------------------------------------


def render(server, messages: list[dict], *, tools: list[dict] | None = None, tool_choice=None,
           parallel: bool = True, template_kwargs: dict | None = None, api_param: str = "tools") -> Prompt:
    """Token ids for a chat. ``tool_choice``: None / "auto" / "none" / "required" / a function
    name. Raises ApiError (400) for what the model's template cannot do."""
    fmt, tok = server.chat_format, server.model.tokenizer
    kwargs = {k: v for k, v in (template_kwargs or {}).items() if k not in RESERVED_TEMPLATE_KWARGS}
    active = bool(tools) and tool_choice != "none"
    if tool_choice not in (None, "auto", "none") and not tools:
        raise invalid(f"tool_choice {tool_choice!r} needs tools", "tool_choice")
    # a template without tool calling gets the generic tool format (coli.grammar.tools): tools in the
    # system prompt, calls and results as text, calls parsed (and constrained) in the Hermes syntax
    last = messages[-1]  # (as sent: the generic format turns calls into text)
    generic = fmt.tools is None and (active or any(m.get("tool_calls") or m["role"] == "tool" for m in messages))
    if generic:
        messages = generic_messages(messages, tools if active else None)
        fmt = ChatFormat(fmt.name, fmt.reasoning, HERMES if active else None, fmt.role_markers, fmt.turn_end)
    tool_grammar = active and fmt.tools is HERMES
    names = {t["function"]["name"] for t in tools or []}
    if tool_choice not in (None, "auto", "none", "required") and tool_choice not in names:
        raise invalid(f"tool_choice names the function {tool_choice!r}, which is not among the tools", "tool_choice")
    continuing = (server.config.continue_assistant and last["role"] == "assistant"
                  and isinstance(last.get("content"), str) and last["content"] != "")
    if continuing:
        if active or last.get("tool_calls"):
            raise invalid("a trailing assistant message cannot be continued together with tools or tool calls; "
                          "drop the tools or end with a user message", "messages")
        if last["content"] != last["content"].rstrip():
            raise invalid("a trailing assistant message to continue must not end in whitespace (the template "
                          "strips it, so the model would resume from other text)", "messages")
    tools_arg = tools if active and not generic else None
    check_length(server, sum(len(v) for m in messages for v in m.values() if isinstance(v, str)))
    text = None
    if continuing:
        try:
            text = tok.apply_chat_template(messages, add_generation_prompt=False, tools=tools_arg,
                                           continue_final_message=True, **kwargs)
        except InvalidRequestError:
            text = None  # the template has no open-turn shape: close the turn and cue a new one
    if text is None:
        continuing = False
        try:
            text = tok.apply_chat_template(messages, add_generation_prompt=True, tools=tools_arg, **kwargs)
        except InvalidRequestError as e:
            raise invalid(str(e), "messages") from None
    in_reasoning = opens_reasoning(fmt, text)
    primed = ""
    if active and tool_choice not in (None, "auto") and not tool_grammar:  # (a grammar forces the opening)
        primed = forced_prefix(fmt, None if tool_choice == "required" else tool_choice)
        text += primed
        in_reasoning = False
    check_length(server, len(text))
    ids = tok.encode(text, add_special_tokens=False)
    if len(text) > BIG_INPUT:
        release_memory()
    if not ids:
        raise invalid("the rendered prompt is empty", "messages")
    return Prompt(ids, text, active, in_reasoning, primed, parallel, continuing, fmt, tools if active else None,
                  tool_choice, tool_grammar, kwargs.get("enable_thinking", True) is not False)


def implicit_stops(server, prompt_ids_only: bool = False) -> tuple[list[str], frozenset[int]]:
    """The template's role markers as stops for chat requests without client stops: single
    special tokens become stop ids (the detokenizer hides them), others stop strings."""
    fmt, tok = server.chat_format, server.model.tokenizer
    strings, ids = [], set()
    for marker in (*fmt.role_markers, *fmt.turn_end):
        t = tok.token_to_id(marker)
        if t is not None and t in tok.special_token_ids:
            if t not in server.model.eos_ids:
                ids.add(t)
        elif t is None or t not in tok.special_token_ids:
            strings.append(marker)
    return strings, frozenset(ids)
