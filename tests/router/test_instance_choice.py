"""Instance choice: prefix affinity for MD, hit-versus-load for P, least-loaded RLD."""

from collections import Counter

import pytest

from pdd.common.block_hash import block_hashes
from pdd.common.cache_events import BlockStored
from pdd.common.vocabulary import Role
from pdd.router.fleet import Fleet
from pdd.router.instance_choice import (
    InstanceLoad,
    choose_main_decode,
    choose_prefill,
    choose_relay,
)
from pdd.router.prefix_index import PrefixIndex, PrefixIndexConfig

pytestmark = pytest.mark.unit


def mds(*loads, capacity=8):
    return [InstanceLoad(f"md{i}", Role.MAIN, a, capacity) for i, a in enumerate(loads)]


def test_same_conversation_lands_on_same_md_across_turns():
    """Turn 1 goes by the affinity ring and MD stores it; turn 2 follows the hit."""
    index = PrefixIndex(PrefixIndexConfig(block_size=4))
    fleet = mds(0, 0, 0, 0)
    turn1 = list(range(40))
    turn2 = turn1 + list(range(100, 140))
    key = block_hashes(turn1, 4)[0]
    first = choose_main_decode(Fleet.of(fleet), index.match(index.hashes(turn1)), 40, key)
    stored = BlockStored(block_hashes=index.hashes(turn1), parent_hash=None, block_size=4)
    index.apply(first.instance_id, stored)
    # The chosen MD is now busier than the others; the conversation still sticks.
    busier = [InstanceLoad(i.instance_id, i.role, 5 if i == first else 0, 8) for i in fleet]
    second = choose_main_decode(Fleet.of(busier), index.match(index.hashes(turn2)), 80, key)
    assert second.instance_id == first.instance_id


def test_affinity_follows_the_hit_not_the_hash():
    """After a scale-up the hash may prefer another MD; the DRC hit keeps the turn home."""
    fleet = mds(0, 0, 0, 0)
    key = 777
    hashed = choose_main_decode(Fleet.of(fleet), {}, 1000, key)
    home = next(i for i in fleet if i != hashed)
    chosen = choose_main_decode(Fleet.of(fleet), {home.instance_id: 640}, 1000, key)
    assert chosen == home


def test_new_conversations_spread_over_mds():
    fleet = mds(0, 0, 0, 0)
    picks = Counter(
        choose_main_decode(Fleet.of(fleet), {}, 100, block_hashes([k] * 16, 16)[0]).instance_id
        for k in range(200)
    )
    assert set(picks) == {"md0", "md1", "md2", "md3"}
    assert min(picks.values()) > 25  # 50 expected each


def test_affinity_is_stable_and_skips_saturated():
    fleet = mds(0, 0, 0, 0)
    key = 12345
    chosen = choose_main_decode(Fleet.of(fleet), {}, 100, key)
    assert choose_main_decode(Fleet.of(fleet), {}, 100, key) == chosen
    others = [i for i in fleet if i.instance_id != chosen.instance_id]
    # Removing the chosen MD moves only this key, to some other MD.
    assert choose_main_decode(Fleet.of(others), {}, 100, key) in others


def test_md_affinity_yields_to_a_full_md():
    fleet = mds(8, 0)  # md0 holds the prefix but is at capacity
    chosen = choose_main_decode(Fleet.of(fleet), {"md0": 900}, 1000, 1)
    assert chosen.instance_id == "md1"


def test_md_with_bigger_hit_wins_over_idle_md():
    fleet = Fleet.of(mds(6, 0))
    assert choose_main_decode(fleet, {"md0": 900, "md1": 100}, 1000, 1).instance_id == "md0"


def test_prefill_trades_hit_for_load():
    ps = [InstanceLoad("p0", Role.PREFILL, 0, 10), InstanceLoad("p1", Role.PREFILL, 9, 10)]
    # p1 holds 80% but is 90% busy: 0.8 - 0.9 < 0 - 0 -> p0.
    assert choose_prefill(Fleet.of(ps), {"p1": 800}, 1000).instance_id == "p0"
    # Holding everything while half busy beats idle with nothing.
    ps[1] = InstanceLoad("p1", Role.PREFILL, 5, 10)
    assert choose_prefill(Fleet.of(ps), {"p1": 1000}, 1000).instance_id == "p1"


def test_ties_break_to_lowest_id():
    ps = [InstanceLoad(n, Role.PREFILL, 0, 4) for n in ("p10", "p2", "p1")]
    assert choose_prefill(Fleet.of(ps), {}, 100).instance_id == "p1"
    rs = [InstanceLoad(n, Role.RELAY, 1, 4) for n in ("r2", "r1")]
    assert choose_relay(Fleet.of(rs)).instance_id == "r1"


def test_relay_least_loaded_by_utilization():
    rs = [InstanceLoad("r0", Role.RELAY, 3, 4), InstanceLoad("r1", Role.RELAY, 4, 16)]
    assert choose_relay(Fleet.of(rs)).instance_id == "r1"


def test_empty_candidates_give_none():
    assert choose_prefill(Fleet.of([]), {}, 1) is None
    assert choose_main_decode(Fleet.of([]), {}, 1, 0) is None
    assert choose_relay(Fleet.of([])) is None


def test_instance_load_validates():
    with pytest.raises(ValueError, match="capacity"):
        InstanceLoad("x", Role.MAIN, 0, 0)
    with pytest.raises(ValueError, match="active"):
        InstanceLoad("x", Role.MAIN, -1, 1)
