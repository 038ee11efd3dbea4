"""Byte counters per channel, optionally rolled up into a per-link total.

The data plane exports ``pdd_worker_wan_kv_bytes_total`` and ``pdd_worker_fastpath_kv_bytes_total``
from a parent counter per link kind; each channel also keeps its own so one
transfer's cost can be read back (e.g. "only MD's miss crossed the WAN").
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdd.worker.transport.framing import HEADER_SIZE


@dataclass
class ByteCounters:
    """Payload bytes and framing (header) bytes, each direction."""

    payload_sent: int = 0
    framing_sent: int = 0
    frames_sent: int = 0
    payload_received: int = 0
    framing_received: int = 0
    frames_received: int = 0
    parent: ByteCounters | None = field(default=None, repr=False)

    @property
    def wire_sent(self) -> int:
        return self.payload_sent + self.framing_sent

    @property
    def wire_received(self) -> int:
        return self.payload_received + self.framing_received

    def on_sent(self, payload_len: int) -> None:
        self.payload_sent += payload_len
        self.framing_sent += HEADER_SIZE
        self.frames_sent += 1
        if self.parent is not None:
            self.parent.on_sent(payload_len)

    def on_received(self, payload_len: int) -> None:
        self.payload_received += payload_len
        self.framing_received += HEADER_SIZE
        self.frames_received += 1
        if self.parent is not None:
            self.parent.on_received(payload_len)
