"""Where spans go: OTLP over HTTP/protobuf or gRPC, and OTLP JSON lines in a file.

Loaded only where tracing is on (``pdd.common.tracing.configure``). Every exporter sits
behind a ``CountingBatchSpanProcessor``: spans are queued and sent by the SDK's own
thread; a full queue drops the oldest span, and the drop is counted.

The file holds one ``ExportTraceServiceRequest`` as OTLP JSON per line (ids in hex, as
OTLP/JSON wants them, not protobuf JSON's base64), what the OpenTelemetry Collector's
file exporter writes, so ``pdd trace`` and other tools read either. Every process of a
``pdd up`` stack appends to the same file: one ``write`` of one line at a time, with
``O_APPEND``, so lines never interleave.
"""

from __future__ import annotations

import base64
import json
import os
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from google.protobuf.json_format import MessageToDict
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

#: Span fields that OTLP/JSON writes as hex strings (protobuf JSON would base64 them).
_ID_FIELDS = ("traceId", "spanId", "parentSpanId")


class CountingBatchSpanProcessor(BatchSpanProcessor):
    """The SDK's batch processor, counting each span it drops for a full queue."""

    def __init__(self, exporter: SpanExporter, dropped: Callable[[int], None]) -> None:
        super().__init__(exporter)
        self._dropped = dropped

    def on_end(self, span: ReadableSpan) -> None:
        if span.context is not None and span.context.trace_flags.sampled and self._full():
            self._dropped(1)
        super().on_end(span)

    def _full(self) -> bool:
        # The SDK keeps its queue private and says nothing of what it dropped but a log
        # line: read its length (a deque, thread-safe) to count the drop.
        batch = self._batch_processor
        return len(batch._queue) >= batch._max_queue_size


def exporters(endpoint: str | None, protocol: str, file: Path | None) -> list[SpanExporter]:
    """An OTLP exporter to ``endpoint`` and a file exporter to ``file``, where given."""
    out: list[SpanExporter] = []
    if endpoint is not None:
        out.append(_otlp_exporter(endpoint, protocol))
    if file is not None:
        out.append(OtlpJsonFileExporter(file))
    return out


def _otlp_exporter(endpoint: str, protocol: str) -> SpanExporter:
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
            OTLPSpanExporter as GrpcExporter,
        )

        return GrpcExporter(endpoint=endpoint)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter(endpoint=endpoint)


def otlp_json(spans: Sequence[ReadableSpan]) -> list[dict[str, Any]]:
    """``spans`` as OTLP/JSON ``resourceSpans``."""
    message = MessageToDict(encode_spans(spans), use_integers_for_enums=True)
    resource_spans = message.get("resourceSpans", [])
    for rs in resource_spans:
        for ss in rs.get("scopeSpans", []):
            for s in ss.get("spans", []):
                for key in _ID_FIELDS:
                    if s.get(key):
                        s[key] = base64.b64decode(s[key]).hex()
    return resource_spans


class OtlpJsonFileExporter(SpanExporter):
    """Appends each batch as one OTLP JSON line to ``path`` (its folder made if need be)."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._lock = threading.Lock()
        path.parent.mkdir(parents=True, exist_ok=True)

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        doc = {"resourceSpans": otlp_json(spans)}
        line = (json.dumps(doc, separators=(",", ":")) + "\n").encode()
        try:
            with self._lock:
                fd = os.open(self._path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
                try:
                    os.write(fd, line)
                finally:
                    os.close(fd)
        except OSError:
            return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass
