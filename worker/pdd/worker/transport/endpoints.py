"""``serve()`` and ``connect()``: the two ways to get a Channel.

The server never lets one connection hurt the others: a failed handshake (TLS or
HMAC), a malformed frame or a crashing handler ends that connection only (counted in
``ServerStats``, logged with the reason), and the listener keeps accepting.

With ``tls`` (an ``ssl.SSLContext``, see ``tls.py``) TLS runs first, on the accepted or
opened TCP connection, and the HMAC handshake and every frame after it run inside. It
is an upgrade (``start_tls``) rather than asyncio's ``ssl=`` listener so that a failed
TLS handshake reaches this code (asyncio's own listener drops it without a word) and
becomes a log line with OpenSSL's reason and a count in ``rejected``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from pdd.common.network import TCP, Listener, Network
from pdd.common.wan_tls import tls_failure
from pdd.worker.transport.channel import Channel
from pdd.worker.transport.config import TransportConfig
from pdd.worker.transport.counters import ByteCounters
from pdd.worker.transport.errors import LinkDown, TlsError, TransferTimeout, TransportError
from pdd.worker.transport.peer_auth import client_handshake, secret_bytes, server_handshake
from pdd.worker.transport.stream import FrameStream

log = logging.getLogger(__name__)

Handler = Callable[[Channel], Awaitable[None]]


@dataclass
class ServerStats:
    """What happened to the connections a server accepted."""

    accepted: int = 0
    authenticated: int = 0
    rejected: int = 0  # failed handshake: TLS, wrong secret, garbage, timeout
    transport_errors: int = 0  # authenticated, then malformed frames or a lost link
    handler_errors: int = 0  # the application handler raised


class Server:
    """A listening transport endpoint; ``close()`` stops it and drops its channels."""

    def __init__(
        self,
        secret: bytes,
        handler: Handler,
        name: str,
        config: TransportConfig,
        counters: ByteCounters | None,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self.name = name
        self.config = config
        self.stats = ServerStats()
        self._secret = secret
        self._handler = handler
        self._counters = counters
        self._tls = tls
        self._tasks: set[asyncio.Task] = set()
        self._listener: Listener | None = None

    @property
    def port(self) -> int:
        if self._listener is None:
            raise RuntimeError("Server.port read before serve() returned")
        return self._listener.port

    async def _start(self, network: Network, host: str, port: int) -> None:
        self._listener = await network.start_server(self._on_connect, host, port)

    async def close(self) -> None:
        if self._listener is not None:
            self._listener.close()
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(BaseException):
                await task

    async def __aenter__(self) -> Server:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _on_connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None  # asyncio runs connection callbacks as tasks
        self._tasks.add(task)
        try:
            await self._run_connection(reader, writer)
        except asyncio.CancelledError:
            # Only Server.close() cancels these tasks. Ending quietly keeps asyncio's
            # stream callback (Python 3.11) from logging the cancellation as an error.
            writer.transport.abort()
        except Exception:
            # A bug, not a peer's fault: logged as one, and the connection closed, since
            # asyncio (3.11) leaves a failed callback's socket open, its peer waiting.
            self.stats.handler_errors += 1
            log.exception("transport handler failed on a connection from %s", _peer_of(writer))
            writer.transport.abort()
        finally:
            self._tasks.discard(task)

    async def _run_connection(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        self.stats.accepted += 1
        if self._tls is not None and not await self._start_tls(writer):
            return
        stream = FrameStream(
            reader, writer, ByteCounters(parent=self._counters), self.config.write_timeout_s
        )
        cfg = self.config
        try:
            peer = await asyncio.wait_for(
                server_handshake(
                    stream, self._secret, self.name, cfg.window_bytes, cfg.max_handshake_bytes
                ),
                cfg.connect_timeout_s,
            )
        except (TransportError, TimeoutError) as exc:
            self.stats.rejected += 1
            log.warning("rejected connection from %s: %s", stream.peer_address, _why(exc))
            stream.reject("auth_failed", _why(exc))
            return
        self.stats.authenticated += 1
        channel = Channel(stream, peer, cfg)
        try:
            await self._handler(channel)
        except TransportError as exc:
            self.stats.transport_errors += 1
            log.warning("channel from %s ended: %s", peer.name, exc)
        except Exception:
            self.stats.handler_errors += 1
            log.exception("transport handler failed on a channel from %s", peer.name)
        finally:
            await channel.close()

    async def _start_tls(self, writer: asyncio.StreamWriter) -> bool:
        """TLS before anything else; False (logged, counted, dropped) when it fails."""
        assert self._tls is not None
        try:
            await writer.start_tls(self._tls, ssl_handshake_timeout=self.config.connect_timeout_s)
        except (OSError, TimeoutError) as exc:  # ssl.SSLError is an OSError
            self.stats.rejected += 1
            log.warning("rejected connection from %s: %s", _peer_of(writer), tls_failure(exc))
            writer.close()  # not abort(): the alert that tells the client why must go out
            return False
        return True


def _peer_of(writer: asyncio.StreamWriter) -> str:
    peer = writer.get_extra_info("peername")
    return f"{peer[0]}:{peer[1]}" if peer else "?"


def _why(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "handshake did not complete within connect_timeout_s"
    return str(exc)


async def serve(
    host: str,
    port: int,
    secret: str | bytes,
    handler: Handler,
    *,
    name: str = "server",
    config: TransportConfig | None = None,
    counters: ByteCounters | None = None,
    network: Network = TCP,
    tls: ssl.SSLContext | None = None,
) -> Server:
    """Listen on ``host:port`` (0 = any free port); run ``handler`` per authenticated channel.

    ``counters``, when given, accumulates the bytes of every channel (per-link totals).
    ``tls``: a server context; every connection must complete TLS first (TCP only).
    The channel is closed when the handler returns.
    """
    cfg = config or TransportConfig()
    server = Server(secret_bytes(secret), handler, name, cfg, counters, tls)
    await server._start(network, host, port)
    return server


async def connect(
    host: str,
    port: int,
    secret: str | bytes,
    peer_name: str,
    *,
    config: TransportConfig | None = None,
    counters: ByteCounters | None = None,
    network: Network = TCP,
    tls: ssl.SSLContext | None = None,
) -> Channel:
    """Open an authenticated channel; ``peer_name`` is how this side introduces itself.

    ``tls``: a client context; TLS runs before the handshake (TCP only).
    Raises ``LinkDown`` (refused, reset), ``TransferTimeout`` (no answer within
    ``connect_timeout_s``), ``AuthError`` (secret mismatch; ``TlsError``: a certificate
    not from the deployment's CA, or the server refused ours) or ``FrameError``.
    """
    cfg = config or TransportConfig()
    key = secret_bytes(secret)
    try:
        reader, writer = await asyncio.wait_for(
            network.open_connection(host, port), cfg.connect_timeout_s
        )
    except TimeoutError:
        raise TransferTimeout(f"connect to {host}:{port} timed out") from None
    except OSError as exc:
        raise LinkDown(f"cannot connect to {host}:{port}: {exc}") from None
    if tls is not None:
        await _start_tls(writer, tls, host, port, cfg.connect_timeout_s)
    stream = FrameStream(reader, writer, ByteCounters(parent=counters), cfg.write_timeout_s)
    try:
        peer = await asyncio.wait_for(
            client_handshake(stream, key, peer_name, cfg.window_bytes, cfg.max_handshake_bytes),
            cfg.connect_timeout_s,
        )
    except TimeoutError:
        stream.abort()
        raise TransferTimeout(
            f"handshake with {host}:{port} did not complete within {cfg.connect_timeout_s}s"
        ) from None
    except LinkDown as exc:
        stream.abort()
        if tls is None:
            raise
        # TLS 1.3 finishes the client's handshake before the server has checked the
        # client's certificate; a server that refuses it closes, and the reset can beat
        # its alert to us. Right after TLS, that is what a drop means.
        raise TlsError(
            f"{host}:{port} closed the connection right after TLS: most likely it refused "
            f"our certificate (another CA, or none); its log says why ({exc})"
        ) from None
    except TransportError:
        stream.abort()
        raise
    return Channel(stream, peer, cfg)


async def _start_tls(
    writer: asyncio.StreamWriter, tls: ssl.SSLContext, host: str, port: int, timeout_s: float
) -> None:
    """The client's TLS handshake; a failure drops the connection and raises ``TlsError``
    (or ``TransferTimeout`` when the server never answers)."""
    try:
        await writer.start_tls(tls, server_hostname=host, ssl_handshake_timeout=timeout_s)
    except ssl.SSLError as exc:
        writer.close()  # not abort(): the alert that tells the server why must go out
        raise TlsError(f"TLS to {host}:{port}: {tls_failure(exc)}") from None
    except (OSError, TimeoutError) as exc:
        writer.transport.abort()
        if isinstance(exc, TimeoutError | ConnectionAbortedError):
            raise TransferTimeout(f"TLS handshake with {host}:{port} did not complete") from None
        raise LinkDown(f"TLS handshake with {host}:{port} lost: {exc}") from None
