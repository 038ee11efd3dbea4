"""Hardware cost: every pool's GPUs at their hourly price, plus the WAN line.

One function for the simulator's benefit-cost ratio and for the published cost
comparison, so the exact-arithmetic test checks the very figure the reports print.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdd.simulator.scenario import Scenario, SystemSpec


def system_cost_per_hour(scenario: Scenario, system: SystemSpec) -> float:
    gpus = sum(
        pool.instances * pool.gpus_per_instance * scenario.gpus[pool.gpu].price_per_hour
        for pool in system.pools().values()
    )
    return gpus + (scenario.wan.price_per_hour if system.uses_wan else 0.0)


def gpu_counts(system: SystemSpec) -> dict[str, int]:
    """GPUs of each type the system uses, e.g. {"A": 43, "B": 32}."""
    counts: dict[str, int] = {}
    for pool in system.pools().values():
        counts[pool.gpu] = counts.get(pool.gpu, 0) + pool.instances * pool.gpus_per_instance
    return counts


@dataclass(frozen=True)
class PremiumPoint:
    premium: float  # price of ``priced`` over ``reference``, e.g. 0.2 = 20% dearer
    baseline_cost: float
    candidate_cost: float

    @property
    def saving(self) -> float:
        """Fraction by which the candidate is cheaper than the baseline."""
        return 1.0 - self.candidate_cost / self.baseline_cost


def cost_at_premium(
    scenario: Scenario,
    baseline: SystemSpec,
    candidate: SystemSpec,
    premium: float,
    reference: str = "A",
    priced: str = "B",
) -> PremiumPoint:
    """Both systems' cost with GPU ``priced`` at ``(1 + premium)`` x GPU ``reference``."""
    gpus = dict(scenario.gpus)
    base_price = gpus[reference].price_per_hour
    gpus[priced] = gpus[priced].model_copy(update={"price_per_hour": base_price * (1 + premium)})
    repriced = scenario.model_copy(update={"gpus": gpus})
    return PremiumPoint(
        premium,
        system_cost_per_hour(repriced, baseline),
        system_cost_per_hour(repriced, candidate),
    )
