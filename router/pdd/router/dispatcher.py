"""From token IDs to a route: the prefix index, the shared loads and R1's policy, joined.

``Dispatcher.attempt`` is what a request asks for, first and on each recovery: a route
(``Dispatcher.route``), its plan and its in-flight lease (``pdd.router.lease``).
``route`` gathers what the pure ``policy.decide`` needs (hits, instance loads, the line
as a ``LinkView``, the recent traffic window), turns its answer into the workers'
endpoints, and raises typed errors for "nobody is up" (503) and "everybody is busy"
(429). The policy sees the line through the link estimator (``pdd.common.link_estimator``,
the simulator's too): measured goodput and the backlog every replica committed, so P-MD
requests stop piling up on a busy line.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from pdd.common import tracing
from pdd.common.cost_model import LinkState
from pdd.common.link_estimator import LinkEstimator
from pdd.common.vocabulary import Pipeline, Role
from pdd.common.wire import Endpoint, PipelinePlan, SamplingSpec
from pdd.router.config import RouterConfig
from pdd.router.errors import NotReadyError, SaturatedError
from pdd.router.instance_choice import choose_main_decode, choose_prefill
from pdd.router.lease import Lease
from pdd.router.link_health import LinkHealth
from pdd.router.link_view import LinkView
from pdd.router.policy import PolicyConfig, RequestFeatures, Saturated, decide
from pdd.router.prefix_index import PrefixIndex, reusable
from pdd.router.recent_traffic import RecentTraffic
from pdd.router.registry import InstanceRegistry
from pdd.router.route import Route, committed_backlog, md_computing_tokens
from pdd.router.route_trace import link_attributes, route_attributes
from pdd.router.routing_view import RoutingView
from pdd.router.state.base import RouterStore


@dataclass(frozen=True)
class Attempt:
    """One try at serving the request: its route, the plan sent, the in-flight lease."""

    route: Route
    plan: PipelinePlan
    lease: Lease


class Dispatcher:
    """Routes prompts for one router replica; ``attempt`` is what a request asks for, the
    first time and each time it recovers from a failed worker."""

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

    async def attempt(
        self,
        prompt_ids: Sequence[int],
        sampling: SamplingSpec,
        exclude: frozenset[str] = frozenset(),
        emitted: Sequence[int] = (),
        *,
        request_id: str,
    ) -> Attempt:
        """Route the prompt, or, to resume, the prompt plus the tokens already sent
        (``emitted``) with what is left of ``max_tokens``: the new instances prefill the
        known tokens and go on from the next position. They count the tokens sent as
        output (``prior_output_tokens``: penalties, ``min_tokens``, the grammar), so the
        resumed output is the one an unbroken request makes. ``exclude``: instances the
        request failed on; ``request_id``: the plan's (each attempt has its own). The
        route's in-flight lease is held from here."""
        prompt = [*prompt_ids, *emitted]
        left = sampling.model_copy(
            update={
                "max_tokens": sampling.max_tokens - len(emitted),
                "prior_output_tokens": len(emitted),
            }
        )
        with tracing.span("pdd.route", attributes={tracing.REQUEST_ID: request_id}):
            route = await self.route(prompt, left.max_tokens, exclude, left)
            tracing.set_attributes(route_attributes(route))
        lease = Lease.of(route, self._store, self._estimator)
        plan = route.plan(request_id, prompt, left, self._config)
        if tracing.enabled():  # the workers' spans join the request's (``pdd.request``)
            plan = plan.model_copy(update={"trace_context": tracing.carrier()})
        return Attempt(route, plan, lease)

    async def route(
        self,
        prompt_ids: Sequence[int],
        max_tokens: int | None,
        exclude: frozenset[str] = frozenset(),
        sampling: SamplingSpec | None = None,
    ) -> Route:
        """Route one prompt; ``exclude`` names instances this request already failed on
        (a retry: see ``policy.decide``); ``sampling``, where given, may keep the request
        from a handoff (rule ``vllm_one_sampler``)."""
        retry = bool(exclude)
        hashes = tuple(self._index.hashes(prompt_ids))
        # The decision's only await: both reads answer within the store's deadline, and
        # everything below runs without yielding, on the instances ready after it.
        hits, inflight = await asyncio.gather(
            self._index.match_via(self._store.holders, hashes), self._store.inflight()
        )
        self._check_roles_ready(retry)
        self._view.refresh(inflight, self._store.take_moved())
        hits = reusable(hits, self._view.cache_block)  # what each engine's cache can reuse
        backlog = committed_backlog(inflight)
        self._estimator.overdue(time.monotonic(), backlog)
        link = self._estimator.link(backlog)
        tracing.set_attributes(link_attributes(link))
        features = RequestFeatures.from_prompt(
            prompt_ids, max_tokens, self._config.block_size, sampling
        )
        with self._view.excluding(exclude):
            if self._config.mono:
                route = self._route_mono(features, hits)
            elif self._config.force_pipeline == Pipeline.NAIVE:
                route = self._route_naive(features, hits)
            else:
                awaited = self._estimator.awaited_bytes(hashes)
                computing = md_computing_tokens(inflight)
                route = self._route_policy(features, hits, link, retry, awaited, computing)
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
            kv_bytes=(n - route.md_hit_tokens) * self._kv_bytes_per_token(route),
            prefill_tokens=n - route.p_hit_tokens,
            md_compute_tokens=n - route.md_hit_tokens if route.md_computes_miss else 0,
            backlog=backlog,
        )

    def _kv_bytes_per_token(self, route: Route) -> int:
        """KV bytes per token the route puts on the line (0 where MD computes its miss)."""
        chosen = route.kv_bytes_per_token
        return self._policy.kv_bytes_per_token if chosen is None else chosen

    def _route_policy(
        self,
        features: RequestFeatures,
        hits: dict[str, int],
        link: LinkState,
        retry: bool = False,
        awaited: dict[str, int] | None = None,
        computing: Mapping[str, int] | None = None,
    ) -> Route:
        """PDD: the pure policy picks the pipeline and instances; ``awaited``: per MD, the
        KV still crossing to it that the prompt's hit there counts on; ``computing``: per
        MD, the prompt tokens it is computing for earlier requests."""
        traffic = self._traffic.snapshot()
        doubt = self._link_health.doubt()
        view = LinkView(
            link,
            doubt=doubt,
            prefill_rates=self._estimator.prefill_rates(),
            relay_slot_s=self._estimator.relay_slot_s,
            awaited_bytes=awaited or {},
            md_computing_tokens={} if computing is None else computing,
            md_step_s=self._estimator.overhead_s,
        )
        result = decide(
            features, hits, self._view.fleet, view, traffic, self._policy, retry,
            self._view.engines,
        )  # fmt: skip
        if isinstance(result, Saturated):
            raise SaturatedError(result.reason, result.retry_after_s)
        self._traffic.record(result.pipeline == Pipeline.P_RLD, features.input_tokens)
        a = result.instances
        return Route(
            pipeline=result.pipeline,
            reason=result.reason,
            reason_code=result.rule.code,
            prefill=self._endpoint(a.prefill),
            relay=self._endpoint(a.relay) if a.relay else None,
            main=self._endpoint(a.main_decode) if a.main_decode else None,
            p_hit_tokens=result.estimate.p_hit_tokens,
            md_hit_tokens=result.estimate.md_hit_tokens,
            relay_active=result.estimate.relay_active,
            kv_codec=result.estimate.kv_codec,
            kv_bytes_per_token=result.estimate.kv_bytes_per_token,
            md_computes_miss=result.estimate.md_computes_miss,
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
