"""The WAN link's admin endpoint: a deliberately tiny HTTP/1.1 server on asyncio.

    GET  /stats                   -> WanLink.stats() as JSON
    POST /rate      {"gbps": G}   -> re-rate the line
    POST /partition {"cut": bool} -> cut or heal the line

Three routes do not justify a web framework in the emulator's process (and
an in-process uvicorn would take over the process's signal handlers), so
this speaks just enough HTTP: one request per connection, JSON bodies,
``Connection: close``. Bodies are validated with pydantic; errors come back
as ``{"error": ...}`` with a 4xx status: a rate must be a finite number from
``MIN_GBPS`` to ``MAX_GBPS`` (1 kbit/s to 10 Tbit/s), so the line never stalls for
good nor turns infinite, and no answer holds a non-finite number (``Infinity`` is
not JSON).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pdd.wan.bottleneck import MAX_GBPS, MIN_GBPS
from pdd.wan.link import WanLink, parse_addr

_MAX_BODY = 64 * 1024
_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
            500: "Internal Server Error"}  # fmt: skip


class RateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    gbps: float = Field(ge=MIN_GBPS, le=MAX_GBPS, allow_inf_nan=False)


class PartitionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    cut: bool


class _Answer(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class RouteStats(_Answer):
    listen: str
    to: str


class ConnectionStats(_Answer):
    active: int
    total: int
    refused: int
    reset: int


class DirectionStats(_Answer):
    bytes: int
    throughput_gbps: float


class LinkStats(_Answer):
    """``GET /stats`` (and every answer): the line's settings and counters, as ``pdd
    bench`` and the tests read them from another process."""

    listen: str
    to: str
    routes: list[RouteStats]
    gbps: float
    rtt_ms: float
    jitter_ms: float
    cut: bool
    connections: ConnectionStats
    forward: DirectionStats
    reverse: DirectionStats


class HttpError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def handle(link: WanLink, method: str, path: str, body: bytes) -> LinkStats:
    """Route one request; the whole API in one function."""
    routes = {"/stats": "GET", "/rate": "POST", "/partition": "POST"}
    if path not in routes:
        raise HttpError(404, f"no route {path}; try GET /stats, POST /rate, POST /partition")
    if method != routes[path]:
        raise HttpError(405, f"{path} takes {routes[path]}")
    try:
        if path == "/rate":
            link.set_rate(RateRequest.model_validate_json(body).gbps)
        elif path == "/partition":
            link.partition(PartitionRequest.model_validate_json(body).cut)
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        where = ".".join(str(part) for part in first["loc"])
        raise HttpError(400, f"{where}: {first['msg']}" if where else first["msg"]) from None
    return LinkStats.model_validate(link.stats())


async def _read_request(reader: asyncio.StreamReader) -> tuple[str, str, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3:
        raise HttpError(400, "malformed request line")
    headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
    length = int(headers.get("content-length", "0") or 0)
    if not 0 <= length <= _MAX_BODY:
        raise HttpError(400, f"body must be at most {_MAX_BODY} bytes")
    body = await reader.readexactly(length) if length else b""
    return parts[0], parts[1].split("?")[0], body


def _response(status: int, payload: dict[str, Any]) -> bytes:
    """The HTTP answer; ValueError where ``payload`` holds a non-finite number."""
    body = json.dumps(payload, allow_nan=False).encode()
    head = (
        f"HTTP/1.1 {status} {_REASONS[status]}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + body


class AdminServer:
    """Serves ``handle()`` on a host:port until ``close()``."""

    def __init__(self, link: WanLink) -> None:
        self._link = link
        self._server: asyncio.Server | None = None

    async def start(self, address: str) -> None:
        """Listen on ``host:port`` (port 0 picks a free one; read it from ``port``)."""
        self._server = await asyncio.start_server(self._on_client, *parse_addr(address))

    @property
    def port(self) -> int:
        if self._server is None:
            raise RuntimeError("AdminServer.port read before start()")
        return self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _on_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            method, path, body = await asyncio.wait_for(_read_request(reader), 10)
            status, payload = 200, handle(self._link, method, path, body).model_dump()
        except HttpError as exc:
            status, payload = exc.status, {"error": str(exc)}
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError, TimeoutError):
            status, payload = 400, {"error": "malformed HTTP request"}
        try:
            answer = _response(status, payload)
        except ValueError:  # the bounds keep every number finite; never answer bad JSON
            answer = _response(500, {"error": "the line's state holds a non-finite number"})
        with contextlib.suppress(ConnectionError):
            writer.write(answer)
            await writer.drain()
        writer.close()
