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
from collections.abc import AsyncIterator

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


class WorkerCallError(RuntimeError):
    """A worker answered with an error status or could not be reached; ``error_type`` and
    ``message`` are those of the worker's error body, when it answered with one."""

    def __init__(
        self, url: str, detail: str, error_type: str | None = None, message: str | None = None
    ) -> None:
        super().__init__(f"{url}: {detail}")
        self.url = url
        self.detail = detail
        self.error_type = error_type
        self.message = message or detail


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


class WorkerClient:
    """One pooled ``httpx.AsyncClient`` for every worker; cheap to share."""

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
        self._http = httpx.AsyncClient(
            transport=transport,
            verify=tls if tls is not None else True,
            headers=self._headers,
            timeout=httpx.Timeout(timeout_s),
            limits=httpx.Limits(
                max_connections=1000,
                max_keepalive_connections=200,
                keepalive_expiry=KEEPALIVE_EXPIRY_S,
            ),
        )

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _get_json(self, url: str, params: dict | None = None) -> dict:
        try:
            resp = await self._http.get(url, params=params)
        except httpx.HTTPError as exc:
            raise WorkerCallError(url, failure(exc)) from exc
        if resp.status_code != 200:
            raise WorkerCallError(url, f"answered {resp.status_code}: {resp.text[:300]}")
        return resp.json()

    async def health(self, http_url: str) -> WorkerHealth:
        """The worker's identity, data addresses and engine limits."""
        return WorkerHealth.model_validate(await self._get_json(f"{http_url}/health"))

    async def load(self, http_url: str) -> LoadReport:
        return LoadReport.model_validate(await self._get_json(f"{http_url}/load"))

    async def cache_events(self, http_url: str, since: int) -> CacheEventsPage:
        body = await self._get_json(f"{http_url}/v1/pdd/cache-events", {"since": since})
        return CacheEventsPage.model_validate(body)

    async def warm_wan_peers(self, http_url: str, main_decodes: list[Endpoint]) -> None:
        """Name to a prefill worker the main decodes it ships KV to (it opens channels)."""
        body = WanPeers(main_decodes=main_decodes).model_dump_json()
        await self._send("PUT", f"{http_url}/v1/pdd/wan-peers", body, 204)

    async def start(self, http_url: str, plan: PipelinePlan) -> None:
        await self._send("POST", f"{http_url}/v1/pdd/requests", plan.model_dump_json(), 202)

    async def handoff(self, http_url: str, request_id: str, token_ids: list[int]) -> None:
        url = f"{http_url}/v1/pdd/requests/{request_id}/handoff"
        await self._send("POST", url, HandoffIds(token_ids=token_ids).model_dump_json(), 200)

    async def takeover(self, http_url: str, request_id: str) -> None:
        url = f"{http_url}/v1/pdd/requests/{request_id}/takeover"
        await self._send("POST", url, "{}", 200)

    async def cancel(self, http_url: str, request_id: str) -> None:
        """Tell the worker to stop the request; any answer will do (404: it already
        ended there). A cancel lost on the way leaves the request running for nobody, so
        one that got no answer (a pooled connection the worker was closing, a timeout on
        a loaded machine) is sent again, ``CANCEL_ATTEMPTS`` times in all."""
        url = f"{http_url}/v1/pdd/requests/{request_id}"
        for attempt in range(1, CANCEL_ATTEMPTS + 1):
            try:
                await self._http.delete(url)
                return
            except httpx.HTTPError:
                if attempt == CANCEL_ATTEMPTS:
                    return  # the worker is unreachable: its own timeouts free the request
                await asyncio.sleep(CANCEL_RETRY_S * attempt)

    async def _send(self, method: str, url: str, body: str, expect: int) -> None:
        headers = {"Content-Type": "application/json"}
        try:
            resp = await self._http.request(method, url, content=body, headers=headers)
        except httpx.HTTPError as exc:
            raise WorkerCallError(url, failure(exc)) from exc
        if resp.status_code != expect:
            detail = f"answered {resp.status_code}: {resp.text[:300]}"
            raise WorkerCallError(url, detail, *_error_body(resp))

    async def stream(self, http_url: str, request_id: str) -> AsyncIterator[TokenEvent]:
        """The instance's NDJSON token stream for ``request_id`` until it closes."""
        url = f"{http_url}/v1/pdd/requests/{request_id}/stream"
        try:
            async with self._http.stream("GET", url, timeout=None) as resp:
                if resp.status_code != 200:
                    raise WorkerCallError(url, f"answered {resp.status_code}")
                async for line in resp.aiter_lines():
                    if line.strip():
                        yield _token_event(url, line)
        except httpx.HTTPError as exc:
            raise WorkerCallError(url, failure(exc)) from exc


def _token_event(url: str, line: str) -> TokenEvent:
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
