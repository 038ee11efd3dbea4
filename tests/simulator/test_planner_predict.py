"""Load predictors: last value and a least-squares trend on the rate."""

from __future__ import annotations

import pytest

from pdd.simulator.planner.load import LoadError, ObservedLoad, Slo
from pdd.simulator.planner.predict import LastValue, LinearTrend

pytestmark = pytest.mark.unit


def at(rate: float, hit: float = 0.9) -> ObservedLoad:
    return ObservedLoad(rate, 1000, 100, hit, hit)


def test_last_value_is_the_last_interval() -> None:
    assert LastValue().predict([at(1), at(5, 0.5)]) == at(5, 0.5)


def test_a_ramp_is_extrapolated_one_interval_ahead() -> None:
    assert LinearTrend(3).predict([at(1), at(2), at(3), at(4)]).rate_rps == pytest.approx(5)


def test_the_trend_keeps_the_last_lengths_and_hits() -> None:
    predicted = LinearTrend().predict([at(4, 0.2), at(2, 0.7)])
    assert predicted.p_hit == 0.7 and predicted.rate_rps == pytest.approx(0.0)


def test_a_falling_trend_stops_at_zero() -> None:
    assert LinearTrend().predict([at(9), at(5), at(1)]).rate_rps == 0.0


def test_nothing_observed_is_an_error() -> None:
    with pytest.raises(LoadError, match="no interval"):
        LastValue().predict([])
    with pytest.raises(LoadError, match="window"):
        LinearTrend(1)


@pytest.mark.parametrize(
    "kw", [{"rate_rps": -1}, {"p_hit": 1.5}, {"relay_share": -0.1}, {"miss_scv": float("nan")}]
)
def test_bad_observations_name_the_field(kw: dict) -> None:
    values = {"rate_rps": 1, "input_tokens_mean": 1, "output_tokens_mean": 1, "p_hit": 0,
              "md_hit": 0, **kw}  # fmt: skip
    with pytest.raises(LoadError, match=next(iter(kw))):
        ObservedLoad(**values)


def test_an_slo_is_positive() -> None:
    with pytest.raises(LoadError):
        Slo(0, 0.1)
