"""The router's HTTP client for the workers' control API (torch-free, wire schemas only).

Every ``/v1/pdd/*`` call carries ``Authorization: Bearer <shared secret>``; probes
(``/health``, ``/load``) are open on the worker but get the header too, harmlessly.
With WAN TLS on, the workers across the WAN (MD) answer on https: their certificate must
chain to the deployment's CA (``pdd.common.wan_tls``); a failed handshake is reported
in words (whose certificate, OpenSSL's reason), not as a bare exception.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Protocol

import httpx
from pydantic import ValidationError

from pdd.common.wan_tls import tls_failure
from pdd.common.wire import (
    CacheEventsPage,
    Endpoint,
    HandoffIds,
    LoadReport,
    PipelinePlan,
    TokenEvent,
    WanPeers,
    WorkerHealth,
)
from pdd.router.worker_http import Timeouts, WorkerTransport


class WorkerCallError(RuntimeError):
    """A worker answered with an error status or could not be reached; ``error_type`` and
    ``message`` are those of the worker's error body, when it answered with one."""

    def __init__(
        self,
        url: str,
        detail: str,
        error_type: str | None = None,
        message: str | None = None,
        late: bool = False,
    ) -> None:
        super().__init__(f"{url}: {detail}")
        self.url = url
        self.detail = detail
        self.error_type = error_type
        self.message = message or detail
        #: No answer within the timeout: a busy worker (or router), not a dead one.
        self.late = late


def is_late(exc: httpx.HTTPError) -> bool:
    """Whether ``exc`` is a timeout: connecting, reading, writing, or waiting for a pooled
    connection. A connect that times out is late too: a live worker's kernel completes
    the connection whatever its process is doing, unless its accept queue is full (its
    loop starved) or the router's own loop was too busy to see it made; a worker that is
    gone refuses the connection (a ``ConnectError``, not late). Kubernetes' readiness
    probe counts a connect timeout as one failure of its threshold, too."""
    return isinstance(exc, httpx.TimeoutException)


def failure(exc: httpx.HTTPError) -> str:
    """What went wrong, in words where it was the TLS handshake (a worker whose certificate
    is from another CA, a plaintext port dialled with https), else the exception's repr."""
    cause: BaseException | None = exc
    while cause is not None:
        if isinstance(cause, ssl.SSLError):
            return tls_failure(cause)
        cause = cause.__cause__ or cause.__context__
    return repr(exc)


#: Idle pooled connections are dropped well before the workers' uvicorn closes them
#: (its keep-alive timeout is 5 s); reusing one the server is closing at that moment
#: fails the request with a bare ReadError before a byte is sent.
KEEPALIVE_EXPIRY_S = 2.0
#: How many times a cancel is sent before the router gives up on reaching the worker,
#: and the pause before the next try (times the attempt number).
CANCEL_ATTEMPTS = 3
CANCEL_RETRY_S = 0.2
#: A token stream's timeout: none (it lasts as long as the answer; the relay keeps the
#: request's deadline).
_NO_TIMEOUT = httpx.Timeout(None).as_dict()


class _Transport(Protocol):
    """How :class:`WorkerClient` reaches one worker (:class:`WorkerTransport`'s shape)."""

    async def call(
        self,
        method: str,
        path: str,
        timeout: Timeouts,
        body: bytes | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> httpx.Response: ...

    async def aclose(self) -> None: ...


class _Pool:
    """One worker's transport (its connection pool) and how many calls are using it now,
    so a pool whose worker left the fleet is closed when its last call ends, not under a
    stream still being read (a draining pod leaves the Service before its streams end)."""

    def __init__(self, http: _Transport, retire: Callable[[_Pool], None]) -> None:
        self.http = http
        self.calls = 0
        self.retired = False
        self._retire = retire

    def __enter__(self) -> _Transport:
        self.calls += 1
        return self.http

    def __exit__(self, *exc: object) -> None:
        self.calls -= 1
        if self.retired and self.calls == 0:
            self._retire(self)


class _Shared:
    """An httpx transport given to :class:`WorkerClient` (tests: an in-process one) as one
    worker's: each call made an ``httpx.Request`` for it. It is shared by every worker's
    pool, so a pool that closes leaves it open for the others."""

    def __init__(
        self, inner: httpx.AsyncBaseTransport, base_url: str, headers: dict[str, str]
    ) -> None:
        self._inner = inner
        self._base_url = base_url
        self._headers = headers

    async def call(
        self,
        method: str,
        path: str,
        timeout: Timeouts,
        body: bytes | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> httpx.Response:
        request = httpx.Request(
            method,
            self._base_url + path,
            content=body,
            headers={**self._headers, **headers} if headers else self._headers,
            extensions={"timeout": timeout},
        )
        return await self._inner.handle_async_request(request)

    async def aclose(self) -> None:
        """The transport stays open: other pools use it."""


class WorkerClient:
    """A pooled transport per worker (by base URL), made at its first call; cheap to
    share. Over TCP it is the router's own lean HTTP/1.1 transport
    (:class:`~pdd.router.worker_http.WorkerTransport`), not httpx's: httpcore cost about
    1 ms of router CPU per call (docs/router-scale.md).

    One pool per worker, not one for the fleet: httpcore walked every connection of a
    pool, with a syscall or two each, on every request and again on every response's
    close, so one shared pool made each call cost in proportion to the fleet; a pool of
    one worker's connections stays small whatever the transport. A worker that leaves the
    fleet is :meth:`forget`-ten: its pool is closed.

    Requests go to the transport itself, not through an ``httpx.AsyncClient``: the
    client's layers (URL and header merging, cookie jars, auth and redirect handling,
    proxies from the environment) serve none of these calls and cost a share of the
    router's CPU on every one (docs/router-scale.md). So the workers are reached
    directly, never through an ``HTTP(S)_PROXY``, and are offered no content encoding.
    """

    def __init__(
        self,
        secret: str,
        timeout_s: float = 5.0,
        transport: httpx.AsyncBaseTransport | None = None,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        """``transport`` replaces the network (an in-process one in tests); default: TCP.
        ``tls``: how https workers are verified (``load_wan_ca``); default: system CAs."""
        self._headers = {"Authorization": f"Bearer {secret}"}
        self._timeout = httpx.Timeout(timeout_s).as_dict()
        self._transport = transport
        self._tls = tls
        self._pools: dict[str, _Pool] = {}
        #: Forgotten pools still serving calls, and the tasks closing pools.
        self._retiring: set[_Pool] = set()
        self._closing: set[asyncio.Task] = set()

    def _pool(self, http_url: str) -> _Pool:
        pool = self._pools.get(http_url)
        if pool is None:
            pool = self._pools[http_url] = _Pool(self._new_transport(http_url), self._close_later)
        return pool

    def _new_transport(self, http_url: str) -> _Transport:
        if self._transport is not None:
            return _Shared(self._transport, http_url, self._headers)
        if self._tls is None:
            self._tls = httpx.create_ssl_context()  # once: it reads the CA bundle
        return WorkerTransport(http_url, self._headers, self._tls, KEEPALIVE_EXPIRY_S)

    async def _call(
        self,
        http_url: str,
        method: str,
        path: str,
        body: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> httpx.Response:
        """The answer to ``method path`` (the secret and ``headers`` sent, nothing else),
        its body read whole (so its connection is back in the pool), within the client's
        timeout; raises ``httpx.HTTPError`` as the client would."""
        content = None if body is None else body.encode()
        with self._pool(http_url) as http:
            resp = await http.call(method, path, self._timeout, content, headers)
            try:
                await resp.aread()  # read to its end, it closes itself
            finally:
                await resp.aclose()
        return resp

    async def forget(self, http_url: str) -> None:
        """The worker at ``http_url`` left the fleet: close its pool now, or when the calls
        still using it end (its streams run on). Left open, its idle connections would
        sit in ``CLOSE_WAIT`` for the router's life once the pod is gone. A later call to
        the same URL opens a new pool."""
        pool = self._pools.pop(http_url, None)
        if pool is None:
            return
        pool.retired = True
        if pool.calls == 0:
            await pool.http.aclose()
        else:
            self._retiring.add(pool)

    def _close_later(self, pool: _Pool) -> None:
        """Close a forgotten pool whose last call just ended, on a task of its own: this
        runs in that call's exit, which may be a cancelled one's."""
        self._retiring.discard(pool)
        task = asyncio.get_running_loop().create_task(pool.http.aclose())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def aclose(self) -> None:
        pools = [*self._pools.values(), *self._retiring]
        self._pools.clear()
        self._retiring.clear()
        for pool in pools:
            await pool.http.aclose()
        await asyncio.gather(*self._closing, return_exceptions=True)
        if self._transport is not None:
            await self._transport.aclose()

    async def _get(self, http_url: str, path: str) -> bytes:
        """The body of a 200 answer to ``GET http_url + path``, for the caller to parse
        straight from JSON (pydantic's ``model_validate_json``: no dict in between)."""
        url = http_url + path
        try:
            resp = await self._call(http_url, "GET", path)
        except httpx.HTTPError as exc:
            raise WorkerCallError(url, failure(exc), late=is_late(exc)) from exc
        if resp.status_code != 200:
            raise WorkerCallError(url, f"answered {resp.status_code}: {resp.text[:300]}")
        return resp.content

    async def health(self, http_url: str) -> WorkerHealth:
        """The worker's identity, data addresses and engine limits."""
        return WorkerHealth.model_validate_json(await self._get(http_url, "/health"))

    async def load(self, http_url: str) -> LoadReport:
        return LoadReport.model_validate_json(await self._get(http_url, "/load"))

    async def cache_events(self, http_url: str, since: int) -> CacheEventsPage:
        body = await self._get(http_url, f"/v1/pdd/cache-events?since={since}")
        return CacheEventsPage.model_validate_json(body)

    async def warm_wan_peers(self, http_url: str, main_decodes: list[Endpoint]) -> None:
        """Name to a prefill worker the main decodes it ships KV to (it opens channels)."""
        body = WanPeers(main_decodes=main_decodes).model_dump_json()
        await self._send("PUT", http_url, "/v1/pdd/wan-peers", body, 204)

    async def start(self, http_url: str, plan: PipelinePlan) -> None:
        """Start ``plan`` on its entry instance; its trace context goes as ``traceparent``
        too (W3C's header, beside the plan's own field the data channels carry on)."""
        body = plan.model_dump_json()
        await self._send("POST", http_url, "/v1/pdd/requests", body, 202, plan.trace_context)

    async def handoff(self, http_url: str, request_id: str, token_ids: list[int]) -> None:
        path = f"/v1/pdd/requests/{request_id}/handoff"
        body = HandoffIds(token_ids=token_ids).model_dump_json()
        await self._send("POST", http_url, path, body, 200)

    async def takeover(self, http_url: str, request_id: str) -> None:
        await self._send("POST", http_url, f"/v1/pdd/requests/{request_id}/takeover", "{}", 200)

    async def cancel(self, http_url: str, request_id: str) -> None:
        """Tell the worker to stop the request; any answer will do (404: it already
        ended there). A cancel lost on the way leaves the request running for nobody, so
        one that got no answer (a pooled connection the worker was closing, a timeout on
        a loaded machine) is sent again, ``CANCEL_ATTEMPTS`` times in all."""
        path = f"/v1/pdd/requests/{request_id}"
        for attempt in range(1, CANCEL_ATTEMPTS + 1):
            try:
                await self._call(http_url, "DELETE", path)
                return
            except httpx.HTTPError:
                if attempt == CANCEL_ATTEMPTS:
                    return  # the worker is unreachable: its own timeouts free the request
                await asyncio.sleep(CANCEL_RETRY_S * attempt)

    async def _send(
        self,
        method: str,
        http_url: str,
        path: str,
        body: str,
        expect: int,
        trace: dict[str, str] | None = None,
    ) -> None:
        url = http_url + path
        headers = {"Content-Type": "application/json", **(trace or {})}
        try:
            resp = await self._call(http_url, method, path, body, headers)
        except httpx.HTTPError as exc:
            raise WorkerCallError(url, failure(exc)) from exc
        if resp.status_code != expect:
            detail = f"answered {resp.status_code}: {resp.text[:300]}"
            raise WorkerCallError(url, detail, *_error_body(resp))

    async def stream(self, http_url: str, request_id: str) -> AsyncIterator[TokenEvent]:
        """The instance's NDJSON token stream for ``request_id`` until it closes."""
        path = f"/v1/pdd/requests/{request_id}/stream"
        url = http_url + path
        try:
            with self._pool(http_url) as http:
                resp = await http.call("GET", path, _NO_TIMEOUT)
                try:
                    if resp.status_code != 200:
                        raise WorkerCallError(url, f"answered {resp.status_code}")
                    async for line in ndjson_lines(_body(resp)):
                        yield _token_event(url, line)
                finally:
                    await resp.aclose()
        except httpx.HTTPError as exc:
            raise WorkerCallError(url, failure(exc)) from exc


async def ndjson_lines(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """The non-blank lines of an NDJSON body, as bytes, however its chunks cut them.

    Read off the raw body (the workers send no content encoding): httpx's
    ``aiter_lines`` runs each chunk through four generators (bytes, a decoder, text,
    lines) and a UTF-8 decode that pydantic's ``model_validate_json`` does not need, on
    every token event of every stream: a share of the router's CPU per request
    (docs/router-scale.md)."""
    rest = b""
    async for chunk in chunks:
        *lines, rest = (rest + chunk).split(b"\n")
        for line in lines:
            if line.strip():
                yield line
    if rest.strip():
        yield rest


def _body(resp: httpx.Response) -> AsyncIterator[bytes]:
    """The answer's body as the transport hands it on, chunk by chunk. Not through
    ``aiter_raw``, which passes each chunk (a token event each, on every stream) through a
    context manager, a chunker and a byte count the router has no use for
    (docs/router-scale.md); the response is closed by its reader, as before."""
    stream = resp.stream
    assert isinstance(stream, httpx.AsyncByteStream)  # every transport here is async
    return stream.__aiter__()


def _token_event(url: str, line: bytes | str) -> TokenEvent:
    """One stream line; a line that is not a token event fails this source (the router
    routes around it) instead of escaping as an error no one waits for."""
    try:
        return TokenEvent.model_validate_json(line)
    except ValidationError as exc:
        raise WorkerCallError(url, f"sent a line that is not a token event: {exc}") from None


def _error_body(resp: httpx.Response) -> tuple[str | None, str | None]:
    """``error.type`` and ``error.message`` of a worker's JSON error body, if it has one."""
    try:
        error = resp.json().get("error")
    except (ValueError, AttributeError):
        return None, None
    if not isinstance(error, dict):
        return None, None
    return error.get("type"), error.get("message")
