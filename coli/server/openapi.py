"""GET /openapi.json: an OpenAPI 3.1 description of every endpoint.

tests/test_server_fuzz.py keeps it true: every route is described, every answer the
server gives to generated requests (valid and invalid ones) matches the documented
status codes, content types and schemas.
"""
from __future__ import annotations

from coli.server.anthropic import EFFORTS as ANTHROPIC_EFFORTS
from coli.server.openai import EFFORTS, MAX_N, MAX_TOP_LOGPROBS
from coli.server.systemone import openapi_schemas as systemone_schemas

JSON = "application/json"
SSE = "text/event-stream"


def _obj(props: dict, required: tuple = (), extra: bool = True) -> dict:
    s = {"type": "object", "properties": props}
    if required:
        s["required"] = list(required)
    if not extra:
        s["additionalProperties"] = False
    return s


def _ref(name: str) -> dict:
    return {"$ref": f"#/components/schemas/{name}"}


def _nullable(schema: dict) -> dict:
    return {"anyOf": [schema, {"type": "null"}]}


STR = {"type": "string"}
INT = {"type": "integer"}
NUM = {"type": "number"}
BOOL = {"type": "boolean"}
NULL_STR = _nullable(STR)

TEXT_PART = _obj({"type": {"const": "text"}, "text": STR}, ("type", "text"))
CONTENT = {"anyOf": [STR, {"type": "array", "items": TEXT_PART}]}
TOOL_CALL = _obj({"id": STR, "type": {"const": "function"},
                  "function": _obj({"name": STR, "arguments": STR}, ("name", "arguments"))}, ("type", "function"))
MESSAGE = _obj({"role": {"enum": ["system", "developer", "user", "assistant", "tool"]},
                "content": _nullable(CONTENT), "name": STR, "tool_calls": {"type": "array", "items": TOOL_CALL},
                "tool_call_id": STR, "reasoning_content": STR}, ("role",))
TOOL = _obj({"type": {"const": "function"},
             "function": _obj({"name": {"type": "string", "pattern": "^[A-Za-z0-9_.-]{1,64}$"}, "description": STR,
                               "parameters": {"type": "object"}}, ("name",))}, ("type", "function"))
TOOL_CHOICE = {"anyOf": [{"enum": ["none", "auto", "required"]},
                         _obj({"type": {"const": "function"}, "function": _obj({"name": STR}, ("name",))},
                              ("type", "function"))]}
STOP = {"anyOf": [{"type": "string", "minLength": 1},
                  {"type": "array", "items": {"type": "string", "minLength": 1}, "maxItems": 4}, {"type": "null"}]}


def _sampling(model_id: str) -> dict:
    """Fields chat and legacy completions share."""
    return {
        "model": {"type": "string", "enum": [model_id], "description": "the served model id (GET /v1/models)"},
        "max_tokens": {"type": "integer", "minimum": 1, "description": "a ceiling, clamped to the room the "
                                                                       "context leaves (finish_reason length)"},
        "temperature": {"type": "number", "minimum": 0, "maximum": 2},
        "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
        "top_k": {"type": "integer", "minimum": -1, "description": "-1 or 0: off"},
        "min_p": {"type": "number", "minimum": 0, "maximum": 1},
        "presence_penalty": {"type": "number", "minimum": -2, "maximum": 2},
        "frequency_penalty": {"type": "number", "minimum": -2, "maximum": 2},
        "repetition_penalty": {"type": "number", "minimum": 0.01, "maximum": 10},
        "seed": {"type": "integer", "description": "the same request and seed give the same text"},
        "logit_bias": {"type": "object", "propertyNames": {"pattern": "^[0-9]+$"},
                       "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100}},
        "n": {"type": "integer", "minimum": 1, "maximum": MAX_N},
        "stop": STOP,
        "stream": BOOL,
        "stream_options": _nullable(_obj({"include_usage": BOOL, "x_colibri_stats": BOOL})),
        "cache_slot": {"type": "integer", "minimum": 0, "description": "the KV slot to use (0..--kv-slots - 1)"},
        "x_colibri_ignore_leading_stop": BOOL,
        "response_format": _obj({"type": {"enum": ["text", "json_object", "json_schema"]},
                                 "json_schema": _obj({"name": STR, "schema": {"type": "object"}, "strict": BOOL})},
                                ("type",)),
        "x_colibri_grammar": {"anyOf": [STR, _obj({"type": {"enum": ["lark", "regex", "gbnf"]}, "grammar": STR},
                                                  ("type", "grammar"))],
                              "description": "constrain the answer to a Lark grammar (a string), a regex or GBNF"},
    }


def _usage() -> dict:
    return _obj({"prompt_tokens": INT, "completion_tokens": INT, "total_tokens": INT,
                 "prompt_tokens_details": _obj({"cached_tokens": INT}, ("cached_tokens",))},
                ("prompt_tokens", "completion_tokens", "total_tokens", "prompt_tokens_details"))


def schemas(model_id: str) -> dict:
    sampling = _sampling(model_id)
    logprob = _obj({"token": STR, "logprob": NUM, "bytes": {"type": "array", "items": INT},
                    "top_logprobs": {"type": "array", "items": _obj({"token": STR, "logprob": NUM, "bytes": {
                        "type": "array", "items": INT}}, ("token", "logprob"))}}, ("token", "logprob"))
    anthropic_block = {"anyOf": [
        STR, {"type": "array", "items": _obj({"type": {"enum": ["text"]}, "text": STR}, ("type", "text"))}]}
    messages_request = _obj({
        "model": {"type": "string", "enum": [model_id]}, "max_tokens": {"type": "integer", "minimum": 1},
        "system": anthropic_block,
        "messages": {"type": "array", "minItems": 1, "items": _obj({
            "role": {"enum": ["user", "assistant", "system"]},
            "content": {"anyOf": [STR, {"type": "array", "items": {"anyOf": [
                _obj({"type": {"const": "text"}, "text": STR}, ("type", "text")),
                _obj({"type": {"const": "thinking"}, "thinking": STR, "signature": STR}, ("type", "thinking")),
                _obj({"type": {"const": "tool_use"}, "id": STR, "name": STR, "input": {"type": "object"}},
                     ("type", "id", "name", "input")),
                _obj({"type": {"const": "tool_result"}, "tool_use_id": STR, "content": anthropic_block,
                      "is_error": BOOL}, ("type", "tool_use_id"))]}}]}}, ("role", "content"))},
        "stop_sequences": {"type": "array", "items": {"type": "string", "minLength": 1}, "maxItems": 16},
        "temperature": {"type": "number", "minimum": 0, "maximum": 1},
        "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
        "top_k": {"type": "integer", "minimum": 0}, "seed": INT, "stream": BOOL,
        "tools": {"type": "array", "items": _obj({
            "name": {"type": "string", "pattern": "^[A-Za-z0-9_.-]{1,64}$"}, "description": STR,
            "input_schema": {"type": "object"}}, ("name", "input_schema"))},
        "tool_choice": _obj({"type": {"enum": ["auto", "any", "tool", "none"]}, "name": STR,
                             "disable_parallel_tool_use": BOOL}, ("type",)),
        "thinking": _obj({"type": {"enum": ["enabled", "disabled", "adaptive"]},
                          "budget_tokens": {"type": "integer", "minimum": 1}}, ("type",)),
        "metadata": {"type": "object"}, "cache_slot": {"type": "integer", "minimum": 0},
        "output_config": _obj({"effort": {"enum": list(ANTHROPIC_EFFORTS)},
                               "format": _obj({"type": {"const": "json_schema"}, "schema": {"type": "object"}},
                                              ("type", "schema"))}),
        "output_format": _obj({"type": {"const": "json_schema"}, "schema": {"type": "object"}}, ("type", "schema")),
        "context_management": {"type": "object", "description": "accepted and ignored"},
    }, ("model", "max_tokens", "messages"))
    return {
        **responses_schemas(model_id),
        "Error": _obj({"error": _obj({"message": STR, "type": STR, "param": NULL_STR, "code": NULL_STR},
                                     ("message", "type"))}, ("error",)),
        "AnthropicError": _obj({"type": {"const": "error"}, "error": _obj({"type": STR, "message": STR},
                                                                          ("type", "message"))}, ("type", "error")),
        "Model": _obj({"id": STR, "object": {"const": "model"}, "created": INT, "owned_by": STR,
                       "max_model_len": INT}, ("id", "object", "created", "owned_by")),
        "ModelList": _obj({"object": {"const": "list"}, "data": {"type": "array", "items": _ref("Model")},
                           "models": _ref("JevModels")}, ("object", "data")),
        **systemone_schemas(model_id),
        "ChatCompletionRequest": _obj({
            **sampling, "messages": {"type": "array", "items": MESSAGE, "minItems": 1},
            "max_completion_tokens": {"type": "integer", "minimum": 1},
            "logprobs": BOOL, "top_logprobs": {"type": "integer", "minimum": 0, "maximum": MAX_TOP_LOGPROBS},
            "tools": {"type": "array", "items": TOOL}, "tool_choice": TOOL_CHOICE, "parallel_tool_calls": BOOL,
            "enable_thinking": BOOL, "reasoning_effort": {"enum": list(EFFORTS)},
            "chat_template_kwargs": {"type": "object"},
        }, ("messages",)),
        "ChatCompletion": _obj({
            "id": STR, "object": {"const": "chat.completion"}, "created": INT, "model": STR,
            "choices": {"type": "array", "items": _obj({
                "index": INT, "finish_reason": {"enum": ["stop", "length", "tool_calls", "malformed_tool_call"]},
                "logprobs": _nullable(_obj({"content": {"type": "array", "items": logprob}})),
                "message": _obj({"role": {"const": "assistant"}, "content": NULL_STR, "reasoning_content": STR,
                                 "reasoning": STR, "tool_calls": {"type": "array", "items": TOOL_CALL}},
                                ("role", "content"))}, ("index", "message", "finish_reason"))},
            "usage": _usage()}, ("id", "object", "created", "model", "choices", "usage")),
        "CompletionRequest": _obj({
            **sampling,
            "prompt": {"anyOf": [STR, {"type": "array", "items": STR, "minItems": 1, "maxItems": MAX_N},
                                 {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1},
                                 {"type": "array", "minItems": 1, "maxItems": MAX_N, "items": {
                                     "type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}}]},
            "echo": BOOL, "logprobs": {"type": "integer", "minimum": 0, "maximum": MAX_TOP_LOGPROBS},
            "best_of": {"type": "integer", "minimum": 1, "maximum": MAX_N},
        }, ("prompt",)),
        "Completion": _obj({
            "id": STR, "object": {"const": "text_completion"}, "created": INT, "model": STR,
            "choices": {"type": "array", "items": _obj({
                "index": INT, "text": STR, "finish_reason": {"enum": ["stop", "length"]},
                "logprobs": _nullable(_obj({"tokens": {"type": "array", "items": STR}}))},
                ("index", "text", "finish_reason"))},
            "usage": _usage()}, ("id", "object", "created", "model", "choices", "usage")),
        "MessagesRequest": messages_request,
        "Message": _obj({
            "id": STR, "type": {"const": "message"}, "role": {"const": "assistant"}, "model": STR,
            "content": {"type": "array", "items": _obj({"type": {"enum": ["text", "thinking", "tool_use"]}},
                                                       ("type",))},
            "stop_reason": {"enum": ["end_turn", "max_tokens", "stop_sequence", "tool_use"]},
            "stop_sequence": NULL_STR,
            "usage": _obj({"input_tokens": INT, "output_tokens": INT, "cache_creation_input_tokens": INT,
                           "cache_read_input_tokens": INT}, ("input_tokens", "output_tokens"))},
            ("id", "type", "role", "model", "content", "stop_reason", "usage")),
        "CountTokensRequest": _obj({k: v for k, v in messages_request["properties"].items() if k in (
            "model", "system", "messages", "tools", "tool_choice", "thinking")}, ("model", "messages")),
        "TokenCount": _obj({"input_tokens": INT}, ("input_tokens",)),
        "BrioRequest": _obj({
            "model": {"type": "string", "enum": [model_id]},
            "options": {"type": "array", "items": {"type": "string", "minLength": 1, "pattern": r"\S"},
                        "minItems": 2, "maxItems": 64, "uniqueItems": True},
            "state": STR, "messages": {"type": "array", "items": MESSAGE, "minItems": 1}, "question": STR,
            "normalize": {"enum": ["mean", "sum"]}, "cache_slot": {"type": "integer", "minimum": 0}}, ("options",)),
        "Brio": _obj({
            "object": {"const": "brio.choice"}, "model": STR, "answer": STR,
            "entropy": {"type": "number", "minimum": 0, "maximum": 1}, "normalize": {"enum": ["mean", "sum"]},
            "choices": {"type": "array", "items": _obj({"option": STR, "p": {"type": "number", "minimum": 0,
                                                                               "maximum": 1},
                                                         "logprob": NUM, "mean_logprob": NUM, "tokens": INT},
                                                        ("option", "p", "logprob", "mean_logprob", "tokens"))},
            "usage": _obj({"prompt_tokens": INT, "completion_tokens": INT, "read_tokens": INT, "total_tokens": INT},
                          ("prompt_tokens", "completion_tokens", "read_tokens", "total_tokens"))},
            ("object", "answer", "entropy", "normalize", "choices", "usage")),
        "TokenizeRequest": {**_obj({"model": {"type": "string", "enum": [model_id]}, "prompt": STR,
                                    "add_special_tokens": BOOL, "messages": {"type": "array", "items": MESSAGE,
                                                                             "minItems": 1},
                                    "add_generation_prompt": BOOL, "return_token_strs": BOOL,
                                    "tools": {"type": "array", "items": TOOL}, "enable_thinking": BOOL,
                                    "chat_template_kwargs": {"type": "object"}}),
                            "anyOf": [{"required": ["prompt"]}, {"required": ["messages"]}]},
        "Tokens": _obj({"tokens": {"type": "array", "items": INT}, "count": INT, "max_model_len": INT,
                        "token_strs": {"type": "array", "items": STR}}, ("tokens", "count", "max_model_len")),
        "DetokenizeRequest": _obj({"model": {"type": "string", "enum": [model_id]},
                                   "tokens": {"type": "array", "items": {"type": "integer", "minimum": 0}}},
                                  ("tokens",)),
        "Text": _obj({"prompt": STR}, ("prompt",)),
        "Health": _obj({"status": {"enum": ["ok", "closed"]}, "active": INT, "queued": INT, "capacity": INT,
                        "max_queue": INT, "admitted": INT, "completed": INT, "failed": INT, "rejected": INT,
                        "timed_out": INT, "cancelled": INT,
                        "slots": {"type": "array", "items": _obj({"slot": INT, "busy": BOOL, "tokens": INT})},
                        "model": STR, "context": INT, "uptime_seconds": NUM, "memory": {"type": "object"},
                        "hardware": {"type": "object"}, "plan": {"type": "object"}},
                       ("status", "active", "queued", "slots")),
        "Experts": _obj({"rows": INT, "cols": INT, "seq": INT, "tiers": {"type": "object"},
                         "cells": {"type": "string", "contentEncoding": "base64",
                                   "description": "rows x cols bytes, row-major: tier << 6 | heat; tier 0 disk, "
                                                  "1 RAM, 2 pinned; heat = bit length of the routing count"},
                         "routed": {"type": "string", "contentEncoding": "base64",
                                    "description": "bitmap of rows x cols bits (row-major, least significant "
                                                   "bit first): experts routed in the latest step"},
                         "routed_tokens": INT}, ("rows", "cols", "seq", "cells", "routed")),
        "Profile": _obj({"window": INT, "turns": {"type": "array", "items": _obj({
            "wall_seconds": NUM, "prompt_tokens": INT, "cached_tokens": INT, "completion_tokens": INT,
            "forward_passes": INT, "disk_seconds": NUM, "io_wait_seconds": NUM, "expert_matmul_seconds": NUM,
            "attention_seconds": NUM, "dense_mlp_seconds": NUM, "lm_head_seconds": NUM, "other_seconds": NUM,
            "tokens_per_second": _nullable(NUM)})}, "totals": {"type": "object"}}, ("window", "turns", "totals")),
    }


SSE_EVENT = _obj({"event": STR, "data": STR, "id": STR, "retry": INT}, ("data",))


def _json(ref: str) -> dict:
    return {"content": {JSON: {"schema": _ref(ref)}}}


def _op(summary: str, ok: str | None, *, body: str | None = None, stream: bool = False, anthropic: bool = False,
        ok_schema: dict | None = None, ok_type: str = JSON, params: list | None = None, extra: dict | None = None):
    err = "AnthropicError" if anthropic else "Error"
    content = {ok_type: {"schema": ok_schema if ok_schema is not None else _ref(ok)}}
    if stream:  # each server-sent event; data is JSON (OpenAI's stream ends with data: [DONE])
        content[SSE] = {"schema": SSE_EVENT}
    op = {"summary": summary, "responses": {"200": {"description": "OK", "content": content},
                                            "default": {"description": "an API-shaped error", **_json(err)},
                                            **(extra or {})}}
    if body is not None:
        op["requestBody"] = {"required": True, "content": {JSON: {"schema": _ref(body)}}}
    if params:
        op["parameters"] = params
    return op


def _given(name: str) -> dict:
    """A subschema that holds when ``name`` is present and not null (null reads as absent)."""
    return {"required": [name], "properties": {name: {"not": {"type": "null"}}}}


def cross_field_rules(out: dict, server) -> dict:
    """The rules that tie fields together, so a schema-driven client or fuzzer sees what
    the server refuses: top_logprobs needs logprobs, a forced tool_choice needs tools, Brio
    takes state or messages (one of them), and n is at most what the slots and the queue
    hold together (more is a 400, too_many_choices)."""
    chat = out["ChatCompletionRequest"]
    chat["allOf"] = [
        {"if": _given("top_logprobs"), "then": {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}}},
        {"if": {"required": ["tool_choice"], "properties": {"tool_choice": {"not": {"enum": [None, "none", "auto"]}}}},
         "then": {"required": ["tools"], "properties": {"tools": {"type": "array", "minItems": 1}}}},
    ]
    out["BrioRequest"]["oneOf"] = [{"allOf": [_given("state"), {"not": _given("messages")}]},
                                   {"allOf": [_given("messages"), {"not": _given("state")}]}]
    config = getattr(server.runner, "config", None)
    slots, queue = getattr(config, "kv_slots", None), getattr(config, "max_queue", None)
    if isinstance(slots, int) and isinstance(queue, int):
        for name in ("ChatCompletionRequest", "CompletionRequest"):
            n = out[name]["properties"]["n"]
            out[name]["properties"]["n"] = {**n, "maximum": min(n["maximum"], slots + queue),
                                            "description": "at most --kv-slots + --max-queue"}
    out["CompletionRequest"]["properties"]["best_of"]["description"] = "supported only equal to n"
    return out


def _jev(op: dict) -> dict:
    """An operation whose errors use the Jev envelope ({"detail": ...})."""
    op["responses"]["default"] = {"description": "a Jev-shaped error", **_json("JevError")}
    return op


def nullable_optionals(schema):
    """The server reads JSON null as "not given" (clients send nulls for unset fields), so
    every optional property of every object also accepts null."""
    if isinstance(schema, list):
        return [nullable_optionals(x) for x in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: nullable_optionals(v) for k, v in schema.items()}
    if out.get("type") == "object" and isinstance(out.get("properties"), dict):
        required = set(out.get("required", ()))
        out["properties"] = {k: v if k in required or _allows_null(v) else _nullable(v)
                             for k, v in out["properties"].items()}
    return out


def _allows_null(schema: dict) -> bool:
    return schema.get("type") == "null" or any(_allows_null(x) for x in schema.get("anyOf", ()))


def document(server) -> dict:
    model_param = [{"name": "model", "in": "path", "required": True, "schema": STR}]
    return {
        "openapi": "3.1.0",
        "info": {"title": "colibri (coli serve)", "version": "1",
                 "description": "OpenAI- and Anthropic-compatible API of a local colibri server."},
        "servers": [{"url": "/"}],
        "security": [{"bearer": []}, {"apiKey": []}],
        "paths": {
            "/v1/models": {"get": _op("List the served model", "ModelList")},
            "/v1/models/{model}": {"get": _op("One model", "Model", params=model_param)},
            "/v1/chat/completions": {"post": _op("Chat completion (OpenAI)", "ChatCompletion",
                                                 body="ChatCompletionRequest", stream=True)},
            "/v1/completions": {"post": _op("Text completion (OpenAI, legacy)", "Completion",
                                            body="CompletionRequest", stream=True)},
            "/v1/messages": {"post": _op("Message (Anthropic)", "Message", body="MessagesRequest", stream=True,
                                         anthropic=True)},
            "/v1/messages/count_tokens": {"post": _op("Count a request's input tokens (Anthropic)", "TokenCount",
                                                      body="CountTokensRequest", anthropic=True)},
            **responses_paths(),
            "/v1/brio": {"post": _op("Closed-set scoring: the probability of each option", "Brio",
                                     body="BrioRequest")},
            "/v1/systemone": {"post": _jev(_op("Typed decisions with probabilities (TypeSafe's Jev API)",
                                               "SystemOne", body="SystemOneRequest"))},
            "/tokenize": {"post": _op("Token ids of a text or a rendered chat", "Tokens", body="TokenizeRequest")},
            "/detokenize": {"post": _op("Text of token ids", "Text", body="DetokenizeRequest")},
            "/health": {"get": {**_op("Scheduler counters and slots; model, memory and hardware when "
                                      "authenticated", "Health",
                                      extra={"503": {"description": "shutting down", **_json("Health")}}),
                                "security": [{}, {"bearer": []}, {"apiKey": []}]}},
            "/metrics": {"get": _op("Prometheus metrics (colibri_scheduler_*, colibri_server_*)", None,
                                    ok_schema={"type": "string"}, ok_type="text/plain")},
            "/experts": {"get": _op("Expert grid: tier and routing heat of every expert", "Experts")},
            "/experts/atlas": {"get": _op("The expert atlas made by coli atlas (experts.json, docs/ATLAS.md); "
                                          "404 atlas_not_found when there is none", None,
                                          ok_schema=_obj({"format": {"const": "coli-atlas"}, "version": INT,
                                                          "model": {"type": "object"},
                                                          "regions": {"type": "array"}, "layers": {"type": "array"}},
                                                         ("format", "version", "model", "regions", "layers")))},
            "/profile": {"get": _op("Recent turns: time by phase, tokens, forward passes", "Profile")},
            "/openapi.json": {"get": _op("This document", None, ok_schema={"type": "object"})},
        },
        "components": {
            "schemas": nullable_optionals(cross_field_rules(schemas(server.model_id), server)),
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"},
                                "apiKey": {"type": "apiKey", "in": "header", "name": "x-api-key"}},
        },
    }


# -- the Responses API (coli/server/responses.py) ---------------------------------------------


def responses_schemas(model_id: str) -> dict:
    text_part = {"anyOf": [_obj({"type": {"enum": ["input_text", "output_text", "text"]}, "text": STR},
                                ("type", "text")),
                           _obj({"type": {"const": "refusal"}, "refusal": STR}, ("type", "refusal"))]}
    content = {"anyOf": [STR, {"type": "array", "items": text_part}]}
    reasoning_part = _obj({"type": {"enum": ["reasoning_text", "summary_text"]}, "text": STR}, ("type", "text"))
    item = {"anyOf": [
        _obj({"type": {"const": "message"}, "role": {"enum": ["user", "system", "developer", "assistant"]},
              "content": content}, ("role", "content")),
        _obj({"type": {"const": "function_call"}, "call_id": STR, "name": STR, "arguments": STR},
             ("type", "call_id", "name", "arguments")),
        _obj({"type": {"const": "function_call_output"}, "call_id": STR, "output": content},
             ("type", "call_id", "output")),
        _obj({"type": {"const": "reasoning"}, "summary": {"type": "array", "items": reasoning_part},
              "content": {"type": "array", "items": reasoning_part}}, ("type",))]}
    tool = _obj({"type": {"const": "function"}, "name": {"type": "string", "pattern": "^[A-Za-z0-9_.-]{1,64}$"},
                 "description": STR, "parameters": {"type": "object"}, "strict": BOOL}, ("type", "name"))
    out_item = _obj({"type": {"enum": ["message", "reasoning", "function_call"]}, "id": STR, "status": STR},
                    ("type", "id"))
    return {
        "ResponseRequest": _obj({
            "model": {"type": "string", "enum": [model_id]},
            "input": {"anyOf": [STR, {"type": "array", "items": item}]}, "instructions": STR,
            "previous_response_id": STR, "store": BOOL, "stream": BOOL,
            "background": {"const": False, "description": "true is refused: responses run while the request is open"},
            "max_output_tokens": {"type": "integer", "minimum": 1},
            "temperature": {"type": "number", "minimum": 0, "maximum": 2},
            "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1}, "seed": INT,
            "tools": {"type": "array", "items": {"anyOf": [
                tool, _obj({"type": {"enum": ["web_search", "web_search_preview"]}}, ("type",)),
                _obj({"type": {"const": "namespace"}, "name": STR, "description": STR,
                      "tools": {"type": "array", "items": tool}}, ("type", "name", "tools"))]}},
            "tool_choice": {"anyOf": [{"enum": ["none", "auto", "required"]},
                                      _obj({"type": {"const": "function"}, "name": STR}, ("type", "name"))]},
            "parallel_tool_calls": BOOL,
            "reasoning": _obj({"effort": {"enum": list(EFFORTS)},
                               "summary": {"enum": ["auto", "concise", "detailed"]}}),
            "text": _obj({"format": _obj({"type": {"const": "text"}}, ("type",))}),
            "truncation": {"enum": ["auto", "disabled"]}, "metadata": {"type": "object"}, "user": STR,
            "cache_slot": {"type": "integer", "minimum": 0},
        }, ("input",)),
        "Response": _obj({
            "id": STR, "object": {"const": "response"}, "created_at": INT, "model": STR,
            "status": {"enum": ["completed", "incomplete", "in_progress", "failed", "cancelled"]},
            "output": {"type": "array", "items": out_item},
            "usage": _nullable(_obj({"input_tokens": INT, "output_tokens": INT, "total_tokens": INT,
                                     "input_tokens_details": _obj({"cached_tokens": INT}, ("cached_tokens",)),
                                     "output_tokens_details": _obj({"reasoning_tokens": INT})},
                                    ("input_tokens", "output_tokens", "total_tokens", "input_tokens_details"))),
            "previous_response_id": NULL_STR, "instructions": NULL_STR,
        }, ("id", "object", "created_at", "model", "status", "output")),
        "ResponseDeleted": _obj({"id": STR, "object": {"const": "response"}, "deleted": BOOL},
                                ("id", "object", "deleted")),
        "ResponseItemList": _obj({"object": {"const": "list"}, "data": {"type": "array", "items": {"type": "object"}},
                                  "first_id": NULL_STR, "last_id": NULL_STR, "has_more": BOOL},
                                 ("object", "data", "has_more")),
    }


def responses_paths() -> dict:
    rid = [{"name": "id", "in": "path", "required": True, "schema": STR}]
    page = [*rid, {"name": "order", "in": "query", "schema": {"enum": ["asc", "desc"]}},
            {"name": "limit", "in": "query", "schema": {"type": "integer", "minimum": 1, "maximum": 100}},
            {"name": "after", "in": "query", "schema": STR}]
    return {
        "/v1/responses": {"post": _op("Response (OpenAI Responses API)", "Response", body="ResponseRequest",
                                      stream=True)},
        "/v1/responses/{id}": {"get": _op("A stored response", "Response", params=rid),
                               "delete": _op("Delete a stored response", "ResponseDeleted", params=rid)},
        "/v1/responses/{id}/cancel": {"post": _op("Cancel a response still running", "Response", params=rid)},
        "/v1/responses/{id}/input_items": {"get": _op("A stored response's input items", "ResponseItemList",
                                                      params=page)},
    }
