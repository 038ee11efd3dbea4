"""The fleet the policy chooses from, kept in step by applying only what changed.

A route needs every routable instance's load: the larger of what the worker last
reported and what the routers have in flight on it. Rebuilding that for every request
costs a pass over the whole fleet (6.5 ms per request at 1,000 instances, measured).
Instead the view applies each change the registry makes (a poll's answer, a suspicion,
a pod gone) as it is made, and each route applies only the in-flight counts that moved
since the last one: a request costs O(its own leases' changes x log n) however large
the fleet, and the fleet's per-role orders answer the choice. (Polls still cost
O(log n) per changed report, on the poll's path.)
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager

from pdd.common.vocabulary import Role
from pdd.router.fleet import Fleet
from pdd.router.instance_load import InstanceLoad
from pdd.router.registry import Instance, InstanceRegistry
from pdd.router.route import md_pending_key, pending_main

#: The policy's roles for the workers' roles; a mono instance plays main decode.
POLICY_ROLE: dict[Role, Role] = {
    Role.PREFILL: Role.PREFILL,
    Role.RELAY: Role.RELAY,
    Role.MAIN: Role.MAIN,
    Role.MONO: Role.MAIN,
}


class RoutingView:
    """The routable instances by id and their loads in a :class:`Fleet`."""

    def __init__(self, registry: InstanceRegistry, capacity_cap: int | None = None) -> None:
        """``capacity_cap``: the config's per-instance limit, below the workers' own."""
        self.fleet = Fleet()
        self._registry = registry
        self._cap = capacity_cap
        self._by_id: dict[str, Instance] = {}
        self._id_of: dict[str, str] = {}  # URL -> the instance id it was last routable as
        self._inflight: Mapping[str, int] = {}
        self._stale: set[str] = set()  # left out for one retry: recompute on the next refresh
        #: Each routable instance's engine, as its ``/health`` reported (``EngineInfo.engine``).
        self.engines: dict[str, str] = {}
        registry.watch(self._take_registry_changes)
        self._take_registry_changes()  # what the registry changed before this view

    def instance(self, instance_id: str) -> Instance:
        return self._by_id[instance_id]

    def cache_block(self, instance_id: str) -> int:
        """Tokens per block of the instance's prefix cache, as its ``/health`` reported
        (``EngineInfo.block_size``): the unit its hits are reused in. 1 (any hit as it
        is) where the instance is not routable or did not say (nothing routes by it)."""
        inst = self._by_id.get(instance_id)
        return 1 if inst is None or inst.engine is None else inst.engine.block_size

    def refresh(self, inflight: Mapping[str, int], moved: set[str]) -> None:
        """Take the in-flight counts (every replica's sum), of which only the ``moved``
        instances' may differ from the last refresh, and bring back those a retry left out."""
        self._inflight = inflight
        moved = {pending_main(key) or key for key in moved}  # an MD's pending count is its own
        dirty, self._stale = self._stale | moved, set()
        for instance_id in dirty:
            self._apply(instance_id)

    def _take_registry_changes(self) -> None:
        """Apply what the registry changed (it calls this after each change), with the
        in-flight counts of the last refresh: an instance whose count moved since is
        among the next refresh's ``moved``."""
        dirty = set()
        for url, inst in self._registry.take_changes():
            old = self._id_of.pop(url, None)
            if old is not None:
                self._by_id.pop(old, None)
                self.engines.pop(old, None)
                dirty.add(old)
            if inst is not None and inst.endpoint is not None and self._registry.routes_to(inst):
                instance_id = inst.endpoint.instance_id
                self._id_of[url] = instance_id
                self._by_id[instance_id] = inst
                if inst.engine is not None:
                    self.engines[instance_id] = inst.engine.engine
                dirty.add(instance_id)
        for instance_id in dirty:
            self._apply(instance_id)

    @contextmanager
    def excluding(self, instance_ids: frozenset[str]) -> Iterator[None]:
        """Leave these instances out of the fleet for one decision (a retry's failed ones)."""
        for instance_id in instance_ids:
            self.fleet.remove(instance_id)
        try:
            yield
        finally:
            self._stale |= instance_ids

    def _apply(self, instance_id: str) -> None:
        load = self._load(instance_id)
        if load is None:
            self.fleet.remove(instance_id)
        else:
            self.fleet.update(load)

    def _load(self, instance_id: str) -> InstanceLoad | None:
        """Active = the larger of the routers' in-flight count and the worker's own report;
        pending = the requests routed to it still at P (an MD's: ``md_pending_key``);
        capacity = what the worker reports (its max_running_requests), capped by the config's."""
        inst = self._by_id.get(instance_id)
        if inst is None or inst.load is None:  # gone, or not polled yet
            return None
        report = inst.load
        capacity = report.capacity if self._cap is None else min(self._cap, report.capacity)
        active = max(report.running + report.waiting, self._inflight.get(instance_id, 0))
        pending = self._inflight.get(md_pending_key(instance_id), 0)
        return InstanceLoad(instance_id, POLICY_ROLE[inst.role], active, capacity, pending)
