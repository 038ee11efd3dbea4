"""KV on its way into MD's prefix cache, which a later request of the conversation waits for.

A conversation's next turn can reach MD while its previous turn's KV is still
crossing the WAN, or, where the relay finished that turn, while MD computes its
answer from the relay's IDs. The router counts that KV as MD's already (it sent
it), so P sends only what is new. Attaching at once would find less cached than
P assumed, and MD would ask P for the gap: the conversation's KV would cross the
line twice, and a loaded line is what made the router relay in the first place.
So a request waits, bounded, for each earlier request that brings more of its
prompt than MD caches now, or whose whole prompt it extends (the conversation's
previous turn, whose answer MD may not know yet), until that request's KV is in,
then attaches.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field


@dataclass
class _Landing:
    prompt: list[int]
    tokens: list[int]  # what MD will have cached once this request's KV is in
    landed: asyncio.Event = field(default_factory=asyncio.Event)


class LandingKV:
    """The requests whose KV is on its way into the cache, in the order they came."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._landing: dict[str, _Landing] = {}

    def expect(self, request_id: str, prompt: Sequence[int]) -> None:
        """``request_id``'s prompt is coming; its answer may follow (``answered``)."""
        self._landing[request_id] = _Landing(list(prompt), list(prompt))

    def answered(self, request_id: str, output: Sequence[int]) -> None:
        """MD learnt ``request_id``'s answer, whose KV it now computes for the cache."""
        entry = self._landing.get(request_id)
        if entry is not None:
            entry.tokens = [*entry.prompt, *output]

    def landed(self, request_id: str) -> None:
        """``request_id``'s KV is cached, or will never be: stop waiting for it."""
        entry = self._landing.pop(request_id, None)
        if entry is not None:
            entry.landed.set()

    def ahead_of(self, request_id: str, tokens: Sequence[int], cached: int) -> list[asyncio.Event]:
        """The landing events of requests that came before ``request_id`` and either bring
        more full blocks of ``tokens`` than the ``cached`` tokens the cache holds now, or
        whose whole prompt ``tokens`` extends (token for token: another conversation
        sharing only a system prompt does not)."""
        events = []
        for other, entry in self._landing.items():
            if other == request_id:
                break
            n = len(entry.prompt)
            extends = len(tokens) > n and list(tokens[:n]) == entry.prompt
            if extends or self._shared_blocks(entry.tokens, tokens) * self.block_size > cached:
                events.append(entry.landed)
        return events

    def _shared_blocks(self, a: Sequence[int], b: Sequence[int]) -> int:
        """Full blocks that ``a`` and ``b`` share from the start (one slice compare each)."""
        bs = self.block_size
        blocks = min(len(a), len(b)) // bs
        for k in range(blocks):
            if a[k * bs : (k + 1) * bs] != b[k * bs : (k + 1) * bs]:
                return k
        return blocks

    async def wait_ahead(
        self,
        request_id: str,
        tokens: Sequence[int],
        cached: Callable[[], Awaitable[int]],
        timeout_s: float,
    ) -> None:
        """Wait until no earlier request brings more of ``tokens`` than the cache holds
        (``cached()`` asks it, only where an earlier request shares a block at all), or
        ``timeout_s`` passed: then attach with what is there."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self.ahead_of(request_id, tokens, 0):
            events = self.ahead_of(request_id, tokens, await cached())
            if not events:
                return
            remaining = deadline - loop.time()
            if remaining <= 0:
                return
            waits = [asyncio.ensure_future(e.wait()) for e in events]
            try:
                await asyncio.wait(waits, timeout=remaining, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waits:
                    w.cancel()
