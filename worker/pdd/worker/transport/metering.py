"""ChannelMeter: one channel's events, fed into the link meters of its two directions.

A channel carries frames both ways, so it feeds two directed links: ``out`` (this end
to the peer: what it sends, and the credit that confirms it) and ``inbound`` (the
peer to this end: what arrives). RTT samples go to both (a round trip has no
direction). A failure or a timeout belongs to the *transfer* the channel exists for,
so it is counted once, on the link the data flows on (``sends``: this end sends it).

The channel tells its meter what happened; the meter keeps this channel's own share
(its backlog, its unconfirmed bytes) so that when the channel ends, exactly that share
leaves the link's totals, whatever the peer still owed.
"""

from __future__ import annotations

from pdd.worker.transport.errors import (
    AuthError,
    FrameError,
    LinkDown,
    TlsError,
    TransportError,
)
from pdd.worker.transport.link_meter import LinkMeter


def failure_reason(exc: TransportError) -> str:
    """A bounded label for a transport failure (``TransferTimeout`` is counted apart)."""
    for kind, reason in (
        (TlsError, "tls"),  # before AuthError: a TlsError is one
        (AuthError, "auth"),
        (FrameError, "frame_error"),
        (LinkDown, "link_down"),
    ):
        if isinstance(exc, kind):
            return reason
    return "other"


class ChannelMeter:
    """What one channel contributes to its links; ``close()`` takes its share back out."""

    def __init__(self, out: LinkMeter, inbound: LinkMeter, sends: bool) -> None:
        self.out = out
        self.inbound = inbound
        self.transfer = out if sends else inbound
        self._committed = 0  # backlog this channel promised and has not sent yet
        self._in_flight = 0  # sent by this channel, not yet confirmed
        self._failed = False
        self._closed = False
        out.attach()
        inbound.attach()

    def commit(self, nbytes: int, now: float) -> None:
        self._committed += nbytes
        self.out.commit(nbytes, now)

    def settle(self, now: float) -> None:
        """A transfer on this channel ended: what it committed and did not send (chunks
        the receiver turned out to hold) leaves the backlog; the channel stays open."""
        self.out.release(self._committed, 0, now)
        self._committed = 0

    def sent(self, nbytes: int, now: float) -> None:
        from_queue = min(nbytes, self._committed)
        self._committed -= from_queue
        self._in_flight += nbytes
        self.out.record_sent(nbytes, now, from_queue)

    def acked(self, nbytes: int, now: float) -> None:
        confirmed = min(nbytes, self._in_flight)  # credit for bytes sent before metering
        self._in_flight -= confirmed
        self.out.record_acked(confirmed, now)

    def received(self, nbytes: int, now: float) -> None:
        self.inbound.record_received(nbytes, now)

    def rtt(self, rtt_s: float, now: float) -> None:
        self.out.record_rtt(rtt_s, now)
        self.inbound.record_rtt(rtt_s, now)

    def timeout(self, now: float) -> None:
        self.transfer.record_timeout(now)

    def failed(self, reason: str, now: float) -> None:
        """The transfer failed; only the first report counts (one failure, many symptoms)."""
        if not self._failed:
            self._failed = True
            self.transfer.record_failure(reason, now)

    def close(self, now: float) -> None:
        """The channel ended: its backlog and unconfirmed bytes leave the link; idempotent."""
        if self._closed:
            return
        self._closed = True
        self.out.release(self._committed, self._in_flight, now)
        self._committed = self._in_flight = 0
        self.out.detach(now)
        self.inbound.detach(now)
