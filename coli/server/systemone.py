"""System One (POST /v1/systemone): typed decisions with probabilities, nothing generated.

The wire contract is TypeSafe's Jev API (shared/spec/systemone.md): a ``state`` and named
questions of type ``noul`` (yes/no), ``choice`` (one of 2–255 named options) or
``score`` (one of 2–10 ordered levels); each answer is a softmax over the model's scores
of the question's closed set of outcomes.

How a question becomes probabilities (docs/SERVER.md, "System One"):

- The ``state`` (a string; objects and arrays as compact JSON) is one user message,
  rendered with the chat template up to the assistant's cue. Everything before the
  question's place in it is the shared prefix: it depends on the state only, so it is
  computed once per request and reused from the KV slot by later requests with the
  same state.
- Each question is rendered on its own (``render_question``) from its instructions and
  criteria — never its id — and tokenized apart from the prefix, so other questions,
  their order and their names cannot change its tokens.
- Outcomes are read right after the assistant's cue: ``Yes`` / ``No`` for a noul, the
  option's name for a choice, the level's digit for a score. An outcome's score is its
  mean token log-probability; a softmax over the outcomes gives the probabilities.

All questions of a request run in one batched scoring request (coli.scoring): the prefix,
one step for every question's text, one step for every option longer than one token.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass

from aiohttp import web

from coli.scoring import Question
from coli.server.brio import score
from coli.server.errors import ApiError, ValidationFailed
from coli.server.state import server_of

JEV_ALIAS = "jev-latest"
TYPES = ("noul", "choice", "score")
MIN_OPTIONS, MAX_OPTIONS = 2, 255
MIN_LEVELS, MAX_LEVELS = 2, 10
YES, NO = "Yes", "No"
_MARK = "\ue000"  # where the question goes in the rendered state (a private-use character)


@dataclass
class Ask:
    """One validated question: its id, type, rendered text and outcome labels."""

    qid: str
    kind: str
    text: str
    outcomes: list[str]  # the keys of its probabilities (option names; "0".."n-1"; yes, no)
    labels: list[str]  # the text read for each outcome
    legend: dict | None = None


def jev_models(server) -> list[dict]:
    """GET /v1/models' ``models``: the served model under its own id and as jev-latest."""
    day = time.strftime("%Y-%m-%d", time.gmtime(server.created))
    return [{"name": name, "description": f"{what} ({server.model_id}, served by colibri): typed decisions, "
                                          "POST /v1/systemone", "release_date": day}
            for name, what in ((server.model_id, "the served model"), (JEV_ALIAS, "an alias of the served model"))]


# -- the handler ------------------------------------------------------------------------------


async def systemone(request: web.Request) -> web.Response:
    server = server_of(request)
    reply, wait_ms = await evaluate(server, await _read(request))
    return web.json_response(reply, headers={"x-colibri-queue-wait-ms": str(wait_ms)})


async def evaluate(server, body: dict) -> tuple[dict, int]:
    """The reply to a request body, and its queue wait in ms (the handler; ``coli decide``
    calls it without HTTP). Raises ApiError."""
    errors: list[dict] = []
    model_id = _model(server, body)
    if body.get("assets") is not None:
        raise ApiError(400, "assets: images are not supported: this server's model is text-only",
                       code="unsupported_feature", param="assets")
    if "state" not in body:
        errors.append(_err(["state"], "Field required", "missing"))
    elif not isinstance(body["state"], (str, dict, list)):
        errors.append(_err(["state"], "Input should be a string, an object or an array", "value_error"))
    asks = _questions(body.get("questions", _MISSING), errors)
    if errors:
        raise ValidationFailed(errors)
    tok = server.model.tokenizer
    prefix_text, tail = _split(server, _content(body["state"]))
    prefix = tok.encode(prefix_text, add_special_tokens=False)
    if not prefix:
        raise ApiError(400, "this model's chat template renders nothing before the state", code="unsupported_feature")
    questions = []
    for a in asks:
        labels = [tok.encode(label, add_special_tokens=False) for label in a.labels]
        empty = [o for o, ids in zip(a.outcomes, labels) if not ids]
        if empty:
            raise ValidationFailed([_err(["questions", a.qid, "criteria", empty[0]],
                                         "this option name has no tokens in the model's vocabulary", "value_error")])
        questions.append(Question.of(tok.encode(a.text + tail, add_special_tokens=False), labels))
    logprobs, wait_ms = await score(server, prefix, questions, None)
    answers = {a.qid: answer(a, lp) for a, lp in zip(asks, logprobs)}
    read = sum(len(q.ids) + sum(len(o) for o in q.options) for q in questions)
    return {"model": model_id, "answers": answers,
            "usage": {"input_tokens": len(prefix) + read, "output_tokens": 0}}, wait_ms


def answer(a: Ask, logprobs) -> dict:
    """The answer to one question from its outcomes' token log-probabilities."""
    p = probabilities([sum(lp) / len(lp) for lp in logprobs])
    if a.kind == "noul":
        return {"type": "noul", "noul": p[0]}
    probs = dict(zip(a.outcomes, p))
    if a.kind == "choice":
        best = max(range(len(p)), key=p.__getitem__)
        return {"type": "choice", "choice": a.outcomes[best], "probabilities": probs,
                "confidence": choice_confidence(p)}
    return {"type": "score", "score": expected_score(p), "confidence": score_confidence(p), "legend": a.legend,
            "probabilities": probs}


# -- the reference formulas -------------------------------------------------------------------


def probabilities(scores: list[float]) -> list[float]:
    """Softmax, finite and summing to 1 (scores are finite log-probabilities)."""
    top = max(scores)
    w = [math.exp(s - top) for s in scores]
    total = math.fsum(w)
    return [min(1.0, max(0.0, x / total)) for x in w]


def choice_confidence(p: list[float]) -> float:
    """(max p − 1/n) / (1 − 1/n)."""
    n = len(p)
    return min(1.0, max(0.0, (max(p) - 1 / n) / (1 - 1 / n)))


def expected_score(p: list[float]) -> float:
    """Σ i·p(i), within [0, n − 1]."""
    return min(len(p) - 1.0, max(0.0, math.fsum(i * x for i, x in enumerate(p))))


def score_confidence(p: list[float]) -> float:
    """max(0, 1 − Σ p(i)·|i − m| / U(n)), m the most probable level, U(n) = (1/n)·Σ|i − (n−1)/2|."""
    n = len(p)
    m = max(range(n), key=p.__getitem__)
    spread = math.fsum(abs(i - (n - 1) / 2) for i in range(n)) / n
    return min(1.0, max(0.0, 1 - math.fsum(x * abs(i - m) for i, x in enumerate(p)) / spread))


# -- rendering ----------------------------------------------------------------------------------


def _content(v) -> str:
    """Text as itself; objects and arrays as compact JSON."""
    return v if isinstance(v, str) else json.dumps(v, ensure_ascii=False, separators=(",", ":"))


def _split(server, state: str) -> tuple[str, str]:
    """The rendered chat up to where a question goes (state, then a blank line), and what
    follows the question (the end of the user turn and the assistant's cue)."""
    tok = server.model.tokenizer
    try:
        text = tok.apply_chat_template([{"role": "user", "content": f"{state}\n\n{_MARK}"}],
                                       add_generation_prompt=True, enable_thinking=False)
    except Exception as e:
        raise ApiError(400, f"the chat template failed: {e}", code="template_error") from None
    if text.count(_MARK) != 1:
        raise ApiError(400, "this model's chat template does not keep the question in one place",
                       code="unsupported_feature")
    head, tail = text.split(_MARK)
    return head, tail


def render_question(kind: str, instructions, criteria) -> str:
    """A question's text: its instructions, its criteria, then how to answer."""
    lines = [] if instructions is None else [_content(instructions)]
    if kind == "noul":
        c = criteria or {}
        yes, no = c.get("true"), c.get("false")
        if yes is not None:
            lines.append(f"Answer {YES} if: {_content(yes)}")
        if no is not None:
            lines.append(f"Answer {NO} if: {_content(no)}")
        if (yes is None) != (no is None):
            lines.append(f"Otherwise answer {NO if no is None else YES}.")
        lines.append(f"Answer {YES} or {NO}.")
    elif kind == "choice":
        if any(v is not None for v in criteria.values()):
            lines.append("Options:")
            lines += [f"- {k}" if v is None else f"- {k}: {_content(v)}" for k, v in criteria.items()]
        lines.append("Answer with one option.")
    else:
        lines.append("Levels:")
        lines += [f"{i}: {_content(v)}" for i, v in enumerate(criteria)]
        lines.append(f"Answer with the number of the level, from 0 to {len(criteria) - 1}.")
    return "\n".join(lines)


# -- validation (422 with detail[], as the reference's clients expect) --------------------------

_MISSING = object()
_CONTENT = (str, dict, list)


def _err(loc: list, msg: str, kind: str) -> dict:
    return {"loc": ["body", *loc], "msg": msg, "type": kind}


async def _read(request: web.Request) -> dict:
    ctype = request.headers.get("Content-Type", "")
    if ctype.startswith("multipart/"):
        raise ApiError(400, "multipart requests (image assets) are not supported: this server's model is text-only; "
                            "send application/json", code="unsupported_feature")
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise ApiError(413, f"the request body is larger than the limit of {request.client_max_size} bytes "
                            "(--max-body)", code="request_too_large") from None
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise ValidationFailed([_err([], f"JSON decode error: {e}", "json_invalid")]) from None
    if not isinstance(body, dict):
        raise ValidationFailed([{"loc": ["body"], "msg": "Input should be a valid dictionary or object",
                                 "type": "model_attributes_type"}])
    return body


def _model(server, body: dict) -> str:
    name = body.get("model")
    if name is None or name == JEV_ALIAS:
        return server.model_id
    if not isinstance(name, str):
        raise ValidationFailed([_err(["model"], "Input should be a valid string", "string_type")])
    return server.check_model(body)


def _questions(qs, errors: list[dict]) -> list[Ask]:
    if qs is _MISSING:
        errors.append(_err(["questions"], "Field required", "missing"))
        return []
    if not isinstance(qs, dict):
        errors.append(_err(["questions"], "Input should be a valid dictionary", "dict_type"))
        return []
    if not qs:
        errors.append(_err(["questions"], "Dictionary should have at least 1 item after validation", "too_short"))
    asks = []
    for qid, q in qs.items():
        a = _question(qid, q, errors)
        if a is not None:
            asks.append(a)
    return asks


def _question(qid: str, q, errors: list[dict]) -> Ask | None:
    at = ["questions", qid]
    n0 = len(errors)
    if qid == "":
        errors.append(_err(["questions"], "a question id must be a non-empty string", "value_error"))
    if not isinstance(q, dict):
        errors.append(_err(at, "Input should be a valid dictionary or object", "model_attributes_type"))
        return None
    kind = q.get("type")
    if kind == "box":
        raise ApiError(400, f"questions.{qid}: box questions locate things in images; this server's model is "
                            "text-only", code="unsupported_feature", param=f"questions.{qid}.type")
    if kind not in TYPES:
        errors.append(_err([*at, "type"], "Input tag should be 'noul', 'choice', 'score' or 'box'",
                           "union_tag_invalid"))
        return None
    instructions = q.get("instructions")
    if instructions is not None and not isinstance(instructions, _CONTENT):
        errors.append(_err([*at, "instructions"], "Input should be a string, an object or an array", "value_error"))
    criteria = q.get("criteria")
    if kind == "noul":
        ask = _noul(qid, at, instructions, criteria, errors)
    elif kind == "choice":
        ask = _choice(qid, at, criteria, errors)
    else:
        ask = _score(qid, at, criteria, errors)
    if ask is None or len(errors) > n0:
        return None
    ask.text = render_question(kind, instructions, criteria)
    return ask


def _noul(qid, at, instructions, criteria, errors) -> Ask | None:
    if criteria is not None:
        if not isinstance(criteria, dict):
            errors.append(_err([*at, "criteria"], "Input should be a valid dictionary or object", "dict_type"))
            return None
        for k, v in criteria.items():
            if k not in ("true", "false"):
                errors.append(_err([*at, "criteria", k], "Extra inputs are not permitted", "extra_forbidden"))
            elif v is not None and not isinstance(v, _CONTENT):
                errors.append(_err([*at, "criteria", k], "Input should be a string, an object or an array",
                                   "value_error"))
    described = isinstance(criteria, dict) and any(criteria.get(k) is not None for k in ("true", "false"))
    if instructions is None and not described:
        errors.append(_err([*at, "instructions"], "a noul needs instructions, or criteria that describe an outcome",
                           "value_error"))
    return Ask(qid, "noul", "", ["true", "false"], [YES, NO])


def _choice(qid, at, criteria, errors) -> Ask | None:
    if not isinstance(criteria, dict):
        errors.append(_err([*at, "criteria"], "Field required" if criteria is None else
                           "Input should be a valid dictionary", "missing" if criteria is None else "dict_type"))
        return None
    if not MIN_OPTIONS <= len(criteria) <= MAX_OPTIONS:
        errors.append(_err([*at, "criteria"], f"a choice needs from {MIN_OPTIONS} to {MAX_OPTIONS} options, got "
                           f"{len(criteria)}", "too_short" if len(criteria) < MIN_OPTIONS else "too_long"))
    for k, v in criteria.items():
        if not k.strip():
            errors.append(_err([*at, "criteria", k], "an option name must not be empty or blank", "value_error"))
        if v is not None and not isinstance(v, _CONTENT):
            errors.append(_err([*at, "criteria", k], "Input should be a string, an object or an array", "value_error"))
    names = list(criteria)
    return Ask(qid, "choice", "", names, names)


def _score(qid, at, criteria, errors) -> Ask | None:
    if not isinstance(criteria, list):
        errors.append(_err([*at, "criteria"], "Field required" if criteria is None else
                           "Input should be a valid list (levels in order; the object form is not accepted)",
                           "missing" if criteria is None else "list_type"))
        return None
    if not MIN_LEVELS <= len(criteria) <= MAX_LEVELS:
        errors.append(_err([*at, "criteria"], f"a score needs from {MIN_LEVELS} to {MAX_LEVELS} levels, got "
                           f"{len(criteria)}", "too_short" if len(criteria) < MIN_LEVELS else "too_long"))
    for i, v in enumerate(criteria):
        if not isinstance(v, _CONTENT):
            errors.append(_err([*at, "criteria", i], "Input should be a string, an object or an array", "value_error"))
    keys = [str(i) for i in range(len(criteria))]
    return Ask(qid, "score", "", keys, keys, legend=dict(zip(keys, criteria)))


# -- /openapi.json ------------------------------------------------------------------------------


def openapi_schemas(model_id: str) -> dict:
    """The request, reply and error schemas of /v1/systemone (coli.server.openapi)."""
    text = {"anyOf": [{"type": "string"}, {"type": "object"}, {"type": "array"}]}
    opt_text = {"anyOf": [*text["anyOf"], {"type": "null"}]}
    prob = {"type": "number", "minimum": 0, "maximum": 1}
    probs = {"type": "object", "additionalProperties": prob}
    name = {"type": "string", "minLength": 1, "pattern": r"\S"}
    noul = {"type": "object", "properties": {
        "type": {"const": "noul"}, "instructions": opt_text,
        "criteria": {"anyOf": [{"type": "object", "properties": {"true": opt_text, "false": opt_text},
                                "additionalProperties": False}, {"type": "null"}]}},
        "required": ["type"]}
    choice = {"type": "object", "properties": {
        "type": {"const": "choice"}, "instructions": opt_text,
        "criteria": {"type": "object", "propertyNames": name, "additionalProperties": opt_text,
                     "minProperties": MIN_OPTIONS, "maxProperties": MAX_OPTIONS}}, "required": ["type", "criteria"]}
    score = {"type": "object", "properties": {
        "type": {"const": "score"}, "instructions": opt_text,
        "criteria": {"type": "array", "items": text, "minItems": MIN_LEVELS, "maxItems": MAX_LEVELS}},
        "required": ["type", "criteria"]}
    usage = {"type": "object", "properties": {"input_tokens": {"type": "integer", "minimum": 0},
                                              "output_tokens": {"type": "integer", "minimum": 0}},
             "required": ["input_tokens", "output_tokens"]}
    answers = {"anyOf": [
        {"type": "object", "properties": {"type": {"const": "noul"}, "noul": prob}, "required": ["type", "noul"]},
        {"type": "object", "properties": {"type": {"const": "choice"}, "choice": {"type": "string"},
                                          "probabilities": probs, "confidence": prob},
         "required": ["type", "choice", "probabilities", "confidence"]},
        {"type": "object", "properties": {"type": {"const": "score"}, "score": {"type": "number", "minimum": 0},
                                          "confidence": prob, "legend": {"type": "object"}, "probabilities": probs},
         "required": ["type", "score", "confidence", "legend", "probabilities"]}]}
    return {
        "SystemOneRequest": {"type": "object", "properties": {
            "model": {"type": "string", "enum": [JEV_ALIAS, model_id]}, "state": text,
            "questions": {"type": "object", "propertyNames": {"type": "string", "minLength": 1},
                          "additionalProperties": {"anyOf": [noul, choice, score]}, "minProperties": 1}},
            "required": ["state", "questions"]},
        "SystemOne": {"type": "object", "properties": {
            "model": {"type": "string"}, "answers": {"type": "object", "additionalProperties": answers},
            "usage": usage}, "required": ["model", "answers", "usage"]},
        "JevError": {"type": "object", "properties": {"detail": {"anyOf": [
            {"type": "array", "items": {"type": "object", "properties": {
                "loc": {"type": "array", "items": {"anyOf": [{"type": "string"}, {"type": "integer"}]}},
                "msg": {"type": "string"}, "type": {"type": "string"}}, "required": ["loc", "msg", "type"]}},
            {"type": "object", "properties": {"error_type": {"type": "string"}, "message": {"type": "string"}},
             "required": ["error_type", "message"]}]}}, "required": ["detail"]},
        "JevModels": {"type": "array", "items": {"type": "object", "properties": {
            "name": {"type": "string"}, "description": {"type": "string"},
            "release_date": {"type": "string", "pattern": r"^\d{4}-\d{2}-\d{2}$"}},
            "required": ["name", "description", "release_date"]}},
    }
