"""The sliding window behind the P-RLD cap."""

import pytest

from pdd.router.recent_traffic import RecentTraffic

pytestmark = pytest.mark.unit


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def test_window_counts_and_forgets():
    clock = Clock()
    traffic = RecentTraffic(window_s=10, clock=clock)
    traffic.record(relay_only=False, input_tokens=100)
    clock.now = 5
    traffic.record(relay_only=True, input_tokens=50_000)
    traffic.record(relay_only=False, input_tokens=10)
    snap = traffic.snapshot()
    assert (snap.requests, snap.relay_only_requests, snap.relay_only_input_tokens) == (3, 1, 50_000)
    assert snap.relay_only_tokens_per_s == 5_000
    clock.now = 10  # the first record is exactly window_s old: gone
    assert traffic.snapshot().requests == 2
    clock.now = 15.5
    snap = traffic.snapshot()
    assert (snap.requests, snap.relay_only_requests, snap.relay_only_input_tokens) == (0, 0, 0)


def test_window_validates():
    with pytest.raises(ValueError, match="window_s"):
        RecentTraffic(window_s=0)
