"""Run one system of a scenario on a workload: chains in, request records and samples out.

Chains are driven as the live replay drives them (``pdd.bench.replay``): each request
goes out ``think_s`` after the previous answer of its chain, and spawned chains
(subagents) start when their parent reaches them. An open-loop workload is one
single-request chain per arrival, started by a feeder so only live chains hold state.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass, field

import simpy

from pdd.local.traces.base import Chain, Trace, TraceRequest
from pdd.router.policy import RequestFeatures
from pdd.simulator.cluster import Cluster, SimRequest
from pdd.simulator.costs import system_cost_per_hour
from pdd.simulator.events import run_until
from pdd.simulator.lifecycle import Proc, RequestRecord, serve
from pdd.simulator.scenario import Scenario, SystemSpec


@dataclass(frozen=True)
class Sample:
    """The system at one instant of the time series."""

    t: float
    relay_utilization: float  # mean active / capacity over relays
    relays_saturated: bool  # every relay at capacity: the router cannot relay
    relay_fallbacks: int  # cumulative decisions that wanted a relay and found none
    wan_busy: float  # share of the last bucket with data on the WAN line
    prefill_queue: float  # mean requests per P
    main_utilization: float


@dataclass
class SystemRun:
    name: str
    spec: SystemSpec
    cost_per_hour: float
    records: list[RequestRecord]
    samples: list[Sample]
    horizon_s: float
    warmup_s: float
    last_arrival_s: float
    score_until_s: float  # arrivals in [warmup_s, score_until_s] are scored
    wan_bytes: float
    wan_gbps: float | None
    extras: dict[str, float] = field(default_factory=dict)


class BlockKeys:
    """Trace hash ids are equal only within a namespace; keys are unique across the trace
    and deterministic (namespace by first appearance), so instance choice is repeatable."""

    def __init__(self) -> None:
        self._namespaces: dict[str, int] = {}

    def __call__(self, r: TraceRequest) -> tuple[int, ...]:
        base = self._namespaces.setdefault(r.namespace, len(self._namespaces)) << 40
        if base == 0:  # the first namespace (the generator's only one) keeps its ids as they are
            return r.hash_ids
        return tuple(map(base.__or__, r.hash_ids))


def _affinity_key(keys: tuple[int, ...], request_key: str) -> int:
    if keys:
        return keys[0]
    return int.from_bytes(hashlib.blake2b(request_key.encode(), digest_size=8).digest(), "little")


#: A process started beside the run (an autoscaler): it sees the cluster and the records.
Controller = Callable[[simpy.Environment, Cluster, list[RequestRecord]], Generator]


def simulate(
    scenario: Scenario,
    name: str,
    trace: Trace[TraceRequest],
    score_until_s: float | None = None,
    controllers: Sequence[Controller] = (),
) -> SystemRun:
    """Run system ``name`` of ``scenario`` on ``trace`` until it drains (or the horizon).

    ``score_until_s`` closes the scoring window (a generator's duration: its sessions
    keep their turns going after it, so the load does not ramp down inside the window);
    by default it is the last arrival. ``controllers`` run as processes beside it."""
    spec = scenario.systems[name]
    env = simpy.Environment()
    block_size = scenario.block_size or trace.block_size
    cluster = Cluster(env, scenario, spec, block_size)
    records: list[RequestRecord] = []
    keys = BlockKeys()
    state = {"last_arrival": 0.0}

    def send(r: TraceRequest) -> Proc:
        k = keys(r)
        features = RequestFeatures(r.input_tokens, r.output_tokens, _affinity_key(k, r.key))
        req = SimRequest(r.key, env.now, k, r.input_tokens, max(1, r.output_tokens), features)
        rec = RequestRecord(req.key, env.now, req.input_tokens, req.output_tokens)
        records.append(rec)
        state["last_arrival"] = env.now
        return serve(cluster, req, rec)

    def run_chain(chain: Chain[TraceRequest], delay: float) -> Proc:
        if delay > 0:
            yield env.timeout(delay)
        start_spawns(chain, -1)
        for i, r in enumerate(chain.requests):
            if i > 0 and r.think_s > 0:
                yield env.timeout(r.think_s)
            yield from send(r)  # in the chain's own process: no process per request
            start_spawns(chain, i)

    def start_spawns(chain: Chain[TraceRequest], index: int) -> None:
        for spawn in chain.spawns:
            if spawn.after == index:
                env.process(run_chain(spawn.chain, spawn.delay_s))

    def feeder() -> Proc:
        for chain in sorted(trace.chains, key=lambda c: c.start_s):
            if chain.start_s > env.now:
                yield env.timeout(chain.start_s - env.now)
            env.process(run_chain(chain, 0.0))

    samples: list[Sample] = []
    horizon = _horizon(trace) + scenario.run.drain_s
    env.process(feeder())
    env.process(_sampler(env, cluster, scenario.run.sample_s, samples))
    for controller in controllers:
        env.process(controller(env, cluster, records))
    with _rare_collections():
        run_until(env, horizon)
    return SystemRun(
        name=name,
        spec=spec,
        cost_per_hour=system_cost_per_hour(scenario, spec),
        records=records,
        samples=samples,
        horizon_s=horizon,
        warmup_s=scenario.run.warmup_s,
        last_arrival_s=state["last_arrival"],
        score_until_s=state["last_arrival"] if score_until_s is None else score_until_s,
        wan_bytes=cluster.wan.bytes_sent if cluster.wan else 0.0,
        wan_gbps=scenario.wan.gbps if cluster.wan else None,
        extras=_instance_extras(cluster),
    )


#: Allocations between young-generation collections while the event loop runs (Python's
#: default is 700).
_YOUNG_THRESHOLD = 50_000


@contextlib.contextmanager
def _rare_collections() -> Iterator[None]:
    """Collect garbage rarely while the event loop runs.

    A run allocates millions of short-lived objects (events, generator frames, decisions)
    and keeps a large, long-lived heap (the trace, the records); with Python's defaults
    the cycle collector ran hundreds of times per simulated minute, re-scanning that heap.
    Freezing what exists before the run takes it out of every scan, and a larger young
    generation collects the cycles the run makes (processes, callbacks) in fewer passes.
    Memory stays bounded: collections still happen, and everything is restored after."""
    thresholds = gc.get_threshold()
    gc.freeze()
    gc.set_threshold(_YOUNG_THRESHOLD, *thresholds[1:])
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)
        gc.unfreeze()


def _horizon(trace: Trace[TraceRequest]) -> float:
    """Latest start plus the longest chain's think time: when the last request could go out
    if every answer were instant; the drain time is added on top."""

    def span(chain: Chain[TraceRequest]) -> float:
        own = sum(r.think_s for r in chain.requests[1:])
        return own + max((s.delay_s + span(s.chain) for s in chain.spawns), default=0.0)

    return max((c.start_s + span(c) for c in trace.chains), default=0.0)


def _sampler(env: simpy.Environment, c: Cluster, every: float, out: list[Sample]) -> Proc:
    busy_before = 0.0
    while True:
        yield env.timeout(every)
        relay_util, saturated = c.sample_relays()
        busy = c.wan.busy_until_now() if c.wan else 0.0
        out.append(
            Sample(
                t=env.now,
                relay_utilization=relay_util,
                relays_saturated=saturated,
                relay_fallbacks=c.relay_fallbacks,
                wan_busy=(busy - busy_before) / every,
                prefill_queue=sum(p.active for p in c.prefill) / len(c.prefill),
                main_utilization=sum(m.utilization for m in c.main) / max(1, len(c.main)),
            )
        )
        busy_before = busy


def _instance_extras(c: Cluster) -> dict[str, float]:
    """Per-pool busy shares and stalls over the run, for the report."""
    out: dict[str, float] = {"relay_fallbacks": float(c.relay_fallbacks)}
    for name, pool in (("relay", c.relay), ("main", c.main)):
        if pool:
            out[f"{name}_stall_s"] = sum(i.stats.stall_s for i in pool)
            out[f"{name}_queue_wait_s"] = sum(i.stats.queue_waits.total_s for i in pool)
            out[f"{name}_tokens"] = sum(i.stats.tokens for i in pool)
    out["prefill_queue_wait_s"] = sum(p.stats.queue_waits.total_s for p in c.prefill)
    now = c.env.now
    out["prefill_busy_share"] = sum(p.stats.busy_s for p in c.prefill) / (now * len(c.prefill))
    return out
