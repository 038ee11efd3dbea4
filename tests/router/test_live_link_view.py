"""The router's live link view: a route's lease commits its KV to the line and lets go
when MD has it; what the line is learnt to do changes the pipeline (driven clock)."""

import asyncio
from dataclasses import replace

import pytest

from pdd.common.cost_model import LinkState
from pdd.common.link_estimator import Backlog, LinkEstimator
from pdd.common.vocabulary import Pipeline, Role
from pdd.common.wire import Endpoint, KVShipment
from pdd.router.fleet import Fleet
from pdd.router.instance_choice import InstanceLoad
from pdd.router.lease import Lease
from pdd.router.link_view import LinkView
from pdd.router.policy import PolicyConfig, RequestFeatures, decide
from pdd.router.recent_traffic import TrafficWindow
from pdd.router.route import (
    WAN_BACKLOG_KIB,
    WAN_TRANSFERS,
    Route,
    md_computing_key,
    md_computing_tokens,
    md_pending_key,
)
from pdd.router.state.memory import LocalStore

pytestmark = pytest.mark.unit

KVB = 2048
#: The bench's default line: 0.05 Gbit/s, 30 ms.
LINK = LinkState(declared_gbps=0.05, rtt_ms=30)
#: The budget rules alone (no idle-relay rule): what the live view changes is the budget test.
POLICY = PolicyConfig(
    kv_bytes_per_token=KVB,
    ttft_budget_s=0.5,
    prefill_tokens_per_s=10_000,
    idle_relay_min_transfer_s=None,
)
FLEET = Fleet.of(
    [
        InstanceLoad("p0", Role.PREFILL, 0, 8),
        InstanceLoad("md0", Role.MAIN, 0, 8),
        InstanceLoad("rld0", Role.RELAY, 0, 8),
    ]
)


def ep(name: str) -> Endpoint:
    return Endpoint(instance_id=name, http_url=f"http://{name}", fast_addr="a:1", wan_addr="a:2")


def p_md_route(kv_bytes: int, prefill_tokens: int = 100) -> Route:
    return Route(
        Pipeline.P_MD, "r", "c", prefill=ep("p0"), relay=None, main=ep("md0"),
        kv_bytes=kv_bytes, prefill_tokens=prefill_tokens,
    )  # fmt: skip


def counts(store: LocalStore) -> dict[str, int]:
    return dict(asyncio.run(store.inflight()))


def test_a_lease_commits_the_kv_and_lets_go_once_md_has_it():
    store, estimator = LocalStore(60.0), LinkEstimator(LINK, 10_000)
    lease = Lease.of(p_md_route(300 * KVB), store, estimator)
    pending = md_pending_key("md0")  # at P until its first token: pending on MD
    assert counts(store) == {"p0": 1, pending: 1, WAN_TRANSFERS: 1, WAN_BACKLOG_KIB: 600}
    assert estimator.backlog == Backlog(300 * KVB, 1)
    lease.release("p0")
    lease.main_reached()  # the first token: MD counts it in full
    assert counts(store) == {"md0": 1, WAN_TRANSFERS: 1, WAN_BACKLOG_KIB: 600}
    lease.kv_landed(lease.dispatched_at + 0.2)
    assert estimator.backlog == Backlog() and WAN_BACKLOG_KIB not in counts(store)
    lease.release_all()  # the end of the stream settles nothing twice
    assert counts(store) == {} and estimator.backlog == Backlog()


def test_md_computing_counts_against_md_until_its_first_token():
    """Every replica sees the tokens MD computes for a request, until MD streams."""
    store, estimator = LocalStore(60.0), LinkEstimator(LINK, 10_000)
    route = replace(p_md_route(0), md_computes_miss=True, md_compute_tokens=300)
    lease = Lease.of(route, store, estimator)
    assert counts(store) == {"p0": 1, "md0": 1, md_computing_key("md0"): 300}
    assert md_computing_tokens(counts(store)) == {"md0": 300}
    lease.kv_landed(lease.dispatched_at + 0.2)
    assert md_computing_tokens(counts(store)) == {}
    lease.release_all()
    assert counts(store) == {}


class CountsNotToScan(dict):
    """Every instance's in-flight count, which a lookup may read but not walk through."""

    def __iter__(self):
        raise AssertionError("walked every in-flight count for one MD's")

    def items(self):
        raise AssertionError("walked every in-flight count for one MD's")


def test_md_computing_is_read_per_md_not_by_walking_every_count():
    """At 10,000 instances the store counts thousands of busy instances; the policy asks
    only about the MD it chose, so a route must not walk all of them."""
    inflight = CountsNotToScan({f"p{k}": 1 for k in range(100)})
    inflight[md_computing_key("md0")] = 300
    computing = md_computing_tokens(inflight)
    assert computing.get("md0", 0) == 300 and computing.get("md1", 0) == 0
    assert "md0" in computing and "md1" not in computing


def test_a_request_that_ends_before_its_kv_lands_settles_it_unlearnt():
    store, estimator = LocalStore(60.0), LinkEstimator(LINK, 10_000)
    Lease.of(p_md_route(300 * KVB), store, estimator).release_all()
    assert counts(store) == {} and estimator.backlog == Backlog()
    assert estimator.goodput_samples == 0


def test_a_request_the_relay_finished_keeps_its_kv_on_the_line_until_p_reports():
    store, estimator = LocalStore(60.0), LinkEstimator(LINK, 10_000)
    lease = Lease.of(p_md_route(300 * KVB), store, estimator, now=0.0)
    lease.release_all(keep_line=True)  # the client has its answer; the KV still crosses
    assert counts(store) == {WAN_TRANSFERS: 1, WAN_BACKLOG_KIB: 600}
    assert estimator.backlog == Backlog(300 * KVB, 1)
    lease.kv_shipped(KVShipment(kv_bytes=300 * KVB, seconds=0.5), now=3.0)
    lease.release_line()  # P's reports are over
    assert counts(store) == {} and estimator.backlog == Backlog()
    assert lease.shipped is not None  # the report times the line's queue (an arrival)


def choose(estimator: LinkEstimator, miss_tokens: int = 600) -> Pipeline:
    request = RequestFeatures(miss_tokens, 100, 1)
    link = LinkView(estimator.link(), prefill_rates=estimator.prefill_rates())
    result = decide(request, {}, FLEET, link, TrafficWindow(60.0, 100), POLICY)
    return result.pipeline  # type: ignore[union-attr]


@pytest.mark.parametrize("frozen", [False, True])
def test_a_line_learnt_ten_times_slower_sends_the_next_request_through_a_relay(frozen):
    """600 tokens of KV (1.2 MB) take 0.2 s on the declared line: P-MD. The line now runs
    at a tenth of that; the transfers that land say so, and the live view relays the
    same request. A static view keeps P-MD."""
    estimator = LinkEstimator(LINK, 10_000, frozen=frozen)
    assert choose(estimator) == Pipeline.P_MD
    for i in range(8):  # one a second, each alone on the line
        lease = Lease.of(p_md_route(600 * KVB, 0), LocalStore(60.0), estimator, now=float(i))
        lease.kv_landed(i + 0.03 + 600 * KVB * 8 / 0.005e9)
    assert choose(estimator) == (Pipeline.P_MD if frozen else Pipeline.P_RLD_MD)


def test_a_slow_line_is_learnt_when_p_reports_before_md_streams():
    """P's report that MD imported the KV usually beats MD's first token to the router.
    It lets go of the line's counts, and the first token still times the transfer: the
    tenfold slower line is learnt and the request relayed, as when MD streams first."""
    store, estimator = LocalStore(60.0), LinkEstimator(LINK, 10_000)
    line_s = 600 * KVB * 8 / 0.005e9
    for i in range(8):
        lease = Lease.of(p_md_route(600 * KVB, 0), store, estimator, now=float(i))
        lease.kv_shipped(KVShipment(kv_bytes=600 * KVB, seconds=0.03 + line_s), i + line_s)
        assert estimator.backlog == Backlog()
        lease.kv_landed(i + 0.03 + line_s + 0.01)
    assert estimator.goodput_samples == 8
    assert choose(estimator) == Pipeline.P_RLD_MD


def test_the_next_turn_relays_while_the_kv_its_hit_counts_on_still_crosses():
    """Turn 1's 300 tokens of KV (0.6 MB, about 0.1 s on the declared line) are on their
    way to md0, and the index already counts them as md0's. Turn 2 extends turn 1 and
    misses 4 tokens: alone on the line that is one RTT, but md0 lets turn 1's KV land
    before it attaches turn 2, so MD's first token waits for all of it, and an idle relay
    hides that. Once P reports turn 1 imported, turn 2 goes P-MD."""
    store, estimator = LocalStore(60.0), LinkEstimator(LINK, 10_000)
    policy = PolicyConfig(kv_bytes_per_token=KVB, ttft_budget_s=0.5, prefill_tokens_per_s=10_000)
    turn1_blocks = tuple(range(100, 119))
    route = Route(
        Pipeline.P_RLD_MD, "r", "c", prefill=ep("p0"), relay=ep("rld0"), main=ep("md0"),
        kv_bytes=300 * KVB, prefill_tokens=300, carried_hashes=turn1_blocks,
    )  # fmt: skip
    turn1 = Lease.of(route, store, estimator, now=0.0)
    turn1.release_all(keep_line=True)  # the relay finished turn 1; its KV still crosses
    turn2 = RequestFeatures(304, 16, 1)
    hashes = (*turn1_blocks, 119)

    def pipeline() -> Pipeline:
        link = LinkView(estimator.link(), awaited_bytes=estimator.awaited_bytes(hashes))
        result = decide(
            turn2, {"md0": 300, "p0": 300}, FLEET, link, TrafficWindow(60.0, 100), policy
        )
        return result.pipeline  # type: ignore[union-attr]

    assert pipeline() == Pipeline.P_RLD_MD
    turn1.kv_shipped(KVShipment(kv_bytes=300 * KVB, seconds=0.13), now=0.2)
    turn1.release_line()
    assert pipeline() == Pipeline.P_MD


def test_a_slow_prefill_measured_on_one_p_counts_in_its_estimate():
    estimator = LinkEstimator(LINK, 10_000)
    assert choose(estimator, 600) == Pipeline.P_MD
    for _ in range(10):
        estimator.prefill_seen("p0", 600, seconds=0.6)  # 1,000 tokens/s, not 10,000
    assert choose(estimator, 600) == Pipeline.P_RLD_MD


def test_a_relayed_transfer_times_a_recovery_not_a_collapse():
    """A relayed request's KV is timed by MD's first token after the hand-off, or by
    P's report: both also hold waits that are not the line's (the relay's step loop,
    the engines), so a slow time teaches nothing and a fast one shows the line back."""
    store, estimator = LocalStore(60.0), LinkEstimator(LINK, 10_000)
    route = Route(
        Pipeline.P_RLD_MD, "r", "c", prefill=ep("p0"), relay=ep("rld0"), main=ep("md0"),
        kv_bytes=600 * KVB, prefill_tokens=100,
    )  # fmt: skip
    slow = Lease.of(route, store, estimator, now=0.0)
    slow.kv_shipped(KVShipment(kv_bytes=600 * KVB, seconds=2.5), 2.6)  # 10x the declared time
    slow.kv_landed(3.0)  # MD streams after P's report: nothing twice
    assert estimator.link().effective_gbps == 0.05 and estimator.goodput_samples == 0
    pending = md_pending_key("md0")
    assert estimator.backlog == Backlog() and counts(store) == {"p0": 1, "rld0": 1, pending: 1}
    learnt = Lease.of(p_md_route(600 * KVB), store, estimator, now=10.0)
    learnt.kv_landed(10.0 + 0.01 + 0.03 + 2.0)  # P-MD: a 10x slower line
    collapsed = estimator.link().effective_gbps
    assert collapsed < 0.05
    back = Lease.of(route, store, estimator, now=20.0)
    back.kv_shipped(KVShipment(kv_bytes=600 * KVB, seconds=0.03 + 0.2), 20.3)  # declared rate
    assert estimator.link().effective_gbps > collapsed
