"""What the planner may buy: per pool a GPU type, a price per replica-hour and min/max
replicas (the CRD's per-pool ``costPerHour``, ``minReplicas``, ``maxReplicas``), and
the replica counts it chooses.

Pool names are the simulator's (``prefill``, ``relay``, ``main``; ``decode`` for
same-datacenter PD), so a plan is applied to a scenario's system as it is.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from pdd.simulator.planner.load import LoadError

Counts = Mapping[str, int]

#: The pools of each system kind the planner sizes, in the order tables print them.
PDD_POOLS = ("prefill", "relay", "main")
SAME_DC_POOLS = ("prefill", "decode")


@dataclass(frozen=True)
class PoolBounds:
    """One pool: its GPU type, what a replica costs per hour, and how many it may have."""

    gpu: str
    cost_per_hour: float
    min_replicas: int = 1
    max_replicas: int = 256

    def __post_init__(self) -> None:
        if self.cost_per_hour < 0:
            raise LoadError(f"costPerHour must be >= 0, got {self.cost_per_hour}")
        if not 0 <= self.min_replicas <= self.max_replicas:
            raise LoadError(
                f"need 0 <= minReplicas <= maxReplicas, got {self.min_replicas}, "
                f"{self.max_replicas}"
            )

    def clamp(self, n: int) -> int:
        return max(self.min_replicas, min(self.max_replicas, n))


def cost_per_hour(counts: Counts, pools: Mapping[str, PoolBounds], line: float = 0.0) -> float:
    """Replicas at their pool's price, plus the line's (0 for same-datacenter PD)."""
    return sum(n * pools[name].cost_per_hour for name, n in counts.items()) + line


def clamp_all(counts: Counts, pools: Mapping[str, PoolBounds]) -> dict[str, int]:
    return {name: pools[name].clamp(counts.get(name, 0)) for name in pools}
