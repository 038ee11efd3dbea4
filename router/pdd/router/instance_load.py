"""One instance as the router sees it: its role and how busy it is."""

from __future__ import annotations

from dataclasses import dataclass

from pdd.common.vocabulary import Role


@dataclass(frozen=True)
class InstanceLoad:
    """An instance's role, the requests it serves now and how many it may serve at once.

    ``pending``: requests routed to it that have not reached it yet (an MD's, while P
    still queues or prefills them). They weigh in its utilization, so the next request
    goes to a less committed instance, but not in its saturation: an instance refuses
    only what it would have to run now, not a backlog upstream of it (issue 59)."""

    instance_id: str
    role: Role
    active: int  # requests it is serving now
    capacity: int  # requests it may serve at once
    pending: int = 0  # requests on their way to it (not yet serving)

    def __post_init__(self) -> None:
        if self.capacity <= 0:
            raise ValueError(f"{self.instance_id}: capacity must be positive, got {self.capacity}")
        if self.active < 0:
            raise ValueError(f"{self.instance_id}: active must be >= 0, got {self.active}")
        if self.pending < 0:
            raise ValueError(f"{self.instance_id}: pending must be >= 0, got {self.pending}")

    @property
    def utilization(self) -> float:
        return (self.active + self.pending) / self.capacity

    @property
    def saturated(self) -> bool:
        return self.active >= self.capacity
