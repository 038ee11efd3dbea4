"""``pdd bench --link-schedule``: the parser, a short schedule applied to the WAN
emulator through its own admin API on a virtual clock, and the per-phase report."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from pdd.bench import cli as bench
from pdd.bench import link_schedule, plots
from pdd.bench.link_schedule import (
    LinkSchedule,
    LinkScheduleError,
    LinkViewSampler,
    Phase,
    parse_schedule,
    phase_summaries,
    phase_table,
)
from pdd.bench.replay import Outcome
from pdd.bench.report import ModeRun
from pdd.local.probes import flatten
from pdd.testing import virtual_time
from pdd.wan.admin import handle
from pdd.wan.link import WanLink

pytestmark = pytest.mark.unit


def test_a_schedule_is_phases_from_the_declared_rate():
    assert parse_schedule("20:0.005, 50:0.05,60:cut,80:0.05", 0.05) == [
        Phase(0.0, 0.05),
        Phase(20.0, 0.005),
        Phase(50.0, 0.05),
        Phase(60.0, None),
        Phase(80.0, 0.05),
    ]
    assert parse_schedule("0:cut,5:1", 0.05) == [Phase(0.0, None), Phase(5.0, 1.0)]


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("20", "expected SECONDS:GBPS"),
        ("x:0.1", "expected SECONDS:GBPS"),
        ("10:fast", "expected SECONDS:GBPS"),
        ("10:0", "expected SECONDS:GBPS"),
        ("-1:0.1", "expected SECONDS:GBPS"),
        ("10:nan", "expected SECONDS:GBPS"),
        ("10:0.1,10:cut", "times must increase"),
    ],
)
def test_a_bad_schedule_is_refused_with_what_to_write(text, says):
    with pytest.raises(LinkScheduleError, match=says):
        parse_schedule(text, 0.05)


def test_bench_refuses_a_schedule_it_cannot_run_before_starting(capsys):
    assert bench.main(["--link-schedule", "10:zero", "--max-requests", "5"]) == 2
    assert "expected SECONDS:GBPS" in capsys.readouterr().err
    assert bench.main(["--link-schedule", "10:cut", "--chaos", "--modes", "mono,pdd"]) == 2
    assert "not with --url, --chaos or --scale-down" in capsys.readouterr().err


def test_the_default_modes_compare_the_live_view_with_a_static_one_and_naive():
    args = bench.build_parser().parse_args(["--link-schedule", "10:cut"])
    assert bench.parse_modes(args) == ["pdd", "pdd-static", "naive"]
    assert bench.base_mode("pdd-static") == "pdd"
    assert bench.VARIANTS["pdd-static"].router_args == ("--static-link-view",)


def admin_client(link: WanLink) -> httpx.AsyncClient:
    """The emulator's admin API (``pdd.wan.admin.handle``) without a socket."""

    def respond(request: httpx.Request) -> httpx.Response:
        stats = handle(link, request.method, request.url.path, request.content)
        return httpx.Response(200, json=stats.model_dump())

    return httpx.AsyncClient(transport=httpx.MockTransport(respond))


def test_a_short_schedule_changes_the_line_on_time_and_counts_pipelines_per_phase():
    """On the virtual clock: the line is re-rated, cut and healed at the scheduled
    seconds; each phase gets the router's pipeline counts taken at its ends; the line
    is as it began once the replay is over."""

    async def main():
        link = WanLink("dc-a:7000", "dc-b:7000", gbps=0.05)
        seen = []
        counts = {"P-MD": 0.0, "P-RLD-MD": 0.0}
        loop = asyncio.get_running_loop()
        t0 = loop.time()

        async with admin_client(link) as client:
            apply = link_schedule.admin_apply(client, ["http://wan-admin"])

            async def applying(phase, previous):
                problem = await apply(phase, previous)
                seen.append((loop.time() - t0, link.stats().gbps, link.is_cut))
                return problem

            async def pipelines():
                return dict(counts)

            async def traffic():  # what the router would choose meanwhile
                for at, pipeline in [(1, "P-MD"), (12, "P-RLD-MD"), (13, "P-RLD-MD"), (25, "P-MD")]:
                    await asyncio.sleep(at - (loop.time() - t0))
                    counts[pipeline] += 1
                await asyncio.sleep(30 - (loop.time() - t0))
                schedule.replay_over()

            phases = parse_schedule("10:0.005,20:cut,24:0.01,40:cut", 0.05)
            schedule = LinkSchedule(phases, applying, pipelines)
            await asyncio.gather(schedule.run(lambda: loop.time() - t0), traffic())
        return seen, schedule.ran, link

    seen, ran, link = virtual_time.run(main())
    assert seen == [
        (0.0, 0.05, False),
        (10.0, 0.005, False),
        (20.0, 0.005, True),
        (24.0, 0.01, False),
        (30.0, 0.05, False),  # the replay ended: the line as it began (40 s never came)
    ]
    assert [(r.began_s, r.ended_s) for r in ran] == [(0, 10), (10, 20), (20, 24), (24, 30)]
    assert [r.pipelines for r in ran] == [
        {"P-MD": 1, "P-RLD-MD": 0},
        {"P-MD": 0, "P-RLD-MD": 2},
        {"P-MD": 0, "P-RLD-MD": 0},
        {"P-MD": 1, "P-RLD-MD": 0},
    ]
    assert not link.is_cut


def outcome(key, sent_at, ttft_s=None, error=None):
    o = Outcome(key, prompt_tokens=10, max_tokens=4, sent_at=sent_at, ttft_s=ttft_s)
    if error:
        o.fail("frame", error, error)
    else:
        o.finish_reason = "length"
    return o


def test_requests_are_reported_in_the_phase_they_were_sent_in():
    ran = [
        {"phase": {"start_s": 0.0, "gbps": 0.05}, "began_s": 0.0, "ended_s": 10.0,
         "pipelines": {"P-MD": 3.0}, "problem": None},
        {"phase": {"start_s": 10.0, "gbps": None}, "began_s": 10.0, "ended_s": None,
         "pipelines": {"P-MD": 1.0, "P-RLD-MD": 3.0}, "problem": None},
    ]  # fmt: skip
    outcomes = [
        outcome("a", 1.0, 0.1),
        outcome("b", 2.0, 0.3),
        outcome("c", 9.9, 0.2),
        outcome("d", 10.0, 1.0),
        outcome("e", 12.0, error="upstream_error"),
    ]
    before, during = phase_summaries(outcomes, ran)
    assert (before["link"], before["requests"], before["failed"]) == ("0.05 Gbit/s", 3, 0)
    assert before["ttft_p50_s"] == pytest.approx(0.2)
    assert (during["link"], during["requests"], during["failed"]) == ("cut", 2, 1)
    assert during["ttft_p99_s"] == pytest.approx(1.0)
    assert during["pipelines"] == {"P-MD": 0.25, "P-RLD-MD": 0.75}
    assert during["failure_reasons"] == {"upstream_error": 1}
    table = phase_table({"pdd": [before, during]})
    assert "| 10-end s | cut | pdd | 2 | 1 | 1.000 | 1.000 | - | P-MD:0.25 P-RLD-MD:0.75 |" in table
    json.dumps([before, during])  # results.json takes it as is


ROUTER_METRICS = """\
pdd_router_link_goodput_bytes_per_second{link="wan"} 625000
pdd_router_link_backlog_bytes{link="wan"} 2048
pdd_router_relay_slot_seconds 0.04
pdd_router_prefill_tokens_per_second{worker="p0"} 900
pdd_router_prefill_tokens_per_second{worker="p1"} 1200
"""


def test_the_router_link_view_is_sampled_beside_the_replay_and_plotted(tmp_path):
    """On the virtual clock: one sample each half second until stopped, what the router's
    gauges say (the slowest P's rate; no measured rate reads as None), and a plot."""
    scrapes = [flatten(ROUTER_METRICS), {"pdd_router_relay_slot_seconds": 0.0}]

    async def main():
        loop = asyncio.get_running_loop()
        t0, stop = loop.time(), asyncio.Event()

        async def read():
            if len(sampler.series) == 2:  # the third sample is the last
                stop.set()
            return scrapes[min(len(sampler.series), 1)]

        sampler = LinkViewSampler(read)
        await sampler.run(lambda: loop.time() - t0, stop)
        return sampler.series

    series = virtual_time.run(main())
    assert [v["t"] for v in series] == [0.0, 0.5, 1.0]
    first, later = series[0], series[1]
    assert (first["goodput_gbps"], first["backlog_bytes"]) == (0.005, 2048)
    assert (first["relay_slot_s"], first["prefill_tokens_per_s"]) == (0.04, 900)
    assert later["prefill_tokens_per_s"] is None and later["goodput_gbps"] == 0
    ran = [{"phase": {"start_s": 0.0, "gbps": 0.05}, "began_s": 0.0, "ended_s": 0.5},
           {"phase": {"start_s": 0.5, "gbps": None}, "began_s": 0.5, "ended_s": None}]  # fmt: skip
    run = ModeRun("pdd", [], 1.2, link_phases=ran, link_view=series)
    paths = plots.write_all({}, [run], tmp_path)
    assert tmp_path / "link_view_over_time.png" in paths
    assert (tmp_path / "link_view_over_time.png").stat().st_size > 0
    json.dumps(series)  # results.json takes it as is


def test_each_phase_reports_its_requests_agreement_with_the_reference() -> None:
    """The agreement a phase reports is over that phase's requests only."""
    ran = [
        {"phase": {"start_s": 0.0, "gbps": 0.05}, "began_s": 0.0, "ended_s": 10.0,
         "pipelines": {"P-MD": 2.0}, "problem": None},
        {"phase": {"start_s": 10.0, "gbps": 0.005}, "began_s": 10.0, "ended_s": None,
         "pipelines": {"P-MD": 1.0}, "problem": None},
    ]  # fmt: skip
    outcomes = [outcome("a", 1.0, 0.1), outcome("b", 2.0, 0.1), outcome("c", 11.0, 0.1)]
    seen: list[list[str]] = []

    def agreement(group) -> float:
        seen.append([o.key for o in group])
        return 0.5 if len(group) == 1 else 1.0

    healthy, throttled = phase_summaries(outcomes, ran, agreement)
    assert seen == [["a", "b"], ["c"]]
    assert (healthy["agreement"], throttled["agreement"]) == (1.0, 0.5)
    assert "| 10-end s | 0.005 Gbit/s | pdd | 1 | 0 | 0.100 | 0.100 | 50.00% |" in phase_table(
        {"pdd": [healthy, throttled]}
    )
