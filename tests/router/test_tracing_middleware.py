"""``pdd.request``, the router's root span (issue 58): under the client's ``traceparent``,
current while the request is served (so the route's span and the plan's context hang
under it), ended with the last byte of a stream, its ``traceparent`` in the response;
and nothing at all where tracing is off."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

from pdd.common import tracing
from pdd.router.tracing_middleware import TracingMiddleware

pytestmark = pytest.mark.unit

CLIENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


async def _serve(request: Request) -> StreamingResponse:
    """Like the router: a span of its own while routing, the request id in a header, and
    a body that opens a span per chunk (the stream runs in the request's context)."""
    with tracing.span("pdd.route"):
        sent = tracing.carrier()

    async def body() -> AsyncIterator[bytes]:
        for i in range(2):
            with tracing.span(f"chunk-{i}"):
                yield json.dumps(sent).encode() + b"\n"

    return StreamingResponse(
        body(), headers={"x-pdd-request-id": "pdd-1", "x-pdd-pipeline": "P-MD"}
    )


def _client() -> httpx.AsyncClient:
    app = TracingMiddleware(Starlette(routes=[Route("/v1/completions", _serve, methods=["POST"])]))
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router")


def _spans(path: Path) -> dict[str, dict]:
    assert tracing.flush()
    out = {}
    for line in path.read_text().splitlines():
        for rs in json.loads(line)["resourceSpans"]:
            for ss in rs["scopeSpans"]:
                for s in ss["spans"]:
                    s["attrs"] = {
                        a["key"]: next(iter(a["value"].values())) for a in s.get("attributes", [])
                    }
                    out[s["name"]] = s
    return out


@pytest.fixture
def traced(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "traces.jsonl"
    tracing.configure(tracing.config_from("pdd-router", file=path, env={}))
    yield path
    tracing.shutdown()


async def test_the_request_span_is_the_clients_child_and_holds_the_stream(traced: Path) -> None:
    async with _client() as client:
        resp = await client.post("/v1/completions", headers={"traceparent": CLIENT})
    spans = _spans(traced)
    root = spans["pdd.request"]
    assert root["traceId"] == "0af7651916cd43dd8448eb211c80319c"
    assert root["parentSpanId"] == "b7ad6b7169203331"
    assert resp.headers["traceparent"] == f"00-{root['traceId']}-{root['spanId']}-01"
    assert root["attrs"]["pdd.request_id"] == "pdd-1"
    assert root["attrs"]["pdd.pipeline"] == "P-MD"
    route = spans["pdd.route"]
    assert route["parentSpanId"] == root["spanId"]
    # What the router hands the workers names the route's span's parent's trace.
    sent = json.loads(resp.text.splitlines()[0])
    assert sent["traceparent"].split("-")[1] == root["traceId"]
    for name in ("chunk-0", "chunk-1"):  # the stream ran inside the request's span
        assert spans[name]["parentSpanId"] == root["spanId"]
        assert int(spans[name]["endTimeUnixNano"]) <= int(root["endTimeUnixNano"])


async def test_without_a_client_context_the_request_is_a_root(traced: Path) -> None:
    async with _client() as client:
        await client.post("/v1/completions")
    assert "parentSpanId" not in _spans(traced)["pdd.request"]


async def test_off_adds_no_header() -> None:
    async with _client() as client:
        resp = await client.post("/v1/completions", headers={"traceparent": CLIENT})
    assert "traceparent" not in resp.headers
    assert resp.text.splitlines()[0] == "{}"
