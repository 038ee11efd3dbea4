"""Every instance's load as the router sees it, kept per role for choices that never scan.

The live router and the simulator both hold one :class:`Fleet` and tell it when an
instance's load changes (``update``/``remove``, or ``sync`` against a fresh list);
``pdd.router.instance_choice`` then picks P, MD and RLD from it in O(log n) plus the
prompt's holders, instead of scoring every instance per request.
"""

from __future__ import annotations

from collections.abc import Iterable

from pdd.common.vocabulary import Role
from pdd.router.affinity_ring import AffinityRing
from pdd.router.instance_load import InstanceLoad
from pdd.router.load_order import LoadOrder


class Fleet:
    """Per role, the instances ordered by load (:class:`LoadOrder`) and their
    :class:`AffinityRing`, built when first needed and from then on kept up member by
    member (only MD's is ever asked for)."""

    def __init__(self) -> None:
        self._orders: dict[Role, LoadOrder] = {}
        self._role_of: dict[str, Role] = {}
        self._rings: dict[Role, AffinityRing] = {}

    @classmethod
    def of(cls, loads: Iterable[InstanceLoad]) -> Fleet:
        fleet = cls()
        for load in loads:
            fleet.update(load)
        return fleet

    def update(self, load: InstanceLoad) -> None:
        """Add an instance or record its new load: O(log n) (a new member also places its
        points on its role's ring, once that is built)."""
        role = self._role_of.get(load.instance_id)
        if role is not load.role:
            if role is not None:
                self.remove(load.instance_id)
            self._role_of[load.instance_id] = load.role
            ring = self._rings.get(load.role)
            if ring is not None:
                ring.add(load.instance_id)
        self.role(load.role).update(load)

    def remove(self, instance_id: str) -> None:
        role = self._role_of.pop(instance_id, None)
        if role is not None:
            self._orders[role].remove(instance_id)
            ring = self._rings.get(role)
            if ring is not None:
                ring.remove(instance_id)

    def sync(self, loads: Iterable[InstanceLoad]) -> None:
        """Make the fleet exactly ``loads``: changed instances are updated, missing ones
        removed. A comparison per instance, a tree update only per change."""
        seen: set[str] = set()
        for load in loads:
            seen.add(load.instance_id)
            role = self._role_of.get(load.instance_id)
            if role is None or self._orders[role].get(load.instance_id) != load:
                self.update(load)
        for gone in [i for i in self._role_of if i not in seen]:
            self.remove(gone)

    def role(self, role: Role) -> LoadOrder:
        order = self._orders.get(role)
        if order is None:
            order = self._orders[role] = LoadOrder()
        return order

    def ring(self, role: Role) -> AffinityRing:
        ring = self._rings.get(role)
        if ring is None:
            ring = self._rings[role] = AffinityRing(self.role(role).ids())
        return ring
