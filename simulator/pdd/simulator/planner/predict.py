"""Load predictors: the next interval's load from the ones observed so far.

Two, both cheap and explainable: ``LastValue`` (the next interval looks like the last)
and ``LinearTrend`` (a least-squares line through the last few intervals' request rates,
extrapolated one interval ahead and never below zero), which reacts to a ramp an
interval sooner. Only the rate is extrapolated: lengths and hit ratios are the last
interval's (they move slowly and are not additive).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Protocol

from pdd.simulator.planner.load import LoadError, ObservedLoad


class Predictor(Protocol):
    def predict(self, history: Sequence[ObservedLoad]) -> ObservedLoad: ...


def _last(history: Sequence[ObservedLoad]) -> ObservedLoad:
    if not history:
        raise LoadError("no interval observed yet: nothing to predict from")
    return history[-1]


class LastValue:
    """The next interval is the last one."""

    def predict(self, history: Sequence[ObservedLoad]) -> ObservedLoad:
        return _last(history)


class LinearTrend:
    """The rate's least-squares trend over the last ``window`` intervals, one step ahead."""

    def __init__(self, window: int = 4) -> None:
        if window < 2:
            raise LoadError(f"a trend needs a window of at least 2 intervals, got {window}")
        self.window = window

    def predict(self, history: Sequence[ObservedLoad]) -> ObservedLoad:
        last = _last(history)
        rates = [h.rate_rps for h in history[-self.window :]]
        if len(rates) < 2:
            return last
        n = len(rates)
        mean_x, mean_y = (n - 1) / 2, sum(rates) / n
        slope = sum((x - mean_x) * (y - mean_y) for x, y in enumerate(rates)) / sum(
            (x - mean_x) ** 2 for x in range(n)
        )
        ahead = mean_y + slope * (n - mean_x)
        return replace(last, rate_rps=max(0.0, ahead))


PREDICTORS: dict[str, type[LastValue] | type[LinearTrend]] = {
    "last": LastValue,
    "trend": LinearTrend,
}
