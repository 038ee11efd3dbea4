"""What vLLM's prefix cache holds, as the worker sees it from vLLM's own KV events.

A receiver (RLD, MD) answers P's ``prepare`` with the prefix it already holds, so P
sends only the rest: across the WAN, a conversation's next turn then costs only its new
tokens. vLLM's scheduler cannot be asked from the worker's process, but its KV events
(already renamed into the router's block hashes for the router's index, ``kv_events``)
say which blocks it stores and evicts. ``CachedPrefix`` keeps the set of router blocks
stored and answers a prompt's leading run of them, rounded down to vLLM's own blocks:
vLLM's prefix cache hits whole blocks of its own size only, so a prompt sharing a router
block but not the whole vLLM block around it (two chats with one system prompt shorter
than vLLM's block) hits nothing there (measured: such an answer of 16 made vLLM compute
the request in full).

Nothing is locked: a block evicted after the answer is simply not there when vLLM
schedules the request, and the connector then computes the request in full
(``params.import_params``'s ``start``), so a stale answer costs time, never a wrong token.
"""

from __future__ import annotations

from collections.abc import Sequence

from pdd.common.block_hash import block_hashes
from pdd.common.cache_events import AllCleared, BlockRemoved, BlockStored, CacheEvent


class CachedPrefix:
    """The router blocks vLLM holds, from the cache events it published."""

    def __init__(self, block_size: int, engine_block_size: int) -> None:
        """``block_size``: the router's, which the events name; ``engine_block_size``:
        vLLM's, what its prefix cache hits in."""
        self.block_size = block_size
        self.engine_block_size = engine_block_size
        self._held: set[int] = set()

    def seen(self, events: Sequence[CacheEvent]) -> None:
        """Take in events in the order vLLM published them."""
        for event in events:
            if isinstance(event, BlockStored):
                self._held.update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                self._held.difference_update(event.block_hashes)
            elif isinstance(event, AllCleared):
                self._held.clear()

    def tokens(self, token_ids: Sequence[int]) -> int:
        """Tokens of ``token_ids`` held, from the start, in whole router blocks and whole
        vLLM blocks."""
        held = 0
        for block_hash in block_hashes(token_ids, self.block_size):
            if block_hash not in self._held:
                break
            held += self.block_size
        return held // self.engine_block_size * self.engine_block_size
