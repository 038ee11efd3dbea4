"""The WAN link's admin endpoint: a deliberately tiny HTTP/1.1 server on asyncio.

    GET  /stats                   -> WanLink.stats() (a LinkStats) as JSON
    POST /rate      {"gbps": G}   -> re-rate the line
    POST /partition {"cut": bool} -> cut or heal the line

Three routes do not justify a web framework in the emulator's process (and
an in-process uvicorn would take over the process's signal handlers), so
this speaks just enough HTTP: one request per connection, JSON bodies,
``Connection: close``. Bodies are validated with pydantic; errors come back
as ``{"error": ...}`` with a 4xx status: a rate must be a finite number from
``MIN_GBPS`` to ``MAX_GBPS`` (1 kbit/s to 10 Tbit/s), so the line never stalls for
good nor turns infinite, and no answer holds a non-finite number (``Infinity`` is
not JSON; ``LinkStats`` refuses one, and a state past the bounds is a 500).
"""

from __future__ import annotations

import asyncio
import contextlib
import json

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pdd.wan.bottleneck import MAX_GBPS, MIN_GBPS
from pdd.wan.link import WanLink, parse_addr
from pdd.wan.stats import LinkStats

_MAX_BODY = 64 * 1024
_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
            500: "Internal Server Error"}  # fmt: skip


class RateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    gbps: float = Field(ge=MIN_GBPS, le=MAX_GBPS, allow_inf_nan=False)


class PartitionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    cut: bool


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
    return link.stats()


def answer(link: WanLink, method: str, path: str, body: bytes) -> bytes:
    """The whole HTTP answer to one request: the line's stats, or the error and its status."""
    try:
        stats = handle(link, method, path, body)
    except HttpError as exc:
        return _response(exc.status, _error(str(exc)))
    except ValidationError:  # the bounds keep every number finite; never answer bad JSON
        return _response(500, _error("the line's state holds a non-finite number"))
    return _response(200, stats.model_dump_json().encode())


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


def _error(message: str) -> bytes:
    return json.dumps({"error": message}).encode()


def _response(status: int, body: bytes) -> bytes:
    head = (
        f"HTTP/1.1 {status} {_REASONS[status]}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + body


class AdminServer:
    """Serves ``answer()`` on a host:port until ``close()``."""

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
        except HttpError as exc:
            reply = _response(exc.status, _error(str(exc)))
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError, TimeoutError):
            reply = _response(400, _error("malformed HTTP request"))
        else:
            reply = answer(self._link, method, path, body)
        with contextlib.suppress(ConnectionError):
            writer.write(reply)
            await writer.drain()
        writer.close()
