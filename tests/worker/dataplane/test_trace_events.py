"""A failover and a drain are events on the request's trace (issue 58), at the exact point.

In-process on a virtual clock, every role exporting to one file through PDD's tracing,
each request run under a ``pdd.request`` span as the router's middleware opens it (the
plan carries its context, as the router's does): MD dies while its KV is held on the
line, so the router's stream relay routes around it (``pdd.failover`` on the request,
naming MD and the relay that carries on) and the relay takes over (``pdd.takeover`` on
its decode); a relay that drains hands over in one shot, and its handoff says why
(``pdd.drain``). The same failover across real processes is ``test_tracing_failover``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pdd.common import tracing
from pdd.common.wire import PipelinePlan, TokenEvent
from pdd.testing.waiting import until

pytestmark = [pytest.mark.unit, pytest.mark.virtual_clock]

MAX_TOKENS = 40
THRESHOLD = 64  # the plan's default catch-up threshold


@pytest.fixture
def traces(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "traces.jsonl"
    tracing.configure(tracing.config_from("pdd-test", file=path, env={}))
    yield path
    tracing.shutdown()


def spans(path: Path) -> list[dict[str, Any]]:
    """Every exported span, its events' names and attributes flattened."""
    assert tracing.flush()
    out = []
    for line in path.read_text().splitlines():
        for rs in json.loads(line)["resourceSpans"]:
            for ss in rs["scopeSpans"]:
                for s in ss["spans"]:
                    s["eventsByName"] = {
                        e["name"]: {
                            a["key"]: next(iter(a["value"].values()))
                            for a in e.get("attributes", [])
                        }
                        for e in s.get("events", [])
                    }
                    out.append(s)
    return out


def traced(plan: PipelinePlan) -> PipelinePlan:
    """The plan as the router sends it from inside ``pdd.request``."""
    return plan.model_copy(update={"trace_context": tracing.carrier()})


async def test_a_dead_main_decode_is_a_failover_and_a_takeover_on_the_trace(
    vdp, traces: Path
) -> None:
    prompt = vdp.prompts(1, seed=61, lo=90, hi=91)[0]
    vdp.cluster.wan_path("md_v").pause()  # MD's KV cannot arrive before it dies

    def kill_md(event: TokenEvent) -> None:
        if vdp.cluster["md_v"].alive:
            vdp.cluster.crash("md_v")

    with tracing.span("pdd.request") as root:
        plan = vdp.cluster.plan("t-md-0", prompt, "P-RLD-MD", vdp.sampling(0, MAX_TOKENS),
                                main="md_v")  # fmt: skip
        [result] = await vdp.run_all([traced(plan)], on_token=kill_md)
        trace_id = tracing.trace_id_hex(root)
    assert set(result.sources) == {"rld"} and len(result.token_ids) == MAX_TOKENS
    await vdp.assert_quiescent()

    ours = [s for s in spans(traces) if s["traceId"] == trace_id]
    (request,) = [s for s in ours if s["name"] == "pdd.request"]
    failover = request["eventsByName"]["pdd.failover"]
    assert (failover["pdd.failed"], failover["pdd.failover.to"]) == ("md_v", "rld")
    (decode,) = [s for s in ours if s["name"] == "pdd.relay.decode"]
    assert decode["parentSpanId"] == request["spanId"]
    assert "pdd.takeover" in decode["eventsByName"]


async def test_a_takeover_that_overtakes_the_relays_kv_waits_for_it(
    vdp, traces: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """MD dies before P's KV reaches the relay: the router's takeover arrives first. It
    waits for the request (refused, it was lost: the relay stopped at the handoff point)."""
    prompt = vdp.prompts(1, seed=63, lo=90, hi=91)[0]
    relay = vdp.cluster["rld"].role
    asked = asyncio.Event()
    takeover = relay.takeover

    async def observed(request_id: str) -> None:
        asked.set()
        await takeover(request_id)

    monkeypatch.setattr(relay, "takeover", observed)
    fast, wan = vdp.cluster.fast_path("rld"), vdp.cluster.wan_path("md_v")
    fast.pause()  # the relay has nothing until the router has asked it to take over
    wan.pause()
    with tracing.span("pdd.request") as root:
        plan = vdp.cluster.plan("t-early-0", prompt, "P-RLD-MD", vdp.sampling(0, MAX_TOKENS),
                                main="md_v")  # fmt: skip
        vdp.cluster.crash("md_v")
        running = asyncio.ensure_future(vdp.run_all([traced(plan)]))
        await until(asked.is_set, "the router asked the relay to take over")
        assert plan.request_id not in relay.sessions
        fast.resume()
        [result] = await running
        trace_id = tracing.trace_id_hex(root)
    assert set(result.sources) == {"rld"} and len(result.token_ids) == MAX_TOKENS
    await vdp.assert_quiescent()

    ours = [s for s in spans(traces) if s["traceId"] == trace_id]
    (decode,) = [s for s in ours if s["name"] == "pdd.relay.decode"]
    assert "pdd.takeover" in decode["eventsByName"]


async def test_a_draining_relays_handoff_says_so(vdp, traces: Path) -> None:
    prompt = vdp.prompts(1, seed=62, lo=60, hi=100)[0]
    relay, path = vdp.cluster["rld"], vdp.cluster.wan_path("md")
    draining: list[asyncio.Task[bool]] = []

    def drain_then_release(event: TokenEvent) -> None:
        if not draining and event.seq > THRESHOLD:
            draining.append(asyncio.ensure_future(relay.instance.drain(grace_s=600.0)))
            path.resume()

    path.pause()  # no handoff before the relay drains
    with tracing.span("pdd.request") as root:
        plan = vdp.cluster.plan("t-drain-0", prompt, "P-RLD-MD", vdp.sampling(0, 120),
                                handoff="catch-up")  # fmt: skip
        [result] = await vdp.run_all([traced(plan)], on_token=drain_then_release)
        trace_id = tracing.trace_id_hex(root)
    assert draining and await draining[0]
    assert result.sources[-1] == "md" and not result.errors

    ours = [s for s in spans(traces) if s["traceId"] == trace_id]
    (handoff,) = [s for s in ours if s["name"] == "pdd.handoff"]
    assert handoff["eventsByName"]["pdd.drain"] == {"pdd.instance": "rld"}
    assert {a["key"]: a["value"] for a in handoff["attributes"]}["pdd.handoff.mode"] == {
        "stringValue": "one-shot"
    }
