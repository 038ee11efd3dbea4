"""The router's access log: one line per API request, whatever became of it.

An ASGI middleware opens an ``AccessRecord`` for each ``/v1/`` request and writes it
when the response has been sent in full (the last byte of a stream, not its headers),
or when the request failed before any response: what an operator greps for first.
The serving code fills the record through ``current()`` (a context variable, so the
routes need no extra parameter): each ``Generation`` adds itself (TTFT and tokens are
read off it at the end) and a refusal notes its cause. The route's pipeline and reason
are read off the response headers the router sends anyway.

A client that goes away still gets its line: a non-streaming request it left (the app
cancels the work and answers 499 into the void, as nginx logs it), a body it cut short
(499 too), a stream it closed mid-way (the status that went out, usually 200): each
with ``error=client_disconnected``. Starlette stops a response early only for that.

Every value a client chose (the path, its user agent, a field name quoted in a reason)
is escaped in the text line (``format_line``; JSON quotes it by its own rules), so one
request is always exactly one line and no line can be forged.

The logger is ``pdd.router.access``; with ``--log-format json`` each line is a JSON
object whose keys are the record's fields.
"""

from __future__ import annotations

import contextvars
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Protocol
from urllib.parse import unquote

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pdd.common.logs import FIELDS, printable
from pdd.router.openai_protocol import new_id

log = logging.getLogger("pdd.router.access")

#: The ``error`` of a request whose client went away before its response was complete.
CLIENT_DISCONNECTED = "client_disconnected"
#: The status logged for a request whose client left before any status went out (nginx's).
CLIENT_CLOSED_REQUEST = 499

_current: contextvars.ContextVar[AccessRecord | None] = contextvars.ContextVar(
    "pdd_access_record", default=None
)


def current() -> AccessRecord | None:
    """The record of the request being served in this context (None outside one)."""
    return _current.get()


class Generation(Protocol):
    """What the line reads off a ``pdd.router.generation.Generation`` at the end."""

    @property
    def request_id(self) -> str: ...
    @property
    def pipeline(self) -> str: ...
    @property
    def ttft_s(self) -> float | None: ...
    @property
    def finish_reason(self) -> str | None: ...
    @property
    def prompt_tokens(self) -> int: ...
    @property
    def completion_tokens(self) -> int: ...


@dataclass
class AccessRecord:
    method: str
    path: str
    user_agent: str | None = None
    started: float = field(default_factory=time.monotonic)
    status: int | None = None
    #: The router's request id (``x-pdd-request-id``); one of its own for a request
    #: refused before it was routed.
    request_id: str | None = None
    pipeline: str | None = None
    reason: str | None = None
    error: str | None = None
    generations: list[Generation] = field(default_factory=list)

    def add(self, generation: Generation) -> None:
        self.generations.append(generation)

    def refused(self, cause: str, message: str) -> None:
        """A 4xx/5xx, or an error frame in a stream: why."""
        self.error = cause
        self.reason = self.reason or message

    def left(self) -> None:
        """The client went away before the response was complete."""
        self.status = self.status or CLIENT_CLOSED_REQUEST
        self.refused(CLIENT_DISCONNECTED, "the client closed the connection first")

    def fields(self) -> dict[str, Any]:
        """The line's fields, in a fixed order. Where no response headers went out (the
        client left first), the id and pipeline are the request's first generation's."""
        gens = self.generations
        first = gens[0] if gens else None
        ttfts = [g.ttft_s for g in gens if g.ttft_s is not None]
        finishes = sorted({g.finish_reason for g in gens if g.finish_reason})
        return {
            "request_id": self.request_id or (first.request_id if first else new_id("req")),
            "method": self.method,
            "path": self.path,
            "status": self.status,
            "pipeline": self.pipeline or (first.pipeline if first else None),
            "ttft_s": round(min(ttfts), 4) if ttfts else None,
            "prompt_tokens": gens[0].prompt_tokens if gens else None,
            "completion_tokens": sum(g.completion_tokens for g in gens) if gens else None,
            "finish_reason": ",".join(finishes) or None,
            "duration_s": round(time.monotonic() - self.started, 4),
            "error": self.error,
            "reason": self.reason,
            "user_agent": self.user_agent,
        }


def format_line(fields: dict[str, Any]) -> str:
    """``key=value`` pairs (logfmt), unset fields left out. In a value, backslashes and
    double quotes are escaped, then every character that is not printable
    (``printable``: ``\\x0d``); one with a space, a quote or an ``=``, or an empty one,
    is quoted. So a value never ends the line, nor leaves its quotes."""
    parts = []
    for key, value in fields.items():
        if value is None:
            continue
        raw = str(value)
        text = printable(raw.replace("\\", "\\\\").replace('"', '\\"'))
        quoted = not raw or any(c in raw for c in ' "=')
        parts.append(f'{key}="{text}"' if quoted else f"{key}={text}")
    return " ".join(parts)


class AccessLogMiddleware:
    """Writes one access-log line per ``/v1/`` request once its response is over."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        record = AccessRecord(scope["method"], scope["path"], _user_agent(scope))
        token = _current.set(record)
        done = False

        async def sending(message: Message) -> None:
            nonlocal done
            if message["type"] == "http.response.start":
                record.status = message["status"]
                headers = {k.decode("latin-1"): v for k, v in message.get("headers", [])}
                record.request_id = _header(headers, "x-pdd-request-id") or record.request_id
                record.pipeline = _header(headers, "x-pdd-pipeline")
                route_reason = _header(headers, "x-pdd-reason")
                record.reason = unquote(route_reason) if route_reason else record.reason
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body"):
                done = True
                _write(record)

        try:
            await self.app(scope, receive, sending)
            if not done:  # the response stopped short: its client went away
                record.left()
                _write(record)
        except BaseException as exc:
            if not done:  # no response went out in full: still one line
                record.status = record.status or 500
                record.refused("internal", repr(exc))
                _write(record)
            raise
        finally:
            _current.reset(token)


def _user_agent(scope: Scope) -> str | None:
    for name, value in scope["headers"]:
        if name == b"user-agent":
            return value.decode("latin-1")
    return None


def _header(headers: dict[str, bytes], name: str) -> str | None:
    value = headers.get(name)
    return None if value is None else value.decode("latin-1")


def _write(record: AccessRecord) -> None:
    fields = record.fields()
    log.info("%s", format_line(fields), extra={FIELDS: fields})
