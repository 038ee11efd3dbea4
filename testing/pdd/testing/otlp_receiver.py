"""An OTLP/HTTP trace receiver for tests: what a Jaeger or Collector would get.

A loopback HTTP server on a thread that decodes each ``POST /v1/traces`` body
(``ExportTraceServiceRequest``, protobuf) into ``ReceivedSpan`` records, so a test can
assert on the spans every process of a stack exported.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)


@dataclass(frozen=True)
class ReceivedSpan:
    trace_id: str
    span_id: str
    parent_id: str | None
    name: str
    service: str
    attributes: dict[str, Any]
    #: The span's events' names, in order (failover, link fault, transfer failed).
    events: tuple[str, ...] = ()


def parents_arrived(spans: list[ReceivedSpan], client_span: str) -> bool:
    """Whether every span's parent is among ``spans`` or is the client's span. Each
    process exports a span when it ends, in its own batches, so an outer span (a worker's
    request) arrives after the spans inside it, seconds later on a loaded machine: a test
    waits for this before it asserts that the trace is whole."""
    ids = {s.span_id for s in spans} | {client_span}
    return all(s.parent_id in ids for s in spans)


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    return None if kind is None else getattr(v, kind)


def decode(body: bytes) -> list[ReceivedSpan]:
    """The spans of one export request."""
    request = ExportTraceServiceRequest.FromString(body)
    out = []
    for rs in request.resource_spans:
        resource = {a.key: _value(a.value) for a in rs.resource.attributes}
        for ss in rs.scope_spans:
            for s in ss.spans:
                out.append(
                    ReceivedSpan(
                        trace_id=s.trace_id.hex(), span_id=s.span_id.hex(),
                        parent_id=s.parent_span_id.hex() or None, name=s.name,
                        service=str(resource.get("service.name")),
                        attributes={a.key: _value(a.value) for a in s.attributes},
                        events=tuple(e.name for e in s.events),
                    )
                )  # fmt: skip
    return out


class OtlpReceiver:
    """Collects spans; ``url`` is the base to give ``--otlp-traces-endpoint``."""

    def __init__(self, server: ThreadingHTTPServer) -> None:
        self._server = server
        self._lock = threading.Lock()
        self._spans: list[ReceivedSpan] = []
        self.bad_paths: list[str] = []

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def spans(self) -> list[ReceivedSpan]:
        with self._lock:
            return list(self._spans)

    def add(self, spans: list[ReceivedSpan]) -> None:
        with self._lock:
            self._spans.extend(spans)


@contextmanager
def otlp_receiver() -> Iterator[OtlpReceiver]:
    """An ``OtlpReceiver`` on a free loopback port, served until the block ends."""
    receiver: OtlpReceiver

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
            if self.path != "/v1/traces":
                receiver.bad_paths.append(self.path)
                self.send_response(404)
                self.end_headers()
                return
            receiver.add(decode(body))
            reply = ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    receiver = OtlpReceiver(server)
    thread = threading.Thread(target=server.serve_forever, name="otlp-receiver", daemon=True)
    thread.start()
    try:
        yield receiver
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
