"""OpenAI-compatible endpoints: models, chat completions, legacy completions, (de)tokenize.

Beyond the usual subset: ``n`` > 1, ``seed`` (the same request and seed give the same
text, also while other requests share the batch), presence/frequency/repetition
penalties, ``logit_bias``, ``logprobs``/``top_logprobs``, ``top_k``/``min_p``, tools with
streamed tool-call deltas, reasoning in ``reasoning_content`` (and ``reasoning``),
``cache_slot``, ``x_colibri_ignore_leading_stop``, and a trailing assistant message
continued in place.
"""
from __future__ import annotations

import time
import uuid
from dataclasses import replace

from aiohttp import web

from coli.scheduler import Finished, ReasoningDelta, TextDelta, TokenLogprob, ToolCallDelta, Usage
from coli.server import params as P
from coli.server.errors import invalid, unsupported
from coli.server.generation import GenSpec, Generation, collect, speculative_field
from coli.server import structured
from coli.server.limits import off_loop
from coli.server.prompts import implicit_stops, normalize_openai, openai_tools, render
from coli.server.state import server_of
from coli.server.streaming import run_stream, sse

EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
MAX_N = 16
MAX_TOP_LOGPROBS = 20


# -- models -----------------------------------------------------------------------------------


def _model_card(server) -> dict:
    return {"id": server.model_id, "object": "model", "created": server.created, "owned_by": "colibri",
            "max_model_len": server.runner.ctx}


async def models(request: web.Request) -> web.Response:
    """OpenAI's list (``data``) and, in the same body, the Jev list (``models``) that
    /v1/systemone's clients read (coli.server.systemone)."""
    from coli.server.systemone import jev_models

    server = server_of(request)
    return web.json_response({"object": "list", "data": [_model_card(server)], "models": jev_models(server)})


async def model(request: web.Request) -> web.Response:
    server = server_of(request)
    server.check_model({"model": request.match_info["model"]})
    return web.json_response(_model_card(server))


# -- request fields shared by chat and completions --------------------------------------------


def sampling_fields(server, body: dict):
    """(SamplingParams, logit_bias) from the request; the model's generation_config fills gaps."""
    top_k = P.integer(body, "top_k", -1)
    seed = P.get(body, "seed", int)
    params = server.model.sampling_params(
        temperature=P.number(body, "temperature", 0, 2), top_p=P.number(body, "top_p", 0, 1),
        top_k=None if top_k is None else max(top_k, 0), min_p=P.number(body, "min_p", 0, 1, default=0.0),
        seed=None if seed is None else seed % 2**63)
    if params.top_p == 0:
        raise invalid("top_p must be more than 0", "top_p")
    params = replace(params, presence_penalty=P.number(body, "presence_penalty", -2, 2, default=0.0),
                     frequency_penalty=P.number(body, "frequency_penalty", -2, 2, default=0.0),
                     repetition_penalty=P.number(body, "repetition_penalty", 0.01, 10, default=1.0))
    bias = P.get(body, "logit_bias", dict)
    if bias:
        vocab = server.model.config.vocab_size
        try:
            bias = {int(k): v for k, v in bias.items()}
        except ValueError:
            raise invalid("logit_bias: keys must be token ids", "logit_bias") from None
        if any(not 0 <= k < vocab for k in bias) or any(
                isinstance(v, bool) or not isinstance(v, (int, float)) or not -100 <= v <= 100 for v in bias.values()):
            raise invalid(f"logit_bias maps token ids (0..{vocab - 1}) to numbers from -100 to 100", "logit_bias")
    return params, bias or None


def max_tokens_field(server, body: dict) -> int:
    """A ceiling: the scheduler clamps it to the room the context leaves (finish_reason "length")."""
    for name in ("max_completion_tokens", "max_tokens"):
        v = P.integer(body, name, 1)
        if v is not None:
            return v
    return server.runner.ctx


def refuse_unsupported(body: dict) -> None:
    if body.get("audio") is not None or (isinstance(body.get("modalities"), list) and "audio" in body["modalities"]):
        raise unsupported("audio output is not supported: this server is text-only", "modalities")
    if body.get("functions") is not None or body.get("function_call") is not None:
        raise unsupported("functions/function_call are deprecated: send tools and tool_choice", "functions")


def usage_body(prompt_tokens: int, completion_tokens: int, cached: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens, "prompt_tokens_details": {"cached_tokens": cached}}


def _usage(choices_usage: list[Usage], prompts: int = 1) -> dict:
    first = [u for u in choices_usage if u is not None]
    if not first:
        return usage_body(0, 0, 0)
    per_prompt = len(first) // max(prompts, 1) or 1
    prompt_tokens = sum(u.prompt_tokens for u in first[::per_prompt])
    return usage_body(prompt_tokens, sum(u.completion_tokens for u in first), first[0].cached_tokens)


def _logprob_entry(server, lp: TokenLogprob, with_top: bool) -> dict:
    entry = {"token": server.token_text(lp.token), "logprob": lp.logprob, "bytes": list(server.token_bytes(lp.token))}
    entry["top_logprobs"] = [{"token": server.token_text(t), "logprob": v, "bytes": list(server.token_bytes(t))}
                             for t, v in lp.top] if with_top else []
    return entry


def _tool_choice(body: dict):
    tc = body.get("tool_choice")
    if tc is None or tc in ("none", "auto", "required"):
        return tc
    if isinstance(tc, dict) and tc.get("type") == "function" and isinstance(tc.get("function"), dict) \
            and isinstance(tc["function"].get("name"), str):
        return tc["function"]["name"]
    raise invalid("tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name'}}",
                  "tool_choice")


def template_kwargs(body: dict) -> dict:
    kw = dict(P.get(body, "chat_template_kwargs", dict, {}))
    effort = P.choice(body, "reasoning_effort", EFFORTS)
    if effort is not None:
        kw.setdefault("enable_thinking", effort != "none")
    thinking = P.get(body, "enable_thinking", bool)
    if thinking is not None:
        kw["enable_thinking"] = thinking
    return kw


# -- chat completions -------------------------------------------------------------------------


async def chat_completions(request: web.Request) -> web.StreamResponse:
    server = server_of(request)
    body = await P.read_json(request)
    model_id = server.check_model(body)
    refuse_unsupported(body)
    stream = P.get(body, "stream", bool, False)
    stream_options = P.get(body, "stream_options", dict, {})
    include_usage = P.get(stream_options, "include_usage", bool, False, param="stream_options.include_usage")
    stats = P.get(stream_options, "x_colibri_stats", bool, False, param="stream_options.x_colibri_stats")
    n = P.integer(body, "n", 1, MAX_N, default=1)
    sampling, bias = sampling_fields(server, body)
    max_tokens = max_tokens_field(server, body)
    want_logprobs = P.get(body, "logprobs", bool, False)
    top = P.integer(body, "top_logprobs", 0, MAX_TOP_LOGPROBS)
    if top is not None and not want_logprobs:
        raise invalid("top_logprobs needs logprobs: true", "top_logprobs")
    stop = P.stop_list(body, "stop", 4)
    ignore_leading = P.get(body, "x_colibri_ignore_leading_stop", bool, False)
    cache_slot = P.integer(body, "cache_slot", 0)
    messages = normalize_openai(body.get("messages"))
    tools = openai_tools(body["tools"]) if body.get("tools") is not None else None
    answer, tool_choice = structured.openai_answer(body), _tool_choice(body)
    prompt = await off_loop(render, server, messages, tools=tools, tool_choice=tool_choice,
                            parallel=P.get(body, "parallel_tool_calls", bool, True),
                            template_kwargs=structured.default_thinking(answer, tool_choice, template_kwargs(body)))
    constraint = await off_loop(structured.constraint, server, answer, prompt)
    stop_ids = frozenset()
    if not stop:  # the template's role markers, skipped where they lead the answer
        stop, stop_ids = implicit_stops(server)
        ignore_leading = True
    spec = GenSpec([prompt.ids], max_tokens, sampling, n, stop, ignore_leading, stop_ids,
                   (top or 0) if want_logprobs else None, bias, cache_slot, lambda: prompt.parser(server), constraint)
    spec.speculative = speculative_field(body)
    gen = Generation(server, spec)
    try:
        await gen.start()
        base = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": model_id,
                "system_fingerprint": f"colibri-{server.model.config.model_type}"}
        if stream:
            return await _stream_chat(request, server, gen, base, include_usage, stats, want_logprobs, top)
        choices = await collect(gen)
        out = []
        for c in choices:
            text = "".join(c.text)
            message = {"role": "assistant", "content": text if text or not c.calls else None}
            if c.reasoning:
                message["reasoning_content"] = message["reasoning"] = "".join(c.reasoning)
            if c.calls:
                message["tool_calls"] = [{"id": v["id"], "type": "function",
                                          "function": {"name": v["name"], "arguments": v["arguments"]}}
                                         for _, v in sorted(c.calls.items())]
            logprobs = {"content": [_logprob_entry(server, lp, bool(top)) for lp in c.logprobs]} \
                if want_logprobs else None
            out.append({"index": c.index, "message": message, "logprobs": logprobs, "finish_reason": c.finish_reason})
        return web.json_response({**base, "object": "chat.completion", "choices": out,
                                  "usage": _usage([c.usage for c in choices])}, headers=gen.headers)
    finally:
        gen.cancel()


async def _stream_chat(request, server, gen: Generation, base: dict, include_usage: bool, stats: bool,
                       want_logprobs: bool, top: int | None) -> web.StreamResponse:
    base = {**base, "object": "chat.completion.chunk"}
    if include_usage:
        base["usage"] = None
    pending: dict[int, list] = {i: [] for i in range(len(gen.handles))}  # logprobs not yet sent
    usage: dict[int, Usage] = {}

    def chunk(i: int, delta: dict, finish: str | None = None) -> bytes:
        lps = None
        if want_logprobs and (delta.get("content") or finish is not None or pending[i]):
            lps = {"content": [_logprob_entry(server, lp, bool(top)) for lp in pending[i]]}
            pending[i] = []
        return sse({**base, "choices": [{"index": i, "delta": delta, "logprobs": lps, "finish_reason": finish}]})

    async def on_event(i: int, ev) -> bytes | None:
        if isinstance(ev, TextDelta):
            return chunk(i, {"content": ev.text})
        if isinstance(ev, ReasoningDelta):
            return chunk(i, {"reasoning_content": ev.text, "reasoning": ev.text})
        if isinstance(ev, ToolCallDelta):
            call = {"index": ev.index, "function": {"arguments": ev.arguments}}
            if ev.name is not None:
                call.update(id=ev.id, type="function", function={"name": ev.name, "arguments": ev.arguments})
            return chunk(i, {"tool_calls": [call]})
        if isinstance(ev, TokenLogprob):
            pending[i].append(ev)
        elif isinstance(ev, Usage):
            usage[i] = ev
        elif isinstance(ev, Finished):
            return chunk(i, {}, ev.finish_reason)
        return None

    def closing() -> bytes:
        tail = b""
        if include_usage:
            tail += sse({**base, "choices": [], "usage": _usage([usage.get(i) for i in sorted(usage)])})
        if stats:
            tail += sse({"x_colibri_stats": _stats(server, usage)})
        return tail + sse("[DONE]")

    first = b"".join(sse({**base, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                               "logprobs": None, "finish_reason": None}]})
                     for i in range(len(gen.handles)))
    return await run_stream(request, server, gen, first, on_event, closing, b": keepalive\n\n",
                            lambda e: sse(e.openai()) + sse("[DONE]"))


def _stats(server, usage: dict[int, Usage]) -> dict:
    last = server.telemetry.turns[-1] if server.telemetry.turns else {}
    engine = server.model.engine
    return {"tokens_per_second": last.get("tokens_per_second"), "expert_hit_rate": engine.totals.hit_rate,
            "resident_bytes": engine.resident_bytes(),
            "completion_tokens": sum(u.completion_tokens for u in usage.values())}
