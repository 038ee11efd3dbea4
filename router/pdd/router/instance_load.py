"""One instance as the router sees it: its role and how busy it is."""

from __future__ import annotations

from dataclasses import dataclass

from pdd.common.vocabulary import Role


@dataclass(frozen=True)
class InstanceLoad:
    """An instance's role, the requests it serves now and how many it may serve at once."""

    instance_id: str
    role: Role
    active: int  # requests it is serving now
    capacity: int  # requests it may serve at once

    def __post_init__(self) -> None:
        if self.capacity <= 0:
            raise ValueError(f"{self.instance_id}: capacity must be positive, got {self.capacity}")
        if self.active < 0:
            raise ValueError(f"{self.instance_id}: active must be >= 0, got {self.active}")

    @property
    def utilization(self) -> float:
        return self.active / self.capacity

    @property
    def saturated(self) -> bool:
        return self.active >= self.capacity
