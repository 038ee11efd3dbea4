"""The simulated day: a diurnal, bursty load on one PDD deployment, three ways to size
it, one run each, scored per 5-minute window.

* **planner**: every tier autoscaled by :class:`pdd.simulator.planner.planner.Planner`
  (the operator's code), its replicas damped as an HPA damps them
  (:class:`~pdd.simulator.planner.stabilize.Stabilizer`), new replicas live after a
  start-up delay, removed ones drained (the router stops choosing them; they finish
  what they hold);
* **static**: every pool fixed at the most replicas the planner ran at any time (the
  peak, provisioned all day);
* **rld-hpa**: today's deployment: P and MD fixed as static, RLD scaled by an HPA on
  the relays' mean load (``targetLoad``, operator/builders/hpa.py).

The load: sessions of the published agentic generator, started at a rate that follows a
cosine day (trough at 04:00, peak ``ratio`` times higher at 16:00) plus bursts of new
conversations (the session start rate multiplied for a few minutes: a rush of cold
first turns on P and the line). Built by thinning one generated trace, so hash ids stay
unique.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Generator, Mapping, Sequence
from dataclasses import dataclass, field, replace

import simpy

from pdd.local.traces.base import Trace, TraceRequest
from pdd.simulator.cluster import Cluster
from pdd.simulator.generator import GeneratorSpec
from pdd.simulator.lifecycle import RequestRecord
from pdd.simulator.planner.deployment import with_counts
from pdd.simulator.planner.load import Slo
from pdd.simulator.planner.observe import client_ttft, observe
from pdd.simulator.planner.planner import Planner
from pdd.simulator.planner.stabilize import Stabilizer
from pdd.simulator.runner import Controller, simulate
from pdd.simulator.scenario import Scenario
from pdd.simulator.stats import percentile

DAY_S = 86400.0
WINDOW_S = 300.0


@dataclass(frozen=True)
class Burst:
    at_h: float  # hour of the day it starts
    minutes: float
    factor: float  # session start rate multiplier while it lasts


@dataclass(frozen=True)
class DayShape:
    """The day's session start rate, relative to the peak (at most 1)."""

    ratio: float = 5.0  # peak over trough
    peak_h: float = 16.0
    bursts: tuple[Burst, ...] = (Burst(7.0, 10, 3.0), Burst(11.0, 5, 1.5), Burst(21.0, 10, 2.0))

    def level(self, t: float) -> float:
        trough = 1 / self.ratio
        phase = 2 * math.pi * ((t / 3600 - self.peak_h) % 24) / 24
        base = trough + (1 - trough) * (1 + math.cos(phase)) / 2
        for b in self.bursts:
            if b.at_h * 3600 <= t % DAY_S < b.at_h * 3600 + b.minutes * 60:
                base *= b.factor
        return min(1.0, base)


def day_trace(
    spec: GeneratorSpec, shape: DayShape, duration_s: float = DAY_S, seed: int = 1
) -> Trace[TraceRequest]:
    """``spec`` (at the peak rate) over ``duration_s``, with each session kept with
    probability ``shape.level`` at its start."""
    full = spec.model_copy(update={"duration_s": duration_s}).build()
    rng = random.Random(seed)
    kept = tuple(c for c in full.chains if rng.random() < shape.level(c.start_s))
    return replace(full, chains=kept)


@dataclass
class Autoscaler:
    """A controller: every ``interval_s``, desired replicas per pool from ``decide``,
    damped, then applied (adds live after ``startup_s``, removals drain at once).
    It also integrates the GPU-hours of every instance that costs money: live,
    starting, or retired and still finishing its requests."""

    decide: Callable[[Cluster, Sequence[RequestRecord], float], Mapping[str, int]]
    interval_s: float = 60.0
    startup_s: float = 120.0
    stabilize_s: float = 300.0
    gpu_hours: float = 0.0
    cost: float = 0.0
    timeline: list[dict] = field(default_factory=list)

    def __call__(self, env: simpy.Environment, c: Cluster, records: list) -> Generator:
        stabilizers: dict[str, Stabilizer] = {}
        starting: dict[str, int] = {}
        while True:
            yield env.timeout(self.interval_s)
            self._bill(c, starting)
            desired = self.decide(c, records, env.now)
            for name, want in desired.items():
                stab = stabilizers.setdefault(name, Stabilizer(self.stabilize_s))
                self._apply(env, c, name, stab(env.now, want), starting)
            self.timeline.append({"t": env.now, **{n: len(c.pool(n)) for n in desired}})

    def _apply(
        self, env: simpy.Environment, c: Cluster, name: str, target: int, starting: dict
    ) -> None:
        pending = starting.get(name, 0)
        if target > len(c.pool(name)) + pending:
            for _ in range(target - len(c.pool(name)) - pending):
                starting[name] = starting.get(name, 0) + 1
                env.process(self._start(env, c, name, starting))
        else:
            cancel = min(pending, len(c.pool(name)) + pending - target)
            starting[name] = pending - cancel
            for _ in range(len(c.pool(name)) + starting[name] - target):
                c.retire_instance(name)

    def _start(self, env: simpy.Environment, c: Cluster, name: str, starting: dict) -> Generator:
        yield env.timeout(self.startup_s)
        if starting.get(name, 0) > 0:  # not cancelled by a scale-down meanwhile
            starting[name] -= 1
            c.add_instance(name)

    def _bill(self, c: Cluster, starting: Mapping[str, int]) -> None:
        hours = self.interval_s / 3600
        for name, pool in c.spec.pools().items():
            price = pool.gpus_per_instance * c.scenario.gpus[pool.gpu].price_per_hour
            n = len(c.pool(name)) + starting.get(name, 0) + c.draining(name)
            self.gpu_hours += n * pool.gpus_per_instance * hours
            self.cost += n * price * hours
        if c.wan is not None:
            self.cost += c.scenario.wan.price_per_hour * hours


def planner_decide(planner: Planner, interval_s: float):
    """The planner's replicas from the last interval's observation."""

    def decide(c: Cluster, records: Sequence[RequestRecord], now: float) -> Mapping[str, int]:
        return planner.observe(observe(c, records, now, interval_s)).replicas

    return decide


def fixed(counts: Mapping[str, int]):
    """No scaling: the counts it started with (for billing through the same path)."""
    return lambda c, records, now: dict(counts)


def relay_hpa(counts: Mapping[str, int], target_load: float, max_relays: int):
    """Today's: P and MD fixed, RLD = ceil(relays x mean relay load / target), as the HPA
    computes it from ``pdd_relay_load``."""

    def decide(c: Cluster, records: Sequence[RequestRecord], now: float) -> Mapping[str, int]:
        load = sum(r.utilization for r in c.relay) / len(c.relay)
        relays = max(1, min(max_relays, math.ceil(len(c.relay) * load / target_load)))
        return {**counts, "relay": relays}

    return decide


def run_one(
    scenario: Scenario,
    system: str,
    counts: Mapping[str, int],
    trace: Trace[TraceRequest],
    scaler: Autoscaler,
) -> tuple[list[RequestRecord], Autoscaler]:
    spec = with_counts(scenario.systems[system], counts)
    sc = scenario.model_copy(update={"systems": {system: spec}})
    controllers: list[Controller] = [scaler]
    run = simulate(sc, system, trace, DAY_S, controllers)
    return run.records, scaler


def windows(records: Sequence[RequestRecord], slo: Slo, horizon: float) -> list[dict]:
    """Per 5-minute window of arrivals: requests, client TTFT P90, ITL P90, met or not."""
    by: dict[int, list[RequestRecord]] = {}
    for r in records:
        if r.arrival < DAY_S:
            by.setdefault(int(r.arrival // WINDOW_S), []).append(r)
    out = []
    for w in sorted(by):
        rs = by[w]
        ttft = percentile([client_ttft(r, horizon) for r in rs], 90) or 0.0
        done = [r.tpot for r in rs if not math.isnan(r.finish) and r.output_tokens > 1]
        itl = percentile(done, 90) or 0.0
        met = ttft <= slo.ttft_p90_s and itl <= slo.itl_p90_s
        out.append({"t": w * WINDOW_S, "requests": len(rs), "ttft_p90_s": ttft,
                    "itl_p90_s": itl, "met": met})  # fmt: skip
    return out
