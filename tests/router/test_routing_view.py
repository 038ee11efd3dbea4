"""The routing view, updated by changes only, always equals the fleet rebuilt from scratch,
and takes the registry's changes as they happen, so a route has none left to apply."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdd.common.vocabulary import Role
from pdd.common.wire import Endpoint, LoadReport
from pdd.router.config import WorkerRef
from pdd.router.instance_load import InstanceLoad
from pdd.router.prefix_index import PrefixIndex, PrefixIndexConfig
from pdd.router.registry import Instance, InstanceRegistry
from pdd.router.route import md_pending_key
from pdd.router.routing_view import POLICY_ROLE, RoutingView
from pdd.router.state.memory import LocalStore
from pdd.router.worker_client import WorkerClient

pytestmark = pytest.mark.unit

NAMES = [(Role.PREFILL, "p0"), (Role.PREFILL, "p1"), (Role.RELAY, "r0"), (Role.MAIN, "m0"),
         (Role.MAIN, "m1"), (Role.MAIN, "m2")]  # fmt: skip
CAP = 4  # the config's per-instance limit, below the workers' 8


#: Never called here (no poll runs); one for all examples, as building one is slow.
CLIENT = WorkerClient("t")


def registry() -> InstanceRegistry:
    refs = tuple(WorkerRef(role, f"http://{name}", name) for role, name in NAMES)
    return InstanceRegistry(refs, CLIENT, PrefixIndex(PrefixIndexConfig(16)), 1.0)


def answer_poll(reg: InstanceRegistry, inst: Instance, running: int) -> None:
    """What a good poll does: identity, a load report, ready."""
    name = inst.expected_id
    assert name is not None
    inst.endpoint = Endpoint(
        instance_id=name, http_url=inst.http_url, fast_addr="x:1", wan_addr="x:2"
    )
    inst.load = LoadReport(
        instance_id=name, role=inst.role, running=running, waiting=0, kv_blocks_free=1,
        kv_blocks_total=2, relay_load=0.0, capacity=8,
    )  # fmt: skip
    reg._mark_ready(inst)


def from_scratch(reg: InstanceRegistry, inflight: dict[str, int]) -> dict[str, InstanceLoad]:
    """The loads a full pass over the registry gives (what every route did before)."""
    loads = {}
    for inst in reg.routable():
        name, report = inst.instance_id, inst.load
        assert name is not None and report is not None
        active = max(report.running + report.waiting, inflight.get(name, 0))
        pending = inflight.get(md_pending_key(name), 0)
        role, capacity = POLICY_ROLE[inst.role], min(CAP, report.capacity)
        loads[name] = InstanceLoad(name, role, active, capacity, pending)
    return loads


def in_view(view: RoutingView) -> dict[str, InstanceLoad]:
    loads = {}
    for role in (Role.PREFILL, Role.RELAY, Role.MAIN):
        order = view.fleet.role(role)
        loads.update({i: order.get(i) for i in order.ids()})
    return loads


operation = st.one_of(
    st.tuples(st.just("poll"), st.integers(0, 5), st.integers(0, 2)),
    st.tuples(st.just("fail"), st.integers(0, 5), st.just(0)),
    st.tuples(st.just("suspect"), st.integers(0, 5), st.just(0)),
    st.tuples(st.just("lease"), st.integers(0, 5), st.sampled_from([1, -1])),
    st.tuples(st.just("pending"), st.integers(0, 5), st.sampled_from([1, -1])),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(operation, max_size=60))
async def test_the_view_equals_a_rebuild_after_any_changes(ops) -> None:
    """Polls, failures, suspicions (a role whose every instance is suspected keeps them
    routable, and drops them when one recovers) and leases, in any order, each followed
    by a route's refresh: the view never drifts from a rebuild from scratch. A poll, a
    failure or a suspicion is in the view before any route: the route's refresh applies
    only the leases that moved (an MD's pending count among them), not the fleet's news."""
    reg, store = registry(), LocalStore(60.0)
    view = RoutingView(reg, capacity_cap=CAP)
    instances = reg.all()
    for op, k, arg in ops:
        inst = instances[k]
        if op == "poll":
            answer_poll(reg, inst, arg)
        elif op == "fail":
            reg._set_problem(inst, "connection refused")  # what a failed poll does
        elif op == "suspect" and inst.instance_id is not None:
            reg.suspect(inst.instance_id, "a request failed on it")
        elif op in ("lease", "pending"):
            key = NAMES[k][1] if op == "lease" else md_pending_key(NAMES[k][1])
            if arg > 0 or store.counts().get(key, 0) > 0:
                store.add_inflight(key, arg)
        if op not in ("lease", "pending"):
            assert in_view(view) == from_scratch(reg, store.counts())
            assert reg.take_changes() == []
        view.refresh(await store.inflight(), store.take_moved())
        assert in_view(view) == from_scratch(reg, store.counts())


async def test_an_instance_left_out_for_a_retry_returns_on_the_next_refresh() -> None:
    reg, store = registry(), LocalStore(60.0)
    for inst in reg.all():
        answer_poll(reg, inst, 1)
    view = RoutingView(reg)
    view.refresh(await store.inflight(), store.take_moved())
    with view.excluding(frozenset({"m0", "p1"})):
        assert set(view.fleet.role(Role.MAIN).ids()) == {"m1", "m2"}
        assert set(view.fleet.role(Role.PREFILL).ids()) == {"p0"}
    view.refresh(await store.inflight(), store.take_moved())
    assert set(view.fleet.role(Role.MAIN).ids()) == {"m0", "m1", "m2"}
    assert set(view.fleet.role(Role.PREFILL).ids()) == {"p0", "p1"}
