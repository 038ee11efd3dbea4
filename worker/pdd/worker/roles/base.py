"""What every role shares: settings, the engine runner, streams, metrics, peer connections.

A role is the worker's behaviour for one part of a pipeline. The control API
and the data-plane server call the same few entry points on any role; a role
that does not play a part answers ``RoleMismatchError`` (HTTP 409), so a
misrouted request fails loudly instead of hanging.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass

from pdd.common.kv_codec import NO_CODEC, KVCodecSetting
from pdd.common.network import TCP, Network
from pdd.common.vocabulary import Role
from pdd.common.wan_tls import HTTPS_ROLES
from pdd.common.wire import Endpoint, LoadReport, PipelinePlan, StateReport
from pdd.worker.engine.request import UnknownRequestError
from pdd.worker.engine.sampling import SamplingParams
from pdd.worker.engine_runner import EngineRunner
from pdd.worker.metrics import WorkerMetrics, loop_time
from pdd.worker.roles.cancellations import CancelledRequests
from pdd.worker.roles.protocol import Opening, OpHandler, answering, send_error, split_addr
from pdd.worker.roles.streams import StreamHub
from pdd.worker.transport import (
    ByteCounters,
    Channel,
    TransferTimeout,
    TransportConfig,
    TransportError,
    WanTls,
    connect,
)
from pdd.worker.transport.link_meter import LinkKey
from pdd.worker.transport.metering import ChannelMeter, failure_reason

log = logging.getLogger(__name__)


class RoleMismatchError(Exception):
    """The operation is for another role (e.g. a plan POSTed to a relay)."""


class NoSuchRequestError(KeyError):
    """No request with this id is live on this instance."""


@dataclass(frozen=True)
class WorkerSettings:
    role: Role
    instance_id: str
    secret: str
    handoff: str = "auto"  # default when the plan says "auto": auto | one-shot | catch-up
    catchup_load_level: float = 0.5  # auto: relay load above this -> one-shot (frees RLD soonest)
    transfer_timeout_s: float = 30.0
    chunk_bytes: int = 1 << 20  # KV bytes per chunk (and frame)
    advertise_fast: str = ""  # data address for peers in this datacenter
    advertise_wan: str = ""  # data address for peers across the WAN
    http: str = ""  # HOST:PORT of the control API
    #: TLS on the channels across the WAN (the WAN port, and dials to peers' WAN addresses).
    wan_tls: WanTls | None = None
    #: How P codes the KV it sends MD across the WAN, and what MD accepts (spec.wan.kvCodec).
    kv_codec: KVCodecSetting = NO_CODEC

    @property
    def serves_https(self) -> bool:
        """Whether the control API speaks TLS: WAN TLS is on and the router reaches this
        role across the WAN (``HTTPS_ROLES``)."""
        return self.wan_tls is not None and self.role in HTTPS_ROLES

    @property
    def http_scheme(self) -> str:
        return "https" if self.serves_https else "http"

    @property
    def endpoint(self) -> Endpoint:
        return Endpoint(
            instance_id=self.instance_id,
            http_url=f"{self.http_scheme}://{self.http}",
            fast_addr=self.advertise_fast,
            wan_addr=self.advertise_wan,
        )

    @property
    def transport(self) -> TransportConfig:
        t = self.transfer_timeout_s
        return TransportConfig(
            read_timeout_s=t,
            write_timeout_s=t,
            connect_timeout_s=min(t, 10.0),
            chunk_bytes=self.chunk_bytes,
        )


def sampling_params(plan: PipelinePlan, max_tokens: int | None = None) -> SamplingParams:
    """The engine's parameters for the plan: its ``SamplingSpec`` as it is; every role builds
    the same ones (P caps ``max_tokens`` at its one token), so each position is steered
    and drawn alike."""
    if max_tokens is None:
        return SamplingParams.of(plan.sampling)
    return SamplingParams.of(plan.sampling, max_tokens=max_tokens)


#: Share of P's wait for a receiver's answer to ``prepare`` (the transport's connect
#: timeout) the receiver may spend before answering: waiting for KV still landing, then
#: for free blocks. The rest is the line's margin, so a receiver that waits is never
#: taken for a cut line.
ANSWER_SHARE = 0.8


class RoleBase:
    """Entry points (overridden per role) and the shared machinery."""

    role: Role

    def __init__(
        self,
        settings: WorkerSettings,
        runner: EngineRunner,
        metrics: WorkerMetrics,
        network: Network = TCP,
    ) -> None:
        self.settings = settings
        self.runner = runner
        self.metrics = metrics
        self.network = network  # where peers' data addresses are dialled
        self.hub = StreamHub(settings.instance_id)
        self.wan_counters = ByteCounters()
        self.fast_counters = ByteCounters()
        self._tasks: set[asyncio.Task] = set()
        self.live: set[str] = set()  # requests holding engine or transfer state here
        #: Cancels seen here, so a request that arrives after its cancel is refused.
        self.cancelled = CancelledRequests(ttl_s=2 * settings.transfer_timeout_s)
        self.ops: dict[str, OpHandler] = {}
        #: Set by ``WorkerInstance.drain``: no new work is routed here; what runs finishes.
        self.draining = False
        #: What the engine got (device, dtype, KV capacity); fixed once it is built.
        self.engine_info = runner.engine.info()
        metrics.report_engine(self.engine_info)

    def answer_deadline(self) -> float:
        """Loop time by which a ``prepare`` arriving now must be answered (``ANSWER_SHARE``)."""
        t = ANSWER_SHARE * self.settings.transport.connect_timeout_s
        return asyncio.get_running_loop().time() + t

    # --- entry points -----------------------------------------------------------------------
    async def start_request(self, plan: PipelinePlan) -> None:
        raise RoleMismatchError(f"a {self.role} instance does not accept plans")

    async def cancel(self, request_id: str) -> None:
        """Stop ``request_id`` here and free what it holds; NoSuchRequestError when it is
        not (or no longer, or not yet) here. The cancel is recorded either way: it may
        have overtaken the request, which is then refused when it arrives."""
        self.cancelled.add(request_id)
        await self.stop_request(request_id)

    async def stop_request(self, request_id: str) -> None:
        """The role's part of ``cancel``."""
        raise NoSuchRequestError(request_id)

    async def handoff(self, request_id: str, token_ids: list[int]) -> None:
        raise RoleMismatchError(f"a {self.role} instance takes no handoff (main decode does)")

    async def takeover(self, request_id: str) -> None:
        raise RoleMismatchError(f"a {self.role} instance takes no takeover (relay does)")

    def answer(
        self, model: type[Opening], handler: Callable[[Channel, Opening], Awaitable[bool]]
    ) -> None:
        """Run ``handler`` for each conversation that opens with ``model``'s op."""
        self.ops[model.kind()] = answering(model, handler)

    async def on_channel(self, channel: Channel, first: Mapping[str, object]) -> bool:
        """Run the data-plane conversation that ``first`` (the opening META) names; True
        when it ended cleanly and the channel may open another. An opening that is not
        its op's message is a ``ProtocolError`` (``protocol.read``)."""
        op = first.get("op")
        handler = self.ops.get(op) if isinstance(op, str) else None
        if handler is None:
            await send_error(
                channel,
                str(first.get("request_id", "")),
                "unknown_op",
                f"a {self.role} instance does not handle op {op!r}",
            )
            return False
        return bool(await handler(channel, first))

    # --- reports ----------------------------------------------------------------------------
    @property
    def max_running_requests(self) -> int:
        # fixed at start: safe to read off the engine thread
        return self.runner.engine.max_running_requests

    def relay_load(self) -> float:
        s = self.runner.snapshot.stats
        held = s.num_total_blocks - s.num_free_blocks - s.num_cached_blocks
        return min(1.0, max(s.num_running / self.max_running_requests, held / s.num_total_blocks))

    def load_report(self) -> LoadReport:
        s = self.runner.snapshot.stats
        return LoadReport(
            instance_id=self.settings.instance_id,
            role=self.role,
            running=s.num_running,
            waiting=s.num_waiting,
            kv_blocks_free=s.num_free_blocks,
            kv_blocks_total=s.num_total_blocks,
            relay_load=self.relay_load(),
            capacity=self.max_running_requests,
            draining=self.draining,
        )

    def state_report(self) -> StateReport:
        s = self.runner.snapshot.stats
        return StateReport(
            instance_id=self.settings.instance_id,
            live_requests=len(self.live),
            engine_requests=s.num_running + s.num_waiting + s.num_awaiting_kv,
            kv_blocks_free=s.num_free_blocks,
            kv_blocks_cached=s.num_cached_blocks,
            kv_blocks_locked=s.num_locked_blocks,
            kv_blocks_total=s.num_total_blocks,
            asyncio_tasks=len(asyncio.all_tasks()),
        )

    def refresh_gauges(self) -> None:
        s = self.runner.snapshot.stats
        m = self.metrics
        m.kv_blocks_free.set(s.num_free_blocks)
        m.kv_blocks_total.set(s.num_total_blocks)
        held = s.num_total_blocks - s.num_free_blocks - s.num_cached_blocks
        m.kv_usage.set(held / max(1, s.num_total_blocks))
        m.running.set(s.num_running)
        m.waiting.set(s.num_waiting)
        m.relay_load.set(self.relay_load())
        m.wire_sent["wan"] = self.wan_counters.wire_sent
        m.wire_sent["fastpath"] = self.fast_counters.wire_sent

    def warm_wan_peers(self, main_decodes: list[Endpoint]) -> list[asyncio.Task[None]]:
        """The main decodes this instance may ship KV to (``PUT /v1/pdd/wan-peers``), and
        the tasks opening channels to them: only a prefill worker ships across the WAN
        (``PrefillRole``); elsewhere nothing."""
        return []

    # --- helpers ----------------------------------------------------------------------------
    def spawn(self, coro: Awaitable[None], name: str) -> None:
        """Run ``coro`` in the background, logging (not losing) its failure."""
        task = asyncio.ensure_future(coro)
        task.set_name(name)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("%s failed", task.get_name(), exc_info=task.exception())

    async def open_channel(
        self, peer: Endpoint, peer_role: Role, wan: bool, sends: bool, spare: bool = False
    ) -> Channel:
        """A channel to a peer's data address; across the WAN with TLS where it is on, and
        metered as a WAN link (``sends``: this end sends the transfer's data), a failed
        connect included unless it is a ``spare`` opened ahead of need (no transfer
        failed: the next one opens, and reports, its own)."""
        host, port = split_addr(peer.wan_addr if wan else peer.fast_addr)
        tls = self.settings.wan_tls
        try:
            channel = await connect(
                host,
                port,
                self.settings.secret,
                self.settings.instance_id,
                config=self.settings.transport,
                counters=self.wan_counters if wan else self.fast_counters,
                network=self.network,
                tls=tls.client if wan and tls is not None else None,
            )
        except TransportError as exc:
            if wan and not spare:
                self._count_connect_failure(peer.instance_id, peer_role, sends, exc)
            raise
        if wan:
            self.meter_wan(channel, peer_role, sends)
        return channel

    def meter_wan(self, channel: Channel, peer_role: Role, sends: bool) -> None:
        """Meter a WAN channel on the links to and from its (authenticated) peer, once
        (a channel P keeps carries one transfer after another)."""
        if channel.metered:
            return
        out = self._link(channel.peer.name, peer_role)
        links, now = self.metrics.links, loop_time()
        meter = ChannelMeter(links.meter(out, now), links.meter(out.reverse, now), sends)
        channel.attach_meter(meter)

    def _link(self, peer: str, peer_role: Role) -> LinkKey:
        """The link from this instance to ``peer``."""
        return LinkKey(self.settings.instance_id, peer, self.role, peer_role)

    def _count_connect_failure(
        self, peer: str, peer_role: Role, sends: bool, exc: TransportError
    ) -> None:
        key = self._link(peer, peer_role)
        now = loop_time()
        meter = self.metrics.links.meter(key if sends else key.reverse, now)
        if isinstance(exc, TransferTimeout):
            meter.record_timeout(now)
        else:
            meter.record_failure(failure_reason(exc), now)

    async def abort_engine_request(self, request_id: str) -> None:
        """Abort if the engine still holds it (it may have finished on its own)."""
        with contextlib.suppress(UnknownRequestError):
            await self.runner.call(lambda e: e.abort(request_id))

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(BaseException):
                await task
