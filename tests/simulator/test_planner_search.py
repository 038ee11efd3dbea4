"""The least-cost search, judged by a closed form instead of a simulation."""

from __future__ import annotations

from collections.abc import Mapping

import pytest

from pdd.simulator.planner.load import Slo
from pdd.simulator.planner.pools import PoolBounds, cost_per_hour
from pdd.simulator.planner.search import Outcome, cheapest

pytestmark = pytest.mark.unit

SLO = Slo(1.0, 1.0)
POOLS = {"prefill": PoolBounds("A", 2.0, 1, 64), "main": PoolBounds("B", 2.5, 1, 64)}


def needs(p: int, md: int, line_bound: bool = False):
    """Meets the SLO exactly when prefill >= p and main >= md; blames the short pool."""

    def evaluate(counts: Mapping[str, int]) -> Outcome:
        ttft = p / counts["prefill"]
        itl = md / counts["main"]
        blame = "main" if itl > 1 else "prefill"
        return Outcome(ttft, itl, blame, line_bound=line_bound and ttft > 1)

    return evaluate


@pytest.mark.parametrize("start", [{"prefill": 3, "main": 3}, {"prefill": 30, "main": 40}])
def test_it_finds_the_fewest_replicas_from_below_or_above(start: dict) -> None:
    result = cheapest(needs(20, 25), POOLS, start, SLO, max_probes=40)
    assert result.feasible and result.verdict == "met"
    assert result.counts == {"prefill": 20, "main": 25}


def test_the_probe_budget_bounds_the_evaluations() -> None:
    calls = []

    def counting(counts: Mapping[str, int]) -> Outcome:
        calls.append(dict(counts))
        return needs(60, 60)(counts)

    result = cheapest(counting, POOLS, {"prefill": 1, "main": 1}, SLO, max_probes=5)
    assert len(calls) == 5 and not result.feasible and result.verdict == "out-of-probes"


def test_a_saturated_line_is_reported_not_grown_into() -> None:
    result = cheapest(needs(20, 5, line_bound=True), POOLS, {"prefill": 4, "main": 5}, SLO)
    assert result.verdict == "line-bound" and result.counts["prefill"] == 4


def test_a_pool_at_its_maximum_is_infeasible() -> None:
    small = {**POOLS, "prefill": PoolBounds("A", 2.0, 1, 8)}
    result = cheapest(needs(20, 5), small, {"prefill": 4, "main": 5}, SLO, max_probes=40)
    assert not result.feasible and result.verdict == "at-max" and result.counts["prefill"] == 8


def test_minimums_hold_even_when_fewer_would_do() -> None:
    floor = {**POOLS, "main": PoolBounds("B", 2.5, 6, 64)}
    result = cheapest(needs(2, 1), floor, {"prefill": 4, "main": 8}, SLO, max_probes=40)
    assert result.counts == {"prefill": 2, "main": 6}


def test_cost_adds_each_pool_at_its_price_plus_the_line() -> None:
    assert cost_per_hour({"prefill": 3, "main": 2}, POOLS, 0.64) == pytest.approx(11.64)


def test_bounds_are_checked() -> None:
    with pytest.raises(ValueError, match="minReplicas"):
        PoolBounds("A", 1.0, 5, 2)
