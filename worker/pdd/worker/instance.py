"""One worker instance, assembled in one place: runner, role, cache feed, control API, data port.

``pdd worker`` serves the control API with uvicorn and the data port on real
sockets; the in-process data plane (the deterministic tests) serves the same
app through an in-process HTTP transport and the data port on a
``MemoryNetwork``. One assembly, so what those tests run is what a pod runs.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Awaitable, Callable

from pydantic import ValidationError

from pdd.common.network import TCP, Network
from pdd.common.tls_rotation import TlsRotation
from pdd.worker.control_api import create_app
from pdd.worker.engine_runner import EngineRunner
from pdd.worker.metrics import WorkerMetrics
from pdd.worker.roles.base import RoleBase, WorkerSettings
from pdd.worker.roles.cache_feed import CacheFeed
from pdd.worker.roles.main_decode import MainDecodeRole
from pdd.worker.roles.mono import MonoRole
from pdd.worker.roles.prefill import PrefillRole
from pdd.worker.roles.protocol import ProtocolError, send_error, split_addr
from pdd.worker.roles.relay import RelayRole
from pdd.worker.transport import (
    Channel,
    Frame,
    MsgType,
    Server,
    TransportError,
    decode_json,
    serve,
)

log = logging.getLogger("pdd.worker")

ROLES: dict[str, type[RoleBase]] = {
    "prefill": PrefillRole,
    "relay": RelayRole,
    "main": MainDecodeRole,
    "mono": MonoRole,
}


class WorkerInstance:
    """The pieces of one worker; ``start()`` listens on the data port, ``stop()`` ends it all."""

    def __init__(self, settings: WorkerSettings, runner: EngineRunner, network: Network = TCP):
        self.settings = settings
        self.runner = runner
        self.network = network
        self.role = ROLES[settings.role](settings, runner, WorkerMetrics(settings.role), network)
        self.feed = CacheFeed(runner, settings.instance_id)
        self.app = create_app(self.role, self.feed, ready=lambda: not self.role.draining)
        self.data: Server | None = None
        self.wan: Server | None = None
        self._rotation: asyncio.Task | None = None

    async def start(self, data_addr: str, wan_addr: str | None = None) -> None:
        """Start the engine's driver and listen for peers on ``data_addr`` (HOST:PORT), and
        for peers across the WAN on ``wan_addr`` where given: the same protocol on a port
        of its own, so that only that port need be reachable from the other datacenter.
        With WAN TLS on, that port speaks TLS and the data port stays plaintext (it serves
        this datacenter only), so TLS needs the WAN port of its own."""
        tls = self.settings.wan_tls
        if tls is not None and wan_addr is None:
            raise ValueError("WAN TLS needs a WAN port of its own (--wan HOST:PORT)")
        self.runner.start()
        self.data = await self._listen(data_addr)
        if wan_addr is not None:
            self.wan = await self._listen(wan_addr, tls.server if tls is not None else None)
        if tls is not None:  # a renewed Secret applies to the next handshake, no restart
            watch = TlsRotation(tls.folder, tls.contexts).watch()
            self._rotation = asyncio.create_task(watch, name="wan-tls-rotation")

    async def _listen(self, addr: str, tls: ssl.SSLContext | None = None) -> Server:
        host, port = split_addr(addr)
        return await serve(
            host,
            port,
            self.settings.secret,
            _data_handler(self.role),
            name=self.settings.instance_id,
            config=self.settings.transport,
            network=self.network,
            tls=tls,
        )

    async def drain(self, grace_s: float, notice_s: float = 0.0, poll_s: float = 0.05) -> bool:
        """Stop taking work and let what runs finish: ``/ready`` turns false at once (the
        router stops choosing this instance on its next poll, Kubernetes takes the pod
        out of its Service), a relay hands each request to MD in one shot as soon as MD
        holds the KV, and every request with state here ends. Requests still sent during
        ``notice_s`` (before every router and the Service have seen the drain) are served
        too, so an idle instance lingers that long instead of exiting under them. True
        when all ended within ``grace_s`` (loop time); False when the deadline came first."""
        self.role.draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_s
        noticed = loop.time() + min(notice_s, grace_s)
        while self.role.live or loop.time() < noticed:
            if loop.time() >= deadline:
                log.warning(
                    "%s: drain deadline (%.0f s) reached with %d requests live",
                    self.settings.instance_id,
                    grace_s,
                    len(self.role.live),
                )
                return False
            await asyncio.sleep(poll_s)
        log.info("%s: drained; nothing live", self.settings.instance_id)
        return True

    async def stop(self) -> None:
        if self._rotation is not None:
            self._rotation.cancel()
        await self.role.close()
        for server in (self.data, self.wan):
            if server is not None:
                await server.close()
        self.runner.stop()


def _data_handler(role: RoleBase) -> Callable[[Channel], Awaitable[None]]:
    """Per connection: the opening META names the conversation; bad input gets an ERROR.

    A conversation that ends cleanly leaves the channel to the sender's next one (P keeps
    its WAN channels warm: ``transport.pool``). Between conversations, and before the
    first (a spare P opened ahead of need), a channel idles without a timeout until the
    sender opens one, closes it, or the line drops it: nothing is in progress on it."""

    async def handle(channel: Channel) -> None:
        while True:
            try:
                frame = await channel.recv(timeout_s=None)
            except TransportError:
                return  # an idle channel went away: nothing was in progress on it
            if frame.msg_type == MsgType.CLOSE or not await _converse(role, channel, frame):
                return

    return handle


async def _converse(role: RoleBase, channel: Channel, frame: Frame) -> bool:
    """One conversation from its opening frame; True when the channel may carry another."""
    try:
        if frame.msg_type != MsgType.META:
            raise ValueError(f"a conversation opens with META, not {frame.msg_type.name}")
        return await role.on_channel(channel, decode_json(frame.payload)) and channel.is_open
    except (ValidationError, ValueError, ProtocolError) as exc:
        log.warning("bad data-plane message from %s: %s", channel.peer.name, exc)
        await send_error(channel, "", "bad_request", str(exc))
        return False
