"""OpenAI's legacy text completions (no chat template) and POST /tokenize, /detokenize."""
from __future__ import annotations

import json
import time
import uuid

from aiohttp import web

from coli.errors import InvalidRequestError
from coli.scheduler import Finished, TextDelta, TokenLogprob, Usage
from coli.server import params as P
from coli.server import structured
from coli.server.errors import invalid, unsupported
from coli.server.generation import GenSpec, Generation, collect, speculative_field
from coli.server.limits import BIG_INPUT, check_length, off_loop, release_memory
from coli.server.openai import MAX_N, MAX_TOP_LOGPROBS, _usage, max_tokens_field, sampling_fields, template_kwargs
from coli.server.prompts import normalize_openai, openai_tools
from coli.server.state import server_of
from coli.server.streaming import run_stream, sse


def _prompts(server, body: dict) -> list[list[int]]:
    p = body.get("prompt")
    tok = server.model.tokenizer
    vocab = server.model.config.vocab_size
    if isinstance(p, str):
        items = [p]
    elif isinstance(p, list) and p and all(isinstance(x, str) for x in p):
        items = p
    elif isinstance(p, list) and p and all(isinstance(x, int) and not isinstance(x, bool) for x in p):
        items = [p]
    elif isinstance(p, list) and p and all(isinstance(x, list) and x and all(
            isinstance(t, int) and not isinstance(t, bool) for t in x) for x in p):
        items = p
    else:
        raise invalid("prompt must be a string, an array of strings, an array of token ids, or an array of "
                      "arrays of token ids (none of them empty)", "prompt")
    if len(items) > MAX_N:
        raise invalid(f"prompt: at most {MAX_N} prompts per request", "prompt")
    check_length(server, sum(len(x) for x in items if isinstance(x, str)), "prompt")
    out = []
    for item in items:
        ids = tok.encode(item) if isinstance(item, str) else list(item)
        if not ids:
            raise invalid("prompt: a prompt is empty", "prompt")
        if any(not 0 <= t < vocab for t in ids):
            raise invalid(f"prompt: token ids must lie in 0..{vocab - 1}", "prompt")
        out.append(ids)
    return out


async def completions(request: web.Request) -> web.StreamResponse:
    server = server_of(request)
    body = await P.read_json(request)
    model_id = server.check_model(body)
    if P.get(body, "suffix", str):
        raise unsupported("suffix (fill-in-the-middle) is not supported", "suffix")
    stream = P.get(body, "stream", bool, False)
    stream_options = P.get(body, "stream_options", dict, {})
    include_usage = P.get(stream_options, "include_usage", bool, False, param="stream_options.include_usage")
    n = P.integer(body, "n", 1, MAX_N, default=1)
    best_of = P.integer(body, "best_of", 1, MAX_N)
    if best_of is not None and best_of != n:
        raise unsupported("best_of is supported only equal to n", "best_of")
    echo = P.get(body, "echo", bool, False)
    top = P.integer(body, "logprobs", 0, MAX_TOP_LOGPROBS)
    sampling, bias = sampling_fields(server, body)
    prompts = await off_loop(_prompts, server, body)
    spec = GenSpec(prompts, max_tokens_field(server, body) if body.get("max_tokens") is not None else 16, sampling, n,
                   P.stop_list(body, "stop", 4), P.get(body, "x_colibri_ignore_leading_stop", bool, False),
                   logprobs=top, logit_bias=bias, cache_slot=P.integer(body, "cache_slot", 0),
                   constraint=structured.constraint(server, structured.openai_answer(body)))
    spec.speculative = speculative_field(body)
    gen = Generation(server, spec)
    tok = server.model.tokenizer
    echoes = [tok.decode(p) for p in prompts for _ in range(n)] if echo else [""] * (len(prompts) * n)
    try:
        await gen.start()
        base = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": model_id}
        if stream:
            return await _stream_completion(request, server, gen, base, include_usage, top, echoes, len(prompts))
        choices = await collect(gen)
        out = [{"index": c.index, "text": echoes[c.index] + "".join(c.text),
                "logprobs": _completion_logprobs(server, c.logprobs, top, len(echoes[c.index])) if top is not None
                else None, "finish_reason": c.finish_reason} for c in choices]
        return web.json_response({**base, "choices": out, "usage": _usage([c.usage for c in choices], len(prompts))},
                                 headers=gen.headers)
    finally:
        gen.cancel()


def _completion_logprobs(server, lps: list[TokenLogprob], top: int, offset: int = 0) -> dict:
    tokens, offsets, at = [], [], offset
    for lp in lps:
        text = server.token_text(lp.token)
        tokens.append(text)
        offsets.append(at)
        at += len(text)
    return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in lps],
            "top_logprobs": [{server.token_text(t): v for t, v in lp.top} for lp in lps] if top else None,
            "text_offset": offsets}


async def _stream_completion(request, server, gen, base, include_usage, top, echoes, prompts):
    if include_usage:
        base = {**base, "usage": None}
    pending: dict[int, list] = {i: [] for i in range(len(gen.handles))}
    usage: dict[int, Usage] = {}

    def chunk(i: int, text: str, finish: str | None = None) -> bytes:
        lps = None
        if top is not None:
            lps, pending[i] = _completion_logprobs(server, pending[i], top), []
        return sse({**base, "choices": [{"index": i, "text": text, "logprobs": lps, "finish_reason": finish}]})

    async def on_event(i, ev):
        if isinstance(ev, TextDelta):
            return chunk(i, ev.text)
        if isinstance(ev, TokenLogprob):
            pending[i].append(ev)
        elif isinstance(ev, Usage):
            usage[i] = ev
        elif isinstance(ev, Finished):
            return chunk(i, "", ev.finish_reason)
        return None

    def closing() -> bytes:
        tail = sse({**base, "choices": [], "usage": _usage([usage.get(i) for i in sorted(usage)], prompts)}) \
            if include_usage else b""
        return tail + sse("[DONE]")

    first = b"".join(sse({**base, "choices": [{"index": i, "text": e, "logprobs": None, "finish_reason": None}]})
                     for i, e in enumerate(echoes) if e)
    return await run_stream(request, server, gen, first, on_event, closing, b": keepalive\n\n",
                            lambda e: sse(e.openai()) + sse("[DONE]"))


# -- tokenize / detokenize ----------------------------------------------------------------------


async def tokenize(request: web.Request) -> web.Response:
    server = server_of(request)
    body = await P.read_json(request)
    server.check_model(body)
    return web.Response(text=await off_loop(_tokenize, server, body), content_type="application/json")


def _tokenize(server, body: dict) -> str:
    """POST /tokenize's answer (no length limit: it is how a client learns a text's size)."""
    tok = server.model.tokenizer
    prompt = P.get(body, "prompt", str)
    special = P.get(body, "add_special_tokens", bool, True)
    cue = P.get(body, "add_generation_prompt", bool, True)
    tools = openai_tools(body["tools"]) if body.get("tools") is not None else None
    kwargs = template_kwargs(body)
    if body.get("messages") is not None:
        messages = normalize_openai(body["messages"])
        try:
            text = tok.apply_chat_template(messages, add_generation_prompt=cue, tools=tools, **kwargs)
        except InvalidRequestError as e:
            raise invalid(str(e), "messages") from None
        ids = tok.encode(text, add_special_tokens=False)
    elif prompt is not None:
        ids = tok.encode(prompt, add_special_tokens=special)
    else:
        raise invalid("give prompt (a string) or messages (a chat)", "prompt")
    out = {"tokens": ids, "count": len(ids), "max_model_len": server.runner.ctx}
    if P.get(body, "return_token_strs", bool, False):
        out["token_strs"] = [tok.id_to_token(t) for t in ids]
    text = json.dumps(out, ensure_ascii=False)
    if len(ids) > BIG_INPUT // 4:
        del out, ids
        release_memory()
    return text


async def detokenize(request: web.Request) -> web.Response:
    server = server_of(request)
    body = await P.read_json(request)
    server.check_model(body)
    return web.json_response({"prompt": await off_loop(_detokenize, server, body.get("tokens"))})


def _detokenize(server, ids) -> str:
    vocab = server.model.config.vocab_size
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise invalid("tokens: expected an array of token ids", "tokens")
    if any(not 0 <= t < vocab for t in ids):
        raise invalid(f"tokens: token ids must lie in 0..{vocab - 1}", "tokens")
    return server.model.tokenizer.decode(ids, skip_special_tokens=False)
