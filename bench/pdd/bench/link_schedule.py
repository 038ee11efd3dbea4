"""``pdd bench --link-schedule``: the emulated WAN line changes on a timetable while a
trace replays, and the report splits every figure by phase.

    --link-schedule '20:0.005,50:0.05,60:cut,80:0.05'

Each entry is ``SECONDS:VALUE``, seconds since the replay began: a rate in Gbit/s (the
line re-rated through the emulator's admin API, ``POST /rate``, and healed if it was
cut) or ``cut`` (``POST /partition``, both directions, as ``--chaos`` cuts it). Each
entry starts a phase that lasts until the next one; before the first, the line runs
at its declared rate (``--link-gbps``). Unlike ``--chaos``, whose events wait for counts
of finished requests, a schedule is wall-clock time: the point is what the router does
*while* the line is slow or gone, whatever it dispatches meanwhile.

At each phase change the router's pipeline counters are read, so each phase's pipeline
mix is what the router chose during it; requests belong to the phase they were sent in.
Every half second the router's own view of the line is read too (``LinkViewSampler``:
the goodput, backlog, relay queue and prefill rate it decides on), to see what it
learnt and how fast.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from pdd.bench.replay import Outcome
from pdd.local.probes import Samples, by_label, flatten
from pdd.simulator.stats import percentile

#: The value that cuts the line in a schedule entry.
CUT = "cut"


class LinkScheduleError(ValueError):
    """A ``--link-schedule`` that cannot run; the message says what to write."""


@dataclass(frozen=True)
class Phase:
    """The line from ``start_s`` (since the replay began) until the next phase."""

    start_s: float
    gbps: float | None  # None: cut

    def describe(self) -> str:
        return "cut" if self.gbps is None else f"{self.gbps:g} Gbit/s"


def parse_schedule(text: str, declared_gbps: float) -> list[Phase]:
    """The phases of ``text``; a first phase at the declared rate where it starts later
    than 0 s. Times must increase; rates be positive numbers."""
    phases: list[Phase] = []
    for entry in (e.strip() for e in text.split(",")):
        at, sep, value = entry.partition(":")
        try:
            start = float(at)
            gbps = None if value.strip() == CUT else float(value)
        except ValueError:
            start = gbps = math.nan
        bad_rate = gbps is not None and not (math.isfinite(gbps) and gbps > 0)
        if not sep or not math.isfinite(start) or start < 0 or bad_rate:
            raise LinkScheduleError(
                f"--link-schedule entry {entry!r}: expected SECONDS:GBPS or SECONDS:cut "
                "(e.g. '20:0.005,50:0.05,60:cut,80:0.05')"
            )
        if phases and start <= phases[-1].start_s:
            raise LinkScheduleError(
                f"--link-schedule entry {entry!r}: times must increase "
                f"(after {phases[-1].start_s:g} s)"
            )
        phases.append(Phase(start, gbps))
    if phases[0].start_s > 0:
        phases.insert(0, Phase(0.0, declared_gbps))
    return phases


@dataclass
class PhaseRun:
    """A phase as it ran: when it began and ended (s since the replay began), and the
    router's pipeline counts over it."""

    phase: Phase
    began_s: float
    ended_s: float | None = None
    pipelines: dict[str, float] | None = None
    problem: str | None = None


#: Applies one phase to the line; what went wrong, or None.
Apply = Callable[[Phase, Phase | None], Awaitable[str | None]]
#: The router's pipeline counts now (``pdd_router_requests_total`` by pipeline).
ReadPipelines = Callable[[], Awaitable[dict[str, float]]]


class LinkSchedule:
    """Runs the phases beside a replay: ``run`` sleeps until each phase's start on the
    event loop's clock, applies it, and reads the router's pipeline counts at each
    change; ``replay_over`` ends the last phase (a phase not reached is not run)."""

    def __init__(self, phases: Sequence[Phase], apply: Apply, pipelines: ReadPipelines) -> None:
        self.phases = list(phases)
        self._apply = apply
        self._pipelines = pipelines
        self.ran: list[PhaseRun] = []
        self._over = asyncio.Event()

    def replay_over(self) -> None:
        self._over.set()

    async def run(self, since_start: Callable[[], float]) -> None:
        before: dict[str, float] = await self._pipelines()
        previous: Phase | None = None
        for phase in self.phases:
            wait = phase.start_s - since_start()
            if wait > 0 and await self._ends_within(wait):
                break
            now = since_start()
            before = await self._close_last(now, before)
            ran = PhaseRun(phase, now)
            ran.problem = await self._apply(phase, previous)
            self.ran.append(ran)
            previous = phase
        await self._over.wait()
        await self._close_last(since_start(), before)
        if previous is not None and previous.gbps != self.phases[0].gbps:
            await self._apply(self.phases[0], previous)  # the line as it began, for what follows

    async def _ends_within(self, seconds: float) -> bool:
        """Waits ``seconds`` or until the replay is over; True if it is."""
        try:
            await asyncio.wait_for(self._over.wait(), seconds)
        except TimeoutError:
            return False
        return True

    async def _close_last(self, now: float, before: dict[str, float]) -> dict[str, float]:
        """End the running phase at ``now`` with its pipeline counts; the counts now."""
        counts = await self._pipelines()
        if self.ran and self.ran[-1].ended_s is None:
            last = self.ran[-1]
            last.ended_s = now
            last.pipelines = {k: v - before.get(k, 0.0) for k, v in counts.items()}
        return counts


def admin_apply(client: httpx.AsyncClient, admin_urls: Sequence[str]) -> Apply:
    """Apply a phase to every WAN line of a stack through the emulators' admin API."""

    async def apply(phase: Phase, previous: Phase | None) -> str | None:
        calls: list[tuple[str, dict[str, Any]]] = []
        if phase.gbps is None:
            calls.append(("/partition", {"cut": True}))
        else:
            if previous is not None and previous.gbps is None:
                calls.append(("/partition", {"cut": False}))
            calls.append(("/rate", {"gbps": phase.gbps}))
        for url in admin_urls:
            for path, body in calls:
                try:
                    (await client.post(f"{url}{path}", json=body)).raise_for_status()
                except httpx.HTTPError as exc:
                    return f"{path} on {url} failed: {exc!r}"
        return None

    return apply


ReadSamples = Callable[[], Awaitable[Samples]]


def router_samples(client: httpx.AsyncClient, router_url: str) -> ReadSamples:
    """The router's ``/metrics``, flattened (empty when it does not answer)."""

    async def read() -> Samples:
        try:
            return flatten((await client.get(f"{router_url}/metrics")).text)
        except httpx.HTTPError:
            return {}

    return read


def router_pipelines(client: httpx.AsyncClient, router_url: str) -> ReadPipelines:
    """The router's requests per pipeline, from its ``/metrics``."""
    samples = router_samples(client, router_url)

    async def read() -> dict[str, float]:
        return by_label(await samples(), "pdd_router_requests_total", "pipeline")

    return read


def link_view(samples: Samples) -> dict[str, float | None]:
    """The router's view of the line in one scrape (``pdd.common.link_estimator``): the
    goodput and backlog it decides on, what a request on the relay adds to a relayed
    first token, the slowest P's prefill rate (None: none measured, the prior holds);
    and this machine's 1-minute load average, which these times depend on."""
    rates = by_label(samples, "pdd_router_prefill_tokens_per_second", "worker")
    goodput = by_label(samples, "pdd_router_link_goodput_bytes_per_second", "link")
    return {
        "goodput_gbps": sum(goodput.values()) * 8 / 1e9,
        "backlog_bytes": sum(by_label(samples, "pdd_router_link_backlog_bytes", "link").values()),
        "relay_slot_s": samples.get("pdd_router_relay_slot_seconds", 0.0),
        "prefill_tokens_per_s": min(rates.values(), default=None),
        "load_1m": os.getloadavg()[0],
    }


@dataclass
class LinkViewSampler:
    """Reads the router's link view every ``interval_s`` until stopped: ``series`` holds
    ``{"t": seconds since the replay began, **link_view}``."""

    read: ReadSamples
    interval_s: float = 0.5
    series: list[dict[str, float | None]] = field(default_factory=list)

    async def run(self, since_start: Callable[[], float], stop: asyncio.Event) -> None:
        while not stop.is_set():
            samples = await self.read()
            if samples:
                self.series.append({"t": round(since_start(), 3), **link_view(samples)})
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.interval_s)


def document(ran: Sequence[PhaseRun]) -> list[dict[str, Any]]:
    """The phases as they ran, for results.json (and what the report reads)."""
    return [asdict(r) for r in ran]


def phase_of(outcome: Outcome, ran: Sequence[dict[str, Any]]) -> int | None:
    """The index of the phase a request was sent in (None: before the first began)."""
    index = None
    for i, r in enumerate(ran):
        if r["began_s"] <= outcome.sent_at:
            index = i
    return index


def phase_summaries(
    outcomes: Sequence[Outcome],
    ran: Sequence[dict[str, Any]],
    agreement: Callable[[Sequence[Outcome]], float | None] | None = None,
) -> list[dict[str, Any]]:
    """Per phase (``document``'s): the link, its span, requests sent, failed, TTFT p50/p99,
    the pipeline mix the router chose, and ``agreement`` of the phase's requests (the
    share of output positions equal to the reference mode's; None: not compared)."""
    groups: list[list[Outcome]] = [[] for _ in ran]
    for o in outcomes:
        i = phase_of(o, ran)
        if i is not None and not o.skipped:
            groups[i].append(o)
    rows = []
    for r, group in zip(ran, groups, strict=True):
        ttft = [o.ttft_s for o in group if o.ok and o.ttft_s is not None]
        counts = r["pipelines"] or {}
        sent = sum(counts.values())
        rows.append(
            {
                "link": Phase(**r["phase"]).describe(),
                "from_s": r["began_s"],
                "to_s": r["ended_s"],
                "requests": len(group),
                "failed": sum(o.error is not None for o in group),
                "failure_reasons": dict(Counter(o.error_reason for o in group if o.error)),
                "ttft_p50_s": percentile(ttft, 50) if ttft else None,
                "ttft_p99_s": percentile(ttft, 99) if ttft else None,
                "pipelines": {k: v / sent for k, v in sorted(counts.items()) if v} if sent else {},
                "agreement": agreement(group) if agreement is not None else None,
                "problem": r["problem"],
            }
        )
    return rows


def phase_table(by_mode: dict[str, list[dict[str, Any]]]) -> str:
    """A Markdown table: one row per phase and mode, phase by phase."""
    lines = [
        "| phase | link | mode | requests | failed | TTFT p50 (s) | TTFT p99 (s) | agreement "
        "| pipelines |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for i in range(max((len(rows) for rows in by_mode.values()), default=0)):
        for mode, rows in by_mode.items():
            if i >= len(rows):
                continue
            row = rows[i]
            end = "end" if row["to_s"] is None else f"{row['to_s']:.0f}"
            mix = " ".join(f"{k}:{v:.2f}" for k, v in row["pipelines"].items()) or "-"
            lines.append(
                f"| {row['from_s']:.0f}-{end} s | {row['link']} | {mode} | {row['requests']} "
                f"| {row['failed']} | {_seconds(row['ttft_p50_s'])} "
                f"| {_seconds(row['ttft_p99_s'])} | {_share(row.get('agreement'))} | {mix} |"
            )
    return "\n".join(lines)


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _share(value: float | None) -> str:
    return "-" if value is None else f"{value:.2%}"
