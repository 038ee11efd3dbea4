"""The planner's capacity model: textbook queueing on the simulator's step model."""

from __future__ import annotations

import math

import pytest

from pdd.simulator.hardware import InstanceShape
from pdd.simulator.planner.capacity import (
    LINE_UTILIZATION,
    TARGET_UTILIZATION,
    DeploymentModel,
    PoolModel,
    decode_batch,
    decode_replicas,
    erlang_c,
    first_token_trip_s,
    line_gbps_needed,
    prefill_replicas,
    prefill_service_s,
    relay_replicas,
    size,
    ttft_p90_estimate,
)
from pdd.simulator.planner.load import ObservedLoad, Slo

pytestmark = pytest.mark.unit


@pytest.fixture
def deployment(shape: InstanceShape) -> DeploymentModel:
    pools = {name: PoolModel(shape, 48, 8192) for name in ("prefill", "relay", "main")}
    return DeploymentModel(pools, 51200, 100.0, 0.03, 2.0)


def load(rate: float = 20.0, **kw: float) -> ObservedLoad:
    values = {"input_tokens_mean": 30000.0, "output_tokens_mean": 1000.0, "p_hit": 0.9,
              "md_hit": 0.9, "relay_share": 0.02, **kw}  # fmt: skip
    return ObservedLoad(rate, **values)


def test_erlang_c_of_one_server_is_its_utilization() -> None:
    assert erlang_c(1, 0.3) == pytest.approx(0.3)
    assert erlang_c(4, 0.0) == 0.0 and erlang_c(4, 4.0) == 1.0


def test_erlang_c_matches_the_closed_form_for_two_servers() -> None:
    # M/M/2 at a = 1: C = (a^2/2 * 2/(2-a)) / (1 + a + a^2/2 * 2/(2-a)) = 1/3
    assert erlang_c(2, 1.0) == pytest.approx(1 / 3)


def test_ttft_estimate_falls_with_servers_and_is_infinite_when_overloaded() -> None:
    estimates = [ttft_p90_estimate(n, 10.0, 0.5, 0.1) for n in (6, 8, 12)]
    assert estimates == sorted(estimates, reverse=True)
    assert ttft_p90_estimate(5, 10.0, 0.5, 0.1) == math.inf
    assert ttft_p90_estimate(6, 10.0, 0.5, 0.1, scv=4.0) > estimates[0]


def test_prefill_replicas_grow_with_the_rate_and_the_miss(deployment: DeploymentModel) -> None:
    slo = Slo(5.0, 0.08)
    low, high = (
        prefill_replicas(deployment, load(10), slo),
        prefill_replicas(deployment, load(40), slo),
    )
    colder = prefill_replicas(deployment, load(10, p_hit=0.5), slo)
    assert 1 <= low < high and colder > low
    assert prefill_replicas(deployment, load(0), slo) == 0


@pytest.mark.parametrize("target", [3.0, 0.75])
def test_prefill_replicas_are_the_fewest_under_both_bounds(
    deployment: DeploymentModel, target: float
) -> None:
    """The utilization bound binds at a loose target, the TTFT estimate at a tight one."""
    slo, observed = Slo(target, 0.08), load(30)
    n = prefill_replicas(deployment, observed, slo)
    service = prefill_service_s(deployment.pools["prefill"], observed.p_miss_tokens, 27000)
    trip = first_token_trip_s(deployment, observed)
    by_utilization = math.ceil(30 * service / TARGET_UTILIZATION)
    by_ttft = next(c for c in range(1, 100) if ttft_p90_estimate(c, 30, service, trip) <= target)
    assert n == max(by_utilization, by_ttft)


def test_decode_batch_respects_the_itl_target_and_kv(shape: InstanceShape) -> None:
    pool = PoolModel(shape, 64)
    b = decode_batch(pool, 30000, 31000, 0.05)
    assert 1 <= b <= 64
    assert shape.decode_seconds(b, b * 30000) <= 0.05
    assert (
        b == 64
        or shape.decode_seconds(b + 1, (b + 1) * 30000) > 0.05
        or ((b + 1) * 31000 > shape.kv_capacity_tokens)
    )
    assert decode_batch(pool, 30000, 31000, 0.001) == 0  # one step already misses


def test_decode_replicas_carry_the_token_rate(deployment: DeploymentModel) -> None:
    slo = Slo(10.0, 0.08)
    one, two = (
        decode_replicas(deployment, load(10), slo),
        decode_replicas(deployment, load(20), slo),
    )
    assert one is not None and two is not None and two >= 2 * one - 1
    assert decode_replicas(deployment, load(10), Slo(10.0, 0.0001)) is None


def test_relays_only_for_relayed_requests(deployment: DeploymentModel) -> None:
    assert relay_replicas(deployment, load(20, relay_share=0.0)) == 0
    assert relay_replicas(deployment, load(20)) == 1
    assert relay_replicas(deployment, load(100, relay_share=1.0)) == 5  # 100 x 2 s / 48 / 0.85


def test_line_needed_is_the_miss_bytes_at_the_sized_share(deployment: DeploymentModel) -> None:
    got = line_gbps_needed(deployment, load(10, md_hit=0.5))
    assert got == pytest.approx(10 * 15000 * 51200 * 8 / 1e9 / LINE_UTILIZATION)


def test_size_names_every_pool(deployment: DeploymentModel) -> None:
    assert set(size(deployment, load(), Slo(10, 0.08))) == {"prefill", "relay", "main"}
