"""FrameStream: frames over one TCP connection, with sequence checks, counters, timeouts.

This is the layer the handshake runs on (before a channel exists) and the
channel builds on. It turns every socket failure into a typed error:
end of stream or reset -> ``LinkDown``, no progress -> ``TransferTimeout``,
bad bytes -> ``FrameError``.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl

from pdd.common.wan_tls import tls_failure
from pdd.worker.transport.counters import ByteCounters
from pdd.worker.transport.errors import FrameError, LinkDown, TlsError, TransferTimeout
from pdd.worker.transport.framing import Frame, MsgType, encode_header, read_frame
from pdd.worker.transport.payloads import encode_error

_U32_MASK = 0xFFFFFFFF


class FrameStream:
    """Reads and writes frames; one reader and any number of writers at a time."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        counters: ByteCounters,
        write_timeout_s: float,
    ) -> None:
        self._reader = reader
        self._writer = writer
        self.counters = counters
        self._write_timeout_s = write_timeout_s
        self._send_seq = 0
        self._recv_seq = 0

    @property
    def peer_address(self) -> str:
        peer = self._writer.get_extra_info("peername")
        return f"{peer[0]}:{peer[1]}" if peer else "?"

    def write_nowait(
        self, msg_type: MsgType, request_id: int, payload: bytes | memoryview = b"", flags: int = 0
    ) -> None:
        """Queue a frame without waiting for the socket (small control frames).

        Header and payload are queued back to back with no await in between, so
        concurrent writers never interleave inside a frame.
        """
        header = encode_header(msg_type, request_id, self._send_seq, payload, flags)
        self._send_seq = (self._send_seq + 1) & _U32_MASK
        self._writer.write(header)
        if payload:
            self._writer.write(payload)
        self.counters.on_sent(len(payload))

    async def write(
        self, msg_type: MsgType, request_id: int, payload: bytes | memoryview = b"", flags: int = 0
    ) -> None:
        """Write a frame and wait until the socket buffer drains (TCP backpressure)."""
        if self._writer.is_closing():
            raise LinkDown(f"connection to {self.peer_address} is closed")
        self.write_nowait(msg_type, request_id, payload, flags)
        try:
            await asyncio.wait_for(self._writer.drain(), self._write_timeout_s)
        except TimeoutError:
            raise TransferTimeout(
                f"socket to {self.peer_address} accepted no data for {self._write_timeout_s}s"
            ) from None
        except ssl.SSLError as exc:  # the peer's TLS aborted (an alert): it refused us
            raise TlsError(f"TLS with {self.peer_address}: {tls_failure(exc)}") from None
        except OSError as exc:  # after TimeoutError, itself an OSError
            raise LinkDown(f"connection to {self.peer_address} lost: {exc}") from None

    async def read(self, max_payload: int, timeout_s: float | None) -> Frame:
        """Read the next frame, checking its sequence number."""
        try:
            frame = await asyncio.wait_for(read_frame(self._reader, max_payload), timeout_s)
        except TimeoutError:
            raise TransferTimeout(
                f"no frame from {self.peer_address} within {timeout_s}s"
            ) from None
        except ssl.SSLError as exc:  # e.g. the server refused our certificate (TLS 1.3
            # reports that after the client's handshake, on its first read)
            raise TlsError(f"TLS with {self.peer_address}: {tls_failure(exc)}") from None
        except OSError as exc:  # after TimeoutError, itself an OSError
            raise LinkDown(f"connection to {self.peer_address} lost: {exc}") from None
        if frame is None:
            raise LinkDown(f"{self.peer_address} closed the connection")
        if frame.seq != self._recv_seq:
            raise FrameError(
                f"frame out of sequence from {self.peer_address}: got {frame.seq}, "
                f"expected {self._recv_seq}"
            )
        self._recv_seq = (self._recv_seq + 1) & _U32_MASK
        self.counters.on_received(len(frame.payload))
        return frame

    def reject(self, code: str, message: str) -> None:
        """Tell the peer why, best effort, then drop the connection."""
        with contextlib.suppress(Exception):
            self.write_nowait(MsgType.ERROR, 0, encode_error(code, message))
        self._writer.close()

    def abort(self) -> None:
        """Drop the connection at once, discarding unsent data."""
        self._writer.transport.abort()

    async def close(self, timeout_s: float) -> None:
        self._writer.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._writer.wait_closed(), timeout_s)
