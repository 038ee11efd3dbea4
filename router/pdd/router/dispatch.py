"""From token IDs to a route: the prefix index, the shared loads and R1's policy, joined.

``Dispatcher.route`` gathers what the pure ``policy.decide`` needs (hits, instance
loads, the link, the recent traffic window), turns its answer into the workers'
endpoints, and raises typed errors for "nobody is up" (503) and "everybody is busy"
(429). ``Lease`` counts the request against its instances in the shared store, so
other router replicas see the load before the workers' own reports catch up; a route
whose KV crosses the link also counts under ``WAN_TRANSFERS`` (and its KiB under
``WAN_BACKLOG_KIB``) until MD has it, and the policy sees the line through the link
estimator (``pdd.common.link_estimator``, the simulator's too): measured goodput and
the backlog every replica committed, so P-MD requests stop piling up on a busy line.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from pdd.common.cost_model import LinkState
from pdd.common.kv_codec import ADAPTIVE, KVCodec, shared_in_receiver_cache
from pdd.common.link_estimator import Arrival, Backlog, LinkEstimator, Transfer
from pdd.common.vocabulary import Pipeline, Role
from pdd.common.wire import Endpoint, KVShipment, PipelinePlan, SamplingSpec
from pdd.router.config import RouterConfig
from pdd.router.errors import NotReadyError, SaturatedError
from pdd.router.instance_choice import choose_main_decode, choose_prefill
from pdd.router.link_health import LinkHealth
from pdd.router.policy import (
    Decision,
    PolicyConfig,
    RequestFeatures,
    Saturated,
    decide,
    relay_not_sooner,
)
from pdd.router.policy import is_anomalous as _is_anomalous
from pdd.router.prefix_index import PrefixIndex
from pdd.router.recent_traffic import RecentTraffic
from pdd.router.registry import InstanceRegistry
from pdd.router.routing_view import RoutingView
from pdd.router.state.base import RouterStore

#: The in-flight counter of KV transfers on the WAN link, beside the instances' counters:
#: every replica adds its own, so all of them see the line's load (no instance has this id).
WAN_TRANSFERS = "~wan-transfers"
#: ... and of the KiB of KV those transfers carry (the store counts integers).
WAN_BACKLOG_KIB = "~wan-backlog-kib"
_KIB = 1024


@dataclass(frozen=True)
class Route:
    """Where one request goes and why (``reason`` for people, ``reason_code`` for metrics)."""

    pipeline: Pipeline
    reason: str
    reason_code: str
    prefill: Endpoint | None
    relay: Endpoint | None
    main: Endpoint | None
    p_hit_tokens: int = 0
    md_hit_tokens: int = 0
    #: The prompt's chained block hashes, computed once for the lookup and reused when
    #: MD reports its real hit (``MeasuredHits``).
    prompt_hashes: tuple[int, ...] = ()
    #: ``LinkHealth.ticket`` when this route was chosen: its KV landing on MD proves the
    #: line only if no transfer failed since.
    link_ticket: int = 0
    #: KV bytes P ships to MD over the link (MD's miss; 0 when nothing crosses).
    kv_bytes: int = 0
    #: Tokens P computes (its miss): what the link estimator's samples take P's time from.
    prefill_tokens: int = 0
    #: The line's backlog (every replica's) when this route was chosen.
    backlog: Backlog = field(default_factory=Backlog)
    #: Requests already on the relay when this route was chosen: the link estimator
    #: reads the relay's first token as P's time only when there were none.
    relay_active: int = 0
    #: The hashes of the prompt blocks P ships into MD's cache (past MD's hit): a later
    #: request counting on them waits for this transfer (``LinkEstimator.awaited_bytes``).
    carried_hashes: tuple[int, ...] = ()
    #: The codec the router chose for MD's KV (``spec.wan.kvCodec: adaptive``) and its
    #: KV bytes per token on the WAN; None: the deployment's codec.
    kv_codec: KVCodec | None = None
    kv_bytes_per_token: int | None = None

    @property
    def endpoints(self) -> list[Endpoint]:
        return [e for e in (self.prefill, self.relay, self.main) if e is not None]

    @property
    def ships_kv(self) -> bool:
        """P sends the prompt's KV (MD's miss) to MD: a transfer on the link."""
        return self.prefill is not None and self.main is not None

    @property
    def fills_main_cache(self) -> bool:
        """MD keeps what P ships in its prefix cache (naive bypasses it, and under adaptive
        KV coded lossily stays the request's own: ``shared_in_receiver_cache``)."""
        shared = self.kv_codec is None or shared_in_receiver_cache(self.kv_codec, ADAPTIVE)
        return self.ships_kv and self.pipeline != Pipeline.NAIVE and shared

    @property
    def lease_keys(self) -> list[str]:
        """What this route counts in flight: its instances, and the link when it ships KV."""
        keys = [e.instance_id for e in self.endpoints]
        return [*keys, WAN_TRANSFERS, WAN_BACKLOG_KIB] if self.ships_kv else keys

    @property
    def lease_amounts(self) -> dict[str, int]:
        """Counts other than 1 a lease holds: the KiB of KV this route commits to the line."""
        return {WAN_BACKLOG_KIB: math.ceil(self.kv_bytes / _KIB)} if self.ships_kv else {}

    def plan(
        self,
        request_id: str,
        prompt_ids: list[int],
        sampling: SamplingSpec,
        config: RouterConfig,
    ) -> PipelinePlan:
        return PipelinePlan(
            request_id=request_id,
            prompt_ids=prompt_ids,
            sampling=sampling,
            pipeline=self.pipeline,
            prefill=self.prefill,
            relay=self.relay,
            main=self.main,
            handoff=config.handoff,
            catchup_threshold=config.catchup_threshold,
            main_hit_tokens=self.md_hit_tokens if self.ships_kv else None,
            kv_codec=self.kv_codec if self.ships_kv else None,
        )


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
        if route.ships_kv and route.prefill is not None:
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

    def kv_landed(self, now: float) -> None:
        """MD streams: it has the KV. The line's counts let go and the estimator learns
        (from MD's first token after a relay's hand-off, only that the line is faster)."""
        self.release(WAN_TRANSFERS)
        self.release(WAN_BACKLOG_KIB)
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


def reason_code(
    decision: Decision,
    features: RequestFeatures,
    policy: PolicyConfig,
    retry: bool = False,
    link_doubted: bool = False,
) -> str:
    """A bounded label for the decision (the reason text carries numbers)."""
    if retry and decision.pipeline != Pipeline.P_MD:
        return "retry"
    fits = decision.estimate.md_first_token_s <= policy.ttft_budget_s
    if link_doubted and fits and decision.pipeline == Pipeline.P_RLD_MD:
        return "link_doubted"
    if fits and decision.pipeline == Pipeline.P_RLD_MD:
        return "idle_relay"
    if decision.pipeline == Pipeline.P_MD:
        if fits:
            return "fits_ttft_budget"
        return "relay_not_sooner" if relay_not_sooner(decision.estimate) else "relays_saturated"
    if decision.pipeline == Pipeline.P_RLD:
        return "anomalous"
    return "anomalous_capped" if _is_anomalous(features, policy) else "transfer_exceeds_budget"


class Dispatcher:
    def __init__(
        self,
        config: RouterConfig,
        registry: InstanceRegistry,
        index: PrefixIndex,
        store: RouterStore,
        policy: PolicyConfig,
        traffic: RecentTraffic,
        link_health: LinkHealth,
        link_estimator: LinkEstimator,
    ) -> None:
        self._config = config
        self._link_health = link_health
        self._estimator = link_estimator
        self._registry = registry
        self._index = index
        self._store = store
        self._policy = policy
        self._traffic = traffic
        #: The routable instances and their loads, brought up to date by each route.
        self._view = RoutingView(registry, config.instance_capacity)

    async def route(
        self,
        prompt_ids: Sequence[int],
        max_tokens: int | None,
        exclude: frozenset[str] = frozenset(),
    ) -> Route:
        """Route one prompt; ``exclude`` names instances this request already failed on
        (a retry: see ``policy.decide``)."""
        retry = bool(exclude)
        hashes = tuple(self._index.hashes(prompt_ids))
        # The decision's only await: both reads answer within the store's deadline, and
        # everything below runs without yielding, on the instances ready after it.
        hits, inflight = await asyncio.gather(
            self._index.match_via(self._store.holders, hashes), self._store.inflight()
        )
        self._check_roles_ready(retry)
        self._view.refresh(inflight, self._store.take_moved())
        backlog = Backlog(inflight.get(WAN_BACKLOG_KIB, 0) * _KIB, inflight.get(WAN_TRANSFERS, 0))
        link = self._estimator.link(backlog)
        features = RequestFeatures.from_prompt(prompt_ids, max_tokens, self._config.block_size)
        with self._view.excluding(exclude):
            if self._config.mono:
                route = self._route_mono(features, hits)
            elif self._config.force_pipeline == Pipeline.NAIVE:
                route = self._route_naive(features, hits)
            else:
                awaited = self._estimator.awaited_bytes(hashes)
                route = self._route_policy(features, hits, link, retry, awaited)
        n = len(prompt_ids)
        carried: tuple[int, ...] = ()
        if route.fills_main_cache:
            assert route.main is not None  # a route that ships KV names MD
            self._index.expect(route.main.instance_id, hashes)
            carried = hashes[route.md_hit_tokens // self._config.block_size :]
        return replace(
            route,
            prompt_hashes=hashes,
            carried_hashes=carried,
            link_ticket=self._link_health.ticket,
            kv_bytes=(n - route.md_hit_tokens)
            * (route.kv_bytes_per_token or self._policy.kv_bytes_per_token),
            prefill_tokens=n - route.p_hit_tokens,
            backlog=backlog,
        )

    def _route_policy(
        self,
        features: RequestFeatures,
        hits: dict[str, int],
        link: LinkState,
        retry: bool = False,
        awaited: dict[str, int] | None = None,
    ) -> Route:
        """PDD: the pure policy picks the pipeline and instances; ``awaited``: per MD, the
        KV still crossing to it that the prompt's hit there counts on."""
        traffic = self._traffic.snapshot()
        doubt = self._link_health.doubt()
        result = decide(
            features, hits, self._view.fleet, link, traffic, self._policy, retry, doubt,
            self._estimator.prefill_rates(), self._estimator.relay_slot_s, awaited,
            self._estimator.overhead_s,
        )  # fmt: skip
        if isinstance(result, Saturated):
            raise SaturatedError(result.reason, result.retry_after_s)
        self._traffic.record(result.pipeline == Pipeline.P_RLD, features.input_tokens)
        a = result.instances
        return Route(
            pipeline=result.pipeline,
            reason=result.reason,
            reason_code=reason_code(result, features, self._policy, retry, doubt is not None),
            prefill=self._endpoint(a.prefill),
            relay=self._endpoint(a.relay) if a.relay else None,
            main=self._endpoint(a.main_decode) if a.main_decode else None,
            p_hit_tokens=result.estimate.p_hit_tokens,
            md_hit_tokens=result.estimate.md_hit_tokens,
            relay_active=result.estimate.relay_active,
            kv_codec=result.estimate.kv_codec,
            kv_bytes_per_token=result.estimate.kv_bytes_per_token,
        )

    def _route_mono(self, features: RequestFeatures, hits: dict[str, int]) -> Route:
        """Colocated baseline: the best hit against load, affinity by consistent hashing."""
        fleet = self._view.fleet
        chosen = choose_main_decode(fleet, hits, features.input_tokens, features.affinity_key)
        if chosen is None:
            raise SaturatedError("every mono instance is at capacity", self._policy.retry_after_s)
        hit = min(hits.get(chosen.instance_id, 0), features.input_tokens)
        return Route(
            pipeline=Pipeline.MONO,
            reason=f"colocated deployment: {chosen.instance_id} holds {hit} prompt tokens",
            reason_code="colocated",
            prefill=None,
            relay=None,
            main=self._endpoint(chosen.instance_id),
            p_hit_tokens=hit,
            md_hit_tokens=hit,
        )

    def _route_naive(self, features: RequestFeatures, hits: dict[str, int]) -> Route:
        """Naive cross-datacenter PD: the same P and MD choice, the full KV over the WAN.

        MD keeps no decode-side cache on this pipeline, so its hit is 0 by construction.
        """
        fleet = self._view.fleet
        prefill = choose_prefill(fleet, hits, features.input_tokens)
        main = choose_main_decode(fleet, {}, features.input_tokens, features.affinity_key)
        if prefill is None or main is None:
            raise SaturatedError(
                "every prefill or main-decode instance is at capacity", self._policy.retry_after_s
            )
        return Route(
            pipeline=Pipeline.NAIVE,
            reason="forced baseline: P -> MD shipping the full KV, no decode-side cache",
            reason_code="forced",
            prefill=self._endpoint(prefill.instance_id),
            relay=None,
            main=self._endpoint(main.instance_id),
            p_hit_tokens=min(hits.get(prefill.instance_id, 0), features.input_tokens),
        )

    def _endpoint(self, instance_id: str) -> Endpoint:
        endpoint = self._view.instance(instance_id).endpoint
        assert endpoint is not None  # the view holds routable instances only
        return endpoint

    def _check_roles_ready(self, retry: bool = False) -> None:
        """NotReadyError when a role every request needs has no ready instance (a policy
        retry can do without MD where a relay is ready: it ends on the relay)."""
        needed = (Role.MONO,) if self._config.mono else (Role.PREFILL, Role.MAIN)
        has = self._registry.has_routable
        relay_serves = retry and self._policy_routes and has(Role.RELAY)
        for role in needed:
            if role == Role.MAIN and relay_serves:
                continue
            if not has(role):
                raise NotReadyError(f"no {role} worker is ready; check the workers and --{role}")

    @property
    def _policy_routes(self) -> bool:
        """PDD's policy chooses the pipeline (not a baseline's fixed one)."""
        return not self._config.mono and self._config.force_pipeline != Pipeline.NAIVE
