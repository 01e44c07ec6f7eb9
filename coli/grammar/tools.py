"""Tool calls and structured answers as grammars, and the generic tool format.

**The generic tool format** (for chat templates without tool calling: the built-in model,
plain ChatML, Llama 3, Mistral, Tulu): the tools go into the system prompt as JSON lines
between ``<tools>`` and ``</tools>``, a call is written as

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

(one block per call, the Hermes/Qwen syntax, so models trained on it recognise it), an
earlier assistant call is rendered the same way and a tool result comes back as a user
turn ``<tool_response>...</tool_response>``. Templates with native tool calling keep
their own format; where it is this syntax (Qwen), the same grammar checks the call.

**The grammar** (Lark, llguidance's dialect): "text, then calls" for ``tool_choice`` auto
(where ``<tool_call>`` is plain text rather than one token: "text, or calls"),
"calls" for required, "a call of f" for a named function; a call's ``arguments`` follow
the tool's JSON schema (strictly for ``strict: true`` tools, else leniently: keywords
llguidance does not implement are ignored). Where the template reasons (``<think>``), an
optional reasoning block comes first.
"""
from __future__ import annotations

import json

from coli.grammar.constraint import JSON_DEFAULTS, LENIENT, Constraint, GrammarError

BEGIN, END = "<tool_call>", "</tool_call>"


# -- the generic format ----------------------------------------------------------------------


def generic_system_prompt(tools: list[dict]) -> str:
    lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return ("# Tools\n\nYou may call one or more functions to help with the user's request. The functions "
            f"are described by JSON schemas between <tools></tools>:\n<tools>\n{lines}\n</tools>\n\n"
            "To call a function, answer with a JSON object giving its name and arguments inside "
            "<tool_call></tool_call> tags, one block per call:\n<tool_call>\n"
            '{"name": <function-name>, "arguments": <arguments-json-object>}\n</tool_call>\n'
            "Function results come back inside <tool_response></tool_response> tags.")


def generic_messages(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """The chat with tools rendered for a template that has no tool calling: the tools in
    the system prompt (when given), assistant calls as text, tool results as user turns."""
    out: list[dict] = []
    for m in messages:
        m = dict(m)
        if m["role"] == "assistant" and m.get("tool_calls"):
            blocks = [f"{BEGIN}\n" + json.dumps({"name": c["function"]["name"],
                                                  "arguments": c["function"]["arguments"]}, ensure_ascii=False)
                      + f"\n{END}" for c in m.pop("tool_calls")]
            m["content"] = "\n".join(([m["content"]] if m.get("content") else []) + blocks)
        elif m["role"] == "tool":
            m = {"role": "user", "content": f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"}
            if out and out[-1]["role"] == "user" and out[-1]["content"].endswith("</tool_response>"):
                out[-1] = {**out[-1], "content": out[-1]["content"] + "\n" + m["content"]}
                continue
        out.append(m)
    if tools:
        prompt = generic_system_prompt(tools)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": (out[0].get("content") or "") + "\n\n" + prompt}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


# -- grammars --------------------------------------------------------------------------------


def _lit(text: str) -> str:
    return json.dumps(text)  # a Lark string literal


def _marker(text: str, tokens: frozenset[str]) -> str:
    """A marker in Lark: a reference to the token when the vocabulary has it as one added
    token (llguidance matches added tokens only by reference), else its text."""
    return f"<{text[1:-1]}>" if text in tokens and text.startswith("<") and text.endswith(">") else _lit(text)


def _json(schema: dict, strict: bool) -> str:
    """A ``%json`` lexeme for ``schema`` with colibri's JSON options."""
    schema = dict(schema)
    schema["x-guidance"] = {**(JSON_DEFAULTS if strict else LENIENT), **(schema.get("x-guidance") or {})}
    return "%json " + json.dumps(schema, ensure_ascii=False)


_NOT_CLOSE = "/(?s:.*)/ & ~/(?s:.*{0}.*)/"  # text that does not contain {0}


def _reasoning_rules(reasoning: tuple[str, str] | None, in_reasoning: bool,
                     tokens: frozenset[str]) -> tuple[str, list[str]]:
    """(the prefix to put before the answer, its rules) for a template that reasons."""
    if reasoning is None:
        return "", []
    open_, close = reasoning
    body = _NOT_CLOSE.format(_regex_escape(close))
    rules = [f"THINK_BODY: {body}", "THINK_WS: /[ \\t\\n]*/"]
    if in_reasoning:  # the prompt opened the block: it must be closed first
        return f"THINK_BODY {_marker(close, tokens)} THINK_WS ", rules
    rules.append(f"think: {_marker(open_, tokens)} THINK_BODY {_marker(close, tokens)} THINK_WS")
    return "think? ", rules


def _regex_escape(text: str) -> str:
    return "".join("\\" + c if c in r"\.^$|?*+()[]{}/-" else c for c in text)


def answer_constraint(constraint: Constraint, reasoning: tuple[str, str] | None, in_reasoning: bool,
                      tokens: frozenset[str] = frozenset()) -> Constraint:
    """``constraint`` on the answer, after an optional reasoning block where the template has
    one. ``tokens``: the vocabulary's added tokens (Vocabulary.added)."""
    if reasoning is None:
        return constraint
    prefix, rules = _reasoning_rules(reasoning, in_reasoning, tokens)
    lark = "\n".join([f"start: {prefix}answer", f"answer: %llguidance {constraint.grammar}", *rules])
    return Constraint.lark(lark, param=constraint.param)


def json_answer(schema: dict, *, reasoning=None, in_reasoning=False, param: str | None = None,
                strict: bool = True, tokens: frozenset[str] = frozenset()) -> Constraint:
    """A JSON answer valid against ``schema`` (after optional reasoning)."""
    if reasoning is None:
        return Constraint.json_schema(schema, param=param, strict=strict)
    if not isinstance(schema, dict):
        raise GrammarError(f"{param or 'schema'}: a JSON schema must be an object", param)
    prefix, rules = _reasoning_rules(reasoning, in_reasoning, tokens)
    lark = "\n".join([f"start: {prefix}answer", f"answer: {_json(schema, strict)}", *rules])
    return Constraint.lark(lark, param=param)


def tool_constraint(tools: list[dict], choice, *, parallel: bool = True, reasoning=None, in_reasoning: bool = False,
                    param: str = "tools", tokens: frozenset[str] = frozenset(),
                    text: Constraint | None = None) -> Constraint:
    """The answer to a request with tools, in the Hermes syntax (``<tool_call>`` blocks).
    ``choice``: None/"auto" (text or calls), "required" (calls), or a function name (a
    call of it). ``tools``: OpenAI-shaped ``{"type": "function", "function": {...}}``.
    ``text``: what a text answer must match instead (with ``auto``; e.g. a JSON schema)."""
    fns = [t["function"] for t in tools]
    if choice not in (None, "auto", "required"):
        fns = [f for f in fns if f["name"] == choice]
    rules = []
    for i, f in enumerate(fns):
        schema = f.get("parameters") or {"type": "object"}
        strict = bool(f.get("strict"))
        rules.append(f"fn_{i}: " + _lit('{"name": ' + json.dumps(f["name"]) + ', "arguments": ')
                     + f" args_{i} " + _lit("}"))
        rules.append(f"args_{i}: {_json(schema, strict)}")
    rules.append("body: " + " | ".join(f"fn_{i}" for i in range(len(fns))))
    rules.append(f"call: {_marker(BEGIN, tokens)} {_lit(chr(10))} body {_lit(chr(10))} {_marker(END, tokens)}")
    rules.append("calls: call (" + _lit("\n") + " call)*" if parallel else "calls: call")
    prefix, think = _reasoning_rules(reasoning, in_reasoning, tokens)
    if choice in (None, "auto") and text is not None:
        answer = "calls | text"
        rules.append(f"text: %llguidance {text.grammar}")
    elif choice in (None, "auto"):
        # text, then calls: where the call marker is one token, text cannot swallow it; where it is
        # plain text (the generic format on most vocabularies), an answer is text or calls
        answer = "TEXT? calls | TEXT" if BEGIN in tokens else "calls | TEXT"
        rules.append("TEXT: " + _NOT_CLOSE.format(_regex_escape(BEGIN)))
    else:
        answer = "calls"
    lark = "\n".join([f"start: {prefix}answer", f"answer: {answer}", *rules, *think])
    c = Constraint.lark(lark, param=param)
    c.kind = "tools"
    return c
