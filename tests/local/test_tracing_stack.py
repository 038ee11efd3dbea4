"""One trace per request across a real ``pdd up`` stack (issue 58).

An in-test OTLP/HTTP receiver (``pdd.testing.otlp_receiver``) gets, for one request
on P-RLD-MD sent with a client ``traceparent``, one trace under the client's span whose
spans come from the router, P, RLD and MD (``service.name`` distinct per role), every
parent link inside the trace intact: each KV transfer parents its receiver's import, MD's
extend parents the relay's handoff (the context crossed in the channels' META), the WAN
transfer counts the bytes P's WAN meter counted; the router's TTFT histogram carries the
trace id as an OpenMetrics exemplar; and ``pdd trace`` draws the same request from the
stack's ``traces.jsonl``.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdd.common.tracing import TRACES_FILE
from pdd.testing.otlp_receiver import OtlpReceiver, ReceivedSpan, otlp_receiver, parents_arrived
from pdd.testing.waiting import until_sync

from .test_up import Up, start_up

pytestmark = pytest.mark.integration

CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"
#: The span each process must contribute for the request.
EXPECTED = {
    "pdd-router": "pdd.request",
    "pdd-prefill": "pdd.kv_transfer",
    "pdd-relay": "pdd.relay.decode",
    "pdd-main": "pdd.main.decode",
}

#: The other spans asserted on: each receiver's import, MD's extend and RLD's handoff.
ASSERTED = [
    ("pdd-relay", "pdd.kv_import"),
    ("pdd-main", "pdd.kv_import"),
    ("pdd-main", "pdd.extend"),
    ("pdd-relay", "pdd.handoff"),
]


@pytest.fixture
def traced(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[Up, OtlpReceiver]]:
    """A stack exporting to a receiver; a TTFT budget no P-MD route meets, so the request
    takes P-RLD-MD; spans leave every 100 ms rather than 5 s."""
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
    with otlp_receiver() as receiver:
        tmp = tmp_path_factory.mktemp("traced-up")
        args = ("--otlp-traces-endpoint", receiver.url, "--ttft-budget-s", "0.001")
        for up in start_up(tmp, *args):
            yield up, receiver


def wan_meter(up: Up) -> int:
    """The KV bytes P's meter counted on the WAN (the stack served one request)."""
    (prefill,) = [url for name, url in up.info.workers.items() if "prefill" in name]
    text = httpx.get(f"{prefill}/metrics", timeout=30).text
    for family in text_string_to_metric_families(text):
        if family.name == "pdd_worker_wan_kv_coded_bytes":
            return int(family.samples[0].value)
    raise AssertionError("P exports no pdd_worker_wan_kv_coded_bytes_total")


def test_one_trace_across_router_p_rld_md(traced: tuple[Up, OtlpReceiver]) -> None:
    up, receiver = traced
    resp = httpx.post(
        f"{up.info.base_url}/completions",
        json={"model": up.info.model, "prompt": "a b c d " * 40, "max_tokens": 24,
              "temperature": 0},
        headers={"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"},
        timeout=120,
    )  # fmt: skip
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-pdd-pipeline"] == "P-RLD-MD", resp.headers.get("x-pdd-reason")
    assert resp.headers["traceparent"].startswith(f"00-{CLIENT_TRACE}-")
    request_id = resp.headers["x-pdd-request-id"]

    def ours() -> list[ReceivedSpan]:
        return [s for s in receiver.spans() if s.trace_id == CLIENT_TRACE]

    def complete() -> bool:
        spans = ours()
        names = {(s.service, s.name) for s in spans}
        expected = all(item in names for item in [*EXPECTED.items(), *ASSERTED])
        return expected and parents_arrived(spans, CLIENT_SPAN)

    # Each process sends its spans in its own batches, so wait for every span asserted
    # on below (RLD's handoff, say, may leave in a batch after its decode's) and their
    # parents.
    until_sync(complete, "spans from the router, P, RLD and MD")
    spans = ours()
    assert {s.trace_id for s in receiver.spans()} == {CLIENT_TRACE}
    assert not receiver.bad_paths
    by_id = {s.span_id: s for s in spans}
    root = next(s for s in spans if s.name == "pdd.request")
    assert root.parent_id == CLIENT_SPAN
    assert root.attributes["pdd.request_id"] == request_id
    for s in spans:  # every other span's parent is a span of this trace
        assert s is root or s.parent_id in by_id, s
    assert {s.service for s in spans} == set(EXPECTED)
    transfers = [s for s in spans if s.name == "pdd.kv_transfer"]
    assert {t.attributes["pdd.kv.path"] for t in transfers} == {"fast", "wan"}
    (wan,) = [t for t in transfers if t.attributes["pdd.kv.path"] == "wan"]
    assert wan.attributes["pdd.kv.wire_bytes"] == wan_meter(up)  # the WAN meter's count
    imports = [s for s in spans if s.name == "pdd.kv_import"]
    assert {by_id[i.parent_id].name for i in imports} == {"pdd.kv_transfer"}  # type: ignore[index]
    assert {i.service for i in imports} == {"pdd-relay", "pdd-main"}
    (handoff,) = [s for s in spans if s.name == "pdd.handoff"]  # RLD's, under MD's extend
    assert by_id[handoff.parent_id].name == "pdd.extend"  # type: ignore[index]

    # The TTFT sample links to the trace, where the scraper asks for OpenMetrics.
    page = httpx.get(f"{up.info.router_url}/metrics", timeout=30,
                     headers={"Accept": "application/openmetrics-text; version=1.0.0"})  # fmt: skip
    assert page.headers["content-type"].startswith("application/openmetrics-text")
    ttft = [line for line in page.text.splitlines() if line.startswith("pdd_router_ttft_seconds_b")]
    assert any(f'# {{trace_id="{CLIENT_TRACE}"}}' in line for line in ttft), ttft

    view = subprocess.run(
        [sys.executable, "-m", "pdd.cli", "trace", request_id,
         "--from", str(Path(up.info.log_dir) / TRACES_FILE)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert view.returncode == 0, view.stderr
    for name in ("pdd.request", "pdd.route", "pdd.kv_transfer", "pdd.relay.decode"):
        assert name in view.stdout
