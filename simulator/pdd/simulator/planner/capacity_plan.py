"""``pdd plan``'s work: the cheapest PDD deployment and the cheapest same-datacenter PD
for one workload at one rate and SLO, each found by simulation.

Per system: describe the workload (lengths, ideal hit), size it with the capacity model,
simulate that once to measure what the model guessed (P's and MD's hit, the relay
share), size again on those facts, and hand that start to the least-cost search with
the simulation as its judge. The two systems are independent, so they run side by side.
"""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

from pdd.local.traces.base import Trace, TraceRequest, ideal_hit_ratios
from pdd.simulator.generator import GeneratorSpec
from pdd.simulator.planner.capacity import LINE_UTILIZATION, size
from pdd.simulator.planner.deployment import deployment_model
from pdd.simulator.planner.load import ObservedLoad, Slo
from pdd.simulator.planner.pools import PoolBounds, clamp_all, cost_per_hour
from pdd.simulator.planner.search import Outcome, SearchResult, cheapest
from pdd.simulator.planner.simulated import SimulatedEvaluator, observed
from pdd.simulator.scenario import Scenario, SystemKind
from pdd.simulator.workload import WorkloadSpec, describe, offered_rate


@dataclass(frozen=True)
class ProbeWindow:
    """How long each simulated probe runs: a warm-up for the caches (None: the
    scenario's ``run.warmup_s``), then the scored window. Shorter probes answer sooner
    and see fewer bursts."""

    warmup_s: float | None = None
    scored_s: float = 180.0
    drain_s: float = 120.0
    max_probes: int = 10


@dataclass
class SystemPlan:
    system: str
    kind: str
    counts: dict[str, int]
    cost_per_hour: float
    outcome: Outcome
    feasible: bool
    verdict: str
    line_gbps_needed: float | None  # None for same-datacenter PD
    probes: list[tuple[dict[str, int], Outcome]]

    def as_json(self) -> dict:
        return {
            "system": self.system,
            "kind": self.kind,
            "replicas": self.counts,
            "cost_per_hour": self.cost_per_hour,
            "ttft_p90_s": self.outcome.ttft_p90_s,
            "itl_p90_s": self.outcome.itl_p90_s,
            "feasible": self.feasible,
            "verdict": self.verdict,
            "line_gbps_needed": self.line_gbps_needed,
            "facts": self.outcome.facts,
            "probes": [
                {"replicas": c, "ttft_p90_s": o.ttft_p90_s, "itl_p90_s": o.itl_p90_s}
                for c, o in self.probes
            ],
        }


def probe_scenario(scenario: Scenario, workload: WorkloadSpec, window: ProbeWindow) -> Scenario:
    """``scenario`` with ``workload`` and the probe window's warm-up and drain (the trace is
    cut to the window by ``probe_trace``, not by generating a shorter one)."""
    warmup = scenario.run.warmup_s if window.warmup_s is None else window.warmup_s
    run = scenario.run.model_copy(update={"warmup_s": warmup, "drain_s": window.drain_s})
    return scenario.model_copy(update={"workload": workload, "run": run})


def probe_end_s(scenario: Scenario, window: ProbeWindow) -> float | None:
    """Where a generated workload's probe stops scoring (None: a recorded trace's end)."""
    if not isinstance(scenario.workload, GeneratorSpec):
        return None
    return min(scenario.workload.duration_s, scenario.run.warmup_s + window.scored_s)


def probe_trace(
    workload: WorkloadSpec, trace: Trace[TraceRequest], end_s: float | None
) -> Trace[TraceRequest]:
    """A generated trace's turns that go out before ``end_s`` by the generator's own clock
    (each a think time and the expected answer after the last): a prefix of the very trace
    the scenario runs. Generating a shorter trace instead draws another sample (the
    generator's random stream depends on its duration), and near a goodput knee another
    sample can flip the verdict on the same replica counts (docs/planner.md)."""
    if end_s is None or not isinstance(workload, GeneratorSpec):
        return trace
    chains = []
    for chain in trace.chains:
        t, kept = chain.start_s, []
        for i, request in enumerate(chain.requests):
            t += (request.think_s + workload.expected_answer_s) if i else 0.0
            if t >= end_s:
                break
            kept.append(request)
        if kept:
            chains.append(replace(chain, requests=tuple(kept), spawns=()))
    return replace(trace, chains=tuple(chains))


def plan_system(
    scenario: Scenario,
    system: str,
    bounds: Mapping[str, PoolBounds],
    slo: Slo,
    base_dir: Path | None,
    window: ProbeWindow,
) -> SystemPlan:
    """The cheapest replica counts of ``system`` meeting ``slo`` on the scenario's workload."""
    until = probe_end_s(scenario, window)
    trace = probe_trace(scenario.workload, scenario.workload.build(base_dir), until)
    evaluate = SimulatedEvaluator(scenario, system, trace, slo, until)
    model = deployment_model(scenario, system)
    guess = first_guess(trace, offered_rps(scenario.workload, trace))
    start = _sized(size(model, guess, slo), bounds)
    first = evaluate(start)
    guessed, start = start, _sized(size(model, observed(first.facts, guess), slo), bounds)
    result = cheapest(evaluate, bounds, start, slo, window.max_probes)
    spec = scenario.systems[system]
    line = scenario.wan.price_per_hour if spec.uses_wan else 0.0
    return SystemPlan(
        system=system,
        kind=spec.kind.value,
        counts=result.counts,
        cost_per_hour=cost_per_hour(result.counts, bounds, line),
        outcome=result.outcome,
        feasible=result.feasible,
        verdict=result.verdict,
        line_gbps_needed=_line_needed(result, scenario) if spec.uses_wan else None,
        probes=[(guessed, first), *result.probes],
    )


def first_guess(trace: Trace[TraceRequest], rate_rps: float) -> ObservedLoad:
    """The workload as the capacity model reads it, before anything is simulated: its
    ideal (infinite-cache) hit at both P and MD, and the policy's relay share unknown (a
    twentieth: the published figure's order)."""
    d = describe(trace)
    hit = float(d["ideal_mean_hit"] or 0.0)
    hits = ideal_hit_ratios(trace)
    misses = [r.input_tokens * (1 - hits[r.key]) for r in trace.walk()]
    return ObservedLoad(
        rate_rps=rate_rps,
        input_tokens_mean=float(d["input_tokens_mean"] or 0.0),
        output_tokens_mean=float(d["output_tokens_mean"] or 0.0),
        p_hit=hit,
        md_hit=hit,
        relay_share=0.05,
        miss_scv=squared_cv(misses),
    )


def squared_cv(values: list[float]) -> float:
    """Variance over the squared mean (1 for an exponential; 1 when undefined)."""
    if len(values) < 2:
        return 1.0
    mean = sum(values) / len(values)
    if mean <= 0:
        return 1.0
    return sum((v - mean) ** 2 for v in values) / len(values) / mean**2


def offered_rps(workload: WorkloadSpec, trace: Trace[TraceRequest]) -> float:
    """The generator's rate, or a recorded trace's requests over its span of starts."""
    if isinstance(workload, GeneratorSpec):
        return workload.rate_rps
    return offered_rate(trace) or 0.0


def _sized(counts: Mapping[str, int | None], bounds: Mapping[str, PoolBounds]) -> dict[str, int]:
    """The capacity model's counts within bounds (a pool it cannot size: its maximum)."""
    return clamp_all(
        {n: (bounds[n].max_replicas if c is None else c) for n, c in counts.items()}, bounds
    )


def _line_needed(result: SearchResult, scenario: Scenario) -> float:
    """The line rate that would carry what the chosen deployment sent at the sized share."""
    return result.outcome.facts.get("wan_utilization", 0.0) * scenario.wan.gbps / LINE_UTILIZATION


def plan_both(
    scenario: Scenario,
    systems: Mapping[str, Mapping[str, PoolBounds]],
    slo: Slo,
    base_dir: Path | None,
    window: ProbeWindow,
    jobs: int = 2,
) -> list[SystemPlan]:
    """``plan_system`` for each named system, ``jobs`` at a time in worker processes."""
    if jobs <= 1 or len(systems) == 1:
        return [plan_system(scenario, n, b, slo, base_dir, window) for n, b in systems.items()]
    with ProcessPoolExecutor(min(jobs, len(systems))) as pool:
        futures = [
            pool.submit(plan_system, scenario, n, b, slo, base_dir, window)
            for n, b in systems.items()
        ]
        return [f.result() for f in futures]


def pdd_and_same_dc(scenario: Scenario) -> tuple[str, str]:
    """The scenario's PDD system and its same-datacenter PD system, by kind."""

    def first(kind: SystemKind) -> str:
        for name, spec in scenario.systems.items():
            if spec.kind == kind:
                return name
        raise ValueError(f"scenario {scenario.name!r} has no {kind.value} system to plan")

    return first(SystemKind.PDD), first(SystemKind.SAME_DC)
