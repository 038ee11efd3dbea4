"""The router's FastAPI app: thin routes over the serving classes, one error shape.

Every failure a client can meet (bad JSON, a too-large body, an unknown model, a
bad API key, saturation) leaves through one handler as an OpenAI ``ErrorResponse``
with the matching status; ``/health``, ``/ready`` and ``/metrics`` are open (probes
and scrapers), everything under ``/v1`` needs a key when keys are configured.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import TypeVar

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import Receive, Scope, Send

from pdd.common import tracing
from pdd.router.access_log import CLIENT_CLOSED_REQUEST, AccessLogMiddleware
from pdd.router.access_log import current as current_access
from pdd.router.admission import StreamSlots, releasing
from pdd.router.disconnect import unless_disconnected
from pdd.router.errors import (
    AuthenticationError,
    InvalidRequestError,
    PayloadTooLargeError,
    RouterError,
)
from pdd.router.openai_protocol import (
    UNRECOGNIZED_FIELD_ERROR,
    ChatCompletionRequest,
    CompletionRequest,
    ErrorResponse,
    ModelCard,
    ModelList,
    unrecognized_argument,
)
from pdd.router.openapi import document_bodies
from pdd.router.request_body import check_content_type, decode_json
from pdd.router.runtime import RouterRuntime
from pdd.router.serving_base import Served
from pdd.router.serving_chat import OpenAIServingChat
from pdd.router.serving_completions import OpenAIServingCompletion
from pdd.router.tracing_middleware import TracingMiddleware

log = logging.getLogger(__name__)
T = TypeVar("T", bound=BaseModel)


def create_app(runtime: RouterRuntime) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await runtime.start()
        try:
            yield
        finally:
            await runtime.close()
            # uvicorn ends the process by re-raising the stop signal once this has run, so
            # no exit hook flushes the spans still batched (the last seconds of requests).
            await asyncio.to_thread(tracing.flush)

    app = FastAPI(title="pdd router", lifespan=lifespan)
    app.add_middleware(AccessLogMiddleware)
    app.add_middleware(TracingMiddleware)  # outermost: its span covers the access log's
    slots = StreamSlots(runtime.config.max_streams_per_key, runtime.config.retry_after_s)
    admission = runtime.admission
    chat = OpenAIServingChat(runtime)
    completions = OpenAIServingCompletion(runtime)
    _install_errors(app, runtime)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    # Kubernetes' probes, one endpoint each (the operator's manifests point at them).
    @app.get("/startup")
    async def startup() -> dict:
        """Answers once the lifespan has started the runtime (uvicorn serves after it)."""
        return {"started": True}

    @app.get("/live")
    async def live() -> dict:
        """The event loop answers: the process is worth keeping."""
        return {"live": True}

    @app.get("/ready")
    async def ready() -> JSONResponse:
        ok = runtime.ready()
        return JSONResponse({"ready": ok}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        runtime.refresh_gauges()
        body, content_type = runtime.metrics.exposition(request.headers.get("accept", ""))
        return Response(body, media_type=content_type)

    @app.get("/v1/models")
    async def models(request: Request) -> ModelList:
        _authenticate(runtime, request)
        return ModelList(data=[ModelCard(id=runtime.config.served_name)])

    async def serve(
        request: Request, model: type[T], create: Callable[[T], Awaitable[Served]]
    ) -> Response:
        """Key, stream slot, body, a slot of the router's capacity (fair per key), then
        the response; the slots are held until it is sent. A client that goes away once
        its body is read cancels the rest (``unless_disconnected``)."""
        key = _authenticate(runtime, request)
        releases = [slots.take(key)]

        def release() -> None:
            for give_back in releases:
                give_back()

        async def admitted(parsed: T) -> Served:
            with tracing.span("pdd.admission"):
                releases.append(await admission.admit(key))
            return await create(parsed)

        try:
            parsed = await _parse(runtime, request, model)
            return _respond(await unless_disconnected(request.receive, admitted(parsed)), release)
        except BaseException:
            release()
            raise

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await serve(request, ChatCompletionRequest, chat.create)

    @app.post("/v1/completions")
    async def completions_route(request: Request) -> Response:
        return await serve(request, CompletionRequest, completions.create)

    document_bodies(
        app,
        {
            ("post", "/v1/chat/completions"): ChatCompletionRequest,
            ("post", "/v1/completions"): CompletionRequest,
        },
    )
    return app


def _authenticate(runtime: RouterRuntime, request: Request) -> str:
    """The caller's API key ("" where the router takes none), or AuthenticationError.
    The whole header must be ``Bearer <key>``, byte for byte, as vLLM compares it."""
    keys = runtime.config.api_keys
    if not keys:
        return ""
    header = request.headers.get("authorization", "")
    if not any(hmac.compare_digest(header.encode(), f"Bearer {k}".encode()) for k in keys):
        raise AuthenticationError("invalid API key: send Authorization: Bearer <key>")
    return header.removeprefix("Bearer ")


async def _parse(runtime: RouterRuntime, request: Request, model: type[T]) -> T:
    """JSON declared, size-limited body -> JSON (``request_body``) -> the endpoint's
    request model, each failure a 4xx."""
    check_content_type(request.headers.get("content-type"))
    limit = runtime.config.max_body_bytes
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLargeError(f"the request body is {declared} bytes; the limit is {limit}")
    raw = bytearray()
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > limit:
            raise PayloadTooLargeError(f"the request body exceeds the {limit}-byte limit")
    data = decode_json(bytes(raw))
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        if first["type"] == UNRECOGNIZED_FIELD_ERROR:
            raise InvalidRequestError(unrecognized_argument(str(param)), param=param) from None
        raise InvalidRequestError(f"{param}: {first['msg']}", param=param) from exc


class ClosingStreamingResponse(StreamingResponse):
    """A stream whose body is closed when the response ends, however it ends.

    Where the client goes away Starlette cancels the sending task; if that task was in
    ``send`` (a slow reader: the socket's buffer full), the body generator is left
    suspended, and only the garbage collector would close it, some time later. Its
    close is what cancels the request on the workers, so it is done here, at once;
    then ``closed`` runs (for what a body that never started would leave held)."""

    def __init__(
        self, body: AsyncIterator[bytes], closed: Callable[[], None], headers: dict[str, str]
    ) -> None:
        super().__init__(body, media_type="text/event-stream", headers=headers)
        self._body = body
        self._closed = closed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                close = getattr(self._body, "aclose", None)
                if close is not None:
                    await close()
            self._closed()


def _respond(served: Served, release: Callable[[], None]) -> Response:
    """The response; the request's stream slot is given back once it is all sent. A
    stream the client left before its first byte was asked for never ran: its slot and
    the route's in-flight lease are given back when the response is closed."""
    if isinstance(served.body, BaseModel):
        release()
        # Serialized by pydantic-core in one pass, not dumped to a dict for json.dumps.
        content = served.body.model_dump_json().encode()
        return Response(content, media_type="application/json", headers=served.headers)
    stream, began = served.body, False

    async def body() -> AsyncIterator[bytes]:
        nonlocal began
        began = True
        async with contextlib.aclosing(releasing(stream, release)) as chunks:
            async for chunk in chunks:
                yield chunk

    def closed() -> None:
        release()
        if not began:
            served.generation.release()

    return ClosingStreamingResponse(body(), closed, served.headers)


def _install_errors(app: FastAPI, runtime: RouterRuntime) -> None:
    def error_response(
        status: int, body: ErrorResponse, headers: dict[str, str] | None = None
    ) -> JSONResponse:
        return JSONResponse(body.model_dump(mode="json"), status_code=status, headers=headers)

    @app.exception_handler(RouterError)
    async def router_error(_: Request, exc: RouterError) -> JSONResponse:
        runtime.metrics.rejected.labels(exc.cause).inc()
        _note_refusal(exc.cause, exc.message)
        return error_response(exc.status, exc.body(), exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        body = ErrorResponse.of(str(exc.detail), "invalid_request_error", code=exc.status_code)
        _note_refusal("invalid_request", str(exc.detail))
        return error_response(exc.status_code, body, getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(400, ErrorResponse.of(str(exc), "invalid_request_error", code=400))

    @app.exception_handler(ClientDisconnect)
    async def client_left(_: Request, exc: ClientDisconnect) -> Response:
        """Gone before any status went out (its body cut short, or its answer not ready):
        nobody reads this one; the access log says 499, as nginx does."""
        current = current_access()
        if current is not None:
            current.left()
        return Response(status_code=CLIENT_CLOSED_REQUEST)

    @app.exception_handler(Exception)
    async def internal(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        runtime.metrics.rejected.labels("internal").inc()
        _note_refusal("internal", repr(exc))
        body = ErrorResponse.of(f"internal error: {exc!r}", "internal_error", code=500)
        return error_response(500, body)


def _note_refusal(cause: str, message: str) -> None:
    """The access-log line of this request says why it was refused."""
    record = current_access()
    if record is not None:
        record.refused(cause, message)
