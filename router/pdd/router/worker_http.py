"""A lean HTTP/1.1 transport for the router's calls to one worker (issue 61).

httpx's own transport (httpcore on anyio, h11) cost the router about 1 ms of CPU per call
on the development machine, most of a routed request's budget three times over: anyio
cancel scopes around every read and write, trace hooks, h11's event state machine, and a
walk of the pool with a ``select`` per pooled connection on every request and every
response's close, plus the request's head and body sent as two writes (two ``send``
calls). The workers' control API needs little of HTTP/1.1: a request with a small
body, an answer framed by ``Content-Length`` or chunked (the NDJSON token streams), on
keep-alive connections. This transport speaks that much on asyncio streams: one write per
request, the answer's head parsed once, idle connections kept last-in first-out and
dropped after ``keepalive_expiry_s``. It is one worker's: its address and the headers
every call carries are encoded once, and a call names only its method, path and body
(an ``httpx.Request`` parses its whole URL, the address included, on every call). It
answers with an ``httpx.Response`` and raises ``httpx``'s exceptions, as the httpx
transports :class:`~pdd.router.worker_client.WorkerClient` takes in tests do
(docs/router-scale.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import time
from collections.abc import AsyncIterator, Iterator, Mapping

import httpx

#: A call's timeouts, as ``httpx.Timeout.as_dict()`` gives them (``connect``, ``read``,
#: ``write``, ``pool``; None: no limit).
Timeouts = Mapping[str, float | None]

#: Answers with no body whatever their headers say (RFC 9112, section 6.3).
_NO_BODY = frozenset({204, 304})
#: The most a body read asks the socket's buffer for at once.
_READ_SIZE = 65536
_NO_DEADLINE = contextlib.nullcontext()


class _Connection:
    """One keep-alive connection to the worker."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.idle_since = 0.0

    def usable(self, now: float, expiry_s: float) -> bool:
        """Whether an idle connection may carry the next request: not expired (the worker
        may be closing it at this moment, which would fail the request unsent), and not
        closed or written to by the worker meanwhile."""
        fresh = now - self.idle_since < expiry_s
        return fresh and not self.writer.is_closing() and not self.reader.at_eof()

    def close(self) -> None:
        self.writer.close()


class _Framing:
    """How an answer's body ends: after ``length`` bytes, at a zero-size chunk, or when
    the worker closes the connection (``length`` None, not chunked)."""

    def __init__(self, length: int | None, chunked: bool, keep_alive: bool) -> None:
        self.length = length
        self.chunked = chunked
        self.keep_alive = keep_alive

    @property
    def reusable(self) -> bool:
        """Whether the connection can carry another request once this body was read: a
        keep-alive one whose body did not end by its closing."""
        return self.keep_alive and (self.chunked or self.length is not None)


class WorkerTransport:
    """Keep-alive HTTP/1.1 connections to the worker at ``base_url`` (``http://`` or
    ``https://``, verified with ``tls``), every request carrying ``headers``; at most
    ``max_connections`` open and ``max_idle`` kept idle."""

    def __init__(
        self,
        base_url: str,
        headers: Mapping[str, str],
        tls: ssl.SSLContext,
        keepalive_expiry_s: float,
        max_connections: int = 1000,
        max_idle: int = 200,
    ) -> None:
        url = httpx.URL(base_url)
        self._host = url.host
        self._tls = tls if url.scheme == "https" else None
        self._port = url.port or (443 if self._tls else 80)
        self._headers = _header_lines({"Host": url.netloc.decode(), **headers})
        self._expiry_s = keepalive_expiry_s
        self._max_idle = max_idle
        self._slots = asyncio.Semaphore(max_connections)
        self._idle: list[_Connection] = []
        self._open: set[_Connection] = set()

    async def call(
        self,
        method: str,
        path: str,
        timeout: Timeouts,
        body: bytes | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> httpx.Response:
        """The worker's answer to ``method path`` (with ``body``, and ``headers`` beside
        the transport's own), its body still to be read; the connection is the pool's
        again once the body is read to its end and closed."""
        conn = self._idle_connection() or await self._connect(timeout)
        request = self._request_bytes(method, path, body, headers)
        try:
            await _send(conn, request, timeout.get("write"))
            status, header_list, framing = await _read_head(conn, timeout.get("read"))
        except BaseException:
            self._discard(conn)
            raise
        if status in _NO_BODY:
            framing = _Framing(0, chunked=False, keep_alive=framing.keep_alive)
        stream = _Body(self, conn, framing, timeout.get("read"))
        return httpx.Response(status, headers=header_list, stream=stream)

    def _request_bytes(
        self, method: str, path: str, body: bytes | None, headers: Mapping[str, str] | None
    ) -> bytes:
        """The request's head and body, to go in one write (one ``send``)."""
        head = b"%s %s HTTP/1.1\r\n%s" % (method.encode(), path.encode(), self._headers)
        if headers:
            head += _header_lines(headers)
        if body is not None:
            head += b"Content-Length: %d\r\n" % len(body)
        return head + b"\r\n" + (body or b"")

    def _idle_connection(self) -> _Connection | None:
        """The most recently used idle connection still usable; those taken before it
        (expired, or closed by the worker) are closed, and so are the expired ones below
        it (the oldest: ``_idle`` is in the order they went idle), which a pool taken
        newest first would otherwise keep open for as long as fresher ones serve."""
        now = time.monotonic()
        while self._idle and now - self._idle[0].idle_since >= self._expiry_s:
            self._discard(self._idle.pop(0))
        while self._idle:
            conn = self._idle.pop()
            if conn.usable(now, self._expiry_s):
                return conn
            self._discard(conn)
        return None

    async def _connect(self, timeout: Timeouts) -> _Connection:
        """A new connection, once a slot is free (``pool`` timeout) and the worker accepted
        it (``connect`` timeout, the TLS handshake included)."""
        where = f"{self._host}:{self._port}"
        try:
            async with _within(timeout.get("pool")):
                await self._slots.acquire()
        except TimeoutError:
            raise httpx.PoolTimeout(f"no free connection to {where}") from None
        try:
            async with _within(timeout.get("connect")):
                reader, writer = await asyncio.open_connection(
                    self._host,
                    self._port,
                    ssl=self._tls,
                    server_hostname=self._host if self._tls else None,
                )
        except BaseException as exc:
            self._slots.release()
            if isinstance(exc, TimeoutError):
                raise httpx.ConnectTimeout(f"connecting to {where}") from exc
            if isinstance(exc, OSError):
                raise httpx.ConnectError(f"{where}: {exc}") from exc
            raise
        conn = _Connection(reader, writer)
        self._open.add(conn)
        return conn

    def _release(self, conn: _Connection, reusable: bool) -> None:
        """An answer was read (``reusable``: to its end, on a keep-alive connection) or
        dropped: keep the connection for the next call, or close it."""
        if reusable and len(self._idle) < self._max_idle and not conn.writer.is_closing():
            conn.idle_since = time.monotonic()
            self._idle.append(conn)
        else:
            self._discard(conn)

    def _discard(self, conn: _Connection) -> None:
        if conn in self._open:
            self._open.discard(conn)
            self._slots.release()
            conn.close()

    async def aclose(self) -> None:
        self._idle.clear()
        for conn in list(self._open):
            self._discard(conn)


def _header_lines(headers: Mapping[str, str]) -> bytes:
    return b"".join(b"%s: %s\r\n" % (k.encode(), v.encode()) for k, v in headers.items())


async def _send(conn: _Connection, data: bytes, timeout_s: float | None) -> None:
    try:
        conn.writer.write(data)
        async with _within(timeout_s):
            await conn.writer.drain()
    except TimeoutError:
        raise httpx.WriteTimeout("sending the request") from None
    except OSError as exc:
        raise httpx.WriteError(repr(exc)) from exc


async def _read_head(
    conn: _Connection, timeout_s: float | None
) -> tuple[int, list[tuple[bytes, bytes]], _Framing]:
    """The answer's status, headers and how its body is framed."""
    with _reading("the answer's head"):
        async with _within(timeout_s):
            head = await conn.reader.readuntil(b"\r\n\r\n")
    return _parse_head(head)


@contextlib.contextmanager
def _reading(what: str) -> Iterator[None]:
    """asyncio's read failures as the ``httpx`` exceptions the router's callers handle
    (a timeout is late, a closed or reset connection a failed call)."""
    try:
        yield
    except TimeoutError:
        raise httpx.ReadTimeout(f"reading {what}") from None
    except asyncio.IncompleteReadError:
        raise httpx.RemoteProtocolError(f"the worker closed before the end of {what}") from None
    except (asyncio.LimitOverrunError, OSError) as exc:
        raise httpx.ReadError(repr(exc)) from exc


def _parse_head(head: bytes) -> tuple[int, list[tuple[bytes, bytes]], _Framing]:
    status_line, *lines = head[:-4].split(b"\r\n")
    version, _, rest = status_line.partition(b" ")
    if not version.startswith(b"HTTP/1.") or not rest[:3].isdigit():
        raise httpx.RemoteProtocolError(f"not an HTTP/1.1 answer: {status_line[:80]!r}")
    headers = []
    length, chunked, keep_alive = None, False, version == b"HTTP/1.1"
    for line in lines:
        name, sep, value = line.partition(b":")
        if not sep:
            raise httpx.RemoteProtocolError(f"a malformed header line: {line[:80]!r}")
        value = value.strip()
        headers.append((name, value))
        key = name.lower()
        if key == b"content-length":
            length = _content_length(value)
        elif key == b"transfer-encoding":
            chunked = value.lower() == b"chunked"
        elif key == b"connection":
            keep_alive = value.lower() != b"close"
    return int(rest[:3]), headers, _Framing(None if chunked else length, chunked, keep_alive)


def _content_length(value: bytes) -> int:
    if not value.isdigit():
        raise httpx.RemoteProtocolError(f"a malformed Content-Length: {value[:40]!r}")
    return int(value)


class _Body(httpx.AsyncByteStream):
    """An answer's body, read off its connection; the connection goes back to the pool
    when the body was read to its end and closed, and is closed if it was not."""

    def __init__(
        self,
        transport: WorkerTransport,
        conn: _Connection,
        framing: _Framing,
        timeout_s: float | None,
    ) -> None:
        self._transport = transport
        self._conn = conn
        self._framing = framing
        self._timeout_s = timeout_s
        self._ended = False
        self._closed = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        parts = self._chunks() if self._framing.chunked else self._sized()
        with _reading("the answer's body"):
            async for part in parts:
                yield part
        self._ended = True

    async def _sized(self) -> AsyncIterator[bytes]:
        """A body of ``Content-Length`` bytes, or to the connection's end without one."""
        reader, left = self._conn.reader, self._framing.length
        while left is None or left > 0:
            async with _within(self._timeout_s):
                data = await reader.read(_READ_SIZE if left is None else min(left, _READ_SIZE))
            if not data:
                if left is None:
                    return
                raise asyncio.IncompleteReadError(b"", left)
            if left is not None:
                left -= len(data)
            yield data

    async def _chunks(self) -> AsyncIterator[bytes]:
        """A chunked body: each chunk's data as it comes (a token stream's lines), until
        the zero-size chunk and the trailers after it."""
        reader = self._conn.reader
        while True:
            async with _within(self._timeout_s):
                size_line = await reader.readuntil(b"\r\n")
                size = _chunk_size(size_line)
                if size == 0:
                    while await reader.readuntil(b"\r\n") != b"\r\n":
                        pass  # trailers: none are used
                    return
                data = await reader.readexactly(size + 2)
            yield data[:-2]

    async def aclose(self) -> None:
        if not self._closed:
            self._closed = True
            self._transport._release(self._conn, self._ended and self._framing.reusable)


def _chunk_size(line: bytes) -> int:
    try:
        return int(line.split(b";", 1)[0].strip(), 16)
    except ValueError:
        raise httpx.RemoteProtocolError(f"a malformed chunk size: {line[:40]!r}") from None


def _within(timeout_s: float | None) -> contextlib.AbstractAsyncContextManager[object]:
    """A deadline ``timeout_s`` from now, or none (a token stream's reads): no timer is
    made for every chunk of a stream that has no timeout."""
    return _NO_DEADLINE if timeout_s is None else asyncio.timeout(timeout_s)
