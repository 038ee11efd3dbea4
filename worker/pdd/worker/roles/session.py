"""DecodeSession: which of a request's output positions this instance streams, and when.

An instance knows a request's output as a list indexed by position: tokens
handed to it (the first token from P, IDs from a relay) followed by what its
engine samples. It streams positions ``[emit_from, emit_limit)``: a main
decode that took over at position k starts at k (the relay streamed the rest);
a relay that handed its tokens over stops at the handoff point (the main
decode continues), and lifts the limit again if the handoff fails. So every
position is streamed by exactly one instance, and the merge is exact.

The prefix-cache facts the router reports and indexes ride along: the
prefilling instance's hit on the seq-0 event, the main decode's own hit on the
first event it streams (see ``TokenEvent``). So do the logprobs of each position,
where the request asked for them, from the instance that sampled it (P's for the
first token, handed over with it).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from pdd.common.vocabulary import FinishReason
from pdd.common.wire import TokenLogprobs
from pdd.worker.engine.request import FinishReason as EngineFinish
from pdd.worker.engine.request import RequestOutput
from pdd.worker.roles.streams import StreamHub

#: Why the engine ended a request, in the stream's words (``TokenEvent.finish_reason``).
STREAM_REASONS: dict[EngineFinish, FinishReason] = {
    EngineFinish.LENGTH: "length",
    EngineFinish.STOP: "stop",
    EngineFinish.ABORT: "abort",
}


@dataclass
class DecodeSession:
    request_id: str
    hub: StreamHub
    output: list[int] = field(default_factory=list)
    emit_from: int = 0
    emit_limit: int | None = None
    emitted: int = 0  # next position to stream
    finished: bool = False
    finish_reason: FinishReason | None = None
    finish_sent: bool = False
    cached_tokens: int | None = None  # the prefilling instance's hit, on the seq-0 event
    md_hit_tokens: int | None = None  # this main decode's hit, on the first event it streams
    md_hit_seq: int | None = None  # the position that carries it (again if re-sent as final)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    logprobs: dict[int, TokenLogprobs] = field(default_factory=dict)  # by output position

    def on_output(self, out: RequestOutput) -> None:
        """Engine-runner subscriber: record the new tokens, stream what is ours."""
        if out.error is not None:  # the engine gave up: end the stream with the error
            self.finished = True
            self.hub.fail(self.request_id, len(self.output), out.error, error_type=out.error_type)
            self.done.set()
            return
        if out.logprobs is not None:
            for i, lp in enumerate(out.logprobs):
                self.logprobs[len(self.output) + i] = lp
        self.output.extend(out.new_token_ids)
        if out.finished:
            self.finished = True
            self.finish_reason = STREAM_REASONS[out.finish_reason] if out.finish_reason else None
        self.flush()

    def flush(self) -> None:
        limit = len(self.output)
        if self.emit_limit is not None:
            limit = min(self.emit_limit, limit)
        for seq in range(max(self.emitted, self.emit_from), limit):
            self._emit(seq)
        self.emitted = max(self.emitted, limit)
        if self.finished and self.emitted >= len(self.output):
            if not self.finish_sent and self.output:
                self._emit(len(self.output) - 1)  # re-send the last token, now marked final
            self.hub.get(self.request_id).close()
            self.done.set()

    def _emit(self, seq: int) -> None:
        last = self.finished and seq == len(self.output) - 1
        self.finish_sent = self.finish_sent or last
        reason = self.finish_reason if last else None
        if self.md_hit_seq is None:
            self.md_hit_seq = seq
        md_hit = self.md_hit_tokens if seq == self.md_hit_seq else None
        cached = self.cached_tokens if seq == 0 else None
        self.hub.emit(
            self.request_id, seq, self.output[seq], last, reason, cached, md_hit,
            self.logprobs.get(seq),
        )  # fmt: skip

    def stop_at(self, position: int) -> None:
        """Stream up to ``position`` now, nothing after it (handed over to another instance)."""
        self.emit_limit = position
        self.flush()

    def stream_from(self, position: int) -> None:
        """The handoff is final: stream every position from ``position`` on."""
        self.emit_from = self.emitted = position
        self.unlimit()

    def unlimit(self) -> None:
        """The handoff failed: stream everything again, from where we stopped."""
        self.emit_limit = None
        self.flush()

    def end_silently(self) -> None:
        """Another instance streams the rest: close our stream without more tokens."""
        self.hub.get(self.request_id).close()
        self.done.set()
