"""The fleet's O(log n) choices pick what a full scan of every instance picks.

The references below are the choice functions as they were before the fleet: score
every available instance, take the best ``(-score, instance_id)``; for a new
conversation, measure every MD's points on the ring. Random fleets, hits and weights,
reached through random sequences of updates and removals (so the tree's growth, slot
reuse and masking, and the ring's own additions and removals, are all exercised), must
agree with them exactly after every step.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from functools import cache

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pdd.router.affinity_ring as affinity_ring
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


@cache
def point(instance_id: str, v: int) -> int:
    """Where an instance's ``v``-th point sits on the ring (the ring's definition)."""
    digest = hashlib.blake2b(f"{instance_id}#{v}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def scan_ring(loads, key, points):
    """The first available MD clockwise of the key, by measuring every instance's points."""
    candidates = [i for i in loads if i.role == Role.MAIN and not i.saturated]
    if not candidates:
        return None
    pos = key_position(key)
    distance = {
        i.instance_id: min((point(i.instance_id, v) - pos - 1) % (1 << 64) for v in range(points))
        for i in candidates
    }  # bisect_right: a point equal to the key comes last
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


def replay(steps) -> Iterator[tuple[Fleet, list[InstanceLoad]]]:
    """The fleet and the loads it should hold after each step."""
    fleet, final = Fleet(), {}
    for s in steps:
        if isinstance(s, InstanceLoad):
            fleet.update(s)
            final[s.instance_id] = s
        else:
            fleet.remove(s)
            final.pop(s, None)
        yield fleet, list(final.values())


def last(replayed: Iterator[tuple[Fleet, list[InstanceLoad]]]):
    return [(Fleet(), []), *replayed][-1]


@settings(max_examples=300, deadline=None)
@given(
    steps=st.lists(step, max_size=60),
    hits=st.dictionaries(ids, st.integers(0, 4000), max_size=8),
    n=st.integers(0, 4000),
    w=st.sampled_from([0.1, 0.25, 0.3, 1.0, 2.5]),
    key=st.integers(0, 2**64 - 1),
)
def test_choices_equal_a_full_scan(steps, hits, n, w, key) -> None:
    """Asked after every step, so the ring (built at the first new conversation) is kept
    up by the updates and removals that follow: a stale member or a missing one shows."""
    for fleet, loads in replay(steps):
        assert_choices_equal_a_scan(fleet, loads, hits, n, w, key)


def assert_choices_equal_a_scan(fleet, loads, hits, n, w, key) -> None:
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
    fleet, _ = last(replay(steps))
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


@settings(max_examples=200, deadline=None)
@given(
    members=st.lists(st.sampled_from([f"md{k}" for k in range(12)]), max_size=30),
    keys=st.lists(st.integers(0, 2**64 - 1), min_size=1, max_size=5),
)
def test_a_ring_kept_up_prefers_what_a_ring_built_afresh_does(members, keys) -> None:
    """Each name toggles its instance in or out of a ring kept up one change at a time;
    every key's whole preference order must be the one a ring built from scratch gives."""
    kept, present = AffinityRing([], points=8), set()
    for m in members:
        (kept.remove if m in present else kept.add)(m)
        present ^= {m}
        fresh = AffinityRing(sorted(present), points=8)
        for key in keys:
            assert list(kept.preference(key)) == list(fresh.preference(key))


def test_a_member_joining_or_leaving_costs_its_own_points_not_a_rebuild(monkeypatch) -> None:
    """At 10,000 MDs a rebuild hashes 1.6 million points (seconds): a pod coming, going
    or left out for a retry must only place or lift its own."""
    fleet = Fleet.of(InstanceLoad(f"md{k}", Role.MAIN, 0, 4) for k in range(50))
    assert next(fleet.ring(Role.MAIN).preference(7)) in fleet.role(Role.MAIN)
    hashed = []
    real = affinity_ring._position
    monkeypatch.setattr(affinity_ring, "_position", lambda data: hashed.append(data) or real(data))
    fleet.update(InstanceLoad("md50", Role.MAIN, 0, 4))
    fleet.remove("md3")
    fleet.update(InstanceLoad("md3", Role.MAIN, 1, 4))
    fleet.update(InstanceLoad("md7", Role.MAIN, 2, 4))  # a load change: nothing to place
    assert next(fleet.ring(Role.MAIN).preference(7)) in fleet.role(Role.MAIN)
    assert len(hashed) <= 3 * affinity_ring.POINTS_PER_INSTANCE


def test_weights_must_be_positive() -> None:
    with pytest.raises(ValueError, match="positive"):
        ChoiceWeights(prefill_load=0.0)
