"""The worker's HTTP control API (FastAPI): health, load, metrics, and the request verbs.

Every ``/v1/pdd/*`` route requires ``Authorization: Bearer <shared secret>``;
``/health``, the probes (``/startup``, ``/live``, ``/ready``), ``/load`` and ``/metrics``
are open (kubelet and scrapers). Errors have one JSON shape, ``{"error": {"type", "message"}}``.
Streams are NDJSON: one ``TokenEvent`` per line, ending when the instance is
done with the request (a status event with ``error`` set if it failed).
"""

from __future__ import annotations

import hmac
from collections.abc import AsyncIterator, Awaitable, Callable

from fastapi import Depends, FastAPI, Header, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from pdd.common import tracing
from pdd.common.grammar import GRAMMAR_ERROR_TYPE, GrammarError, check_grammar
from pdd.common.wire import (
    REQUEST_TOO_LARGE_ERROR_TYPE,
    CacheEventsPage,
    HandoffAccepted,
    HandoffIds,
    LoadReport,
    PipelinePlan,
    RequestAccepted,
    RequestCancelled,
    StateReport,
    TakeoverAccepted,
    WanPeers,
    WorkerHealth,
)
from pdd.worker.engine.grammar import GrammarRequestError
from pdd.worker.engine.request import PromptTooLongError, RequestError, RequestTooLargeError
from pdd.worker.metrics import CONTENT_TYPE_LATEST
from pdd.worker.roles.base import NoSuchRequestError, RoleBase, RoleMismatchError
from pdd.worker.roles.cache_feed import CacheFeed
from pdd.worker.roles.cancellations import RequestCancelledError


class ApiError(Exception):
    def __init__(self, status: int, type_: str, message: str) -> None:
        super().__init__(message)
        self.status, self.type, self.message = status, type_, message


def _error(status: int, type_: str, message: str) -> JSONResponse:
    return JSONResponse({"error": {"type": type_, "message": message}}, status_code=status)


def _auth(secret: str) -> Callable[..., Awaitable[None]]:
    # async: FastAPI runs a sync dependency on a thread pool, a hop per request for nothing.
    async def check(authorization: str | None = Header(default=None)) -> None:
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.encode(), secret.encode()):
            raise ApiError(401, "unauthorized", "send Authorization: Bearer <shared secret>")

    return check


def create_app(role: RoleBase, feed: CacheFeed, ready: Callable[[], bool]) -> FastAPI:
    app = FastAPI(title=f"pdd worker ({role.role})")
    auth = Depends(_auth(role.settings.secret))
    _install_errors(app)

    @app.get("/health")
    async def health() -> WorkerHealth:
        return WorkerHealth(
            role=role.role, endpoint=role.settings.endpoint, engine=role.engine_info
        )

    # Kubernetes' probes, one endpoint each: /startup (the model is loaded: this API only
    # serves once the worker started), /live (the engine thread runs), /ready (traffic).
    @app.get("/startup")
    async def startup() -> dict:
        return {"started": True}

    @app.get("/live")
    async def live() -> JSONResponse:
        ok = role.runner.alive
        return JSONResponse({"live": ok}, status_code=200 if ok else 503)

    @app.get("/ready")
    async def is_ready() -> JSONResponse:
        ok = ready()
        return JSONResponse({"ready": ok}, status_code=200 if ok else 503)

    @app.get("/load")
    async def load() -> LoadReport:
        return role.load_report()

    @app.get("/metrics")
    async def metrics() -> Response:
        role.refresh_gauges()
        return Response(role.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/pdd/debug/state", dependencies=[auth])
    async def state() -> StateReport:
        return role.state_report()

    @app.get("/v1/pdd/cache-events", dependencies=[auth])
    async def cache_events(since: int = 0) -> CacheEventsPage:
        return await feed.page(since)

    @app.put("/v1/pdd/wan-peers", dependencies=[auth], status_code=204)
    async def wan_peers(request: Request) -> Response:
        peers = WanPeers.model_validate_json(await request.body())
        role.warm_wan_peers(peers.main_decodes)
        return Response(status_code=204)

    @app.post("/v1/pdd/requests", dependencies=[auth], status_code=202)
    async def start(request: Request) -> RequestAccepted:
        plan = PipelinePlan.model_validate_json(await request.body())
        traceparent = request.headers.get(tracing.TRACEPARENT)
        if plan.trace_context is None and traceparent:  # W3C's header, where the plan has none
            plan = plan.model_copy(update={"trace_context": {tracing.TRACEPARENT: traceparent}})
        if plan.sampling.guided is not None:  # refuse a bad schema now, not mid-pipeline
            check_grammar(plan.sampling.guided)
        await role.start_request(plan)
        return RequestAccepted(request_id=plan.request_id, accepted_by=role.settings.instance_id)

    @app.get("/v1/pdd/requests/{request_id}/stream", dependencies=[auth])
    async def stream(request_id: str) -> StreamingResponse:
        events = role.hub.get(request_id).follow(role.settings.transfer_timeout_s)
        return StreamingResponse(_ndjson(events), media_type="application/x-ndjson")

    @app.delete("/v1/pdd/requests/{request_id}", dependencies=[auth])
    async def cancel(request_id: str) -> RequestCancelled:
        await role.cancel(request_id)
        return RequestCancelled(request_id=request_id)

    @app.post("/v1/pdd/requests/{request_id}/handoff", dependencies=[auth])
    async def handoff(request_id: str, body: HandoffIds) -> HandoffAccepted:
        await role.handoff(request_id, body.token_ids)
        return HandoffAccepted(request_id=request_id, accepted=len(body.token_ids))

    @app.post("/v1/pdd/requests/{request_id}/takeover", dependencies=[auth])
    async def takeover(request_id: str) -> TakeoverAccepted:
        await role.takeover(request_id)
        return TakeoverAccepted(request_id=request_id)

    return app


async def _ndjson(events: AsyncIterator) -> AsyncIterator[bytes]:
    async for event in events:
        yield event.model_dump_json().encode() + b"\n"


def _install_errors(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(_: Request, exc: ApiError) -> JSONResponse:
        return _error(exc.status, exc.type, exc.message)

    @app.exception_handler(ValidationError)
    async def invalid(_: Request, exc: ValidationError) -> JSONResponse:
        return _error(400, "invalid_request", str(exc))

    @app.exception_handler(RequestError)
    async def refused(_: Request, exc: RequestError) -> JSONResponse:
        return _error(400, "invalid_request", str(exc))

    @app.exception_handler(PromptTooLongError)
    @app.exception_handler(RequestTooLargeError)
    async def too_large(_: Request, exc: RequestError) -> JSONResponse:
        return _error(400, REQUEST_TOO_LARGE_ERROR_TYPE, str(exc))

    @app.exception_handler(GrammarError)
    @app.exception_handler(GrammarRequestError)
    async def bad_grammar(_: Request, exc: ValueError) -> JSONResponse:
        return _error(400, GRAMMAR_ERROR_TYPE, str(exc))

    @app.exception_handler(ValueError)
    async def bad_value(_: Request, exc: ValueError) -> JSONResponse:
        return _error(400, "invalid_request", str(exc))

    @app.exception_handler(RequestCancelledError)
    async def cancelled(_: Request, exc: RequestCancelledError) -> JSONResponse:
        return _error(409, "cancelled", str(exc))

    @app.exception_handler(NoSuchRequestError)
    async def unknown(_: Request, exc: NoSuchRequestError) -> JSONResponse:
        return _error(404, "not_found", f"no live request {exc.args[0]!r} on this instance")

    @app.exception_handler(RoleMismatchError)
    async def mismatch(_: Request, exc: RoleMismatchError) -> JSONResponse:
        return _error(409, "wrong_role", str(exc))
