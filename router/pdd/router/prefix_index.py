"""The global prefix index: which instance holds how much of a prompt's prefix.

Workers publish cache events named by chained block hashes (``pdd.common.block_hash``).
Because a block's hash covers its whole prefix, "instance X holds block k of this
prompt" means X holds tokens ``0 .. (k+1)*block_size``; a prompt's hit on X is the
longest run of held hashes from the first block. The index never sees token IDs or KV.

The view is an *estimate*: events can be lost (a worker's bounded buffer overflowed,
a router restarted), so every entry expires ``ttl_s`` after it was last stored or
confirmed, and the MD handshake (how much MD really holds) is the ground truth the
request path feeds back through :meth:`PrefixIndex.confirm`.

A hit counts the router's blocks; what a worker can reuse is whole blocks of its own
engine's cache (:func:`reusable`), which the router applies per instance.

Storage sits behind :class:`IndexStore` so router replicas can share one index in
Redis; :class:`InMemoryIndexStore` is the single-process store.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from pdd.common.block_hash import DEFAULT_BLOCK_SIZE, block_hashes
from pdd.common.cache_events import AllCleared, BlockRemoved, BlockStored, CacheEvent


class BlockSizeMismatchError(ValueError):
    """A worker reports blocks of another size than the index hashes prompts with."""


@dataclass(frozen=True)
class PrefixIndexConfig:
    #: Tokens per block; must equal every worker's cache block size.
    block_size: int = DEFAULT_BLOCK_SIZE
    #: Seconds an entry lives without being stored again or confirmed. Long enough
    #: that a conversation's next turn (seconds to minutes later) still finds it.
    ttl_s: float = 600.0

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if self.ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive, got {self.ttl_s}")


class IndexStore(Protocol):
    """Where (instance, block hash) entries live, each with the time it was last seen.

    Contract: ``add`` inserts or refreshes; ``remove`` and ``clear`` ignore unknown
    entries; ``holders`` never mutates and returns, for each hash in order, the
    instances whose entry is younger than ``ttl_s`` at ``now``; it may stop early
    after the first empty set (a chain cannot continue past a block nobody holds).
    ``expire`` drops entries older than ``ttl_s`` and returns how many it dropped.
    """

    def add(self, instance: str, hashes: Iterable[int], now: float) -> None: ...

    def remove(self, instance: str, hashes: Iterable[int]) -> None: ...

    def clear(self, instance: str) -> None: ...

    def holders(self, hashes: Sequence[int], now: float) -> list[set[str]]: ...

    def expire(self, now: float) -> int: ...


#: ``IndexStore.holders`` as a coroutine: a lookup that may ask another process.
HoldersLookup = Callable[[Sequence[int], float], Awaitable[list[set[str]]]]


class InMemoryIndexStore:
    """Per-instance insertion-ordered maps (oldest first, so expiry pops from the front)
    plus a reverse map from hash to its holders for the per-block lookup."""

    def __init__(self, ttl_s: float) -> None:
        self._ttl_s = ttl_s
        self._by_instance: dict[str, OrderedDict[int, float]] = {}
        self._by_hash: dict[int, dict[str, float]] = {}

    def add(self, instance: str, hashes: Iterable[int], now: float) -> None:
        entries = self._by_instance.setdefault(instance, OrderedDict())
        for h in hashes:
            entries[h] = now
            entries.move_to_end(h)
            self._by_hash.setdefault(h, {})[instance] = now

    def remove(self, instance: str, hashes: Iterable[int]) -> None:
        entries = self._by_instance.get(instance)
        if entries is None:
            return
        for h in hashes:
            if entries.pop(h, None) is not None:
                self._drop_holder(h, instance)

    def clear(self, instance: str) -> None:
        for h in self._by_instance.pop(instance, {}):
            self._drop_holder(h, instance)

    def holders(self, hashes: Sequence[int], now: float) -> list[set[str]]:
        oldest = now - self._ttl_s
        result: list[set[str]] = []
        for h in hashes:
            held = {i for i, seen in self._by_hash.get(h, {}).items() if seen > oldest}
            result.append(held)
            if not held:
                break
        return result

    def expire(self, now: float) -> int:
        oldest = now - self._ttl_s
        dropped = 0
        for instance, entries in list(self._by_instance.items()):
            while entries and next(iter(entries.values())) <= oldest:
                h, _ = entries.popitem(last=False)
                self._drop_holder(h, instance)
                dropped += 1
            if not entries:
                del self._by_instance[instance]
        return dropped

    def entries(self) -> list[tuple[str, int, float]]:
        """Every (instance, hash, last seen): what a shared store is re-seeded from
        when it comes back after an outage."""
        return [(i, h, seen) for i, e in self._by_instance.items() for h, seen in e.items()]

    def _drop_holder(self, h: int, instance: str) -> None:
        holders = self._by_hash.get(h)
        if holders is not None:
            holders.pop(instance, None)
            if not holders:
                del self._by_hash[h]


def reusable(hits: Mapping[str, int], cache_block: Callable[[str], int]) -> dict[str, int]:
    """``hits`` as each instance can reuse them: rounded down to whole blocks of its
    engine's prefix cache (``cache_block``: tokens per block, ``EngineInfo.block_size``).

    The index counts the router's blocks, but an engine hits only whole blocks of its own,
    and a vLLM worker's may be larger (32 or 128 on the CPU against the router's 16): it
    names a router block cached once the vLLM block it ends in is, so a prompt diverging
    inside that vLLM block would be predicted by less than a vLLM block over its reuse.
    Rounded, the prediction is exact where the router's block divides the engine's and
    short by at most one engine block where it does not; never over. An instance left
    with nothing is left out, as ``PrefixIndex.match`` leaves out those holding nothing."""
    rounded: dict[str, int] = {}
    for instance, tokens in hits.items():
        block = cache_block(instance)
        if tokens >= block:
            rounded[instance] = tokens // block * block
    return rounded


class PrefixIndex:
    """Cache events in, per-instance prefix hits (in tokens) out."""

    def __init__(
        self,
        config: PrefixIndexConfig,
        store: IndexStore | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self._store = store if store is not None else InMemoryIndexStore(config.ttl_s)
        self._clock = clock

    def hashes(self, token_ids: Sequence[int]) -> list[int]:
        """The prompt's full-block hashes, as workers name them."""
        return block_hashes(token_ids, self.config.block_size)

    def apply(self, instance: str, event: CacheEvent) -> None:
        """Fold one of ``instance``'s cache events into the index."""
        if isinstance(event, BlockStored):
            if event.block_size != self.config.block_size:
                raise BlockSizeMismatchError(
                    f"instance {instance!r} caches {event.block_size}-token blocks but the "
                    f"router indexes {self.config.block_size}-token blocks; set the same "
                    "block size on workers and router"
                )
            self._store.add(instance, event.block_hashes, self._clock())
        elif isinstance(event, BlockRemoved):
            self._store.remove(instance, event.block_hashes)
        elif isinstance(event, AllCleared):
            self._store.clear(instance)

    def apply_all(self, instance: str, events: Iterable[CacheEvent]) -> None:
        for event in events:
            self.apply(instance, event)

    def forget_instance(self, instance: str) -> None:
        """Drop everything about an instance (it left, or its event stream had gaps)."""
        self._store.clear(instance)

    def match(self, hashes: Sequence[int]) -> dict[str, int]:
        """Tokens of the prompt each instance holds (only instances holding >= 1 block)."""
        return self._hits(self._store.holders(hashes, self._clock()))

    async def match_via(self, lookup: HoldersLookup, hashes: Sequence[int]) -> dict[str, int]:
        """``match`` with the holders from ``lookup`` (the router's store, which may ask
        Redis) instead of this index's own store."""
        return self._hits(await lookup(hashes, self._clock()))

    def _hits(self, holders: Iterable[set[str]]) -> dict[str, int]:
        size = self.config.block_size
        hits: dict[str, int] = {}
        alive: set[str] | None = None
        for depth, held in enumerate(holders, start=1):
            alive = set(held) if alive is None else alive & held
            if not alive:
                break
            for instance in alive:
                hits[instance] = depth * size
        return hits

    def expect(self, instance: str, hashes: Sequence[int]) -> None:
        """The router is sending these blocks' KV to ``instance``, which caches them as
        they land: count them as held from now. A conversation's next turn can come
        before the instance's cache events say so (or before the KV even landed), and
        P sends MD's miss from this index's prediction; MD waits for KV already on its
        way and asks for anything it still lacks, and its handshake corrects the index."""
        self._store.add(instance, hashes, self._clock())

    def confirm(self, instance: str, hashes: Sequence[int], held_tokens: int) -> None:
        """Ground truth from a handshake or a response's ``cached_tokens``: the first
        ``held_tokens`` of the prompt are on ``instance`` and nothing past them is."""
        held_blocks = min(held_tokens // self.config.block_size, len(hashes))
        self._store.add(instance, hashes[:held_blocks], self._clock())
        self._store.remove(instance, hashes[held_blocks:])

    def expire(self) -> int:
        """Drop expired entries (housekeeping; lookups already ignore them)."""
        return self._store.expire(self._clock())
