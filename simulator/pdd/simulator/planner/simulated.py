"""The planner's evaluation by discrete-event simulation: one system of a scenario with
the candidate replica counts, on a fixed trace, through the router's own policy and the
calibrated step model (:func:`pdd.simulator.runner.simulate`).

It reports the client-side TTFT P90 (queue time and refusals included: a request never
answered counts until the horizon) and the P90 of the requests' mean inter-token
latency, blames the pool whose queue cost the most, and says when the line was the
limit. It also measures what the capacity model takes as input (hits, relay share), so
the first guess can be redone on the simulated facts.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from pdd.common.vocabulary import Pipeline
from pdd.local.traces.base import Trace, TraceRequest
from pdd.simulator.metrics import scored, summarize, ttft_bounded
from pdd.simulator.planner.deployment import with_counts
from pdd.simulator.planner.load import ObservedLoad, Slo
from pdd.simulator.planner.search import Outcome
from pdd.simulator.runner import SystemRun, simulate
from pdd.simulator.scenario import Scenario, SystemKind
from pdd.simulator.stats import percentile

#: Line busy above this share of the scored window: transfers queue on it, and more
#: replicas cannot shorten them.
LINE_BOUND_UTILIZATION = 0.9
#: The relays are blamed only when no queue waits this share of the TTFT target per
#: request and they were all full this share of the time: full relays are otherwise a
#: symptom (P's queue stretches every request's trip), not the cause.
RELAY_BLAME_WAIT_SHARE = 0.1
RELAY_BLAME_OVERLOAD = 0.1


class SimulatedEvaluator:
    """``evaluate(counts)`` for :func:`pdd.simulator.planner.search.cheapest`."""

    def __init__(
        self,
        scenario: Scenario,
        system: str,
        trace: Trace[TraceRequest],
        slo: Slo,
        score_until_s: float | None = None,
    ) -> None:
        self.scenario, self.system, self.trace, self.slo = scenario, system, trace, slo
        self.score_until_s = score_until_s

    def __call__(self, counts: Mapping[str, int]) -> Outcome:
        spec = with_counts(self.scenario.systems[self.system], counts)
        scenario = self.scenario.model_copy(update={"systems": {self.system: spec}})
        run = simulate(scenario, self.system, self.trace, self.score_until_s)
        return judge(run, scenario, self.slo)


def judge(run: SystemRun, scenario: Scenario, slo: Slo) -> Outcome:
    """The run's P90s against ``slo``; on a miss, the pool to grow or the line."""
    rs = scored(run)
    ttft = percentile([ttft_bounded(r, run.horizon_s) for r in rs], 90) or 0.0
    finished = [r for r in rs if not math.isnan(r.finish) and r.output_tokens > 1]
    itl = percentile([r.tpot for r in finished], 90) or 0.0
    figures = summarize(run, scenario.slo, scenario.billing)
    facts = _facts(run, figures, len(rs))
    outcome = Outcome(ttft, itl, facts=facts)
    if outcome.meets(slo):
        return outcome
    decode = "decode" if run.spec.kind == SystemKind.SAME_DC else "main"
    if itl > slo.itl_p90_s:
        return Outcome(ttft, itl, decode, facts=facts)
    if figures["wan_utilization"] > LINE_BOUND_UTILIZATION:
        return Outcome(ttft, itl, None, line_bound=True, facts=facts)
    return Outcome(ttft, itl, _blame_ttft(facts, decode, slo), facts=facts)


def _blame_ttft(facts: Mapping[str, float], decode: str, slo: Slo) -> str:
    """The pool whose queue held the scored requests longest, per request; the relays
    when neither queue matters and they were full (the router could not relay)."""
    waits = {"prefill": facts["prefill_wait_s"], decode: facts["decode_wait_s"]}
    worst = max(waits, key=lambda k: waits[k])
    quiet = waits[worst] < RELAY_BLAME_WAIT_SHARE * slo.ttft_p90_s
    if quiet and facts.get("relay_overload_share", 0.0) > RELAY_BLAME_OVERLOAD:
        return "relay"
    return worst


def _facts(run: SystemRun, figures: dict, requests: int) -> dict[str, float]:
    """Per-request queue waits, hits, relay share and line use: what the planner reads
    from a live deployment's metrics, read here from the simulation."""
    extras, n = run.extras, max(1, len(run.records))
    pipelines = figures["pipelines"]
    relayed = pipelines.get(Pipeline.P_RLD_MD.value, 0) + pipelines.get(Pipeline.P_RLD.value, 0)
    facts = {
        "prefill_wait_s": extras.get("prefill_queue_wait_s", 0.0) / n,
        "decode_wait_s": extras.get("main_queue_wait_s", 0.0) / n,
        "p_hit": figures["p_hit_ratio"],
        "md_hit": figures["md_hit_ratio"],
        "relay_share": relayed / max(1, requests),
        "wan_utilization": figures["wan_utilization"],
        "attainment": figures["slo_attainment"],
    }
    if run.spec.kind == SystemKind.PDD:
        facts["relay_overload_share"] = figures["relay_overload_share"]
    return facts


def observed(facts: Mapping[str, float], load: ObservedLoad) -> ObservedLoad:
    """``load`` with the hits and relay share a simulation measured."""
    return ObservedLoad(
        load.rate_rps,
        load.input_tokens_mean,
        load.output_tokens_mean,
        p_hit=facts["p_hit"],
        md_hit=facts["md_hit"],
        relay_share=facts["relay_share"],
        miss_scv=load.miss_scv,
    )
