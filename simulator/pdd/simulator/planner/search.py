"""The least-cost search: from a first guess, grow the pool the evaluation blames until
the SLO is met, then shrink the dearest pools while it still is.

The evaluation is a parameter (:class:`Evaluator`): ``pdd plan`` passes the
discrete-event simulation of the deployment (the router's own policy on the calibrated
step model, :mod:`pdd.simulator.planner.simulated`); tests pass a closed form. Each
evaluation is memoized and counted against ``max_probes``, so the search's time is
bounded by the caller, whatever the answer.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from pdd.simulator.planner.load import Slo
from pdd.simulator.planner.pools import Counts, PoolBounds, clamp_all

#: Growth per blamed step: the shortfall's share of the pool, within these bounds, and
#: at least one replica (a P90 twice its target grows the pool by half).
GROWTH = (0.1, 0.5)
#: How far below a passing count the shrink bisects: the first guess and the growth are
#: within this of the answer, and a wider range costs a probe per halving.
SHRINK_RANGE = 0.4


@dataclass(frozen=True)
class Outcome:
    """What one evaluated deployment achieved, and which pool to grow if it failed."""

    ttft_p90_s: float
    itl_p90_s: float
    blame: str | None = None  # the pool whose queue made it miss; None: none to blame
    line_bound: bool = False  # the WAN line was saturated: no replica count fixes that
    facts: dict[str, float] = field(default_factory=dict)  # what the evaluation measured

    def meets(self, slo: Slo) -> bool:
        return self.ttft_p90_s <= slo.ttft_p90_s and self.itl_p90_s <= slo.itl_p90_s

    def shortfall(self, slo: Slo) -> float:
        """How far past its target the worse P90 is (0.5: 50% over; <= 0: met)."""
        return max(self.ttft_p90_s / slo.ttft_p90_s, self.itl_p90_s / slo.itl_p90_s) - 1


Evaluator = Callable[[Mapping[str, int]], Outcome]


@dataclass
class SearchResult:
    counts: dict[str, int]  # the cheapest passing deployment found (or the last tried)
    outcome: Outcome
    feasible: bool
    verdict: str  # why it stopped: met, line-bound, at-max, out-of-probes
    probes: list[tuple[dict[str, int], Outcome]] = field(default_factory=list)


class _Memo:
    """Evaluations by counts, with a budget."""

    def __init__(self, evaluate: Evaluator, max_probes: int) -> None:
        self.evaluate, self.max_probes = evaluate, max_probes
        self.seen: dict[tuple[tuple[str, int], ...], Outcome] = {}
        self.log: list[tuple[dict[str, int], Outcome]] = []

    @property
    def exhausted(self) -> bool:
        return len(self.log) >= self.max_probes

    def __call__(self, counts: dict[str, int]) -> Outcome:
        key = tuple(sorted(counts.items()))
        if key not in self.seen:
            self.seen[key] = self.evaluate(dict(counts))
            self.log.append((dict(counts), self.seen[key]))
        return self.seen[key]


def cheapest(
    evaluate: Evaluator,
    pools: Mapping[str, PoolBounds],
    start: Counts,
    slo: Slo,
    max_probes: int = 12,
) -> SearchResult:
    """The cheapest counts (per ``pools``' prices) that ``evaluate`` says meet ``slo``."""
    memo = _Memo(evaluate, max_probes)
    counts = clamp_all(start, pools)
    grown = _grow(memo, pools, counts, slo)
    if grown is not None:
        return grown
    _shrink(memo, pools, counts, slo)
    return SearchResult(counts, memo(counts), True, "met", memo.log)


def _grow(
    memo: _Memo, pools: Mapping[str, PoolBounds], counts: dict[str, int], slo: Slo
) -> SearchResult | None:
    """Grow ``counts`` in place until it passes (None), or the reason it cannot."""
    while not (outcome := memo(counts)).meets(slo):
        if outcome.line_bound:
            return SearchResult(counts, outcome, False, "line-bound", memo.log)
        name = outcome.blame
        if name is None or counts[name] >= pools[name].max_replicas:
            return SearchResult(counts, outcome, False, "at-max", memo.log)
        if memo.exhausted:
            return SearchResult(counts, outcome, False, "out-of-probes", memo.log)
        share = min(GROWTH[1], max(GROWTH[0], outcome.shortfall(slo) / 2))
        step = max(1, math.ceil(counts[name] * share))
        counts[name] = pools[name].clamp(counts[name] + step)
    return None


def _shrink(memo: _Memo, pools: Mapping[str, PoolBounds], counts: dict[str, int], slo: Slo) -> None:
    """Per pool, dearest replicas first, bisect for the fewest that still pass: between
    the passing count and ``SHRINK_RANGE`` below it, then, if that floor itself passes,
    again below it (the floor is assumed to fail until a probe says so)."""
    order = sorted(pools, key=lambda n: -pools[n].cost_per_hour * counts[n])
    for name in order:
        counts[name] = _fewest(memo, counts, name, pools[name].min_replicas - 1, slo)


def _fewest(memo: _Memo, counts: dict[str, int], name: str, lowest: int, slo: Slo) -> int:
    """The fewest replicas of pool ``name`` that pass, the others as in ``counts``
    (``lowest``: a count known to fail)."""
    passing = counts[name]
    failing = max(lowest, math.floor(passing * (1 - SHRINK_RANGE)))
    known = failing == lowest
    while not memo.exhausted:
        probe = failing if passing - failing <= 1 else (passing + failing) // 2
        if probe == failing and known:
            break
        if memo({**counts, name: probe}).meets(slo):
            passing = probe
            if probe == failing:  # the assumed floor passed: look below it
                failing = max(lowest, math.floor(passing * (1 - SHRINK_RANGE)))
                known = failing == lowest
        else:
            failing, known = probe, True
    return passing
