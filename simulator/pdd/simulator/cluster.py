"""One system's instances, links and router, built from a scenario's system spec.

Routing calls the router's own code: ``pdd.router.policy.decide`` (pipeline choice
on the shared WAN cost model) and, through it, ``pdd.router.instance_choice`` over the
router's :class:`Fleet`, which every instance updates as its load changes. The prefix
index it is fed is exact (``HolderIndex``): the live router's index is the same view
minus lost events and TTL expiry.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TypeVar

import simpy

from pdd.common.cost_model import LinkState
from pdd.common.kv_codec import (
    ADAPTIVE,
    ADAPTIVE_CODECS,
    NO_CODEC,
    KVCodec,
    chunk_wire_bytes,
    default_codec,
)
from pdd.common.link_estimator import LinkEstimator
from pdd.common.vocabulary import Pipeline, Role
from pdd.router.fleet import Fleet
from pdd.router.instance_choice import choose_relay
from pdd.router.instance_load import InstanceLoad
from pdd.router.link_view import LinkView
from pdd.router.policy import Assignment, Decision, PolicyConfig, RequestFeatures, Saturated, decide
from pdd.router.recent_traffic import RecentTraffic
from pdd.simulator.decode import DecodeInstance
from pdd.simulator.links import DirectLink, SharedLink
from pdd.simulator.prefill import PrefillInstance
from pdd.simulator.prefix_cache import HolderIndex, PrefixCache
from pdd.simulator.scenario import Ablation, PoolSpec, Scenario, SystemKind, SystemSpec

#: Bytes per element of the simulated model's KV (bfloat16), for the codecs' sizes.
SIM_KV_DTYPE_BYTES = 2

#: An instance of any pool: P, or a decode instance (RLD, MD or same-datacenter D).
Instance = PrefillInstance | DecodeInstance
_Live = TypeVar("_Live", PrefillInstance, DecodeInstance)


def _drain_one(live: list[_Live]) -> _Live | None:
    """Take the least-active instance (the latest of equals) out of ``live``, unless it is
    the pool's last one (then None)."""
    if len(live) <= 1:
        return None
    inst = min(reversed(live), key=lambda i: i.active)
    live.remove(inst)
    return inst


@dataclass(frozen=True, eq=False)
class SimRequest:
    key: str
    arrival: float
    keys: tuple[int, ...]  # prefix-chained block keys, unique across the whole trace
    input_tokens: int
    output_tokens: int
    features: RequestFeatures


class Cluster:
    """P, RLD and MD (or D) instances, the links between them, and the router."""

    def __init__(
        self, env: simpy.Environment, scenario: Scenario, spec: SystemSpec, block_size: int
    ) -> None:
        self.env, self.scenario, self.spec = env, scenario, spec
        self.kv_bytes_per_token = scenario.model.kv_bytes_per_token
        #: MD's KV on the WAN under the deployment's codec (the relay's copy stays exact).
        self.wan_kv_bytes_per_token = self.coded_bytes_per_token(
            default_codec(scenario.wan.kv_codec)
        )
        self.index = HolderIndex(block_size)
        self.fleet = Fleet()
        #: Instances scaled down, by id, to their pool's name: the router no longer sees
        #: them; they finish what they hold (``by_id`` still has them).
        self.retired: dict[str, str] = {}
        self._block_size = block_size
        self._created: dict[str, int] = {}
        self.prefill = [self._prefill_instance() for _ in range(spec.prefill.instances)]
        self.relay = self._decode_pool("rld", Role.RELAY, spec.relay, cached=False)
        main_pool = spec.decode if spec.kind == SystemKind.SAME_DC else spec.main
        self.main = self._decode_pool("md", Role.MAIN, main_pool, cached=spec.keeps_history)
        instances: list[Instance] = [*self.prefill, *self.relay, *self.main]
        self.by_id = {i.instance_id: i for i in instances}
        for inst in self.by_id.values():
            self.fleet.update(inst.load())
        self.in_dc = DirectLink(env, scenario.in_dc.gbps, scenario.in_dc.latency_ms)
        self.wan = (
            SharedLink(
                env, scenario.wan.gbps, scenario.wan.rtt_ms, scenario.wan.jitter_ms, scenario.seed
            )
            if spec.uses_wan
            else None
        )
        self.link_state = (
            LinkState(scenario.wan.gbps, scenario.wan.rtt_ms)
            if spec.uses_wan
            else LinkState(scenario.in_dc.gbps, scenario.in_dc.latency_ms * 2)
        )
        self.policy = self._policy_config()
        #: The router's view of the line: the same estimator, fed the same commitments.
        self.link_estimator = LinkEstimator(self.link_state, self.policy.prefill_tokens_per_s)
        self.traffic = RecentTraffic(scenario.router.traffic_window_s, clock=lambda: env.now)
        self.relay_fallbacks = 0

    def _cache(self, instance_id: str, pool: PoolSpec) -> PrefixCache:
        capacity = pool.cache_tokens
        if capacity is None:
            capacity = self.scenario.shape(pool).kv_capacity_tokens
        return PrefixCache(instance_id, capacity, self._block_size, self.index)

    def _name(self, prefix: str) -> str:
        """p0, p1, ... per prefix, never reused (a retired instance keeps its name)."""
        index = self._created.get(prefix, 0)
        self._created[prefix] = index + 1
        return f"{prefix}{index}"

    def _publish(self, load: InstanceLoad) -> None:
        """An instance's new load, to the router's fleet, unless it was retired."""
        if load.instance_id not in self.retired:
            self.fleet.update(load)

    def _prefill_instance(self) -> PrefillInstance:
        pool, name = self.spec.prefill, self._name("p")
        return PrefillInstance(
            self.env,
            name,
            self.scenario.shape(pool),
            pool.max_num_batched_tokens,
            pool.max_queue,
            self._cache(name, pool),
            self._publish,
        )

    def _decode_instance(
        self, prefix: str, role: Role, pool: PoolSpec, cached: bool
    ) -> DecodeInstance:
        name = self._name(prefix)
        cache = self._cache(name, pool) if cached else None
        shape = self.scenario.shape(pool)
        return DecodeInstance(self.env, name, role, shape, pool.max_batch, cache, self._publish)

    def _decode_pool(
        self, prefix: str, role: Role, pool: PoolSpec | None, cached: bool
    ) -> list[DecodeInstance]:
        if pool is None:
            return []
        return [self._decode_instance(prefix, role, pool, cached) for _ in range(pool.instances)]

    def draining(self, name: str) -> int:
        """Retired instances of pool ``name`` still finishing requests."""
        return sum(self.by_id[i].active > 0 for i, pool in self.retired.items() if pool == name)

    def pool(self, name: str) -> Sequence[Instance]:
        """The live instances of pool ``name`` (prefill, relay, main; decode: main)."""
        return self.prefill if name == "prefill" else self._decoders(name)

    def _decoders(self, name: str) -> list[DecodeInstance]:
        """The live instances of decode pool ``name`` (relay, main; decode: main)."""
        return self.relay if name == "relay" else self.main

    def add_instance(self, name: str) -> None:
        """One more live instance in pool ``name``, cold (empty cache), seen by the router."""
        inst: Instance
        if name == "prefill":
            inst = self._prefill_instance()
            self.prefill.append(inst)
        else:
            inst = self._new_decoder(name)
            self._decoders(name).append(inst)
        self.by_id[inst.instance_id] = inst
        self.fleet.update(inst.load())

    def _new_decoder(self, name: str) -> DecodeInstance:
        if name == "relay" and self.spec.relay is not None:
            return self._decode_instance("rld", Role.RELAY, self.spec.relay, cached=False)
        main = self.spec.decode if self.spec.kind == SystemKind.SAME_DC else self.spec.main
        assert main is not None
        return self._decode_instance("md", Role.MAIN, main, cached=self.spec.keeps_history)

    def retire_instance(self, name: str) -> None:
        """Scale pool ``name`` down by one through drain: the router stops choosing its
        least-loaded instance, which finishes every request it holds (none is lost)."""
        inst = _drain_one(self.prefill) if name == "prefill" else _drain_one(self._decoders(name))
        if inst is None:
            return
        self.retired[inst.instance_id] = name
        self.fleet.remove(inst.instance_id)

    def prefill_named(self, instance_id: str) -> PrefillInstance:
        """The P instance the router chose (by id)."""
        inst = self.by_id[instance_id]
        assert isinstance(inst, PrefillInstance), f"{instance_id} is not a P instance"
        return inst

    def decoder_named(self, instance_id: str | None) -> DecodeInstance | None:
        """The decode instance the router chose (by id), None where it chose none."""
        if instance_id is None:
            return None
        inst = self.by_id[instance_id]
        assert isinstance(inst, DecodeInstance), f"{instance_id} is not a decode instance"
        return inst

    def _policy_config(self) -> PolicyConfig:
        r = self.scenario.router
        throughput = r.prefill_tokens_per_s or self.scenario.shape(
            self.spec.prefill
        ).prefill_tokens_per_s(self.spec.prefill.max_num_batched_tokens)
        adaptive = self.scenario.wan.kv_codec == ADAPTIVE
        return PolicyConfig(
            kv_bytes_per_token=self.wan_kv_bytes_per_token,
            adaptive_codecs=tuple(
                (c, self.coded_bytes_per_token(c)) for c in ADAPTIVE_CODECS if adaptive
            ),
            ttft_budget_s=r.ttft_budget_s,
            prefill_tokens_per_s=throughput,
            anomalous_min_input_tokens=r.anomalous_min_input_tokens,
            anomalous_output_tokens_below=r.anomalous_output_tokens_below,
            relay_only_max_share=r.relay_only_max_share,
            idle_relay_min_transfer_s=r.idle_relay_min_transfer_s,
            retry_after_s=r.retry_after_s,
            md_recompute_max_tokens=r.md_recompute_max_tokens,
            md_prefill_tokens_per_s=self._md_prefill_tokens_per_s(),
        )

    def _md_prefill_tokens_per_s(self) -> float | None:
        """MD's full-chunk prefill throughput on its own hardware, for the policy's estimate
        of MD computing its miss (None without an MD pool: the policy takes P's)."""
        main = self.spec.main
        if main is None:
            return None
        chunk = self.spec.prefill.max_num_batched_tokens
        return self.scenario.shape(main).prefill_tokens_per_s(chunk)

    def coded_bytes_per_token(self, codec: KVCodec) -> int:
        """A token's KV on the WAN under ``codec``: the model's KV (bf16), as the workers'
        codecs code it, one scale and centre per head vector of ``wan.kv_head_dim``."""
        exact = self.kv_bytes_per_token
        if codec == NO_CODEC:
            return exact
        head_dim = self.scenario.wan.kv_head_dim
        vectors = max(1, exact // (2 * head_dim * SIM_KV_DTYPE_BYTES))  # per K (and V)
        return chunk_wire_bytes(codec, 1, 1, vectors, head_dim, SIM_KV_DTYPE_BYTES)

    @property
    def kv_link(self) -> SharedLink | DirectLink:
        """The path P's KV takes to MD (or D)."""
        return self.wan if self.wan is not None else self.in_dc

    def route(self, request: SimRequest) -> Decision | Saturated:
        """The router's decision for ``request`` on the instances' current load."""
        hits = self.index.hits(request.keys, request.input_tokens)
        decision = decide(
            request.features,
            hits,
            self.fleet,
            self.link_view(),
            self.traffic.snapshot(),
            self.policy,
        )
        if self.relay and self._fell_back(decision):
            self.relay_fallbacks += 1
        return decision

    def _fell_back(self, decision: Decision | Saturated) -> bool:
        """P-MD although MD's first token misses the budget: no relay had room."""
        return (
            isinstance(decision, Decision)
            and decision.pipeline == Pipeline.P_MD
            and decision.estimate.md_first_token_s > self.policy.ttft_budget_s
        )

    def apply_ablation(self, request: SimRequest, decision: Decision) -> Decision:
        """The router's decision, or what a sim-only ablation makes of it (never the
        router's policy): ``low-hit-to-relay`` ends every request whose MD hit is below
        the system's ``low_hit_below`` at a relay (P-RLD), when one has room."""
        if self.spec.ablation != Ablation.LOW_HIT_TO_RELAY or decision.pipeline == Pipeline.P_RLD:
            return decision
        if decision.estimate.md_hit_tokens >= self.spec.low_hit_below * request.input_tokens:
            return decision
        relay = choose_relay(self.fleet)
        if relay is None:
            self.relay_fallbacks += 1
            return decision
        instances = Assignment(decision.instances.prefill, None, relay.instance_id)
        reason = f"ablation {Ablation.LOW_HIT_TO_RELAY.value}: a low-hit request ends at RLD"
        return replace(decision, pipeline=Pipeline.P_RLD, instances=instances, reason=reason)

    def link_view(self) -> LinkView:
        """What the policy sees of the line here: its measured state only. The simulated
        line never fails (no doubt), P and the relay run at the scenario's rates (none
        measured), and MD's step is the policy's ``md_first_step_s``; awaited KV is not
        modelled (a hit counts from dispatch), nor what MD is computing already (a miss
        MD computes is estimated as if it started at once)."""
        return LinkView(self.measured_link())

    def measured_link(self) -> LinkState:
        """The line as the router's link estimator sees it: the KV committed to it and not
        landed, at the declared rate (exact here: the simulated line runs at it)."""
        if self.wan is None:
            return self.link_state
        return self.link_estimator.link()

    def sample_relays(self) -> tuple[float, bool]:
        """Mean relay utilization, and whether every relay is saturated."""
        if not self.relay:
            return 0.0, False
        utils = [r.utilization for r in self.relay]
        return sum(utils) / len(utils), all(u >= 1.0 for u in utils)
