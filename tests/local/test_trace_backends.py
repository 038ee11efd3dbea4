"""``pdd trace --jaeger URL`` / ``--tempo URL``: one trace read from a tracing backend (issue 58).

Jaeger and Tempo cannot run here (no Docker, no network), so an HTTP server in the test
stands in for each, answering in the backend's documented format: Jaeger's query JSON
(``/api/traces/{id}``; the tag search ``/api/traces?service=...&tags=...``) and Tempo's
(``/api/traces/{id}``: OTLP JSON under ``batches`` with base64 ids; ``/api/search?tags=...``).
What they serve is a real trace this test produced with PDD's tracing (two processes'
worth: the router's spans with a failover event, and MD's under the router's context), as
the SDK's exporter wrote it; so ``pdd trace`` must draw from the backend exactly the spans
it draws from the file, whichever way it finds the trace (its id, or the request id).
"""

from __future__ import annotations

import base64
import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest

from pdd.common import tracing
from pdd.local import trace_spans, trace_view
from pdd.local.trace_query import Backend, fetch

pytestmark = pytest.mark.integration

REQUEST = "pdd-4f2a"


@dataclass
class Trace:
    """A trace as the SDK's file exporter wrote it, and its ids."""

    lines: list[str]
    trace_id: str

    def resource_spans(self) -> list[dict[str, Any]]:
        return [rs for line in self.lines for rs in json.loads(line)["resourceSpans"]]

    def records(self) -> set[tuple[Any, ...]]:
        """What ``pdd trace`` draws of each span (times to the microsecond: Jaeger's unit)."""
        return _comparable(trace_spans.parse_lines(self.lines))


def _comparable(spans: Iterator[trace_spans.SpanRecord] | list[trace_spans.SpanRecord]) -> set:
    return {
        (s.trace_id, s.span_id, s.parent_id, s.name, s.service, s.start_ns // 1000,
         s.end_ns // 1000, tuple(s.events), json.dumps(s.attributes, sort_keys=True))
        for s in spans
    }  # fmt: skip


@pytest.fixture(scope="module")
def trace(tmp_path_factory: pytest.TempPathFactory) -> Trace:
    """The router's request with its route and a failover event, and MD's decode under the
    context the router sent it: one trace from two services, through the real exporter."""
    path = tmp_path_factory.mktemp("backend-trace") / "traces.jsonl"
    tracing.configure(tracing.config_from("pdd-router", file=path, env={}))
    try:
        with tracing.span("pdd.request", attributes={tracing.REQUEST_ID: REQUEST}) as root:
            with tracing.span("pdd.route", attributes={"pdd.pipeline": "P-RLD-MD"}):
                pass
            tracing.event("pdd.failover", {"pdd.failed": "pdd-main-0", "pdd.emitted_tokens": 3})
            sent = tracing.carrier()
            trace_id = tracing.trace_id_hex(root)
    finally:
        tracing.shutdown()
    tracing.configure(tracing.config_from("pdd-main", file=path, env={}))
    try:
        with tracing.span("pdd.main.decode", sent, {"pdd.streamed_tokens": 5, "pdd.x": True}):
            pass
    finally:
        tracing.shutdown()
    assert trace_id is not None
    return Trace(path.read_text().splitlines(), trace_id)


# --- the backends' formats -------------------------------------------------------------------
def _any_value(v: dict[str, Any]) -> tuple[str, Any]:
    """An OTLP ``AnyValue`` as a Jaeger tag's (type, value)."""
    if "stringValue" in v:
        return "string", v["stringValue"]
    if "boolValue" in v:
        return "bool", v["boolValue"]
    if "intValue" in v:
        return "int64", int(v["intValue"])
    return "float64", v.get("doubleValue")


def _tags(attributes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for a in attributes:
        kind, value = _any_value(a["value"])
        out.append({"key": a["key"], "type": kind, "value": value})
    return out


def jaeger_trace(trace: Trace) -> dict[str, Any]:
    """The trace in Jaeger's query JSON (``/api/traces/{id}``'s ``data[0]``): ids in hex as
    ``TraceID.String()`` prints them, times in microseconds, events as logs."""
    spans, processes = [], {}
    for i, rs in enumerate(trace.resource_spans()):
        pid = f"p{i + 1}"
        attributes = rs["resource"]["attributes"]
        service = next(a["value"]["stringValue"] for a in attributes if a["key"] == "service.name")
        processes[pid] = {"serviceName": service, "tags": _tags(attributes)}
        for ss in rs["scopeSpans"]:
            for s in ss["spans"]:
                start_us = int(s["startTimeUnixNano"]) // 1000
                parent = s.get("parentSpanId")
                refs = [{"refType": "CHILD_OF", "traceID": s["traceId"], "spanID": parent}
                        ] if parent else []  # fmt: skip
                logs = [{"timestamp": int(e["timeUnixNano"]) // 1000,
                         "fields": [{"key": "event", "type": "string", "value": e["name"]},
                                    *_tags(e.get("attributes", []))]}
                        for e in s.get("events", [])]  # fmt: skip
                spans.append({
                    "traceID": s["traceId"], "spanID": s["spanId"], "flags": 1,
                    "operationName": s["name"], "references": refs, "startTime": start_us,
                    "duration": int(s["endTimeUnixNano"]) // 1000 - start_us,
                    "tags": _tags(s.get("attributes", [])), "logs": logs, "processID": pid,
                    "warnings": None,
                })  # fmt: skip
    return {"traceID": trace.trace_id, "spans": spans, "processes": processes, "warnings": None}


def _b64(hex_id: str) -> str:
    return base64.b64encode(bytes.fromhex(hex_id)).decode()


def tempo_trace(trace: Trace) -> dict[str, Any]:
    """The trace as Tempo's ``/api/traces/{id}`` answers JSON: OTLP ``ResourceSpans`` under
    ``batches``, the ids in base64 (protobuf's JSON mapping of bytes)."""
    batches = json.loads(json.dumps(trace.resource_spans()))
    for rs in batches:
        for ss in rs["scopeSpans"]:
            for s in ss["spans"]:
                for key in ("traceId", "spanId", "parentSpanId"):
                    if s.get(key):
                        s[key] = _b64(s[key])
    return {"batches": batches}


@dataclass
class Backends:
    """The stand-in query APIs, and what they were asked."""

    url: str
    asked: list[tuple[str, dict[str, list[str]], str]] = field(default_factory=list)


@pytest.fixture(scope="module")
def backends(trace: Trace) -> Iterator[Backends]:
    """``/jaeger/...`` answers as a Jaeger query service, ``/tempo/...`` as Tempo."""
    jaeger, tempo = jaeger_trace(trace), tempo_trace(trace)
    router_tags = {
        a["key"]: a["value"].get("stringValue")
        for rs in trace.resource_spans() for ss in rs["scopeSpans"] for s in ss["spans"]
        for a in s.get("attributes", [])
    }  # fmt: skip
    state: Backends

    def answer(path: str, query: dict[str, list[str]], accept: str) -> tuple[int, Any]:
        state.asked.append((path, query, accept))
        if path == f"/jaeger/api/traces/{trace.trace_id}":
            return 200, {"data": [jaeger], "total": 0, "limit": 0, "offset": 0, "errors": None}
        if path.startswith("/jaeger/api/traces/"):
            return 404, {"data": None, "errors": [{"code": 404, "msg": "trace not found"}]}
        if path == "/jaeger/api/traces":
            wanted = json.loads(query["tags"][0])
            hit = query["service"] == ["pdd-router"] and all(
                router_tags.get(k) == v for k, v in wanted.items()
            )
            return 200, {"data": [jaeger] if hit else [], "errors": None}
        if path == f"/tempo/api/traces/{trace.trace_id}" and accept == "application/json":
            return 200, tempo
        if path.startswith("/tempo/api/traces/"):
            return 404, "trace not found"
        if path == "/tempo/api/search":
            key, _, value = query["tags"][0].partition("=")
            hit = router_tags.get(key) == json.loads(value)
            found = [{"traceID": trace.trace_id.lstrip("0"), "rootServiceName": "pdd-router",
                      "rootTraceName": "pdd.request"}] if hit else []  # fmt: skip
            return 200, {"traces": found, "metrics": {}}
        if path.startswith("/garbage/"):
            return 200, "<html>a login page, say</html>"
        if path.startswith("/wrong/"):  # JSON, but neither backend's shape
            wrong = {"data": [{"spans": [{"spanID": "1"}]}], "traces": [{}],
                     "batches": [{"scopeSpans": [{"spans": [{}]}]}]}  # fmt: skip
            return 200, wrong
        return 404, "404 page not found"

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            parts = urlsplit(self.path)
            status, payload = answer(parts.path, parse_qs(parts.query), self.headers["Accept"])
            body = (payload if isinstance(payload, str) else json.dumps(payload)).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    host, port = server.server_address[:2]
    state = Backends(f"http://{host}:{port}")
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield state
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


# --- the tests -------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["jaeger", "tempo"])
@pytest.mark.parametrize("by", ["trace id", "request id"])
def test_pdd_trace_draws_from_a_backend_what_it_draws_from_the_file(
    trace: Trace, backends: Backends, backend: str, by: str,
    capsys: pytest.CaptureFixture[str], tmp_path: Path,
) -> None:  # fmt: skip
    key = trace.trace_id if by == "trace id" else REQUEST
    fetched = fetch(Backend(backend), f"{backends.url}/{backend}", key)
    assert _comparable(trace_spans.select(fetched, key)) == trace.records()
    assert trace_view.main([key, f"--{backend}", f"{backends.url}/{backend}"]) == 0
    drawn = capsys.readouterr().out
    file = tmp_path / "traces.jsonl"
    file.write_text("\n".join(trace.lines) + "\n")
    assert trace_view.main([key, "--from", str(file)]) == 0
    assert capsys.readouterr().out == drawn  # the same waterfall, line for line
    assert "!pdd.failover" in drawn and "pdd-main" in drawn


def test_a_request_id_is_searched_by_its_tag(trace: Trace, backends: Backends) -> None:
    backends.asked.clear()
    fetch(Backend.JAEGER, f"{backends.url}/jaeger", REQUEST)
    fetch(Backend.TEMPO, f"{backends.url}/tempo", REQUEST)
    (jaeger, _), (search, _), (tempo, accept) = [(a[:2], a[2]) for a in backends.asked]
    assert jaeger[0] == "/jaeger/api/traces" and jaeger[1]["service"] == ["pdd-router"]
    assert json.loads(jaeger[1]["tags"][0]) == {"pdd.request_id": REQUEST}
    assert int(jaeger[1]["start"][0]) < int(jaeger[1]["end"][0])  # microseconds, a window
    assert search[0] == "/tempo/api/search"
    assert search[1]["tags"] == [f'pdd.request_id="{REQUEST}"']
    assert tempo[0] == f"/tempo/api/traces/{trace.trace_id}" and accept == "application/json"


@pytest.mark.parametrize("backend", ["jaeger", "tempo"])
def test_what_a_backend_does_not_have_is_said_in_words(
    backends: Backends, backend: str, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"{backends.url}/{backend}"
    assert trace_view.main(["0" * 31 + "1", f"--{backend}", url]) == 1
    assert trace_view.main(["pdd-nope", f"--{backend}", url]) == 1
    err = capsys.readouterr().err
    assert "no trace 00000000000000000000000000000001" in err and "pdd-nope" in err
    assert "Traceback" not in err


def test_a_backend_that_cannot_be_reached_or_answers_garbage_is_exit_2(
    backends: Backends, capsys: pytest.CaptureFixture[str]
) -> None:
    from pdd.local.cluster import free_port

    assert trace_view.main(["pdd-x", "--tempo", f"http://127.0.0.1:{free_port()}"]) == 2
    assert "cannot reach" in capsys.readouterr().err
    assert trace_view.main(["pdd-x", "--jaeger", f"{backends.url}/garbage"]) == 2
    assert "answered no JSON" in capsys.readouterr().err
    for backend, key in (("jaeger", "pdd-x"), ("tempo", "pdd-x"), ("tempo", "a" * 32)):
        assert trace_view.main([key, f"--{backend}", f"{backends.url}/wrong"]) == 2
        assert "cannot read" in capsys.readouterr().err
    assert trace_view.main(["pdd-x", "--tempo", backends.url, "--lookback-hours", "0"]) == 2
    assert "--lookback-hours" in capsys.readouterr().err
