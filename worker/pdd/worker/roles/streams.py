"""Per-request token streams that the control API serves as NDJSON.

A decode-side instance learns about a request from the data plane, but the
router opens the stream over HTTP, maybe before the request has
reached this instance. So a stream exists as soon as either side asks for it;
the reader waits, bounded, for the first event. Events are kept in a list (not
a queue) so a reader that reconnects can start over from any position.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from pdd.common.vocabulary import FinishReason, LinkFault
from pdd.common.wire import TokenEvent, TokenLogprobs

#: A closed stream is forgotten this long after it ends (time for a late reader).
_LINGER_S = 30.0


@dataclass
class RequestStream:
    request_id: str
    source: str
    events: list[TokenEvent] = field(default_factory=list)
    closed: bool = False
    started: bool = False  # the request reached this instance
    closed_at: float | None = None
    _changed: asyncio.Event = field(default_factory=asyncio.Event)

    def push(self, event: TokenEvent) -> None:
        if self.closed:
            return
        self.started = True
        self.events.append(event)
        self._notify()

    def start(self) -> None:
        self.started = True
        self._notify()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.closed_at = asyncio.get_running_loop().time()
            self._notify()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def follow(self, arrival_timeout_s: float) -> AsyncIterator[TokenEvent]:
        """Every event, then new ones as they come, until the stream closes.

        Ends with an error status event when the request never shows up.
        """
        index = 0
        loop = asyncio.get_running_loop()
        deadline = loop.time() + arrival_timeout_s
        while True:
            while index < len(self.events):
                yield self.events[index]
                index += 1
            if self.closed:
                return
            changed = self._changed
            if self.started:
                await changed.wait()
                continue
            try:
                await asyncio.wait_for(changed.wait(), max(0.0, deadline - loop.time()))
            except TimeoutError:
                yield TokenEvent(
                    request_id=self.request_id,
                    seq=0,
                    source=self.source,  # the router routes around the instance it names
                    error=f"request never reached this instance within {arrival_timeout_s}s",
                )
                self.close()  # so the hub forgets it (else one stream per lost request stays)
                return


class StreamHub:
    """The streams of one worker, by request id."""

    def __init__(self, source: str) -> None:
        self.source = source
        self._streams: dict[str, RequestStream] = {}

    def get(self, request_id: str) -> RequestStream:
        self._forget_old()
        stream = self._streams.get(request_id)
        if stream is None:
            stream = self._streams[request_id] = RequestStream(request_id, self.source)
        return stream

    def emit(
        self,
        request_id: str,
        seq: int,
        token_id: int,
        finished: bool,
        reason: FinishReason | None,
        cached_tokens: int | None = None,
        md_hit_tokens: int | None = None,
        logprobs: TokenLogprobs | None = None,
    ) -> None:
        event = TokenEvent(
            request_id=request_id,
            seq=seq,
            token_id=token_id,
            source=self.source,
            finished=finished,
            finish_reason=reason,
            cached_tokens=cached_tokens,
            md_hit_tokens=md_hit_tokens,
            logprobs=logprobs,
        )
        self.get(request_id).push(event)

    def fail(
        self,
        request_id: str,
        seq: int,
        error: str,
        culprit: str | None = None,
        link_fault: LinkFault | None = None,
        error_type: str | None = None,
    ) -> None:
        """Push an error status event and close: this instance gives up on the request
        (``culprit``: the other instance that made it, if one did; ``link_fault``: P's KV
        could not cross the WAN to it; ``error_type``: the request's own work failed, see
        ``TokenEvent``)."""
        stream = self.get(request_id)
        event = TokenEvent(
            request_id=request_id,
            seq=seq,
            source=self.source,
            error=error,
            culprit=culprit,
            link_fault=link_fault,
            error_type=error_type,
        )
        stream.push(event)
        stream.close()

    def _forget_old(self) -> None:
        now = asyncio.get_running_loop().time()
        stale = [
            rid
            for rid, s in self._streams.items()
            if s.closed_at is not None and now - s.closed_at > _LINGER_S
        ]
        for rid in stale:
            del self._streams[rid]
