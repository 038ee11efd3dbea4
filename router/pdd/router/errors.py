"""Typed errors of the router's request path, each mapped to one HTTP status.

Serving code raises these; the app turns every one (and anything unexpected) into
the single OpenAI ``ErrorResponse`` shape, so a client's error handling never meets
a FastAPI default body. A mid-stream failure uses the same shape as an SSE frame.
docs/errors.md lists every class with its status, ``type``, ``cause`` and whether a
retry can help (a test keeps it complete). A 4xx is the request's own fault, said so
for good: only 429 (capacity that comes back), 502 and 503 are worth a retry.
"""

from __future__ import annotations

import math

from pdd.router.openai_protocol import ErrorResponse


def printable(text: str) -> str:
    """``text`` with what has no UTF-8 form (a lone surrogate a client sent, echoed in a
    message or a param) written as its escape, so the error itself can always be sent."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


class RouterError(Exception):
    """Base: ``status`` and ``type`` are what the client sees beside the message."""

    status: int = 500
    type: str = "internal_error"
    #: The ``cause`` label of ``pdd_router_rejected_requests_total``.
    cause: str = "internal"

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = printable(message)
        self.param = None if param is None else printable(param)

    @property
    def headers(self) -> dict[str, str]:
        return {}

    def body(self) -> ErrorResponse:
        return ErrorResponse.of(self.message, self.type, code=self.status, param=self.param)


class InvalidRequestError(RouterError):
    status, type = 400, "invalid_request_error"
    cause = "invalid_request"


class PromptTooLongError(InvalidRequestError):
    """The prompt exceeds the router's token limit."""

    cause = "prompt_too_long"


class ContextLengthError(InvalidRequestError):
    """Prompt plus ``max_tokens`` exceeds the model's context window."""

    cause = "context_length_exceeded"


class RequestTooLargeError(InvalidRequestError):
    """The request could never fit a worker's KV cache, even with the cache to itself:
    its prompt plus ``max_tokens`` is over the pool (``EngineInfo.kv_tokens``), which may
    be smaller than the context window. Permanent, so a 400, never a 429."""

    cause = "request_too_large"


class AuthenticationError(RouterError):
    status, type = 401, "authentication_error"
    cause = "unauthorized"


class ModelNotFoundError(RouterError):
    status, type = 404, "not_found_error"
    cause = "unknown_model"


class PayloadTooLargeError(RouterError):
    status, type = 413, "invalid_request_error"
    cause = "body_too_large"


class UnsupportedMediaTypeError(RouterError):
    """The body is declared as something other than JSON (``Content-Type``)."""

    status, type = 415, "invalid_request_error"
    cause = "unsupported_media_type"


class SaturatedError(RouterError):
    """Every instance a request needs is at capacity: retry later, nothing was queued."""

    status, type = 429, "rate_limit_error"
    cause = "saturated"

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s

    @property
    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(max(1, math.ceil(self.retry_after_s)))}


class TooManyStreamsError(SaturatedError):
    """The API key already has its limit of requests in flight: retry when one ends."""

    cause = "streams_per_key"


class UpstreamError(RouterError):
    """A worker refused or lost the request and nobody could carry it on. ``failed``: the
    instances to blame (none when the failure names no one, e.g. a timeout)."""

    status, type = 502, "upstream_error"
    cause = "upstream"

    def __init__(self, message: str, failed: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.failed = failed


class NotReadyError(RouterError):
    """The router knows no ready worker of a role the request needs."""

    status, type = 503, "service_unavailable"
    cause = "not_ready"
