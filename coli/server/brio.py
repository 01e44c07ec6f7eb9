"""Brio: closed-set answers (POST /v1/brio). Nothing is generated.

The context (``state`` as one user message, or ``messages``) and the optional question
are rendered with the chat template up to the assistant's cue; that is the shared
prefix, computed once in a KV slot (and reused by the next request with the same
context). Every option's tokens are then read after it in batched steps
(``Runner.score_branches``, coli.scoring): options of one token cost nothing more, the
longer ones are fed together in one step. An option's score is its summed log-probability
(``normalize: "sum"``) or that divided by its token count (``"mean"``, the default);
a softmax over the scores gives ``p``, and the entropy of ``p`` divided by ln(options)
says how sure the model is (0: certain, 1: no idea). Options never enter the prompt.
"""
from __future__ import annotations

import math

from aiohttp import web

from coli.errors import ColiError
from coli.scheduler import Error, PromptLogprobs, Started
from coli.scoring import BranchLogprobs, Question
from coli.server import params as P
from coli.server.errors import from_coli, invalid
from coli.server.limits import check_length, off_loop
from coli.server.state import server_of
from coli.server.prompts import normalize_openai, render

MIN_OPTIONS, MAX_OPTIONS = 2, 64


async def brio(request: web.Request) -> web.Response:
    server = server_of(request)
    body = await P.read_json(request)
    model_id = server.check_model(body)
    options = body.get("options")
    if not isinstance(options, list) or not all(isinstance(o, str) and o.strip() for o in options):
        raise invalid("options: expected an array of non-empty strings", "options")
    if not MIN_OPTIONS <= len(options) <= MAX_OPTIONS:
        raise invalid(f"options: give from {MIN_OPTIONS} to {MAX_OPTIONS} options, got {len(options)}", "options")
    if len(set(options)) != len(options):
        raise invalid("options must be distinct", "options")
    normalize = P.choice(body, "normalize", ("mean", "sum"), default="mean")
    question = P.get(body, "question", str)
    state = P.get(body, "state", str)
    slot = P.integer(body, "cache_slot", 0)
    if (state is None) == (body.get("messages") is None):
        raise invalid("give the context as either state (a text) or messages (a chat)", "state")
    if state is not None:
        messages = [{"role": "user", "content": state + (f"\n\n{question}" if question else "")}]
    else:
        messages = normalize_openai(body["messages"])
        if question:
            messages.append({"role": "user", "content": question})
    if messages[-1]["role"] == "assistant":
        raise invalid("the context must end with a user turn: the options are read as the assistant's answer",
                      "messages")
    prefix = (await off_loop(render, server, messages, template_kwargs={"enable_thinking": False})).ids
    check_length(server, sum(map(len, options)), "options")
    tok = server.model.tokenizer
    option_ids = await off_loop(lambda: [tok.encode(o, add_special_tokens=False) for o in options])

    logprobs, wait_ms = await score(server, prefix, [Question.of((), option_ids)], slot)
    sums = [sum(lp) for lp in logprobs[0]]
    counts = [len(ids) for ids in option_ids]
    scores = [s / n for s, n in zip(sums, counts)] if normalize == "mean" else sums
    top = max(scores)
    weights = [math.exp(s - top) for s in scores]
    total = sum(weights)
    p = [w / total for w in weights]
    entropy = -sum(x * math.log(x) for x in p if x > 0) / math.log(len(p))
    read = sum(counts)
    best = max(range(len(p)), key=p.__getitem__)
    return web.json_response({
        "object": "brio.choice", "model": model_id, "answer": options[best], "entropy": max(0.0, min(1.0, entropy)),
        "normalize": normalize,
        "choices": [{"option": o, "p": pi, "logprob": s, "mean_logprob": s / n, "tokens": n}
                    for o, pi, s, n in zip(options, p, sums, counts)],
        "usage": {"prompt_tokens": len(prefix), "completion_tokens": 0, "read_tokens": read,
                  "total_tokens": len(prefix) + read},
    }, headers={"x-colibri-queue-wait-ms": str(wait_ms or 0)})


async def score(server, prefix: list[int], questions: list[Question], slot: int | None):
    """Run one batched scoring request; returns ([question][option][token] log-probabilities,
    the queue wait in ms). Raises ApiError. A runner without ``score_branches`` (the cluster
    router's) gets one ``score`` request per option instead: the same numbers, more steps."""
    if not hasattr(server.runner, "score_branches"):
        return await _score_each(server, prefix, questions, slot)
    try:
        handle = server.runner.score_branches(prefix, questions, cache_slot=slot)
    except ColiError as e:
        raise from_coli(e) from None
    result, wait_ms = None, 0
    try:
        async for ev in handle:
            if isinstance(ev, Started):
                wait_ms = round(1000 * ev.queue_wait_seconds)
            elif isinstance(ev, BranchLogprobs):
                result = ev.logprobs
            elif isinstance(ev, Error):
                raise from_coli(ev.exception())
    finally:
        handle.cancel()
    return result, wait_ms


async def _score_each(server, prefix: list[int], questions: list[Question], slot: int | None):
    out, wait_ms = [], None
    for q in questions:
        row = []
        for option in q.options:
            start = len(prefix) + len(q.ids)
            try:
                handle = server.runner.score(prefix + list(q.ids) + list(option), start, cache_slot=slot)
            except ColiError as e:
                raise from_coli(e) from None
            try:
                async for ev in handle:
                    if isinstance(ev, Started):
                        slot = ev.slot  # the next options reuse this slot's prefix
                        wait_ms = round(1000 * ev.queue_wait_seconds) if wait_ms is None else wait_ms
                    elif isinstance(ev, PromptLogprobs):
                        row.append(tuple(ev.logprobs))
                    elif isinstance(ev, Error):
                        raise from_coli(ev.exception())
            finally:
                handle.cancel()
        out.append(tuple(row))
    return tuple(out), wait_ms or 0
