"""P's report stream as ``relay_tokens`` reads it: closing unfailed means MD has the KV.

Scripted worker streams (no sockets): MD streams the tokens, P's stream carries only
its reports. The router times a transfer by P's close (``on_kv_shipped``) only where P
reported no failure on the line.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from pdd.common.vocabulary import LinkFault
from pdd.common.wire import Endpoint, PipelinePlan, TokenEvent
from pdd.router.stream_relay import relay_tokens

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
) -> tuple[int, list[TokenEvent]]:
    """Read the request to its end (or its failure): times told of a shipment, faults."""
    shipped: list[None] = []
    faults: list[TokenEvent] = []
    events = relay_tokens(
        plan(pipeline), Workers(p_events, speaker), 10.0,  # type: ignore[arg-type]
        on_link_fault=faults.append, on_kv_shipped=lambda: shipped.append(None),
    )  # fmt: skip
    assert [e.seq async for e in events] == [0, 1]
    return len(shipped), faults


async def test_p_closing_its_reports_unfailed_times_the_transfer() -> None:
    shipped, faults = await run([])
    assert shipped == 1 and faults == []


async def test_a_transfer_p_reported_failed_is_no_shipment() -> None:
    fault = TokenEvent(
        request_id="r", seq=0, source="p", error="cut", culprit="md",
        link_fault=LinkFault.STALLED,
    )  # fmt: skip
    shipped, faults = await run([fault], "P-RLD-MD", speaker="rld")  # the relay finishes it
    assert shipped == 0 and faults == [fault]
