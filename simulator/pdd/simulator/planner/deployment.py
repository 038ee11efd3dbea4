"""A scenario's system as the planner sees it: the step model of each pool, the line,
the pools' bounds and prices, and the system with chosen replica counts.

The scenario file (``--pools FILE`` names one) is the one place the model, the GPU
types, the line and the router's knobs are written; a pool's ``costPerHour`` defaults
to its GPUs' price.
"""

from __future__ import annotations

from collections.abc import Mapping

from pdd.simulator.planner.capacity import DeploymentModel, PoolModel
from pdd.simulator.planner.pools import PoolBounds
from pdd.simulator.scenario import Scenario, SystemKind, SystemSpec


def deployment_model(scenario: Scenario, system: str) -> DeploymentModel:
    spec = scenario.systems[system]
    pools = {
        name: PoolModel(scenario.shape(pool), pool.max_batch, pool.max_num_batched_tokens)
        for name, pool in spec.pools().items()
    }
    cross = spec.kind != SystemKind.SAME_DC
    return DeploymentModel(
        pools=pools,
        kv_bytes_per_token=scenario.model.kv_bytes_per_token,
        line_gbps=scenario.wan.gbps if cross else scenario.in_dc.gbps,
        rtt_s=(scenario.wan.rtt_ms if cross else 2 * scenario.in_dc.latency_ms) / 1000,
        ttft_budget_s=scenario.router.ttft_budget_s,
    )


def default_bounds(scenario: Scenario, system: str) -> dict[str, PoolBounds]:
    """Each pool at its GPUs' price, from 1 replica to 4x the scenario's count (at least 64)."""
    return {
        name: PoolBounds(
            pool.gpu,
            pool.gpus_per_instance * scenario.gpus[pool.gpu].price_per_hour,
            1,
            max(64, 4 * pool.instances),
        )
        for name, pool in scenario.systems[system].pools().items()
    }


def with_counts(spec: SystemSpec, counts: Mapping[str, int]) -> SystemSpec:
    """``spec`` with each named pool's replica count replaced."""
    pools = spec.pools()
    update = {name: pools[name].model_copy(update={"instances": n}) for name, n in counts.items()}
    return spec.model_copy(update=update)
