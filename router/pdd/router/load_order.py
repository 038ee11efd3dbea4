"""One role's instances ordered by load: the least utilized in O(1), a change in O(log n).

A tournament tree: a flat list where every node is the smaller of its two children,
over one leaf per instance holding its key ``(utilization, instance_id)``; the root is
the least utilized instance, ties to the lower id (the order the choice functions
break ties in). A saturated instance's leaf holds :data:`_ABSENT`, so the root is
always the best instance that can take one more request, or ``_ABSENT`` when none can.

``least_loaded(skip)`` reads the root; only when the root is one of ``skip`` (the prefix
holders, which the choice scores apart) does it mask the skipped leaves, read the root
again and restore them: O(|skip| log n), never a scan.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable

from pdd.router.instance_load import InstanceLoad

_Key = tuple[float, str]
#: The key of an empty leaf or of an instance that cannot take a request.
_ABSENT: _Key = (math.inf, "")


def _key(load: InstanceLoad) -> _Key:
    return _ABSENT if load.saturated else (load.utilization, load.instance_id)


class LoadOrder:
    """The instances of one role, each in its own leaf (a slot) of a tournament tree."""

    def __init__(self) -> None:
        self._leaves = 1  # a power of two; leaf ``slot`` is ``_tree[_leaves + slot]``
        self._tree: list[_Key] = [_ABSENT, _ABSENT]
        self._slots: dict[str, int] = {}
        self._free: list[int] = []  # slots of removed instances, reused first
        self._loads: dict[str, InstanceLoad] = {}

    def __len__(self) -> int:
        return len(self._loads)

    def __contains__(self, instance_id: object) -> bool:
        return instance_id in self._loads

    def get(self, instance_id: str) -> InstanceLoad | None:
        return self._loads.get(instance_id)

    def ids(self) -> Iterable[str]:
        return self._loads.keys()

    def available(self, instance_id: str) -> InstanceLoad | None:
        """The instance's load if it is here and can take one more request."""
        load = self._loads.get(instance_id)
        return None if load is None or load.saturated else load

    def update(self, load: InstanceLoad) -> None:
        """Add the instance or record its new load: O(log n)."""
        slot = self._slots.get(load.instance_id)
        if slot is None:
            slot = self._allocate(load.instance_id)
        self._loads[load.instance_id] = load
        self._set(slot, _key(load))

    def remove(self, instance_id: str) -> None:
        slot = self._slots.pop(instance_id, None)
        if slot is None:
            return
        del self._loads[instance_id]
        self._set(slot, _ABSENT)
        self._free.append(slot)

    def least_loaded(self, skip: Collection[str] = ()) -> InstanceLoad | None:
        """The least utilized instance that can take a request, ties to the lower id,
        leaving out ``skip`` (ids of other roles or unknown ids are ignored)."""
        best = self._tree[1]
        if best[1] not in skip:  # the usual case: the best is not a prefix holder
            return None if best[0] == math.inf else self._loads[best[1]]
        masked = [(slot, self._tree[self._leaves + slot]) for slot in self._slots_of(skip)]
        for slot, _ in masked:
            self._set(slot, _ABSENT)
        best = self._tree[1]
        for slot, key in masked:  # keys were read before any masking: repeats are safe
            self._set(slot, key)
        return None if best[0] == math.inf else self._loads[best[1]]

    def _slots_of(self, ids: Iterable[str]) -> list[int]:
        slots = self._slots
        return [slots[i] for i in ids if i in slots]

    def _set(self, slot: int, key: _Key) -> None:
        """Set a leaf and fix its ancestors, stopping at the first one that keeps its
        value (those above it are then unchanged too): most changes stop low."""
        tree = self._tree
        i = self._leaves + slot
        tree[i] = key
        i >>= 1
        while i:
            left, right = tree[2 * i], tree[2 * i + 1]
            smaller = left if left <= right else right
            if tree[i] == smaller:
                return
            tree[i] = smaller
            i >>= 1

    def _allocate(self, instance_id: str) -> int:
        if self._free:
            slot = self._free.pop()
        else:
            slot = len(self._slots)
            if slot == self._leaves:
                self._grow()
        self._slots[instance_id] = slot
        return slot

    def _grow(self) -> None:
        """Double the leaves and rebuild the inner nodes: O(n), once per doubling."""
        old, n = self._tree, self._leaves
        self._leaves = 2 * n
        tree = [_ABSENT] * (4 * n)
        tree[2 * n : 3 * n] = old[n : 2 * n]
        for i in range(2 * n - 1, 0, -1):
            left, right = tree[2 * i], tree[2 * i + 1]
            tree[i] = left if left <= right else right
        self._tree = tree
