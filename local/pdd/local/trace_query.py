"""``pdd trace --jaeger URL`` / ``--tempo URL``: one trace from a tracing backend's query API.

Where the spans went to a Jaeger or a Tempo (``--otlp-traces-endpoint``), ``pdd trace``
asks that backend's HTTP query API for them rather than reading a file:

- Jaeger (the v1 query service and Jaeger v2 both serve it): ``GET /api/traces/{id}``
  answers Jaeger's JSON model (``data[].spans[]`` with ``references``, ``tags``, ``logs``
  and ``processes``); a request id is found with the tag search
  ``GET /api/traces?service=pdd-router&tags={"pdd.request_id": ID}``, which answers whole
  traces in the same model.
- Tempo: ``GET /api/traces/{id}`` with ``Accept: application/json`` answers OTLP JSON
  (``batches``: ``ResourceSpans``, ids in base64); a request id is found with
  ``GET /api/search?tags=pdd.request_id="ID"``, whose ``traces[].traceID`` are then fetched.

Either way the spans become ``trace_spans.SpanRecord``s, drawn as from a file. The search
looks back ``lookback_s`` (both backends search a time window; the router's
``pdd.request`` span carries the request id, hence Jaeger's ``service``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from enum import StrEnum
from typing import Any

import httpx

from pdd.common.tracing import REQUEST_ID
from pdd.local.trace_spans import SpanRecord, TraceNotFound, hex_id, is_trace_id, parse_otlp

#: The longest a backend may take to answer one query.
TIMEOUT_S = 30.0
#: How many traces a search may return (a request's attempts share its trace).
SEARCH_LIMIT = 20


class Backend(StrEnum):
    JAEGER = "jaeger"
    TEMPO = "tempo"


class TraceQueryError(RuntimeError):
    """The backend could not be asked, or answered what no backend of its kind answers."""


def fetch(
    backend: Backend,
    base_url: str,
    key: str,
    service: str = "pdd-router",
    lookback_s: float = 86400.0,
) -> list[SpanRecord]:
    """The spans of the trace ``key`` names (a trace id, or a request id to search for)."""
    with httpx.Client(base_url=base_url.rstrip("/"), timeout=TIMEOUT_S) as http:
        if is_trace_id(key):
            return _trace(backend, http, key)
        if backend is Backend.JAEGER:
            return _jaeger_search(http, key, service, lookback_s)
        return _tempo_search(http, key, lookback_s)


def _get(http: httpx.Client, path: str, **params: Any) -> Any:
    """The JSON a query answers; None where it found nothing (404)."""
    try:
        resp = http.get(path, params=params, headers={"Accept": "application/json"})
    except httpx.HTTPError as exc:
        raise TraceQueryError(f"cannot reach {http.base_url}: {exc}") from None
    if resp.status_code == 404:
        return None
    if resp.status_code != 200:
        raise TraceQueryError(f"{resp.request.url} answered {resp.status_code}: {resp.text[:200]}")
    try:
        return resp.json()
    except ValueError:
        raise TraceQueryError(f"{resp.request.url} answered no JSON") from None


def _trace(backend: Backend, http: httpx.Client, trace_id: str) -> list[SpanRecord]:
    doc = _get(http, f"/api/traces/{trace_id}")
    spans = [] if doc is None else _read(backend, doc)
    if not spans:
        raise TraceNotFound(f"{http.base_url} has no trace {trace_id}")
    return spans


def _read(backend: Backend, doc: Any) -> list[SpanRecord]:
    """The spans of a backend's answer; one that is not the backend's format is an error
    in words, not a traceback."""
    try:
        return list(_spans_of(backend, doc))
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise TraceQueryError(f"a {backend} answer PDD cannot read ({exc!r})") from None


def _spans_of(backend: Backend, doc: Any) -> Iterator[SpanRecord]:
    if not isinstance(doc, dict):
        raise TraceQueryError(f"a {backend} answer is a JSON object, not {type(doc).__name__}")
    if backend is Backend.JAEGER:
        for trace in doc.get("data") or []:
            yield from jaeger_spans(trace)
        return
    # Tempo: ``batches`` (/api/traces), or ``trace.resourceSpans`` (/api/v2/traces).
    batches = doc.get("batches") or doc.get("resourceSpans") or []
    yield from parse_otlp(batches or (doc.get("trace") or {}).get("resourceSpans", []))


def _jaeger_search(
    http: httpx.Client, request_id: str, service: str, lookback_s: float
) -> list[SpanRecord]:
    end_us = int(time.time() * 1e6)
    doc = _get(
        http, "/api/traces", service=service, tags=json.dumps({REQUEST_ID: request_id}),
        start=end_us - int(lookback_s * 1e6), end=end_us, limit=SEARCH_LIMIT,
    )  # fmt: skip
    spans = [] if doc is None else _read(Backend.JAEGER, doc)
    if not spans:
        raise TraceNotFound(f"{http.base_url} has no trace of {service} with request {request_id}")
    return spans


def _tempo_search(http: httpx.Client, request_id: str, lookback_s: float) -> list[SpanRecord]:
    end_s = int(time.time())
    doc = _get(
        http, "/api/search", tags=f"{REQUEST_ID}={json.dumps(request_id)}",
        start=end_s - int(lookback_s), end=end_s, limit=SEARCH_LIMIT,
    )  # fmt: skip
    try:
        found = [hex_id(t["traceID"], 32) for t in (doc or {}).get("traces") or []]
    except (KeyError, TypeError, AttributeError) as exc:
        raise TraceQueryError(f"a tempo search answer PDD cannot read ({exc!r})") from None
    spans = [span for trace_id in found for span in _trace(Backend.TEMPO, http, trace_id)]
    if not spans:
        raise TraceNotFound(f"{http.base_url} has no trace with request {request_id}")
    return spans


def jaeger_spans(trace: dict[str, Any]) -> Iterator[SpanRecord]:
    """The spans of one trace in Jaeger's JSON model: the parent is the ``CHILD_OF``
    reference, times are microseconds, OpenTelemetry events are logs whose ``event``
    field names them."""
    processes = trace.get("processes") or {}
    for s in trace.get("spans") or []:
        refs = s.get("references") or []
        parent = next((r for r in refs if r.get("refType") == "CHILD_OF"), None)
        service = (processes.get(s.get("processID")) or {}).get("serviceName", "?")
        start_ns = int(s["startTime"]) * 1000
        yield SpanRecord(
            trace_id=hex_id(s["traceID"], 32), span_id=hex_id(s["spanID"], 16),
            parent_id=hex_id(parent["spanID"], 16) if parent else None,
            name=s.get("operationName", "?"), service=service, start_ns=start_ns,
            end_ns=start_ns + int(s.get("duration", 0)) * 1000,
            attributes={t["key"]: t.get("value") for t in s.get("tags") or []},
            events=[_event_name(log) for log in s.get("logs") or []],
        )  # fmt: skip


def _event_name(log: dict[str, Any]) -> str:
    fields = {f.get("key"): f.get("value") for f in log.get("fields") or []}
    return str(fields.get("event", "?"))
