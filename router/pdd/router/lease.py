"""What a routed request holds until it lets go: its in-flight counts in the shared
store (so other router replicas see the load before the workers' own reports catch up)
and its KV transfer in the link estimator, each released once."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from pdd.common.link_estimator import Arrival, LinkEstimator, Transfer
from pdd.common.wire import KVShipment
from pdd.router.route import WAN_BACKLOG_KIB, WAN_TRANSFERS, Route, md_pending_key
from pdd.router.state.base import RouterStore


@dataclass
class Lease:
    """What a request holds until it lets go, each released once: its in-flight count on
    each instance and on the link, and its KV transfer in the link estimator."""

    store: RouterStore
    held: dict[str, int] = field(default_factory=dict)
    estimator: LinkEstimator | None = None
    transfer: Transfer | None = None
    #: P reported the transfer imported (``LinkEstimator.shipped``): it is off the
    #: backlog, and MD's first token still times it (P's time alone only ever shows
    #: the line faster).
    shipped: Arrival | None = None
    dispatched_at: float = field(default_factory=time.monotonic)
    #: The counter of MD's computing this request holds (``Route.computing_key``):
    #: let go at MD's first token, when what MD computed for it is done.
    computing: str | None = None
    #: The MD this request counts as pending on until its first token (P serves it
    #: first: ``Route.main_waits_upstream``); None once it reached MD, or where it starts there.
    pending_main: str | None = None

    @classmethod
    def of(
        cls, route: Route, store: RouterStore, estimator: LinkEstimator, now: float | None = None
    ) -> Lease:
        """The lease of a route just chosen (``now``: when; the monotonic clock by
        default); a route that ships KV commits it to the line."""
        lease = cls(store, estimator=estimator)
        if now is not None:
            lease.dispatched_at = now
        lease.acquire(route.lease_keys, route.lease_amounts)
        lease.computing = route.computing_key
        if route.main_waits_upstream and route.main is not None:
            lease.pending_main = route.main.instance_id
        if route.loads_line and route.prefill is not None:
            lease.transfer = estimator.commit(
                route.kv_bytes,
                route.prefill.instance_id,
                route.prefill_tokens,
                lease.dispatched_at,
                route.backlog,
                relayed=route.relay is not None,
                main_id=route.main.instance_id if route.main is not None else "",
                carried=route.carried_hashes,
            )
        return lease

    def acquire(self, instance_ids: Sequence[str], amounts: Mapping[str, int] = {}) -> None:
        for i in instance_ids:
            n = amounts.get(i, 1)
            self.store.add_inflight(i, n)
            self.held[i] = n

    def release(self, instance_id: str) -> None:
        n = self.held.pop(instance_id, None)
        if n is not None:
            self.store.add_inflight(instance_id, -n)

    def main_reached(self) -> None:
        """The request's first token: it is at MD (or at its relay, whose KV is landing
        on MD), so MD counts it in full from now on, no longer as pending. Counted there
        before it leaves the pending count, so MD's total never reads low."""
        main, self.pending_main = self.pending_main, None
        if main is not None and md_pending_key(main) in self.held:
            self.acquire([main])
            self.release(md_pending_key(main))

    def kv_landed(self, now: float) -> None:
        """MD streams: it has the KV. The line's counts let go and the estimator learns
        (from MD's first token after a relay's hand-off, only that the line is faster).
        Where MD computed its miss instead, that computing is done."""
        self.release(WAN_TRANSFERS)
        self.release(WAN_BACKLOG_KIB)
        if self.computing is not None:
            self.release(self.computing)
        if self.transfer is not None and self.estimator is not None:
            self.estimator.landed(self.transfer, now, self.transfer.relayed, self.shipped)
            self.transfer = None

    def kv_shipped(self, shipment: KVShipment, now: float) -> None:
        """P reports MD imported the KV, timed at P: the line's counts let go and the
        estimator learns from P's time; MD's first token, if it comes later, still
        times the transfer from the router's side (``kv_landed``)."""
        self.release(WAN_TRANSFERS)
        self.release(WAN_BACKLOG_KIB)
        if self.transfer is not None and self.estimator is not None and self.shipped is None:
            self.shipped = self.estimator.shipped(
                self.transfer, shipment.kv_bytes, shipment.seconds, now
            )

    def release_line(self) -> None:
        """The KV is across, failed, or no longer waited for: the line's counts let go
        and a transfer nothing timed leaves the estimator's backlog."""
        self.release(WAN_TRANSFERS)
        self.release(WAN_BACKLOG_KIB)
        if self.transfer is not None and self.estimator is not None:
            if self.shipped is None:
                self.estimator.settle(self.transfer)  # failed, or ended before it landed
            self.transfer = None

    def release_all(self, keep_line: bool = False) -> None:
        """Let go of everything, or, with ``keep_line``, of all but the line's share
        (``release_line`` follows when P's report on the KV is in)."""
        for i in list(self.held):
            if not (keep_line and i in (WAN_TRANSFERS, WAN_BACKLOG_KIB)):
                self.release(i)
        if not keep_line:
            self.release_line()
