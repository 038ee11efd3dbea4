"""P's reports as ``relay_tokens`` reads them: a transfer MD imported, timed at P, or
one that failed on the line.

Scripted worker streams (no sockets): a decode source streams the tokens, P's stream
carries only its reports, and each report reaches its listener.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from pdd.common.vocabulary import LinkFault
from pdd.common.wire import Endpoint, KVShipment, PipelinePlan, TokenEvent
from pdd.router.stream_relay import relay_tokens
from pdd.testing.waiting import until

pytestmark = pytest.mark.unit


def endpoint(name: str) -> Endpoint:
    return Endpoint(instance_id=name, http_url=f"http://{name}", fast_addr="h:1", wan_addr="h:2")


def plan(pipeline: str) -> PipelinePlan:
    relay = endpoint("rld") if pipeline == "P-RLD-MD" else None
    return PipelinePlan(
        request_id="r", prompt_ids=[1, 2, 3], pipeline=pipeline, prefill=endpoint("p"),
        relay=relay, main=endpoint("md"),
    )  # fmt: skip


class Workers:
    """P's stream yields ``p_events`` then closes; once it has, ``speaker`` streams two
    tokens and any other decode source ends with none (so the order is fixed)."""

    def __init__(self, p_events: list[TokenEvent], speaker: str) -> None:
        self.p_events = p_events
        self.speaker = speaker
        self.p_closed = asyncio.Event()

    async def start(self, http_url: str, plan: PipelinePlan) -> None:
        pass

    async def cancel(self, http_url: str, request_id: str) -> None:
        pass

    async def takeover(self, http_url: str, request_id: str) -> None:
        pass

    async def stream(self, http_url: str, request_id: str) -> AsyncIterator[TokenEvent]:
        if http_url == "http://p":
            for event in self.p_events:
                yield event
            self.p_closed.set()
            return
        await self.p_closed.wait()
        source = http_url.removeprefix("http://")
        for seq in range(2 if source == self.speaker else 0):
            yield TokenEvent(request_id="r", seq=seq, token_id=5, source=source, finished=seq == 1)


async def run(
    p_events: list[TokenEvent], pipeline: str = "P-MD", speaker: str = "md"
) -> tuple[list[KVShipment], list[TokenEvent]]:
    """Read the request to its end: the shipments and the faults P reported."""
    shipped: list[KVShipment] = []
    faults: list[TokenEvent] = []
    events = relay_tokens(
        plan(pipeline), Workers(p_events, speaker), 10.0,  # type: ignore[arg-type]
        on_link_fault=faults.append, on_kv_shipped=shipped.append,
    )  # fmt: skip
    assert [e.seq async for e in events] == [0, 1]
    return shipped, faults


async def test_p_reports_the_kv_imported_with_the_lines_time() -> None:
    shipment = KVShipment(kv_bytes=4096, seconds=0.25)
    report = TokenEvent(request_id="r", seq=0, source="p", kv_shipped=shipment)
    shipped, faults = await run([report], "P-RLD-MD", speaker="rld")
    assert shipped == [shipment] and faults == []
    assert await run([]) == ([], [])  # no report: nothing learnt from P's stream ending


async def test_a_transfer_p_reports_failed_is_a_fault_not_a_shipment() -> None:
    fault = TokenEvent(
        request_id="r", seq=0, source="p", error="cut", culprit="md",
        link_fault=LinkFault.STALLED,
    )  # fmt: skip
    shipped, faults = await run([fault], "P-RLD-MD", speaker="rld")  # the relay finishes it
    assert shipped == [] and faults == [fault]


class LateReport(Workers):
    """The relay streams its two tokens at once; P's report comes only once the test
    releases it (the KV still crossing after the relay finished the request), and MD's
    stream ends with no token."""

    def __init__(self, report: TokenEvent) -> None:
        super().__init__([report], "rld")
        self.released = asyncio.Event()

    async def stream(self, http_url: str, request_id: str) -> AsyncIterator[TokenEvent]:
        if http_url == "http://p":
            await self.released.wait()
            yield self.p_events[0]
            return
        for seq in range(2 if http_url == "http://rld" else 0):
            yield TokenEvent(request_id="r", seq=seq, token_id=5, source="rld", finished=seq == 1)


async def test_a_report_after_the_relay_finished_is_still_read_then_the_line_let_go() -> None:
    shipment = KVShipment(kv_bytes=4096, seconds=2.5)
    workers = LateReport(TokenEvent(request_id="r", seq=0, source="p", kv_shipped=shipment))
    shipped: list[KVShipment] = []
    over: list[int] = []  # how many shipments had been reported when the reports ended
    events = relay_tokens(
        plan("P-RLD-MD"), workers, 10.0,  # type: ignore[arg-type]
        on_kv_shipped=shipped.append, on_reports_over=lambda: over.append(len(shipped)),
    )  # fmt: skip
    assert [e.seq async for e in events] == [0, 1]  # the client has its answer
    assert shipped == [] and over == []  # the KV is still on the line: nothing let go
    workers.released.set()
    await until(lambda: over, "P's reports are over")
    assert shipped == [shipment] and over == [1]


async def test_the_reports_are_over_once_when_p_reported_before_the_end() -> None:
    shipment = KVShipment(kv_bytes=4096, seconds=0.25)
    report = TokenEvent(request_id="r", seq=0, source="p", kv_shipped=shipment)
    over: list[str] = []
    events = relay_tokens(
        plan("P-MD"), Workers([report], "md"), 10.0,  # type: ignore[arg-type]
        on_reports_over=lambda: over.append("over"),
    )  # fmt: skip
    assert [e.seq async for e in events] == [0, 1]
    assert over == ["over"]
