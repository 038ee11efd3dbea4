"""Join the token streams of several instances into one ordered stream.

In PDD a request's tokens come from up to two instances: the relay (RLD)
streams the first ones, the main decode (MD) continues after the handoff, and
around the handoff both may report the same positions. Every token carries its
output position (``seq``), so the merge is exact: each position is released
once, in order, and only when every position before it has been released.

Two sources that disagree on a position would fork the client's text; that is
a correctness bug upstream (the token-exactness invariant is broken), so it is
raised as :class:`TokenConflictError` instead of being silently resolved.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdd.common.wire import TokenEvent


class TokenConflictError(RuntimeError):
    """Two sources produced different tokens for the same output position."""


@dataclass
class TokenStreamMerger:
    """Accepts events from any source in any order; emits each position exactly once.

    ``accept`` returns the events now ready to forward. ``duplicates`` counts
    positions seen again (the same token from another source, or a resend);
    ``gaps`` lists positions still missing below the highest one seen. A
    resend of the last released token marked ``finished`` only finishes the
    stream (an instance learns that a request ended after streaming its last
    token: MD streams the first token P handed it before its engine has checked
    whether that token ends the request); it is not released again, but
    ``accept`` returns a finish event for it (a status event, ``finished`` and no
    token), so the consumer learns the finish reason without a token twice.
    """

    request_id: str
    emitted: list[TokenEvent] = field(default_factory=list)
    duplicates: int = 0
    errors: dict[str, str] = field(default_factory=dict)
    #: Source -> the other instance its error blames (``TokenEvent.culprit``).
    culprits: dict[str, str] = field(default_factory=dict)
    _pending: dict[int, TokenEvent] = field(default_factory=dict)
    _finished_at: int | None = None

    @property
    def next_seq(self) -> int:
        """The position the client is waiting for."""
        return len(self.emitted)

    @property
    def token_ids(self) -> list[int]:
        """Token IDs released so far (what a replacement instance must continue from)."""
        return [e.token_id for e in self.emitted]  # type: ignore[misc]

    @property
    def finished(self) -> bool:
        return bool(self.emitted) and self.emitted[-1].finished

    @property
    def failed(self) -> tuple[str, ...]:
        """The instances to blame for the errors seen: each failed source, or the other
        instance its error names (the P whose KV stopped coming)."""
        return tuple(dict.fromkeys(self.culprits.get(s, s) for s in self.errors))

    @property
    def gaps(self) -> list[int]:
        if not self._pending:
            return []
        return [s for s in range(self.next_seq, max(self._pending)) if s not in self._pending]

    def accept(self, event: TokenEvent) -> list[TokenEvent]:
        """Take one event; return the events released by it, in order."""
        if event.request_id != self.request_id:
            raise ValueError(
                f"event for request {event.request_id!r} given to the merger of {self.request_id!r}"
            )
        if not event.is_token:
            if event.error is not None:
                self.errors[event.source] = event.error
                if event.culprit is not None:
                    self.culprits[event.source] = event.culprit
            return []
        known = self._known(event)
        if known is not None:
            finishes = event.finished and not known.finished
            if finishes and event.seq == self.next_seq - 1:
                return [self._finish_released(event)]
            if not finishes or event.seq < self.next_seq:
                self.duplicates += 1  # the same token again (or a finish behind later tokens)
                return []
        if self._finished_at is not None and event.seq > self._finished_at:
            return []  # a source kept going after another one finished the request
        self._pending[event.seq] = event  # new, or the finish of a position not released yet
        if event.finished:
            self._finished_at = event.seq
        return self._release()

    def _known(self, event: TokenEvent) -> TokenEvent | None:
        """The event already held for this position, if any; raises when the token differs."""
        known = (
            self.emitted[event.seq] if event.seq < self.next_seq else self._pending.get(event.seq)
        )
        if known is not None and known.token_id != event.token_id:
            raise TokenConflictError(
                f"request {self.request_id}: position {event.seq} is token {known.token_id} from "
                f"{known.source} but {event.token_id} from {event.source}; the instances diverged"
            )
        return known

    def _finish_released(self, event: TokenEvent) -> TokenEvent:
        """``event`` finishes the last released position, which went out unfinished: the
        stream ends there, told by a finish event (a status event: no new token)."""
        self.emitted[-1] = event
        self._finished_at = event.seq
        self._pending.clear()  # a source kept going after the finish
        return TokenEvent(
            request_id=self.request_id,
            seq=self.next_seq,
            source=event.source,
            finished=True,
            finish_reason=event.finish_reason,
        )

    def _release(self) -> list[TokenEvent]:
        ready: list[TokenEvent] = []
        while self.next_seq in self._pending and not self.finished:
            event = self._pending.pop(self.next_seq)
            self.emitted.append(event)
            ready.append(event)
        if self.finished:
            self._pending.clear()
        return ready
