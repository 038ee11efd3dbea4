"""A request that fails over is still one trace (issue 58): the WAN line to MD cut mid-request.

One ``pdd up`` stack exports to an in-test OTLP/HTTP receiver. A P-RLD-MD request, sent
with a client ``traceparent``, has MD's KV on a line held to a trickle; the relay is
frozen (SIGSTOP) as soon as the request is routed, so it cannot finish the answer before
the failure is known; once MD has opened its import, the line is cut. P's WAN transfer
fails, P reports the fault, and the router routes around MD (the relay carries the
request); only once the router has counted the line's fault is the relay let go. So in
every interleaving the answer is complete and its trace holds: the router's
``pdd.link_fault`` and ``pdd.failover`` events on ``pdd.request``, P's failed WAN transfer
(``pdd.transfer_failed``), the relay's import and decode, MD's import that never
completed, all under the client's span with every parent inside the trace.
"""

from __future__ import annotations

import json
import os
import signal
import uuid
from collections.abc import Iterator, Mapping
from typing import TypeVar

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdd.testing.otlp_receiver import OtlpReceiver, ReceivedSpan, otlp_receiver, parents_arrived
from pdd.testing.waiting import until_sync

from .test_up import Up, start_up

pytestmark = pytest.mark.integration

CLIENT_SPAN = "b7ad6b7169203331"
TRICKLE_GBPS = 1e-5  # 10 kbit/s: a prompt's KV stays on the line for minutes
MAX_TOKENS = 48
T = TypeVar("T")


@pytest.fixture
def traced(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[Up, OtlpReceiver]]:
    """A stack exporting to a receiver; a TTFT budget only P-RLD-MD meets; spans leave
    every 100 ms; P's transfer to the frozen relay may wait as long as the test needs."""
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
    with otlp_receiver() as receiver:
        tmp = tmp_path_factory.mktemp("traced-failover")
        args = ("--otlp-traces-endpoint", receiver.url, "--ttft-budget-s", "0.001",
                "--prefill-arg=--transfer-timeout-s=600")  # fmt: skip
        for up in start_up(tmp, *args):
            yield up, receiver


def one(table: Mapping[str, T], part: str) -> T:
    """The single entry of ``table`` (workers, links, pids) whose name has ``part``."""
    (value,) = [v for name, v in table.items() if part in name]
    return value


def samples(url: str, family_name: str) -> list[float]:
    """The values of one metric family at ``url`` (a /metrics page)."""
    text = httpx.get(url, timeout=30).text
    return [
        sample.value
        for family in text_string_to_metric_families(text)
        if family.name == family_name
        for sample in family.samples
    ]


def test_a_request_routed_around_a_cut_line_is_one_trace(
    traced: tuple[Up, OtlpReceiver],
) -> None:
    up, receiver = traced
    trace_id = uuid.uuid4().hex
    md_link = one(up.info.links, "a-to-b")  # the line P's KV crosses to MD
    md_url, relay_pid = one(up.info.workers, "main"), one(up.info.pids, "relay")
    httpx.post(f"{md_link}/rate", json={"gbps": TRICKLE_GBPS}, timeout=30).raise_for_status()
    frozen = False
    try:
        with httpx.stream(
            "POST", f"{up.info.base_url}/completions",
            json={"model": up.info.model, "prompt": "a b c d " * 40, "max_tokens": MAX_TOKENS,
                  "temperature": 0, "stream": True},
            headers={"traceparent": f"00-{trace_id}-{CLIENT_SPAN}-01"}, timeout=300,
        ) as resp:  # fmt: skip
            os.kill(relay_pid, signal.SIGSTOP)  # routed: the relay cannot finish it now
            frozen = True
            assert resp.status_code == 200
            assert resp.headers["x-pdd-pipeline"] == "P-RLD-MD"
            request_id = resp.headers["x-pdd-request-id"]
            # MD meters P's WAN channel as it opens the request's import.
            until_sync(
                lambda: samples(f"{md_url}/metrics", "pdd_worker_wan_goodput_bytes_per_second"),
                "MD opening the request's KV import",
            )
            httpx.post(f"{md_link}/partition", json={"cut": True}, timeout=30).raise_for_status()
            until_sync(
                lambda: sum(samples(f"{up.info.router_url}/metrics",
                                    "pdd_router_link_transitions")) > 0,
                "the router counting the line's fault",
            )  # fmt: skip
            os.kill(relay_pid, signal.SIGCONT)
            frozen = False
            events = [json.loads(line[6:]) for line in resp.iter_lines()
                      if line.startswith("data: {")]  # fmt: skip
    finally:
        if frozen:
            os.kill(relay_pid, signal.SIGCONT)
    assert events[-1]["choices"][0]["finish_reason"] in ("length", "stop")
    assert sum(len(e["choices"][0]["text"]) > 0 for e in events) > 0

    def ours() -> list[ReceivedSpan]:
        return [s for s in receiver.spans() if s.trace_id == trace_id]

    def complete() -> bool:
        spans = ours()
        root = [s for s in spans if s.name == "pdd.request"]
        return (
            bool(root)
            and {"pdd.link_fault", "pdd.failover"} <= set(root[0].events)
            and {("pdd-prefill", "pdd.kv_transfer"), ("pdd-relay", "pdd.relay.decode"),
                 ("pdd-main", "pdd.kv_import")} <= {(s.service, s.name) for s in spans}
            and parents_arrived(spans, CLIENT_SPAN)
        )  # fmt: skip

    until_sync(complete, "the failed-over request's spans (router, P, RLD, MD) and parents")
    spans = ours()
    by_id = {s.span_id: s for s in spans}
    (root,) = [s for s in spans if s.name == "pdd.request"]
    assert root.parent_id == CLIENT_SPAN
    assert root.attributes["pdd.request_id"] == request_id
    for s in spans:  # every other span's parent is a span of this trace
        assert s is root or s.parent_id in by_id, s
    assert {s.service for s in spans} == {"pdd-router", "pdd-prefill", "pdd-relay", "pdd-main"}
    (wan,) = [s for s in spans if s.attributes.get("pdd.kv.path") == "wan"]
    assert "pdd.transfer_failed" in wan.events
    imports = {s.service: s for s in spans if s.name == "pdd.kv_import"}
    assert by_id[imports["pdd-main"].parent_id] is wan  # type: ignore[index]
    assert by_id[imports["pdd-relay"].parent_id].attributes["pdd.kv.path"] == "fast"  # type: ignore[index]
    assert not [s for s in spans if s.service == "pdd-main" and s.name == "pdd.main.decode"
                and s.attributes.get("pdd.streamed_tokens")]  # MD streamed nothing  # fmt: skip
