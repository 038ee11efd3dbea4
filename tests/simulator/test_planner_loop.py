"""The planner loop: prediction, sizing, feedback from measured P90s, the line verdict."""

from __future__ import annotations

import pytest

from pdd.simulator.hardware import InstanceShape
from pdd.simulator.planner.capacity import DeploymentModel, PoolModel, size
from pdd.simulator.planner.load import ObservedLoad, Slo
from pdd.simulator.planner.planner import HEADROOM, QUEUED, Planner, line_is_bottleneck
from pdd.simulator.planner.pools import PoolBounds
from pdd.simulator.planner.predict import LinearTrend

pytestmark = pytest.mark.unit

SLO = Slo(5.0, 0.08)


@pytest.fixture
def deployment(shape: InstanceShape) -> DeploymentModel:
    pools = {name: PoolModel(shape, 48, 8192) for name in ("prefill", "relay", "main")}
    return DeploymentModel(pools, 51200, 100.0, 0.03, 2.0)


@pytest.fixture
def planner(deployment: DeploymentModel) -> Planner:
    bounds = {n: PoolBounds("A", 2.0, 1, 200) for n in ("prefill", "relay", "main")}
    return Planner(deployment, bounds, SLO)


def seen(rate: float = 20.0, **kw: float) -> ObservedLoad:
    values = {"input_tokens_mean": 30000.0, "output_tokens_mean": 1000.0, "p_hit": 0.9,
              "md_hit": 0.9, "relay_share": 0.05, "ttft_p90_s": 1.0, "itl_p90_s": 0.03,
              "wan_gbps": 100.0, **kw}  # fmt: skip
    return ObservedLoad(rate, **values)


def test_within_the_slo_it_asks_for_what_the_capacity_model_sizes(
    planner: Planner, deployment: DeploymentModel
) -> None:
    decision = planner.observe(seen(ttft_p90_s=3.0, itl_p90_s=0.06))
    assert decision.replicas == size(deployment, seen(), SLO)
    assert not decision.line_bound


def test_more_load_asks_for_more_of_every_loaded_pool(planner: Planner) -> None:
    low = planner.observe(seen(10, ttft_p90_s=3.0)).replicas
    high = planner.observe(seen(40, ttft_p90_s=3.0)).replicas
    assert high["prefill"] > low["prefill"] and high["main"] > low["main"]


def test_a_ttft_miss_with_p_queued_grows_p_only(planner: Planner) -> None:
    base = planner.observe(seen(ttft_p90_s=3.0)).replicas
    missed = planner.observe(seen(ttft_p90_s=10.0, prefill_queue_p90_s=4.0)).replicas
    assert missed["prefill"] > base["prefill"] and missed["main"] == base["main"]


def test_a_ttft_miss_with_md_queued_longer_grows_md_only(planner: Planner) -> None:
    base = planner.observe(seen(ttft_p90_s=3.0)).replicas
    queued = seen(ttft_p90_s=10.0, prefill_queue_p90_s=1.0, main_queue_p90_s=4.0)
    missed = planner.observe(queued).replicas
    assert missed["main"] > base["main"] and missed["prefill"] == base["prefill"]


def test_a_ttft_miss_with_nothing_queued_blames_no_pool(planner: Planner) -> None:
    """Queue times under ``QUEUED`` of the target (or none measured) cannot explain a
    miss: it is the line, a handoff or the machine, and no pool's headroom grows (before,
    a tie of two empty queues went to P)."""
    base = planner.observe(seen(ttft_p90_s=3.0)).replicas
    short = 0.9 * QUEUED * SLO.ttft_p90_s
    for queues in ({}, {"prefill_queue_p90_s": short, "main_queue_p90_s": 0.0}):
        assert planner.observe(seen(ttft_p90_s=10.0, **queues)).replicas == base
    assert planner.headroom == {"prefill": 1.0, "relay": 1.0, "main": 1.0}


def test_headroom_decays_in_intervals_that_met_the_slo_not_only_comfortable_ones(
    planner: Planner,
) -> None:
    """A pool grown by a burst comes back to its sizing while the P90s sit within their
    targets, even above half of them: on a sizing of 1 any headroom >= 1.05 is 2."""
    base = planner.observe(seen(1.0, ttft_p90_s=3.0)).replicas
    assert base["prefill"] == 1
    planner.observe(seen(1.0, ttft_p90_s=10.0, prefill_queue_p90_s=4.0))
    assert planner.observe(seen(1.0, ttft_p90_s=3.0)).replicas["prefill"] == 2
    met = seen(1.0, ttft_p90_s=0.9 * SLO.ttft_p90_s, itl_p90_s=0.9 * SLO.itl_p90_s)
    for _ in range(30):  # x1.5 decays by 0.9 an interval: within the snap after 22
        after = planner.observe(met).replicas
    assert after == base and planner.headroom["prefill"] == 1.0


def test_an_itl_miss_grows_md(planner: Planner) -> None:
    base = planner.observe(seen(ttft_p90_s=3.0)).replicas
    missed = planner.observe(seen(ttft_p90_s=3.0, itl_p90_s=0.12)).replicas
    assert missed["main"] > base["main"] and missed["prefill"] == base["prefill"]


def test_headroom_decays_back_when_comfortable_and_stays_bounded(planner: Planner) -> None:
    for _ in range(20):
        planner.observe(seen(ttft_p90_s=50.0, prefill_queue_p90_s=9.0))
    assert planner.headroom["prefill"] == HEADROOM[1]
    for _ in range(60):
        planner.observe(seen(ttft_p90_s=0.5))
    assert planner.headroom["prefill"] == pytest.approx(1.0, abs=0.01)


def test_a_saturated_line_is_the_verdict_and_no_pool_is_blamed(
    planner: Planner, deployment: DeploymentModel
) -> None:
    starved = seen(md_hit=0.0, wan_gbps=10.0, ttft_p90_s=30.0, prefill_queue_p90_s=5.0)
    assert line_is_bottleneck(deployment, starved)
    decision = planner.observe(starved)
    assert decision.line_bound and planner.headroom["prefill"] == 1.0
    assert not line_is_bottleneck(deployment, seen(wan_gbps=float("nan")))


def test_a_trend_predictor_sizes_ahead_of_a_ramp(deployment: DeploymentModel) -> None:
    bounds = {n: PoolBounds("A", 2.0, 1, 200) for n in ("prefill", "relay", "main")}
    trend = Planner(deployment, bounds, SLO, LinearTrend(3))
    last = Planner(deployment, bounds, SLO)
    for rate in (10, 20, 30):
        ahead, now = trend.observe(seen(rate)), last.observe(seen(rate))
    assert ahead.predicted.rate_rps == pytest.approx(40)
    assert ahead.replicas["prefill"] > now.replicas["prefill"]


def test_bounds_clamp_the_decision(deployment: DeploymentModel) -> None:
    bounds = {"prefill": PoolBounds("A", 2.0, 3, 4), "relay": PoolBounds("A", 2.0, 2, 2),
              "main": PoolBounds("B", 2.5, 1, 5)}  # fmt: skip
    replicas = Planner(deployment, bounds, SLO).observe(seen(200)).replicas
    assert replicas == {"prefill": 4, "relay": 2, "main": 5}


def test_once_comfortable_again_a_grown_pool_returns_to_the_sized_count(
    planner: Planner, deployment: DeploymentModel
) -> None:
    """A decayed headroom of 1 + epsilon must not hold a pool one replica above its
    sizing for ever (ceil(n * 1.0001) is n + 1): a scale-up must be able to end."""
    base = planner.observe(seen(ttft_p90_s=0.5)).replicas
    planner.observe(seen(ttft_p90_s=50.0, prefill_queue_p90_s=9.0))
    assert (
        planner.observe(seen(ttft_p90_s=50.0, prefill_queue_p90_s=9.0)).replicas["prefill"]
        > base["prefill"]
    )
    for _ in range(60):
        after = planner.observe(seen(ttft_p90_s=0.5)).replicas
    assert after == base
