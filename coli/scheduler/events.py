"""What a front end receives for a request: typed events, and typed scheduler errors.

A request's stream is ``Started`` (once admitted to a KV slot), then any number of
deltas (``TextDelta``, ``ReasoningDelta``, ``ToolCallDelta``) and, when asked for,
``Routing``; it ends with ``Profile``, ``Usage``, ``Finished`` — or with one
``Error`` at any point (queue_timeout, cancelled, an engine failure). Refusals that
happen at submission (queue_full, context_length_exceeded, a closed scheduler) are
raised by ``submit`` instead, so an HTTP front end can answer before it sends headers.
"""
from __future__ import annotations

from dataclasses import dataclass

from coli.errors import ColiError, InvalidRequestError


# -- errors ------------------------------------------------------------------------------------


class SchedulerError(ColiError):
    """A request the scheduler could not serve; ``code`` is the API error code."""

    code = "scheduler_error"


class QueueFullError(SchedulerError):
    """The waiting queue is at --max-queue and no unreserved slot is free (HTTP 429)."""

    code = "queue_full"


class QueueTimeoutError(SchedulerError):
    """The request waited --queue-timeout seconds without getting a slot (HTTP 429)."""

    code = "queue_timeout"


class ContextLengthExceededError(SchedulerError, InvalidRequestError):
    """The prompt does not fit the context (HTTP 400)."""

    code = "context_length_exceeded"


class RequestCancelledError(SchedulerError):
    """The request was cancelled before it finished."""

    code = "cancelled"


class SchedulerClosedError(SchedulerError):
    """The scheduler is shutting down and takes no new requests (HTTP 503)."""

    code = "scheduler_closed"


class EngineError(SchedulerError):
    """The engine (or sampling) failed while the request held a slot (HTTP 500)."""

    code = "engine_error"


class GrammarDeadEndError(SchedulerError, InvalidRequestError):
    """A constraint (coli.grammar) allows no token before its answer is complete (HTTP 400)."""

    code = "grammar_dead_end"


ERRORS: dict[str, type[SchedulerError]] = {
    cls.code: cls for cls in (QueueFullError, QueueTimeoutError, ContextLengthExceededError,
                              RequestCancelledError, SchedulerClosedError, EngineError, GrammarDeadEndError)
}


# -- events ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Started:
    """The request got KV slot ``slot``; ``cached_tokens`` of its prompt are reused."""

    slot: int
    prompt_tokens: int
    cached_tokens: int
    queue_wait_seconds: float
    max_tokens: int  # after clamping to the context


@dataclass(frozen=True)
class TextDelta:
    text: str


@dataclass(frozen=True)
class ReasoningDelta:
    text: str


@dataclass(frozen=True)
class ToolCallDelta:
    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""  # a piece of the JSON arguments


@dataclass(frozen=True)
class TokenLogprob:
    """A sampled token's log-probability under the model (its raw logits, before
    penalties, temperature and filters) and the ``top`` likeliest tokens as (id,
    logprob), most likely first. Put before the text the token produces (which stop
    strings and markers may hold back or hide)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class PromptLogprobs:
    """A scoring request's answer (``Runner.score``): the log-probability of each
    scored prompt token given the tokens before it."""

    logprobs: tuple[float, ...]


@dataclass(frozen=True)
class Routing:
    """Experts chosen for this request's tokens in one step: experts[layer][token] = ids."""

    step: int
    experts: tuple[tuple[tuple[int, ...], ...], ...]  # (moe_layers, tokens, k)


@dataclass(frozen=True)
class Profile:
    """Where the request's time went, summed over the steps it took part in. Steps are
    shared by the sequences batched in them, so each step's seconds count once for
    every request in it. The phase fields are the engine's per-step figures (0 where
    the engine does not measure them); disk service overlaps compute."""

    prefill_seconds: float
    decode_seconds: float
    steps: int  # forward passes
    prefill_tokens: int
    decode_tokens: int
    attention_seconds: float = 0.0
    expert_matmul_seconds: float = 0.0
    dense_mlp_seconds: float = 0.0
    lm_head_seconds: float = 0.0
    io_wait_seconds: float = 0.0  # waiting for experts to arrive from disk
    disk_seconds: float = 0.0  # disk service time of expert reads
    experts_needed: int = 0
    experts_hit: int = 0
    bytes_read: int = 0
    draft_tokens: int = 0  # speculative decoding: draft tokens verified
    accepted_tokens: int = 0  # ... and accepted (decode_tokens counts them)


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    queue_wait_seconds: float


@dataclass(frozen=True)
class Finished:
    # "stop" (end of turn or a stop string) | "length" (max_tokens or the context); with an
    # output parser also "tool_calls" | "malformed_tool_call" (see coli.chat_format)
    finish_reason: str
    stop: str | None = None  # the stop string that ended the text, if one did


@dataclass(frozen=True)
class Error:
    code: str  # one of ERRORS' keys
    message: str

    def exception(self) -> SchedulerError:
        return ERRORS.get(self.code, SchedulerError)(self.message)


Event = (Started | TextDelta | ReasoningDelta | ToolCallDelta | TokenLogprob | PromptLogprobs | Routing | Profile
         | Usage | Finished | Error)
