"""The fleet's O(log n) choices pick what a full scan of every instance picks.

The references below are the choice functions as they were before the fleet: score
every available instance, take the best ``(-score, instance_id)``. Random fleets, hits
and weights, reached through random sequences of updates and removals (so the tree's
growth, slot reuse and masking are all exercised), must agree with them exactly.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdd.common.vocabulary import Role
from pdd.router.affinity_ring import AffinityRing, key_position
from pdd.router.fleet import Fleet
from pdd.router.instance_choice import (
    ChoiceWeights,
    InstanceLoad,
    choose_main_decode,
    choose_prefill,
    choose_relay,
)

pytestmark = pytest.mark.unit

ROLES = (Role.PREFILL, Role.MAIN, Role.RELAY)


def scan_best(loads, role, hits, n, w):
    candidates = [i for i in loads if i.role == role and not i.saturated]
    if not candidates:
        return None

    def score(i):
        hit = hits.get(i.instance_id, 0) / n if n > 0 else 0.0
        return hit - w * i.utilization

    return min(candidates, key=lambda i: (-score(i), i.instance_id))


def scan_ring(loads, key, points):
    """The first available MD clockwise of the key, by measuring every instance's points."""
    candidates = [i for i in loads if i.role == Role.MAIN and not i.saturated]
    if not candidates:
        return None
    pos = key_position(key)
    members = sorted({i.instance_id for i in loads if i.role == Role.MAIN})
    ring = AffinityRing(members, points)
    distance = {}
    for p, owner in zip(ring._positions, ring._owners, strict=True):
        d = (p - pos - 1) % (1 << 64)  # bisect_right: a point equal to the key comes last
        distance[owner] = min(distance.get(owner, d), d)
    return min(candidates, key=lambda i: (distance[i.instance_id], i.instance_id))


ids = st.sampled_from([f"{r}{k}" for r in ("p", "md", "rld") for k in range(12)])
load = st.builds(
    InstanceLoad,
    instance_id=ids,
    role=st.sampled_from(ROLES),
    active=st.integers(0, 10),
    capacity=st.integers(1, 8),
)
step = st.one_of(load, ids)  # an update, or the removal of an id


def replay(steps) -> tuple[Fleet, list[InstanceLoad]]:
    fleet, final = Fleet(), {}
    for s in steps:
        if isinstance(s, InstanceLoad):
            fleet.update(s)
            final[s.instance_id] = s
        else:
            fleet.remove(s)
            final.pop(s, None)
    return fleet, list(final.values())


@settings(max_examples=300, deadline=None)
@given(
    steps=st.lists(step, max_size=60),
    hits=st.dictionaries(ids, st.integers(0, 4000), max_size=8),
    n=st.integers(0, 4000),
    w=st.sampled_from([0.1, 0.25, 0.3, 1.0, 2.5]),
    key=st.integers(0, 2**64 - 1),
)
def test_choices_equal_a_full_scan(steps, hits, n, w, key) -> None:
    fleet, loads = replay(steps)
    weights = ChoiceWeights(prefill_load=w, main_load=w)
    assert choose_prefill(fleet, hits, n, weights) == scan_best(loads, Role.PREFILL, hits, n, w)
    assert choose_relay(fleet) == scan_best(loads, Role.RELAY, {}, 1, 1.0)
    md = choose_main_decode(fleet, hits, n, key, weights)
    mains = {i.instance_id for i in loads if i.role == Role.MAIN and not i.saturated}
    if any(hits[i] > 0 for i in hits if i in mains):
        assert md == scan_best(loads, Role.MAIN, hits, n, w)
    else:
        assert md == scan_ring(loads, key, points=160)


@settings(max_examples=100, deadline=None)
@given(steps=st.lists(step, max_size=60), changes=st.lists(load, max_size=20))
def test_sync_makes_the_fleet_exactly_the_new_loads(steps, changes) -> None:
    fleet, _ = replay(steps)
    target = {**{c.instance_id: c for c in changes}}
    fleet.sync(target.values())
    fresh = Fleet.of(target.values())
    for role in ROLES:
        assert sorted(fleet.role(role).ids()) == sorted(fresh.role(role).ids())
        assert fleet.role(role).least_loaded() == fresh.role(role).least_loaded()
        assert [fleet.role(role).get(i) for i in fresh.role(role).ids()] == [
            fresh.role(role).get(i) for i in fresh.role(role).ids()
        ]


def test_least_loaded_skips_and_restores_holders_even_when_named_twice() -> None:
    fleet = Fleet.of(InstanceLoad(f"p{k}", Role.PREFILL, k, 8) for k in range(5))
    order = fleet.role(Role.PREFILL)
    assert order.least_loaded(skip=["p0", "p1", "p0", "md9"]).instance_id == "p2"
    assert order.least_loaded().instance_id == "p0"


def test_the_ring_spreads_new_conversations_evenly() -> None:
    ring = AffinityRing([f"md{k}" for k in range(20)])
    counts: dict[str, int] = {}
    for key in range(20_000):  # small consecutive keys, as trace keys are
        first = next(ring.preference(key))
        counts[first] = counts.get(first, 0) + 1
    assert len(counts) == 20
    assert max(counts.values()) < 1.35 * 1000 and min(counts.values()) > 0.65 * 1000


def test_removing_an_md_moves_only_the_keys_that_preferred_it() -> None:
    members = [f"md{k}" for k in range(10)]
    before, after = AffinityRing(members), AffinityRing(members[1:])
    for key in range(2_000):
        first = next(before.preference(key))
        if first != "md0":
            assert next(after.preference(key)) == first


def test_weights_must_be_positive() -> None:
    with pytest.raises(ValueError, match="positive"):
        ChoiceWeights(prefill_load=0.0)
