"""One trace per request on the pipelines without a relay (issue 58): P-MD, naive, same-DC.

Beside ``test_tracing_stack``'s P-RLD-MD request, one ``pdd up`` per mode exports to an
in-test OTLP/HTTP receiver and serves one request sent with a client ``traceparent``:
on ``pdd`` with a budget every route meets (P-MD), on ``naive`` (P ships the whole KV to
MD across the emulated WAN) and on ``samedc`` (the same with MD beside P). Each request's
spans form one trace under the client's span, from exactly the processes that served it
(router, P, MD; no relay), every parent inside the trace, MD's KV import under P's
transfer to it, whose bytes are what P's WAN meter counted for the request.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from pdd.testing.otlp_receiver import OtlpReceiver, ReceivedSpan, otlp_receiver, parents_arrived
from pdd.testing.waiting import until_sync

from .test_tracing_stack import wan_meter
from .test_up import Up, start_up

pytestmark = pytest.mark.integration

CLIENT_SPAN = "b7ad6b7169203331"


@dataclass(frozen=True)
class Case:
    mode: str
    pipeline: str
    args: tuple[str, ...] = ()


CASES = [
    # A line and a budget every route meets: MD's miss crosses in time, no relay.
    Case("pdd", "P-MD", ("--ttft-budget-s", "60", "--link-gbps", "10")),
    Case("naive", "naive"),
    Case("samedc", "naive"),
]
#: The spans each serving process must contribute: (service.name, span name).
EXPECTED = {
    ("pdd-router", "pdd.request"),
    ("pdd-router", "pdd.route"),
    ("pdd-prefill", "pdd.prefill"),
    ("pdd-prefill", "pdd.kv_transfer"),
    ("pdd-main", "pdd.kv_import"),
    ("pdd-main", "pdd.main.decode"),
}


@pytest.fixture(scope="module", params=CASES, ids=lambda c: c.mode)
def stack(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Case, Up, OtlpReceiver]]:
    """One stack per mode exporting to its own receiver; spans leave every 100 ms."""
    case: Case = request.param
    with pytest.MonkeyPatch.context() as patch, otlp_receiver() as receiver:
        patch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
        tmp = tmp_path_factory.mktemp(f"traced-{case.mode}")
        args = ("--otlp-traces-endpoint", receiver.url, *case.args)
        for up in start_up(tmp, *args, mode=case.mode):
            yield case, up, receiver


def test_one_trace_from_every_process_that_served(stack: tuple[Case, Up, OtlpReceiver]) -> None:
    case, up, receiver = stack
    trace_id = uuid.uuid4().hex
    before = wan_meter(up)
    resp = httpx.post(
        f"{up.info.base_url}/completions",
        json={"model": up.info.model, "prompt": "a b c d " * 8, "max_tokens": 12,
              "temperature": 0},
        headers={"traceparent": f"00-{trace_id}-{CLIENT_SPAN}-01"},
        timeout=120,
    )  # fmt: skip
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-pdd-pipeline"] == case.pipeline
    request_id = resp.headers["x-pdd-request-id"]

    def ours() -> list[ReceivedSpan]:
        return [s for s in receiver.spans() if s.trace_id == trace_id]

    def complete() -> bool:
        spans = ours()
        names = {(s.service, s.name) for s in spans}
        return names >= EXPECTED and parents_arrived(spans, CLIENT_SPAN)

    until_sync(complete, f"{case.mode}: spans from the router, P and MD, and their parents")
    spans = ours()
    assert not receiver.bad_paths
    assert {s.service for s in spans} == {"pdd-router", "pdd-prefill", "pdd-main"}
    by_id = {s.span_id: s for s in spans}
    (root,) = [s for s in spans if s.name == "pdd.request"]
    assert root.parent_id == CLIENT_SPAN
    assert root.attributes["pdd.request_id"] == request_id
    assert root.attributes["pdd.pipeline"] == case.pipeline
    for s in spans:  # every other span's parent is a span of this trace
        assert s is root or s.parent_id in by_id, s
    (transfer,) = [s for s in spans if s.name == "pdd.kv_transfer"]  # P to MD, none to a relay
    (kv_import,) = [s for s in spans if s.name == "pdd.kv_import"]
    assert kv_import.parent_id == transfer.span_id
    assert transfer.attributes["pdd.kv.wire_bytes"] == wan_meter(up) - before
