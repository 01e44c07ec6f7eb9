"""API errors and their two envelopes (OpenAI's and Anthropic's).

Handlers raise ``ApiError``; the middleware renders it in the envelope of the API the
path belongs to: ``{"error": {"message", "type", "param", "code"}}`` for OpenAI-style
paths, ``{"type": "error", "error": {"type", "message"}}`` under /v1/messages.
"""
from __future__ import annotations

from coli.errors import ColiError, InvalidRequestError
from coli.scheduler import (ContextLengthExceededError, EngineError, QueueFullError, QueueTimeoutError,
                            RequestCancelledError, SchedulerClosedError)

OPENAI_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error",
                429: "rate_limit_error", 500: "server_error", 503: "server_error"}
ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                   404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
                   429: "rate_limit_error", 500: "api_error", 503: "overloaded_error"}
RETRY_AFTER_SECONDS = 1


class ApiError(Exception):
    """An HTTP error with an API-shaped body."""

    def __init__(self, status: int, message: str, *, code: str | None = None, param: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param
        self.headers = headers or {}

    def openai(self) -> dict:
        return {"error": {"message": self.message, "type": OPENAI_TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}

    def anthropic(self) -> dict:
        return {"type": "error", "error": {"type": ANTHROPIC_TYPES.get(self.status, "api_error"),
                                           "message": self.message}}

    def jev(self) -> dict:
        """The envelope of /v1/systemone (TypeSafe's Jev API)."""
        return {"detail": {"error_type": OPENAI_TYPES.get(self.status, "invalid_request_error"),
                           "message": self.message}}


class ValidationFailed(ApiError):
    """422: a request body that does not validate, with each problem as {"loc", "msg", "type"}
    (the shape of /v1/systemone's validation errors)."""

    def __init__(self, detail: list[dict]):
        super().__init__(422, "; ".join(f"{'.'.join(str(x) for x in d['loc'][1:])}: {d['msg']}" for d in detail),
                         code="validation_error")
        self.detail = detail

    def jev(self) -> dict:
        return {"detail": self.detail}


def invalid(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def unsupported(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code="unsupported_feature")


def from_coli(e: ColiError) -> ApiError:
    """The HTTP answer to a library error raised at submission or while queued."""
    message = str(e)
    if isinstance(e, ContextLengthExceededError):
        return ApiError(400, message, code="context_length_exceeded", param="messages")
    if isinstance(e, (QueueFullError, QueueTimeoutError)):
        return ApiError(429, message, code=e.code, headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
    if isinstance(e, SchedulerClosedError):
        return ApiError(503, message, code=e.code)
    if isinstance(e, RequestCancelledError):
        return ApiError(503, message, code=e.code)
    if isinstance(e, EngineError):
        return ApiError(500, message, code=e.code)
    if isinstance(e, InvalidRequestError):
        return ApiError(400, message, param=getattr(e, "param", None), code=getattr(e, "code", None))
    return ApiError(400, message)
