"""What the stack itself counts, read around a replay: Prometheus counters of the router
and workers, and the WAN link emulators' byte counters (sampled over time too).

The bench reports differences of these counters (after minus before), so a stack that
served other traffic earlier still gives per-run figures.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

Samples = dict[str, float]


def flatten(text: str) -> Samples:
    """Prometheus text -> ``{'name{label="v"}': value}`` (bare name without labels)."""
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def delta(before: Samples, after: Samples) -> Samples:
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


def summed(per_worker: dict[str, Samples]) -> Samples:
    """Every worker's samples added up."""
    out: Samples = {}
    for samples in per_worker.values():
        for k, v in samples.items():
            out[k] = out.get(k, 0.0) + v
    return out


def total(samples: Samples, name: str, **labels: str) -> float:
    """Sum of every sample called ``name`` whose labels include ``labels``."""
    want = [f'{k}="{v}"' for k, v in labels.items()]
    result = 0.0
    for key, value in samples.items():
        base, _, rest = key.partition("{")
        if base == name and all(w in rest for w in want):
            result += value
    return result


def by_label(samples: Samples, name: str, label: str) -> dict[str, float]:
    """``name``'s samples summed per value of one label."""
    out: dict[str, float] = {}
    for key, value in samples.items():
        base, _, rest = key.partition("{")
        if base != name:
            continue
        for part in rest.rstrip("}").split(","):
            k, _, v = part.partition("=")
            if k == label:
                out[v.strip('"')] = out.get(v.strip('"'), 0.0) + value
    return out


@dataclass(frozen=True)
class Probes:
    """Where to read counters: the router's and workers' /metrics, the links' /stats."""

    router_url: str | None = None
    worker_urls: tuple[str, ...] = ()
    link_admin_urls: tuple[str, ...] = ()

    async def metrics(
        self, client: httpx.AsyncClient, last: dict[str, Samples] | None = None
    ) -> tuple[Samples, dict[str, Samples]]:
        """(router samples, each answering worker's samples by URL). A worker that no
        longer answers (stopped by a scale-down) keeps its reading from ``last``, so the
        difference over a run never goes negative; what it did after that is not counted."""
        router: Samples = {}
        if self.router_url:
            router = flatten((await client.get(f"{self.router_url}/metrics")).text)
        workers = dict(last or {})
        answers = await asyncio.gather(
            *(client.get(f"{u}/metrics") for u in self.worker_urls), return_exceptions=True
        )
        for url, answer in zip(self.worker_urls, answers, strict=True):
            if isinstance(answer, httpx.Response):
                workers[url] = flatten(answer.text)
            elif not isinstance(answer, httpx.TransportError):
                raise answer
        return router, workers

    async def wan_bytes(self, client: httpx.AsyncClient) -> int | None:
        """Bytes that crossed every emulated WAN line, both directions; None without links."""
        if not self.link_admin_urls:
            return None
        stats = await asyncio.gather(*(client.get(f"{u}/stats") for u in self.link_admin_urls))
        return sum(_link_bytes(s.json()) for s in stats)


def _link_bytes(stats: dict) -> int:
    return int(stats["forward"]["bytes"]) + int(stats["reverse"]["bytes"])


@dataclass
class WanSampler:
    """Polls the links' byte counters every ``interval_s`` until stopped: (t, bytes)."""

    probes: Probes
    interval_s: float = 0.5
    series: list[tuple[float, int]] = field(default_factory=list)

    async def run(self, client: httpx.AsyncClient, stop: asyncio.Event) -> None:
        t0 = time.monotonic()
        while not stop.is_set():
            value = await self.probes.wan_bytes(client)
            if value is None:
                return
            self.series.append((time.monotonic() - t0, value))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.interval_s)


def throughput_mbps(series: Iterable[tuple[float, int]]) -> list[tuple[float, float]]:
    """Cumulative byte samples -> (t, Mbit/s over the preceding interval)."""
    points = list(series)
    return [
        (t1, (b1 - b0) * 8 / 1e6 / (t1 - t0))
        for (t0, b0), (t1, b1) in itertools.pairwise(points)
        if t1 > t0
    ]
