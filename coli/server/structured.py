"""Structured outputs and constrained tool calls for the HTTP APIs (see coli.grammar).

From a request body to the ``Constraint`` its answer must match:

- OpenAI ``response_format``: ``{"type": "json_object"}`` (any JSON object) or
  ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`` on chat
  completions and legacy completions (``strict: false`` ignores schema keywords
  llguidance does not implement instead of refusing them);
- Anthropic ``output_config.format`` (and the beta ``output_format``):
  ``{"type": "json_schema", "schema": {...}}``;
- the extension ``x_colibri_grammar`` on both OpenAI endpoints: a Lark grammar as a
  string, or ``{"type": "lark" | "regex" | "gbnf", "grammar": "..."}``;
- tools (``Prompt.tool_grammar``, set by ``prompts.render``): with the Hermes syntax
  (Qwen's native format and the generic one), "text or calls" for ``auto``, calls for
  ``required``, a call of the named function; arguments follow the tool's schema.

A schema or grammar that does not compile is a 400 naming the field, with llguidance's
reason. Where the template reasons (``<think>``), a reasoning block may come first.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from coli.grammar import Constraint, GrammarError
from coli.grammar import tools as T
from coli.server.errors import invalid, unsupported

GRAMMAR_FIELD = "x_colibri_grammar"
GRAMMAR_TYPES = ("lark", "regex", "gbnf")


@dataclass
class Answer:
    """What a request asks of its answer's shape (before the prompt is rendered)."""

    schema: dict | None = None  # a JSON schema (json_object: {"type": "object"})
    strict: bool = True
    grammar: Constraint | None = None  # x_colibri_grammar
    param: str | None = None

    @property
    def constrained(self) -> bool:
        return self.schema is not None or self.grammar is not None


def openai_answer(body: dict) -> Answer:
    """``response_format`` and ``x_colibri_grammar`` (one of them)."""
    out = Answer()
    fmt = body.get("response_format")
    if fmt is not None:
        if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
            raise invalid("response_format must be {'type': 'text' | 'json_object' | 'json_schema'}",
                          "response_format")
        if fmt["type"] == "json_object":
            out = Answer({"type": "object"}, param="response_format")
        elif fmt["type"] == "json_schema":
            js = fmt.get("json_schema")
            if not isinstance(js, dict) or not isinstance(js.get("schema", {}), dict):
                raise invalid("response_format.json_schema must be {'name', 'schema': {...}, 'strict'}",
                              "response_format.json_schema")
            strict = js.get("strict")
            if strict is not None and not isinstance(strict, bool):
                raise invalid("response_format.json_schema.strict must be a boolean",
                              "response_format.json_schema.strict")
            out = Answer(js.get("schema") or {}, strict is not False, param="response_format.json_schema.schema")
    grammar = body.get(GRAMMAR_FIELD)
    if grammar is not None:
        if out.constrained:
            raise invalid(f"give either response_format or {GRAMMAR_FIELD}, not both", GRAMMAR_FIELD)
        out = Answer(grammar=parse_grammar(grammar), param=GRAMMAR_FIELD)
    return out


def anthropic_answer(body: dict) -> Answer:
    """``output_config.format`` (or the beta ``output_format``): a JSON schema."""
    cfg = body.get("output_config")
    fmt, param = None, "output_format"
    if isinstance(cfg, dict) and cfg.get("format") is not None:
        fmt, param = cfg["format"], "output_config.format"
    elif body.get("output_format") is not None:
        fmt = body["output_format"]
    if fmt is None:
        return Answer()
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise invalid(f"{param} must be {{'type': 'json_schema', 'schema': {{...}}}}", param)
    return Answer(fmt["schema"], param=f"{param}.schema")


def parse_grammar(value, param: str = GRAMMAR_FIELD) -> Constraint:
    if isinstance(value, str):
        kind, text = "lark", value
    elif isinstance(value, dict) and value.get("type") in GRAMMAR_TYPES and isinstance(value.get("grammar"), str):
        kind, text = value["type"], value["grammar"]
    else:
        raise invalid(f"{param} must be a Lark grammar (a string) or {{'type': 'lark' | 'regex' | 'gbnf', "
                      "'grammar': '...'}", param)
    try:
        return getattr(Constraint, kind)(text, param=param)
    except GrammarError as e:
        raise invalid(str(e), param) from None


def default_thinking(answer: Answer, tool_choice, kwargs: dict) -> dict:
    """A constrained answer (or a forced call) starts without reasoning unless the request
    asks for it: the grammar still allows a block the template opens."""
    if (answer.constrained or tool_choice not in (None, "auto", "none")) and "enable_thinking" not in kwargs:
        kwargs = {**kwargs, "enable_thinking": False}
    return kwargs


def constraint(server, answer: Answer, prompt=None) -> Constraint | None:
    """The constraint for a rendered chat ``prompt`` (None for legacy completions) and the
    answer asked for; checked against the model's vocabulary (400 naming the field). A
    runner without grammars (the cluster router) refuses a constraint and leaves tool calls
    unconstrained."""
    if not answer.constrained and not (prompt is not None and prompt.tool_grammar):
        return None
    try:
        vocab = getattr(server.runner, "vocabulary", None)
    except GrammarError as e:  # a tokenizer llguidance cannot read (a word-level one)
        if answer.constrained:
            raise unsupported(str(e), answer.param) from None
        return None  # tool calls stay unconstrained
    if vocab is None:
        if answer.constrained:
            raise unsupported("structured outputs need a local model: this runner (the cluster router) has no "
                              "grammar engine", answer.param)
        return None
    fmt = prompt.chat_format if prompt is not None else None
    in_reasoning = prompt.in_reasoning if prompt is not None else False
    # an optional reasoning block where the template reasons and thinking is on (or the prompt opened it)
    reasoning = fmt.reasoning if fmt is not None and (prompt.thinking or in_reasoning) else None
    try:
        if prompt is not None and prompt.continued and (answer.constrained or prompt.tool_grammar):
            raise invalid("a trailing assistant message cannot be continued under a constraint "
                          "(response_format, x_colibri_grammar or tools)", "messages")
        if prompt is not None and prompt.tool_grammar:
            text = _answer_constraint(answer, reasoning=None, in_reasoning=False, tokens=vocab.added)
            c = T.tool_constraint(_usable_tools(prompt.tool_list, vocab), prompt.tool_choice, parallel=prompt.parallel, reasoning=reasoning,
                                  in_reasoning=in_reasoning, tokens=vocab.added, text=text)
        elif answer.constrained:
            c = _answer_constraint(answer, reasoning, in_reasoning, vocab.added)
        else:
            return None
        c.check(vocab)
    except GrammarError as e:
        raise invalid(str(e), e.param) from None
    return c


def _usable_tools(tools: list[dict], vocab) -> list[dict]:
    """The tools, where a non-strict tool's schema that does not compile even leniently
    lets its arguments be any JSON object (a strict one is refused, naming it)."""
    out = []
    for i, t in enumerate(tools):
        fn = t["function"]
        schema = fn.get("parameters") or {"type": "object"}
        strict = bool(fn.get("strict"))
        key = (id(vocab), strict, json.dumps(schema, sort_keys=True))
        ok = _SCHEMA_OK.get(key)
        if ok is None:
            try:
                Constraint.json_schema(schema, param=f"tools[{i}].function.parameters", strict=strict).check(vocab)
                ok = True
            except GrammarError:
                if strict:
                    raise
                ok = False
            if len(_SCHEMA_OK) > 1024:
                _SCHEMA_OK.clear()
            _SCHEMA_OK[key] = ok
        out.append(t if ok else {**t, "function": {**fn, "parameters": {"type": "object"}}})
    return out


_SCHEMA_OK: dict[tuple, bool] = {}  # (vocabulary, strict, schema) -> it compiles


def _answer_constraint(answer: Answer, reasoning, in_reasoning: bool, tokens) -> Constraint | None:
    if answer.schema is not None:
        return T.json_answer(answer.schema, reasoning=reasoning, in_reasoning=in_reasoning, param=answer.param,
                             strict=answer.strict, tokens=tokens)
    if answer.grammar is not None:
        return T.answer_constraint(answer.grammar, reasoning, in_reasoning, tokens)
    return None
