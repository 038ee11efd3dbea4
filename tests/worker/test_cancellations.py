"""The record of cancels a worker keeps: bounded in time and in size."""

import pytest

from pdd.worker.roles.cancellations import CancelledRequests, RequestCancelledError

pytestmark = pytest.mark.unit


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_cancel_is_remembered_until_its_ttl_passes():
    clock = Clock()
    record = CancelledRequests(ttl_s=60.0, clock=clock)
    record.add("a")
    clock.now = 59.0
    assert "a" in record
    with pytest.raises(RequestCancelledError, match="cancelled before it reached"):
        record.check("a")
    record.check("b")  # never cancelled: no error
    clock.now = 61.0
    assert "a" not in record and len(record) == 0


def test_past_capacity_the_oldest_cancels_go_first():
    record = CancelledRequests(ttl_s=60.0, capacity=3, clock=Clock())
    for rid in "abcd":
        record.add(rid)
    assert len(record) == 3
    assert "a" not in record and all(r in record for r in "bcd")
