"""``pdd plan`` judges each candidate on a prefix of the scenario's own trace, not on a
shorter trace generated afresh (another random sample, which near a goodput knee can flip
the verdict on the same replica counts: docs/planner.md)."""

from __future__ import annotations

import pytest

from pdd.simulator.generator import GeneratorSpec
from pdd.simulator.planner.capacity_plan import (
    ProbeWindow,
    probe_end_s,
    probe_scenario,
    probe_trace,
)
from pdd.simulator.scenario import load_scenario

pytestmark = pytest.mark.unit


def nominal_times(spec: GeneratorSpec, requests, start: float) -> list[float]:
    out, t = [], start
    for i, r in enumerate(requests):
        t += (r.think_s + spec.expected_answer_s) if i else 0.0
        out.append(t)
    return out


def test_the_probe_keeps_the_scenarios_trace_and_cuts_it_by_the_generators_clock() -> None:
    scenario, _ = load_scenario("published")
    spec = scenario.workload.model_copy(update={"rate_rps": 2.0})
    probe = probe_scenario(scenario, spec, ProbeWindow(warmup_s=60, scored_s=60))
    assert probe.workload == spec  # the same generated sample as the scenario's run
    end = probe_end_s(probe, ProbeWindow(warmup_s=60, scored_s=60))
    assert end == 120
    full = spec.build()
    cut = probe_trace(spec, full, end)
    by_name = {c.name: c for c in full.chains}
    assert 0 < len(cut) < len(full)
    for chain in cut.chains:
        whole = by_name[chain.name].requests
        assert whole[: len(chain.requests)] == chain.requests  # a prefix of the same chain
        times = nominal_times(spec, whole, chain.start_s)
        assert all(t < end for t in times[: len(chain.requests)])
        assert len(chain.requests) == len(whole) or times[len(chain.requests)] >= end


def test_a_recorded_trace_is_probed_whole() -> None:
    scenario, _ = load_scenario("claude-code")
    assert probe_end_s(scenario, ProbeWindow()) is None
