"""Everything one router process holds, built from its config and started together."""

from __future__ import annotations

import asyncio
import time

from pdd.common.link_estimator import LinkEstimator
from pdd.common.tls_rotation import TlsRotation
from pdd.common.vocabulary import Role, ToolCallFormat
from pdd.common.wan_tls import load_wan_ca
from pdd.router.config import RouterConfig
from pdd.router.dispatcher import Dispatcher
from pdd.router.fair_admission import FairAdmission
from pdd.router.link_health import LinkCondition, LinkHealth, Transition
from pdd.router.metrics import RouterMetrics
from pdd.router.policy import PolicyConfig
from pdd.router.prefix_index import PrefixIndex, PrefixIndexConfig
from pdd.router.recent_traffic import RecentTraffic
from pdd.router.registry import InstanceRegistry
from pdd.router.state.base import RouterStore
from pdd.router.state.memory import LocalStore
from pdd.router.state.shared import SharedStore
from pdd.router.stream_relay import fullest_buffer
from pdd.router.tokenization import PromptTokenizer, load_prompt_tokenizer
from pdd.router.tool_calls import detect_format
from pdd.router.worker_client import WorkerClient

#: The name of the one WAN line this router's config describes (``--link-gbps``), as
#: its metrics label it.
WAN_LINK = "wan"


def build_policy(config: RouterConfig) -> PolicyConfig:
    return PolicyConfig(
        kv_bytes_per_token=config.resolved_kv_bytes_per_token,
        adaptive_codecs=config.adaptive_codecs,
        ttft_budget_s=config.ttft_budget_s,
        prefill_tokens_per_s=config.prefill_tokens_per_s,
        anomalous_min_input_tokens=config.anomalous_min_input_tokens,
        anomalous_output_tokens_below=config.anomalous_output_tokens_below,
        retry_after_s=config.retry_after_s,
        md_recompute_max_tokens=config.md_recompute_max_tokens,
    )


class RouterRuntime:
    """Tokenizer, store, index, worker registry and dispatcher of one router replica."""

    def __init__(self, config: RouterConfig, client: WorkerClient | None = None) -> None:
        """``client``: the workers reached another way than TCP (in-process tests)."""
        self.config = config
        self.metrics = RouterMetrics(redis=config.redis_url is not None)
        #: The router-wide capacity, shared fairly across API keys.
        self.admission = FairAdmission(
            config.max_inflight_requests, config.admission_wait_s, config.retry_after_s
        )
        self.tokenizer: PromptTokenizer = load_prompt_tokenizer(config.model)
        #: How the model writes tool calls: the configured format, else the template's.
        self.tool_call_format: ToolCallFormat | None = config.tool_call_format or detect_format(
            self.tokenizer.template_source
        )
        tls = load_wan_ca(config.wan_tls_dir) if config.wan_tls_dir is not None else None
        self.client = client or WorkerClient(config.secret, tls=tls)
        #: A renewed ca.crt applies to the next connection to an https worker.
        self._rotation = (
            TlsRotation(config.wan_tls_dir, [tls], with_certificate=False)
            if config.wan_tls_dir is not None and tls is not None
            else None
        )
        self._rotation_task: asyncio.Task | None = None
        index_config = PrefixIndexConfig(block_size=config.block_size)
        self.store: RouterStore = (
            SharedStore(
                config.redis_url,
                config.replica_id,
                index_config.ttl_s,
                on_change=lambda up: self.metrics.redis_up.set(1 if up else 0),
                deadline_s=config.redis_deadline_s,
            )
            if config.redis_url
            else LocalStore(index_config.ttl_s)
        )
        # Wall-clock time: entries in a shared store are compared across hosts.
        self.index = PrefixIndex(index_config, self.store.index, clock=time.time)
        self.registry = InstanceRegistry(
            config.workers, self.client, self.index, config.poll_interval_s
        )
        self.policy = build_policy(config)
        self.link_health = LinkHealth(WAN_LINK, self._link_changed)
        #: The line's live numbers (goodput, backlog, P's throughput); ``link_health``
        #: says whether it works at all. Each replica measures for itself: docs/router.md.
        self.link_estimator = LinkEstimator(
            config.link, config.prefill_tokens_per_s, frozen=config.static_link_view
        )
        self._show_link(LinkCondition.HEALTHY)
        self.dispatcher = Dispatcher(
            config,
            self.registry,
            self.index,
            self.store,
            self.policy,
            RecentTraffic(),
            self.link_health,
            self.link_estimator,
        )

    def _link_changed(self, change: Transition) -> None:
        self.metrics.link_transitions.labels(change.link, change.after).inc()
        self._show_link(change.after)

    def _show_link(self, current: LinkCondition) -> None:
        for condition in LinkCondition:
            value = 1 if condition is current else 0
            self.metrics.link_state.labels(self.link_health.name, condition).set(value)

    async def start(self) -> None:
        await self.store.start()
        await self.registry.start()
        if self._rotation is not None:
            self._rotation_task = asyncio.create_task(self._rotation.watch())

    async def close(self) -> None:
        if self._rotation_task is not None:
            self._rotation_task.cancel()
        await self.registry.close()
        await self.store.close()
        await self.client.aclose()

    def ready(self) -> bool:
        """Ready when every role a request needs has a worker answering."""
        roles = (Role.MONO,) if self.config.mono else (Role.PREFILL, Role.MAIN)
        return all(self.registry.ready(role) for role in roles)

    def prompt_limit(self) -> int | None:
        """The longest prompt accepted: what the prefill instances take (their engines'
        ``max_prompt_tokens``), capped by ``max_prompt_tokens`` where that is set."""
        limits = (self.config.max_prompt_tokens, self.registry.prompt_limit())
        return min((n for n in limits if n is not None), default=None)

    def refresh_gauges(self) -> None:
        self.metrics.admitted.set(self.admission.admitted)
        self.metrics.queued.set(self.admission.queued)
        self.metrics.admitting_keys.set(len(self.admission.held))
        self.metrics.asyncio_tasks.set(len(asyncio.all_tasks()))
        self.metrics.stream_buffer.set(fullest_buffer())
        self.metrics.redis_reads_waiting.set(self.store.reads_waiting)
        view = self.link_estimator.link()
        self.metrics.link_goodput.labels(WAN_LINK).set(view.effective_gbps * 1e9 / 8)
        self.metrics.link_backlog.labels(WAN_LINK).set(view.backlog_bytes)
        self.metrics.relay_slot.set(self.link_estimator.relay_slot_s)
        for instance, rate in self.link_estimator.prefill_rates().items():
            self.metrics.prefill_rate.labels(instance).set(rate)
        for role in Role:
            self.metrics.instances_ready.labels(role).set(len(self.registry.ready(role)))
