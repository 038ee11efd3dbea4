"""Transport settings: one frozen object shared by a server and its channels."""

from __future__ import annotations

from dataclasses import dataclass

from pdd.worker.transport.framing import HEADER_SIZE

MIB = 1 << 20


@dataclass(frozen=True)
class TransportConfig:
    """Limits and timeouts of a channel.

    ``window_bytes`` bounds what a sender may have in flight (sent, not yet
    consumed by the receiving application, headers included), and therefore
    what a receiver ever buffers. Timeouts are per wait, not per transfer: a
    slow link that keeps making progress never times out, a cut one does.
    """

    max_frame_bytes: int = 4 * MIB
    window_bytes: int = 16 * MIB
    chunk_bytes: int = 1 * MIB
    #: Unauthenticated peers may send only this much per handshake frame.
    max_handshake_bytes: int = 4096
    connect_timeout_s: float = 10.0
    read_timeout_s: float = 30.0
    write_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if not 0 < self.chunk_bytes <= self.max_frame_bytes:
            raise ValueError(
                f"chunk_bytes ({self.chunk_bytes}) must be in (0, max_frame_bytes="
                f"{self.max_frame_bytes}]"
            )
        if self.max_frame_bytes + HEADER_SIZE > self.window_bytes:
            raise ValueError(
                f"window_bytes ({self.window_bytes}) must hold one full frame: at least "
                f"max_frame_bytes + {HEADER_SIZE} = {self.max_frame_bytes + HEADER_SIZE}"
            )
        for name in ("connect_timeout_s", "read_timeout_s", "write_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

    @property
    def credit_batch_bytes(self) -> int:
        """Consumed bytes are returned to the sender in batches of this size (fewer frames)."""
        return max(1, self.window_bytes // 4)
