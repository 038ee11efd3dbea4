"""HPA's own damping, as the planner's replicas reach the pods: scale up at once, scale
down only to the highest count desired over the last ``window_s`` (autoscaling/v2's
default scale-down stabilization window is 300 s). The simulated day applies it, so the
planner is judged as it would act through an HPA."""

from __future__ import annotations

from collections import deque


class Stabilizer:
    def __init__(self, window_s: float = 300.0) -> None:
        if window_s < 0:
            raise ValueError(f"window_s must be >= 0, got {window_s}")
        self.window_s = window_s
        self._recent: deque[tuple[float, int]] = deque()

    def __call__(self, now: float, desired: int) -> int:
        """The replicas to run at ``now`` given this interval's ``desired``."""
        self._recent.append((now, desired))
        while self._recent[0][0] < now - self.window_s:
            self._recent.popleft()
        return max(n for _, n in self._recent)
