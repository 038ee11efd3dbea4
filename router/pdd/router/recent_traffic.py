"""A sliding window of recent routing decisions, for the P-RLD admission cap.

P-RLD (finish on the relay, never ship KV to MD) is only for anomalous requests. The
cap that keeps it from ever absorbing normal traffic needs to know how many recent
requests went that way and how many input tokens/s they brought; this window keeps
exactly that and hands the pure policy an immutable snapshot.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class TrafficWindow:
    """Counts over the last ``window_s`` seconds."""

    window_s: float
    requests: int = 0
    relay_only_requests: int = 0  # decided P-RLD
    relay_only_input_tokens: int = 0

    @property
    def relay_only_tokens_per_s(self) -> float:
        return self.relay_only_input_tokens / self.window_s


class RecentTraffic:
    """Records each decision's pipeline and input size; forgets after ``window_s``."""

    def __init__(self, window_s: float = 60.0, clock: Callable[[], float] = time.monotonic):
        if window_s <= 0:
            raise ValueError(f"window_s must be positive, got {window_s}")
        self._window_s = window_s
        self._clock = clock
        self._events: deque[tuple[float, bool, int]] = deque()
        self._relay_only_requests = 0
        self._relay_only_tokens = 0

    def record(self, relay_only: bool, input_tokens: int) -> None:
        self._events.append((self._clock(), relay_only, input_tokens))
        self._count(relay_only, input_tokens, +1)

    def snapshot(self) -> TrafficWindow:
        oldest = self._clock() - self._window_s
        while self._events and self._events[0][0] <= oldest:
            _, relay_only, tokens = self._events.popleft()
            self._count(relay_only, tokens, -1)
        return TrafficWindow(
            window_s=self._window_s,
            requests=len(self._events),
            relay_only_requests=self._relay_only_requests,
            relay_only_input_tokens=self._relay_only_tokens,
        )

    def _count(self, relay_only: bool, tokens: int, sign: int) -> None:
        if relay_only:
            self._relay_only_requests += sign
            self._relay_only_tokens += sign * tokens
