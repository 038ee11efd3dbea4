"""LinkMeter on a driven clock: goodput over the window, decay when idle, RTT, backlog, expiry."""

from __future__ import annotations

import pytest

from pdd.worker.transport.link_meter import (
    BUCKETS,
    Goodput,
    LinkKey,
    LinkMeter,
    LinkMeters,
    RttEstimator,
)

pytestmark = pytest.mark.unit

MB = 1_000_000
KEY = LinkKey("p-0", "md-0", "prefill", "main")


def test_steady_rate_reads_back_within_one_bucket() -> None:
    """1 MB every 10 ms for 30 s is 100 MB/s; the window's rate says so to 2 % (one bucket)."""
    meter = Goodput(window_s=10.0, now=0.0)
    t = 0.0
    while t < 30.0:
        t += 0.01
        meter.add(MB, t)
    assert meter.rate(t) == pytest.approx(100 * MB, rel=1 / BUCKETS)


def test_young_link_rate_is_over_its_age_not_the_empty_window() -> None:
    meter = Goodput(window_s=10.0, now=100.0)
    for i in range(1, 101):  # 1 s at 50 MB/s
        meter.add(MB // 2, 100.0 + i / 100)
    assert meter.rate(101.0) == pytest.approx(50 * MB, rel=0.01)


def test_idle_link_decays_linearly_to_zero_within_one_window() -> None:
    meter = Goodput(window_s=10.0, now=0.0)
    for i in range(1, 1001):  # 10 s at 10 MB/s, then silence
        meter.add(100_000, i / 100)
    assert meter.rate(10.0) == pytest.approx(10 * MB, rel=0.03)
    assert meter.rate(15.0) == pytest.approx(5 * MB, rel=0.05)  # half the window is silent
    assert meter.rate(20.0 + 10.0 / BUCKETS) == 0.0
    meter.add(10 * MB, 30.0)  # and it comes back with the next burst
    assert meter.rate(30.0) == pytest.approx(1 * MB)


def test_rate_is_bytes_over_window_even_across_a_gap_longer_than_the_window() -> None:
    meter = Goodput(window_s=1.0, now=0.0)
    meter.add(5 * MB, 0.5)
    meter.add(3 * MB, 100.2)
    assert meter.rate(100.5) == pytest.approx(3 * MB)


def test_srtt_follows_rfc6298_and_min_holds_the_floor() -> None:
    rtt = RttEstimator(min_window_s=60.0)
    assert rtt.srtt is None and rtt.minimum(0.0) is None
    rtt.add(0.100, 0.0)
    assert rtt.srtt == pytest.approx(0.100)  # the first sample is taken as is
    rtt.add(0.180, 1.0)  # a late sample (a stall, a queue) moves SRTT by 1/8 of the gap
    assert rtt.srtt == pytest.approx(0.110)
    assert rtt.minimum(1.0) == pytest.approx(0.100)  # the floor is the line's delay


def test_rtt_minimum_forgets_old_samples_but_never_all() -> None:
    rtt = RttEstimator(min_window_s=60.0)
    rtt.add(0.050, 0.0)  # the path was shorter a while ago
    rtt.add(0.090, 30.0)
    rtt.add(0.080, 40.0)
    assert rtt.minimum(59.0) == pytest.approx(0.050)
    assert rtt.minimum(61.0) == pytest.approx(0.080)  # 0.050 left the window; 0.090 is beaten
    assert rtt.minimum(500.0) == pytest.approx(0.080)  # nothing recent: the latest stands


def test_backlog_moves_from_queued_to_in_flight_to_delivered() -> None:
    meter = LinkMeter(window_s=10.0, created=0.0)
    meter.commit(3 * MB, 0.0)
    meter.record_sent(MB, 0.1, from_queue=MB)
    snap = meter.snapshot(0.1)
    assert (snap.queued_bytes, snap.in_flight_bytes) == (2 * MB, MB)
    meter.record_acked(MB, 0.2)
    snap = meter.snapshot(0.2)
    assert (snap.queued_bytes, snap.in_flight_bytes) == (2 * MB, 0)
    assert snap.goodput_bps > 0
    meter.release(2 * MB, 0, 0.3)  # the transfer failed: its backlog leaves the link
    meter.record_failure("link_down", 0.3)
    snap = meter.snapshot(0.3)
    assert (snap.queued_bytes, snap.in_flight_bytes, snap.failures) == (0, 0, {"link_down": 1})


def test_idle_links_expire_and_links_in_use_never_do() -> None:
    links = LinkMeters(window_s=10.0, expire_after_s=300.0)
    busy = links.meter(KEY, 0.0)
    busy.attach()  # a channel is open on it
    idle = links.meter(KEY.reverse, 0.0)
    idle.record_rtt(0.05, 10.0)
    assert {k for k, _ in links.snapshots(309.0)} == {KEY, KEY.reverse}
    assert {k for k, _ in links.snapshots(310.0)} == {KEY}  # 300 s since its last event
    busy.detach(310.0)  # the channel ended
    assert links.snapshots(609.0) != [] and links.snapshots(610.0) == []
    assert links.meter(KEY, 610.0) is not busy  # a new peer of that name starts afresh


def test_expiry_shorter_than_the_window_is_refused() -> None:
    with pytest.raises(ValueError, match="expire_after_s"):
        LinkMeters(window_s=10.0, expire_after_s=5.0)
