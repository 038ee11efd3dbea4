"""Each request's time in an instance's waiting queue, logged when it is first scheduled.

The simulated twin of a worker's ``pdd_worker_request_queue_time_seconds`` histogram
(vLLM's ``vllm:request_queue_time_seconds``): observed once per admission, at the moment
the instance first schedules it, so an interval's reading is every wait that *ended* in
it, whatever the request's arrival. The planner reads it as the live scrape reads the
histogram's increase (:func:`pdd.simulator.planner.observe.observe`).
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field


@dataclass
class QueueWaits:
    """Waits in the order they ended (the simulation's clock only moves forward)."""

    ended_at: list[float] = field(default_factory=list)
    waits_s: list[float] = field(default_factory=list)

    def record(self, now: float, wait_s: float) -> None:
        self.ended_at.append(now)
        self.waits_s.append(wait_s)

    def ended_in(self, start: float, end: float) -> list[float]:
        """The waits that ended in [start, end): bisected, as a day logs a wait per request."""
        lo, hi = bisect_left(self.ended_at, start), bisect_left(self.ended_at, end)
        return self.waits_s[lo:hi]

    @property
    def total_s(self) -> float:
        """Every wait summed, for the run's report: derived, so no second tally can drift."""
        return sum(self.waits_s)
