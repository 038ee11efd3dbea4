"""The router's access log: one line per API request, whatever became of it.

An ASGI middleware opens an ``AccessRecord`` for each ``/v1/`` request and writes it
when the response has been sent in full (the last byte of a stream, not its headers),
or when the request failed before any response: what an operator greps for first.
The serving code fills the record through ``current()`` (a context variable, so the
routes need no extra parameter): each ``Generation`` adds itself (TTFT and tokens are
read off it at the end) and a refusal notes its cause. The route's pipeline and reason
are read off the response headers the router sends anyway.

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

from pdd.common.logs import FIELDS
from pdd.common.openai_protocol import new_id

log = logging.getLogger("pdd.router.access")

_current: contextvars.ContextVar[AccessRecord | None] = contextvars.ContextVar(
    "pdd_access_record", default=None
)


def current() -> AccessRecord | None:
    """The record of the request being served in this context (None outside one)."""
    return _current.get()


class Generation(Protocol):
    """What the line reads off a ``pdd.router.generation.Generation`` at the end."""

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

    def fields(self) -> dict[str, Any]:
        """The line's fields, in a fixed order."""
        gens = self.generations
        ttfts = [g.ttft_s for g in gens if g.ttft_s is not None]
        finishes = sorted({g.finish_reason for g in gens if g.finish_reason})
        return {
            "request_id": self.request_id or new_id("req"),
            "method": self.method,
            "path": self.path,
            "status": self.status,
            "pipeline": self.pipeline,
            "ttft_s": round(min(ttfts), 4) if ttfts else None,
            "prompt_tokens": gens[0].prompt_tokens if gens else None,
            "completion_tokens": sum(g.completion_tokens for g in gens) if gens else None,
            "finish_reason": ",".join(finishes) or None,
            "duration_s": round(time.monotonic() - self.started, 4),
            "error": self.error,
            "reason": self.reason,
        }


def format_line(fields: dict[str, Any]) -> str:
    """``key=value`` pairs, values with spaces quoted; unset fields left out."""
    parts = []
    for key, value in fields.items():
        if value is None:
            continue
        text = str(value)
        parts.append(f'{key}="{text}"' if (" " in text or not text) else f"{key}={text}")
    return " ".join(parts)


class AccessLogMiddleware:
    """Writes one access-log line per ``/v1/`` request once its response is over."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        record = AccessRecord(scope["method"], scope["path"])
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
        except BaseException as exc:
            if not done:  # no response went out in full: still one line
                record.status = record.status or 500
                record.refused("internal", repr(exc))
                _write(record)
            raise
        finally:
            _current.reset(token)


def _header(headers: dict[str, bytes], name: str) -> str | None:
    value = headers.get(name)
    return None if value is None else value.decode("latin-1")


def _write(record: AccessRecord) -> None:
    fields = record.fields()
    log.info("%s", format_line(fields), extra={FIELDS: fields})
