"""The link estimator on a driven clock: backlog bookkeeping, goodput and prefill samples."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdd.common.cost_model import LinkState, wan_transfer_seconds
from pdd.common.link_estimator import (
    GAIN,
    MAX_OVER_DECLARED,
    MAX_SLOWDOWN,
    MIN_FIXED_SAMPLES,
    MIN_OVERDUE_S,
    MIN_PREFILL_SAMPLE_TOKENS,
    MIN_SAMPLE_S,
    Backlog,
    LinkEstimator,
)

pytestmark = pytest.mark.unit

#: 0.08 Gbit/s = 10 MB/s, 30 ms RTT; P's prior 1,000 tokens/s.
PRIOR = LinkState(declared_gbps=0.08, rtt_ms=30)
MB = 10**6


def estimator(frozen=False):
    return LinkEstimator(PRIOR, prefill_tokens_per_s=1000, frozen=frozen)


def test_a_fresh_estimator_is_the_declared_link():
    link = estimator().link()
    assert link.effective_gbps == pytest.approx(0.08)
    assert link.rtt_ms == 30 and link.backlog_bytes == 0 and link.backlog_transfers == 0


def test_commitments_are_the_backlog_until_they_land_or_settle():
    e = estimator()
    a = e.commit(2 * MB, "p0", 100, now=0.0)
    b = e.commit(1 * MB, "p0", 100, now=0.0)
    assert e.backlog == Backlog(3 * MB, 2)
    # The next transfer queues behind both: its estimate grows by their bytes.
    busy = wan_transfer_seconds(1000, 1000, e.link())
    assert busy == pytest.approx(0.03 + (1 * MB + 2 * MB) * 8 / 0.08e9)
    e.settle(a)
    e.landed(b, now=0.2)
    assert e.backlog == Backlog(0, 0)


@pytest.mark.parametrize("frozen", [False, True])
def test_a_transfer_is_awaited_by_prompts_sharing_its_blocks_on_its_md_until_it_lands(frozen):
    e = estimator(frozen)
    turn1 = e.commit(2 * MB, "p0", 100, now=0.0, main_id="md0", carried=[11, 12, 13])
    e.commit(MB, "p0", 100, now=0.0, main_id="md1", carried=[21])
    e.commit(MB, "p0", 100, now=0.0)  # names no blocks (the simulator's): awaited by none
    # The next turn extends turn 1: it waits on md0 for all of turn 1's KV.
    assert e.awaited_bytes([10, 11, 12, 13, 14]) == {"md0": 2 * MB}
    assert e.awaited_bytes([10, 13, 21]) == {"md0": 2 * MB, "md1": MB}
    assert e.awaited_bytes([10, 99]) == {}  # shares only what MD held before: nothing
    e.landed(turn1, now=0.5)
    assert e.awaited_bytes([10, 11, 12, 13, 14]) == {}
    shipped = e.commit(MB, "p0", 100, now=1.0, main_id="md0", carried=[31])
    e.shipped(shipped, MB, 0.2, now=1.3)  # P's report: MD imported it
    assert e.awaited_bytes([31]) == {}


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.tuples(st.sampled_from(["md0", "md1", "md2"]), st.sets(st.integers(0, 9))),
            st.integers(0, 30),  # the k-th transfer still crossing, if any, is settled
        ),
        max_size=40,
    ),
    st.sets(st.integers(0, 9)),
)
def test_awaited_bytes_equal_a_pass_over_every_transfer_crossing(steps, prompt) -> None:
    """What a request waits for, per MD, after any commits and settles: the sum over the
    transfers still crossing that carry one of its blocks, as a pass over all of them."""
    e, crossing = estimator(), []
    for step in steps:
        if isinstance(step, tuple):
            main, carried = step
            nbytes = (len(crossing) + 1) * 1000
            crossing.append(e.commit(nbytes, "p0", 0, now=0.0, main_id=main, carried=carried))
        elif crossing:
            e.settle(crossing.pop(step % len(crossing)))
        expected: dict[str, int] = {}
        for t in crossing:
            if t.carried & prompt:
                expected[t.main_id] = expected.get(t.main_id, 0) + t.nbytes
        assert e.awaited_bytes(prompt) == expected


class TransfersNotToWalk(dict):
    """Every transfer crossing, which a request's lookup may not walk through."""

    def __iter__(self):
        raise AssertionError("walked every transfer crossing for one prompt's")

    def values(self):
        raise AssertionError("walked every transfer crossing for one prompt's")

    def items(self):
        raise AssertionError("walked every transfer crossing for one prompt's")


def test_awaited_bytes_look_up_the_prompts_blocks_not_every_transfer():
    """A busy line at fleet scale has thousands of transfers crossing; a request's
    lookup costs its own blocks and the transfers that carry them."""
    e = estimator()
    for k in range(100):
        e.commit(MB, "p0", 0, now=0.0, main_id=f"md{k}", carried=[1000 + k])
    e.commit(MB, "p0", 0, now=0.0, main_id="md0", carried=[7])
    e._in_flight = TransfersNotToWalk(e._in_flight)
    assert e.awaited_bytes([7, 1005, 5]) == {"md0": MB, "md5": MB}


def test_a_shared_backlog_replaces_the_own_one():
    e = estimator()
    e.commit(MB, "p0", 0, now=0.0)
    assert e.link(Backlog(5 * MB, 3)).backlog_bytes == 5 * MB


def test_a_slow_line_is_learnt_from_the_transfers_that_land():
    """The line runs at a tenth of the declared rate: each landing says so, and the
    estimate converges on it (seconds per byte, an EWMA)."""
    e = estimator()
    now = 0.0
    for _ in range(20):
        t = e.commit(MB, "p0", 100, now)  # prefill 0.1 s at the prior
        now += 0.03 + MB * 8 / 0.008e9  # RTT + 1 MB at 0.008 Gbit/s (streamed: the 0.1 s
        # prefill overlaps it)
        e.landed(t, now)
    assert e.goodput_samples == 20
    assert e.link().effective_gbps == pytest.approx(0.008, rel=0.01)
    # And back: the line recovers, the samples follow.
    for _ in range(30):
        t = e.commit(MB, "p0", 100, now)
        now += 0.03 + MB * 8 / 0.08e9  # the line (0.1 s) and the prefill (0.1 s) overlap
        e.landed(t, now)
    assert e.link().effective_gbps == pytest.approx(0.08, rel=0.01)


def test_one_sample_moves_the_estimate_by_the_gain():
    e = estimator()
    t = e.commit(MB, "p0", 0, now=0.0)
    e.landed(t, now=0.03 + 2 * MB * 8 / 0.08e9)  # twice the declared serialization
    spb = 8 / 0.08e9
    assert 8 / (e.link().effective_gbps * 1e9) == pytest.approx(spb + GAIN * (2 * spb - spb))


def test_a_transfer_that_landed_behind_another_is_timed_from_that_landing():
    """Two 1 MB transfers dispatched together cross one after the other: the second
    landed a serialization after the first, which is the declared rate, not half."""
    e = estimator()
    first = e.commit(MB, "p0", 0, now=0.0)
    second = e.commit(MB, "p0", 0, now=0.0)
    e.landed(first, now=0.03 + MB * 8 / 0.08e9)
    e.landed(second, now=0.03 + 2 * MB * 8 / 0.08e9)
    assert e.goodput_samples == 2
    assert e.link().effective_gbps == pytest.approx(0.08)


def test_a_queue_on_a_throttled_line_is_learnt_at_the_lines_rate():
    """The line drops to a tenth: 40 transfers queue on it, each landing one
    serialization after the one before (plus a fixed 50 ms of MD's step and the
    report, the same for every one). The estimate converges on the line's rate: the
    backlog dispatched ahead of each was mostly on its way already, and counting it as
    still queued read the line 2-3x faster than it was."""
    e = estimator()
    slow_s = MB * 8 / 0.008e9
    transfers = [e.commit(MB, "p0", 0, now=0.1 * i) for i in range(40)]
    for i, t in enumerate(transfers):
        e.landed(t, now=0.03 + 0.05 + (i + 1) * slow_s)
    assert e.link().effective_gbps == pytest.approx(0.008, rel=0.02)


def test_a_commitment_still_unreported_does_not_make_the_line_look_fast():
    """A 1 MB transfer committed at 0 has not been reported (its report was lost, or
    its request still waits on P): one committed 10 s later and alone on the line
    took the declared rate's time, and that is what is learnt."""
    e = estimator()
    e.commit(MB, "p0", 0, now=0.0)
    t = e.commit(MB, "p0", 0, now=10.0)
    e.landed(t, now=10.0 + 0.03 + MB * 8 / 0.08e9)
    assert e.link().effective_gbps == pytest.approx(0.08)


def test_a_throttle_shows_in_the_transfers_still_crossing_before_any_lands():
    """The line drops to a tenth and nothing lands for seconds: each decision looks at
    the oldest transfer still crossing. At 0.5 s the 1 MB committed at 0 (0.1 s at the
    estimate, 0.1 s of prefill) is within the margins; at 1.5 s, with 3 MB offered since
    its dispatch, the line carried less than 3 MB in 1.37 s, and the estimate moves
    towards that bound by the gain at each look, until the transfer is no longer
    MIN_OVERDUE_S late at the estimate, never past the bound."""
    e = estimator()
    t0 = e.commit(MB, "p0", 100, now=0.0)
    e.commit(MB, "p0", 100, now=0.2)
    e.overdue(now=0.5)
    assert e.overdue_samples == 0 and e.link().effective_gbps == pytest.approx(0.08)
    e.commit(MB, "p0", 100, now=1.0)
    for _ in range(30):
        e.overdue(now=1.5)
    line_s = 1.5 - 0.1 - 0.03
    bound_gbps = 3 * MB * 8 / line_s / 1e9
    margin_gbps = 3 * MB * 8 / (line_s - MIN_OVERDUE_S) / 1e9
    assert 0 < e.overdue_samples < 30
    assert bound_gbps < e.link().effective_gbps <= margin_gbps
    # Once it lands, the next oldest is judged: committed 0.2 s, 2 MB offered since.
    e.landed(t0, now=1.6)
    before = e.link().effective_gbps
    e.overdue(now=1.6)
    assert e.link().effective_gbps <= before


def test_a_transfer_on_time_or_a_frozen_view_learns_nothing_from_crossing():
    """A 5 MB transfer is due 0.53 s after its prefill at the declared rate: at 0.9 s it
    is late, but by less than MIN_OVERDUE_S; a frozen view never learns."""
    for frozen in (False, True):
        e = estimator(frozen)
        e.commit(5 * MB, "p0", 0, now=0.0)
        e.overdue(now=0.03 + 0.5 + MIN_OVERDUE_S * 0.7)
        assert e.overdue_samples == 0 and e.link().effective_gbps == pytest.approx(0.08)
        e.overdue(now=30.0)
        assert e.overdue_samples == (0 if frozen else 1)
        assert (e.link().effective_gbps < 0.08) is not frozen


def test_other_replicas_backlog_still_counts_as_queued_ahead():
    """With a shared backlog of another replica's 1 MB ahead, twice the serialization is
    the declared rate: those landings are not seen here, so the bytes count whole."""
    e = estimator()
    t = e.commit(MB, "p0", 0, now=0.0, backlog=Backlog(MB, 1))
    e.landed(t, now=0.03 + 2 * MB * 8 / 0.08e9)
    assert e.link().effective_gbps == pytest.approx(0.08)


def test_p_s_report_leaves_md_s_first_token_to_time_the_transfer():
    """P reports MD imported the KV before MD's first token reaches the router: the
    report settles the backlog (a slow P time is no sample), and the first token's
    router-side time still teaches the 10x slower line."""
    e = estimator()
    t = e.commit(MB, "p0", 0, now=0.0)
    shipped = e.shipped(t, MB, seconds=0.03 + 10 * MB * 8 / 0.08e9, now=0.03 + 10 * 0.1)
    assert e.backlog == Backlog() and e.goodput_samples == 0
    e.landed(t, now=0.03 + 10 * MB * 8 / 0.08e9 + 0.02, shipped=shipped)
    assert e.backlog == Backlog() and e.goodput_samples == 1
    assert e.link().effective_gbps < 0.08 * 0.5


def test_a_transfer_queued_behind_a_relayed_one_is_timed_from_p_s_report_of_it():
    """A relayed request's KV crosses too, and P reports it: a P-MD transfer that queued
    behind it crossed in the time since that report, not in the whole wait (reading
    the wait as the line made it look many times slower under load). Each report and
    first token lags the line by 10 ms."""
    e = estimator()
    serial = MB * 8 / 0.08e9
    relayed = e.commit(MB, "p0", 0, now=0.0, relayed=True)
    queued = e.commit(MB, "p0", 0, now=0.0)
    e.shipped(relayed, MB, seconds=0.03 + serial, now=serial + 0.01)
    shipped = e.shipped(queued, MB, seconds=0.03 + 2 * serial, now=2 * serial + 0.01)
    e.landed(queued, now=2 * serial + 0.02, shipped=shipped)
    assert e.link().effective_gbps == pytest.approx(0.08)


def test_a_small_transfer_that_queued_is_no_fixed_cost_sample():
    """A small transfer landing after a large one waited for the line: that wait is the
    line's, so the path's fixed cost stays what the unqueued ones showed."""
    e = estimator()
    for i in range(30):
        e.landed(e.commit(100, "p0", 0, now=float(i)), now=i + 0.03 + 0.05)
    assert e.overhead_s == pytest.approx(0.05, rel=0.01)
    large = e.commit(MB, "p0", 0, now=100.0)
    small = e.commit(100, "p0", 0, now=100.0)
    e.landed(large, now=100.0 + 0.03 + 0.05 + MB * 8 / 0.08e9)
    e.landed(small, now=100.0 + 0.03 + 0.05 + MB * 8 / 0.08e9 + 0.001)
    assert e.overhead_s == pytest.approx(0.05, rel=0.01)


def test_small_transfers_are_no_samples_and_impossible_times_are_capped():
    e = estimator()
    t = e.commit(100, "p0", 0, now=0.0)  # 10 us on the line: fixed costs only
    e.landed(t, now=0.03)
    assert e.goodput_samples == 0 and e.link().effective_gbps == pytest.approx(0.08)
    t = e.commit(MB, "p0", 1000, now=0.0)  # lands before the prior prefill would be over
    e.landed(t, now=0.5)
    assert e.link().effective_gbps <= 0.08 * MAX_OVER_DECLARED


def learnt_fixed_cost(e: LinkEstimator, fixed_s: float) -> None:
    for i in range(MIN_FIXED_SAMPLES + 26):
        e.landed(e.commit(100, "p0", 0, now=float(i)), now=i + 0.03 + fixed_s)
    assert e.overhead_s == pytest.approx(fixed_s, rel=0.01)


def test_a_throttle_is_learnt_from_transfers_too_small_to_time_at_the_estimate():
    """100 KB takes 10 ms at the believed 10 MB/s, under MIN_SAMPLE_S: on time, such
    transfers only measure the fixed cost. On a line ten times slower each lands 90 ms
    late, past the fixed cost: that is the line, and a few of them teach it."""
    e = estimator()
    learnt_fixed_cost(e, 0.05)
    kb100 = 100_000
    for i in range(10):  # on time: the fixed cost, no goodput sample
        e.landed(e.commit(kb100, "p0", 0, now=100.0 + i), now=100.0 + i + 0.03 + 0.05 + 0.01)
    assert e.goodput_samples == 0 and e.overhead_s == pytest.approx(0.05, rel=0.01)
    for i in range(12):  # the line runs at 1 MB/s: 0.1 s for each
        e.landed(e.commit(kb100, "p0", 0, now=200.0 + i), now=200.0 + i + 0.03 + 0.05 + 0.1)
    assert e.goodput_samples > 0
    assert e.link().effective_gbps == pytest.approx(0.008, rel=0.1)


def test_a_small_transfer_shows_no_slow_line_from_jitter_a_few_bytes_or_no_fixed_cost():
    kb100 = 100_000
    fresh = estimator()  # no fixed cost measured yet: a late transfer teaches only that
    fresh.landed(fresh.commit(kb100, "p0", 0, now=0.0), now=0.03 + 0.2)
    assert fresh.goodput_samples == 0
    e = estimator()
    learnt_fixed_cost(e, 0.05)
    # 15 ms late, under MIN_SAMPLE_S: MD's step jittered, the line is as believed.
    e.landed(e.commit(kb100, "p0", 0, now=100.0), now=100.0 + 0.03 + 0.05 + 0.01 + 0.015)
    # A hundred bytes 0.2 s late: too few bytes to say anything of the line.
    e.landed(e.commit(100, "p0", 0, now=101.0), now=101.0 + 0.03 + 0.05 + 0.2)
    assert e.goodput_samples == 0 and e.link().effective_gbps == pytest.approx(0.08)
    # A stall of a whole second on 100 KB: at most MAX_SLOWDOWN times the estimate.
    e.landed(e.commit(kb100, "p0", 0, now=102.0), now=102.0 + 0.03 + 0.05 + 1.0)
    spb = 1 / (0.08e9 / 8)
    expected = 1 / (spb + GAIN * (MAX_SLOWDOWN * spb - spb)) * 8 / 1e9
    assert e.link().effective_gbps == pytest.approx(expected)


def test_a_small_transfer_slowed_by_another_beside_it_shows_no_slow_line():
    """A burst of new conversations: a small transfer shares the line with a large one
    (committed before it, or after it), lands 90 ms late, and the line is as declared."""
    e = estimator()
    learnt_fixed_cost(e, 0.05)
    kb100 = 100_000
    large = e.commit(MB, "p0", 0, now=100.0)
    small = e.commit(kb100, "p0", 0, now=100.0)
    e.landed(small, now=100.0 + 0.03 + 0.05 + 0.1)
    small = e.commit(kb100, "p0", 0, now=101.0)
    e.settle(large)
    e.commit(MB, "p0", 0, now=101.01)
    e.landed(small, now=101.0 + 0.03 + 0.05 + 0.1)
    assert e.goodput_samples == 0 and e.link().effective_gbps == pytest.approx(0.08)


def test_the_fixed_cost_small_transfers_show_is_not_charged_to_the_line():
    """Every transfer pays 0.12 s beyond prefill and one RTT (the handshake's round
    trips, MD's step): the small ones measure it, and a 1 MB transfer that took its
    serialization at the declared rate on top is the declared rate, not slower."""
    e = estimator()
    for i in range(30):
        t = e.commit(100, "p0", 0, now=float(i))
        e.landed(t, now=i + 0.03 + 0.12)
    assert e.overhead_s == pytest.approx(0.12, rel=0.01)
    t = e.commit(MB, "p0", 0, now=100.0)
    e.landed(t, now=100.0 + 0.03 + 0.12 + MB * 8 / 0.08e9)
    assert e.link().effective_gbps == pytest.approx(0.08, rel=0.01)
    # A relayed transfer's MD waits for the hand-off too: one more RTT off its sample.
    t = e.commit(MB, "p0", 0, now=200.0, relayed=True)
    e.landed(t, now=200.0 + 2 * 0.03 + 0.12 + 0.5 * MB * 8 / 0.08e9, upper_bound=True)
    assert e.link().effective_gbps > 0.08


def test_a_hand_off_time_only_shows_a_line_faster_than_believed():
    """MD's first token after a relay's hand-off also waits for the relay: a slow one says
    nothing about the line (the estimate stays), a fast one proves the line faster."""
    e = estimator()
    t = e.commit(MB, "p0", 0, now=0.0)
    e.landed(t, now=0.03 + 10 * MB * 8 / 0.08e9)  # a 10x slower line, timed two-sided
    slow = e.link().effective_gbps
    assert slow < 0.08
    t = e.commit(MB, "p0", 0, now=10.0, relayed=True)
    e.landed(t, now=10.0 + 2 * 0.03 + 100 * MB * 8 / 0.08e9, upper_bound=True)
    assert e.link().effective_gbps == slow and e.goodput_samples == 1
    t = e.commit(MB, "p0", 0, now=30.0, relayed=True)
    e.landed(t, now=30.0 + 2 * 0.03 + MB * 8 / 0.08e9, upper_bound=True)
    assert e.link().effective_gbps > slow and e.goodput_samples == 2


def test_prefill_throughput_per_instance():
    e = estimator()
    e.prefill_seen("p0", 1000, seconds=4.0)  # 250 tokens/s against a 1,000 prior
    e.prefill_seen("p1", MIN_PREFILL_SAMPLE_TOKENS - 1, seconds=100.0)  # too short to count
    rates = e.prefill_rates()
    assert set(rates) == {"p0"}
    assert 1 / rates["p0"] == pytest.approx(1 / 1000 + GAIN * (4 / 1000 - 1 / 1000))
    assert e.prefill_tokens_per_s("p1") == 1000


class NotToWalk(dict):
    """Every P's measured rate, which a lookup may read but not walk through."""

    def __iter__(self):
        raise AssertionError("walked every P's rate for one P's")

    def items(self):
        raise AssertionError("walked every P's rate for one P's")


def test_one_ps_rate_is_read_without_walking_every_ps():
    """The policy asks for the rate of the P it chose, per request: with thousands of P
    measured, building the map of all of them each time costs O(fleet)."""
    e = estimator()
    for k in range(100):
        e.prefill_seen(f"p{k}", 1000, seconds=4.0)
    e._prefill_spt = NotToWalk(e._prefill_spt)
    rates = e.prefill_rates()
    assert rates.get("p7") == e.prefill_tokens_per_s("p7") and rates.get("q0") is None


def test_a_prefills_fixed_cost_is_not_read_as_a_slow_p():
    """Every prefill pays 0.1 s whatever its size (the hop to the relay, its first step):
    the small ones measure it, and a 1,000-token one in 1.1 s is P's 1,000 tokens/s."""
    e = estimator()
    for _ in range(30):
        e.prefill_seen("p0", 10, seconds=0.1)
    assert e.prefill_tokens_per_s("p0") == 1000  # small prefills are no rate sample
    e.prefill_seen("p0", 1000, seconds=1.1)
    assert e.prefill_tokens_per_s("p0") == pytest.approx(1000, rel=0.01)


def test_p_timed_transfers_only_show_a_line_faster_than_believed():
    """P's time from its first chunk to MD's "imported" holds one RTT, the line and the
    engines' export and import waits: a slow one says nothing (CPU starvation looks
    the same), a fast one proves the line faster, whatever the prefill took. One too
    small to show the line is no sample; the transfer is settled either way."""
    e = estimator()
    t = e.commit(MB, "p0", 0, now=0.0)
    e.landed(t, now=0.03 + 10 * MB * 8 / 0.08e9)  # the router's timing: a 10x slower line
    slow = e.link().effective_gbps
    t = e.commit(MB, "p0", 5000, now=10.0)  # 5 s of prefill at the prior: not in P's time
    e.shipped(t, MB, seconds=0.03 + 100 * MB * 8 / 0.08e9, now=20.0)
    assert e.link().effective_gbps == slow and e.backlog == Backlog()
    for _ in range(40):
        t = e.commit(MB, "p0", 5000, now=20.0)
        e.shipped(t, MB, seconds=0.03 + MB * 8 / 0.08e9, now=21.0)
    assert e.link().effective_gbps == pytest.approx(0.08, rel=0.01)
    assert e.goodput_samples == 41
    t = e.commit(MB, "p0", 0, now=25.0)
    e.shipped(t, MB, seconds=0.03, now=26.0)  # no faster than declared, however quick
    assert e.link().effective_gbps == pytest.approx(0.08, rel=0.01)
    small = int(MIN_SAMPLE_S * 0.08e9 / 8 * 0.9)  # under 20 ms at the estimate
    e.shipped(e.commit(small, "p0", 0, now=30.0), small, seconds=0.0, now=31.0)
    assert e.goodput_samples == 42 and e.backlog == Backlog()


def test_a_busy_relays_time_is_its_queue_not_a_slow_p():
    """The relay's first token from a relay already serving 4 requests came 0.4 s late:
    that is the relay's queue (0.1 s a request ahead), not P's prefill."""
    e = estimator()
    for _ in range(40):
        e.prefill_seen("p0", 1000, seconds=1.0 + 0.4, relay_active=4)
    assert e.prefill_tokens_per_s("p0") == pytest.approx(1000)
    assert e.relay_slot_s == pytest.approx(0.1, rel=0.01)
    # An idle relay's time is P's again; a relay faster than the estimate is no queue.
    e.prefill_seen("p0", 1000, seconds=2.0)
    assert e.prefill_tokens_per_s("p0") < 1000
    e.prefill_seen("p0", 1000, seconds=0.1, relay_active=2)
    assert e.relay_slot_s == pytest.approx(0.1 * (1 - GAIN), rel=0.01)


def test_a_frozen_view_counts_the_backlog_and_learns_nothing():
    e = estimator(frozen=True)
    t = e.commit(MB, "p0", 100, now=0.0)
    assert e.link().backlog_bytes == MB
    e.landed(t, now=60.0)
    e.prefill_seen("p0", 1000, seconds=60.0)
    e.prefill_seen("p0", 1000, seconds=60.0, relay_active=3)
    e.shipped(e.commit(MB, "p0", 0, now=0.0), MB, seconds=60.0, now=61.0)
    assert e.link().measured_goodput_gbps is None and e.relay_slot_s == 0.0
    assert e.backlog == Backlog()
    assert e.link().effective_gbps == 0.08
    assert e.prefill_rates() == {} and e.prefill_tokens_per_s("p0") == 1000
