"""Channel: an authenticated, flow-controlled frame connection to one peer.

Flow control is credit based. Each side announces a receive window in the
handshake; a sender may have at most that many bytes (header + payload of
every data frame) sent but not yet *consumed by the receiving application*.
The receiver hands consumed bytes back in CREDIT frames. So a slow reader
slows the writer down to its own pace, and neither side ever buffers more
than the window, however fast the link is. A peer that sends past its credit
is broken or hostile: the channel is failed with a ``FrameError``.

A background task reads frames: CREDIT frames feed the sender, everything
else goes to an inbox that ``recv()`` drains. CREDIT, ERROR and CLOSE are not
flow controlled (they must get through a full window).

A channel that crosses the WAN gets a ``ChannelMeter`` (``attach_meter``): from then
on it reports what it sends, what the peer's credit confirms, what arrives, its
handshake's round trips, and how it failed (see ``metering``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import struct

from pdd.worker.transport.config import TransportConfig
from pdd.worker.transport.counters import ByteCounters
from pdd.worker.transport.errors import FrameError, LinkDown, TransferTimeout, TransportError
from pdd.worker.transport.framing import HEADER_SIZE, Frame, MsgType
from pdd.worker.transport.metering import ChannelMeter, failure_reason
from pdd.worker.transport.peer_auth import PeerInfo
from pdd.worker.transport.stream import FrameStream

log = logging.getLogger(__name__)

_CREDIT = struct.Struct("<Q")
_UNCONTROLLED = frozenset({MsgType.CREDIT, MsgType.ERROR, MsgType.CLOSE})
_HANDSHAKE_ONLY = frozenset({MsgType.HELLO, MsgType.AUTH})
#: ``recv(timeout_s=DEFAULT)`` means the config's read timeout.
DEFAULT = -1.0


def frame_cost(msg_type: MsgType, payload_len: int) -> int:
    """Window bytes a frame uses: 0 for control frames, header + payload otherwise."""
    return 0 if msg_type in _UNCONTROLLED else HEADER_SIZE + payload_len


class Channel:
    """One authenticated connection. Build with ``connect()`` or receive from ``serve()``."""

    def __init__(self, stream: FrameStream, peer: PeerInfo, config: TransportConfig) -> None:
        self.peer = peer
        self.config = config
        self._stream = stream
        self._send_credit = peer.window_bytes
        self._credit_arrived = asyncio.Event()  # also set on failure
        self._inbox: asyncio.Queue[Frame | TransportError] = asyncio.Queue()
        self._buffered = 0  # window bytes sitting in the inbox
        self._consumed_unreported = 0  # consumed by recv(), not yet credited back
        self._failure: TransportError | None = None
        self._closed = False
        self._peer_closed = False  # the peer said CLOSE: its end of stream is no failure
        self._meter: ChannelMeter | None = None
        self._reader = asyncio.create_task(self._read_loop(), name=f"channel-read-{peer.name}")

    @property
    def counters(self) -> ByteCounters:
        return self._stream.counters

    @property
    def in_flight_bytes(self) -> int:
        """Window bytes sent and not yet credited back by the peer."""
        return self.peer.window_bytes - self._send_credit

    @property
    def buffered_bytes(self) -> int:
        """Window bytes received and not yet taken by ``recv()``."""
        return self._buffered

    @property
    def has_inbound(self) -> bool:
        """A frame (or the channel's failure) waits for ``recv()``: lets a sender that
        expects nothing yet notice a peer's ERROR between its own frames."""
        return not self._inbox.empty()

    @property
    def is_open(self) -> bool:
        return self._failure is None and not self._closed

    def attach_meter(self, meter: ChannelMeter) -> None:
        """Report to ``meter`` from now on, starting with the handshake's round trips."""
        now = self._now()
        for rtt in self.peer.rtt_samples:
            meter.rtt(rtt, now)
        self._meter = meter
        if not self.is_open:
            meter.close(now)

    def commit(self, nbytes: int) -> None:
        """Announce ``nbytes`` this channel is about to send (the link's backlog)."""
        if self._meter is not None:
            self._meter.commit(nbytes, self._now())

    def settle(self) -> None:
        """The transfer is over: backlog it announced and did not send leaves the link
        (a channel kept for the next transfer must not carry it over)."""
        if self._meter is not None:
            self._meter.settle(self._now())

    @property
    def metered(self) -> bool:
        """Whether a ``ChannelMeter`` reports this channel (a reused one keeps its first)."""
        return self._meter is not None

    async def send(
        self, msg_type: MsgType, request_id: int, payload: bytes | memoryview = b"", flags: int = 0
    ) -> None:
        """Send one frame, waiting for flow-control credit and socket drain.

        Raises ``TransferTimeout`` when no credit arrives within ``write_timeout_s``
        (the channel stays open: the caller decides), ``LinkDown``/``FrameError``
        when the channel has failed.
        """
        if msg_type in _HANDSHAKE_ONLY:
            raise ValueError(f"{msg_type.name} is only valid during the handshake")
        if len(payload) > self.config.max_frame_bytes:
            raise ValueError(
                f"payload of {len(payload)} bytes exceeds max_frame_bytes="
                f"{self.config.max_frame_bytes}; use send_chunked()"
            )
        cost = frame_cost(msg_type, len(payload))
        if cost > self.peer.window_bytes:
            raise ValueError(f"frame of {cost} bytes can never fit the peer's window")
        self._raise_if_failed()
        try:
            await self._take_credit(cost)
            await self._stream.write(msg_type, request_id, payload, flags)
        except TransportError as exc:
            if exc is not self._failure:  # the channel's own failure was counted as it came
                self._report_failure(exc)
            raise
        if self._meter is not None:
            self._meter.sent(cost, self._now())
            if msg_type == MsgType.ERROR:
                self._meter.failed("error_sent", self._now())

    async def send_chunked(
        self, msg_type: MsgType, request_id: int, data: bytes | memoryview
    ) -> int:
        """Send ``data`` as frames of at most ``chunk_bytes``; returns the number of frames."""
        view = memoryview(data).cast("B")
        step = self.config.chunk_bytes
        offsets = range(0, len(view), step) if len(view) else [0]
        for offset in offsets:
            await self.send(msg_type, request_id, view[offset : offset + step])
        return len(offsets)

    async def recv(self, timeout_s: float | None = DEFAULT) -> Frame:
        """The next frame from the peer (never a CREDIT frame).

        ``timeout_s`` defaults to the config's ``read_timeout_s``; ``None`` waits
        forever (an idle server loop). On ``TransferTimeout`` the channel stays
        open; ``LinkDown``/``FrameError`` mean it is gone.
        """
        timeout = self.config.read_timeout_s if timeout_s == DEFAULT else timeout_s
        try:
            item = await asyncio.wait_for(self._inbox.get(), timeout)
        except TimeoutError:
            exc = TransferTimeout(
                f"no frame from {self.peer.name} within {timeout}s: link cut or peer stuck"
            )
            self._report_failure(exc)
            raise exc from None
        if isinstance(item, TransportError):
            self._inbox.put_nowait(item)  # every later recv() sees the same failure
            raise item
        self._release(frame_cost(item.msg_type, len(item.payload)))
        return item

    async def close(self) -> None:
        """Say goodbye (CLOSE) and close the connection; idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._failure is None:
            with contextlib.suppress(Exception):
                self._stream.write_nowait(MsgType.CLOSE, 0)
        self._reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reader
        await self._stream.close(self.config.write_timeout_s)
        self._fail(LinkDown(f"channel to {self.peer.name} was closed locally"))

    def abort(self) -> None:
        """Drop the connection now (no CLOSE); pending senders and receivers get LinkDown."""
        self._closed = True
        self._reader.cancel()
        self._stream.abort()
        self._fail(LinkDown(f"channel to {self.peer.name} was aborted locally"))

    async def _take_credit(self, cost: int) -> None:
        """Wait until ``cost`` bytes of credit are available, then take them."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.write_timeout_s
        while self._send_credit < cost:
            self._raise_if_failed()
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise TransferTimeout(
                    f"{self.peer.name} returned no flow-control credit within "
                    f"{self.config.write_timeout_s}s ({self.in_flight_bytes} bytes in flight)"
                )
            self._credit_arrived.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._credit_arrived.wait(), remaining)
        self._raise_if_failed()
        self._send_credit -= cost

    def _release(self, cost: int) -> None:
        """Account a consumed frame and hand credit back.

        Credit goes back in batches while frames are queued, and at once when
        the inbox runs empty: the sender may be waiting for room for a frame
        larger than what one batch would free.
        """
        self._buffered -= cost
        self._consumed_unreported += cost
        batch_full = self._consumed_unreported >= self.config.credit_batch_bytes
        caught_up = self._inbox.empty() and self._consumed_unreported > 0
        if (batch_full or caught_up) and self.is_open:
            grant, self._consumed_unreported = self._consumed_unreported, 0
            with contextlib.suppress(Exception):
                self._stream.write_nowait(MsgType.CREDIT, 0, _CREDIT.pack(grant))

    async def _read_loop(self) -> None:
        try:
            while True:
                frame = await self._stream.read(self.config.max_frame_bytes, timeout_s=None)
                if frame.msg_type == MsgType.CREDIT:
                    self._on_credit(frame)
                    continue
                self._admit(frame)
        except FrameError as exc:
            log.warning("closing channel to %s: %s", self.peer.name, exc)
            self._stream.reject("malformed_frame", str(exc))
            self._report_failure(exc)
            self._fail(exc)
        except TransportError as exc:
            if not (self._peer_closed and isinstance(exc, LinkDown)):
                self._report_failure(exc)
            self._fail(exc)

    def _admit(self, frame: Frame) -> None:
        if frame.msg_type in _HANDSHAKE_ONLY:
            raise FrameError(f"{frame.msg_type.name} frame after the handshake")
        cost = frame_cost(frame.msg_type, len(frame.payload))
        outstanding = self._buffered + self._consumed_unreported + cost
        if outstanding > self.config.window_bytes:
            raise FrameError(
                f"{self.peer.name} overran its flow-control window "
                f"({outstanding} > {self.config.window_bytes} bytes)"
            )
        self._buffered += cost
        self._inbox.put_nowait(frame)
        self._peer_closed = self._peer_closed or frame.msg_type == MsgType.CLOSE
        if self._meter is not None:
            self._meter.received(cost, self._now())
            if frame.msg_type == MsgType.ERROR:
                self._meter.failed("peer_error", self._now())

    def _on_credit(self, frame: Frame) -> None:
        if len(frame.payload) != _CREDIT.size:
            raise FrameError(f"CREDIT payload must be {_CREDIT.size} bytes")
        (grant,) = _CREDIT.unpack(frame.payload)
        if self._send_credit + grant > self.peer.window_bytes:
            raise FrameError(f"{self.peer.name} returned more credit than was ever sent")
        self._send_credit += grant
        self._credit_arrived.set()
        if self._meter is not None:
            self._meter.acked(grant, self._now())

    def _fail(self, exc: TransportError) -> None:
        if self._failure is None:
            self._failure = exc
            self._inbox.put_nowait(exc)
            self._credit_arrived.set()
        if self._meter is not None:
            self._meter.close(self._now())

    def _report_failure(self, exc: TransportError) -> None:
        """Count a timeout, or the failure that ends the transfer (once per channel)."""
        if self._meter is None:
            return
        if isinstance(exc, TransferTimeout):
            self._meter.timeout(self._now())
        else:
            self._meter.failed(failure_reason(exc), self._now())

    @staticmethod
    def _now() -> float:
        return asyncio.get_running_loop().time()

    def _raise_if_failed(self) -> None:
        if self._failure is not None:
            raise self._failure
