"""The root span of each ``/v1/`` request: ``pdd.request``, from arrival to last byte.

An ASGI middleware, so the span covers what the client waits for (admission, routing,
the whole stream) and its context is current in everything serving the request: the
route (``pdd.route``, ``Dispatcher.attempt``) and, through the plan's
``trace_context`` and the ``traceparent`` header, every worker that serves it. A
client's own ``traceparent`` makes the request a child of the client's span. The
response carries ``traceparent`` (beside ``x-pdd-request-id``), so a client can find
the trace; the span carries the request id, pipeline, reason and status.

With tracing off the middleware passes the request through untouched.
"""

from __future__ import annotations

from urllib.parse import unquote

from opentelemetry.trace import SpanKind, Status, StatusCode
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pdd.common import tracing

#: Response headers copied onto the span, under these attribute names.
_HEADER_ATTRIBUTES = {
    b"x-pdd-request-id": tracing.REQUEST_ID,
    b"x-pdd-pipeline": "pdd.pipeline",
    b"x-pdd-reason": "pdd.reason",
}


class TracingMiddleware:
    """Opens ``pdd.request`` around each ``/v1/`` request when tracing is on."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not tracing.enabled() or scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        attributes = {"http.request.method": scope["method"], "url.path": scope["path"]}
        parent = {tracing.TRACEPARENT: headers[tracing.TRACEPARENT]} if (
            tracing.TRACEPARENT in headers
        ) else None  # fmt: skip
        with tracing.span("pdd.request", parent, attributes, kind=SpanKind.SERVER) as span:
            traceparent = tracing.carrier().get(tracing.TRACEPARENT, "").encode("latin-1")

            async def sending(message: Message) -> None:
                if message["type"] == "http.response.start":
                    _note_response(span, message)
                    if traceparent:
                        message["headers"] = [
                            *message.get("headers", []), (b"traceparent", traceparent)
                        ]  # fmt: skip
                await send(message)

            await self.app(scope, receive, sending)


def _note_response(span: tracing.Span, message: Message) -> None:
    """The response's status and PDD headers, on the request's span."""
    status = int(message["status"])
    span.set_attribute("http.response.status_code", status)
    for name, value in message.get("headers", []):
        attribute = _HEADER_ATTRIBUTES.get(name)
        if attribute is not None:
            span.set_attribute(attribute, unquote(value.decode("latin-1")))
    if status >= 500:
        span.set_status(Status(StatusCode.ERROR))
