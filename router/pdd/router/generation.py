"""One routed request as text: worker token events in, text deltas out, metrics on the way.

The merged token stream (``stream_relay``) is turned into text incrementally, cut at
the client's stop strings (the workers only know stop token IDs), and timed where
the client sees it. The request's in-flight lease on P is released at the first
token (P's part is over by then); the rest when the stream ends, however it ends.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from pdd.common.openai_protocol import UsageInfo
from pdd.common.wire import PipelinePlan
from pdd.router.detokenize import IncrementalDetokenizer, StopStrings
from pdd.router.dispatch import Lease, Route
from pdd.router.runtime import RouterRuntime
from pdd.router.stream_relay import relay_tokens


@dataclass(frozen=True)
class TextDelta:
    text: str
    finish_reason: str | None = None


class Generation:
    def __init__(
        self,
        runtime: RouterRuntime,
        route: Route,
        plan: PipelinePlan,
        stop: list[str],
        arrived_at: float,
        lease: Lease,
    ) -> None:
        self.runtime = runtime
        self.route = route
        self.plan = plan
        self.prompt_tokens = len(plan.prompt_ids)
        self.completion_tokens = 0
        self.relayed_tokens = 0
        self.finish_reason: str | None = None
        self._stops = StopStrings(stop)
        self._arrived_at = arrived_at
        self._lease = lease

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens the computing instance already held (the index's estimate)."""
        return min(self.route.p_hit_tokens, self.prompt_tokens)

    def usage(self) -> UsageInfo:
        return UsageInfo.of(self.prompt_tokens, self.completion_tokens, self.cached_tokens)

    async def deltas(self) -> AsyncIterator[TextDelta]:
        rt = self.runtime
        detok = IncrementalDetokenizer(rt.tokenizer.tokenizer)
        relay_id = self.plan.relay.instance_id if self.plan.relay else None
        last: float | None = None
        try:
            async for event in relay_tokens(self.plan, rt.client, rt.config.request_timeout_s):
                now = time.monotonic()
                if last is None:
                    rt.metrics.ttft.observe(now - self._arrived_at)
                    if self.plan.prefill is not None:
                        self._lease.release(self.plan.prefill.instance_id)
                else:
                    rt.metrics.itl.observe(now - last)
                last = now
                self._count(event.source == relay_id)
                text, stopped = self._stops.feed(detok.push(event.token_id))  # type: ignore[arg-type]
                if stopped or event.finished:
                    self.finish_reason = "stop" if stopped else (event.finish_reason or "stop")
                    yield TextDelta(
                        text + ("" if stopped else self._stops.flush()), self.finish_reason
                    )
                    return
                if text:
                    yield TextDelta(text)
        finally:
            self._lease.release_all()
            if self.completion_tokens:
                rt.metrics.relayed_share.observe(self.relayed_tokens / self.completion_tokens)

    def _count(self, from_relay: bool) -> None:
        self.completion_tokens += 1
        self.relayed_tokens += from_relay
        self.runtime.metrics.tokens.labels("relay" if from_relay else "main").inc()
