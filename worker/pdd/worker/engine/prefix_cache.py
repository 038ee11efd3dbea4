"""The prefix-cache interface, with a contract on every method, and its naive reference.

The engine asks the cache for the longest cached prefix of a prompt, locks it while
the request uses those blocks, and inserts the finished sequence so the next request
(or the next turn) hits. Only FULL blocks are cached: a cached prefix is always a
multiple of ``block_size`` tokens, and a partial tail is ignored by ``insert`` and
``match_prefix`` alike.

Block ownership (the ``BlockPool`` reference counts):
- ``insert`` increfs every block it newly adopts; the caller still frees its own
  references as usual, so a duplicate block the cache did not adopt goes back to
  the pool when the caller frees it.
- ``match_prefix`` takes no reference: the blocks it returns stay valid only while
  the match is locked, so lock before anything can evict.
- ``evict`` and ``reset`` free the cache's reference of every block they drop.

``NaivePrefixCache`` keeps one dictionary entry per cached block prefix and scans
everything on every call: slow, but obviously right, so property tests can hold the
radix tree to it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from pdd.common.block_hash import ROOT_HASH, block_hashes
from pdd.common.cache_events import AllCleared, BlockRemoved, BlockStored, CacheEvent, EventBuffer
from pdd.worker.engine.block_pool import BlockPool

BlockKey = tuple[int, ...]  # the token IDs of one full block


class PrefixCacheError(Exception):
    """A prefix cache was used against its contract."""


class StaleHandleError(PrefixCacheError):
    """A match handle no longer names what was matched (it was evicted before lock)."""


class LockError(PrefixCacheError):
    """Unbalanced lock/unlock, or an operation that needs nothing locked."""


class InvalidInsertError(PrefixCacheError, ValueError):
    """``insert`` arguments that would corrupt the cache; nothing was changed."""


@dataclass(frozen=True)
class PrefixMatch:
    """The longest cached prefix: ``blocks[i]`` holds tokens ``[i*bs, (i+1)*bs)``."""

    num_tokens: int
    blocks: tuple[int, ...]
    handle: object  # opaque; pass it back to lock()/unlock() of the same cache


class PrefixCache(ABC):
    """A cache of full-block token prefixes whose KV lives in ``pool`` blocks."""

    def __init__(
        self,
        pool: BlockPool,
        block_size: int,
        *,
        event_capacity: int = 4096,
        events_with_tokens: bool = False,
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.pool = pool
        self.block_size = block_size
        self._events = EventBuffer(event_capacity)
        self._events_with_tokens = events_with_tokens
        self._clock = 0  # logical time: deterministic LRU order, unlike a wall clock
        self._init_index()

    @abstractmethod
    def _init_index(self) -> None:
        """Set up the implementation's empty index (called once, by ``__init__``)."""

    @abstractmethod
    def match_prefix(self, token_ids: Sequence[int]) -> PrefixMatch:
        """Longest cached full-block prefix of ``token_ids``.

        Never changes what is cached, any block reference or any size; it refreshes
        the LRU time of the matched blocks (an implementation may also restructure
        internally, e.g. split a radix node, as long as the content is unchanged).
        The returned blocks are safe to use only after ``lock(match.handle)``.
        """

    @abstractmethod
    def lock(self, handle: object) -> None:
        """Protect the matched prefix (and so every shorter prefix) from eviction.

        Locks nest: each lock needs its own unlock. Raises ``StaleHandleError`` if the
        matched blocks were evicted between match and lock.
        """

    @abstractmethod
    def unlock(self, handle: object) -> None:
        """Undo one ``lock(handle)``; raises ``LockError`` if the handle is not locked."""

    @abstractmethod
    def insert(self, token_ids: Sequence[int], blocks: Sequence[int]) -> int:
        """Cache the full-block prefix of ``token_ids``; return how many tokens were cached before.

        ``blocks[i]`` holds the KV of tokens ``[i*bs, (i+1)*bs)`` and must be allocated;
        extra blocks (a partial tail) are ignored. The cache increfs each block it newly
        adopts; blocks of the already-cached part are not adopted (the caller's copy is
        a duplicate it frees as usual). Raises ``InvalidInsertError`` without changing
        anything if ``blocks`` is too short or a new block is already in the cache.
        """

    @abstractmethod
    def evict(self, num_blocks: int) -> int:
        """Drop up to ``num_blocks`` unlocked blocks, least recently used leaves first.

        Frees the cache's reference of each; returns how many were dropped, which is
        ``min(num_blocks, evictable_blocks)``.
        """

    @abstractmethod
    def reset(self) -> None:
        """Drop every cached block; raises ``LockError`` if anything is locked."""

    @property
    @abstractmethod
    def evictable_blocks(self) -> int:
        """Cached blocks that no lock protects."""

    @property
    @abstractmethod
    def protected_blocks(self) -> int:
        """Cached blocks that at least one lock protects."""

    @property
    def num_cached_blocks(self) -> int:
        return self.evictable_blocks + self.protected_blocks

    @abstractmethod
    def check_integrity(self) -> None:
        """Raise ``RuntimeError`` if internal state is inconsistent (for tests and debugging)."""

    def drain_events(self) -> list[CacheEvent]:
        """Events since the last drain, oldest first (see ``cache_events``)."""
        return self._events.drain()

    @property
    def num_dropped_events(self) -> int:
        return self._events.num_dropped

    # Helpers shared by implementations.

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _block_keys(self, token_ids: Sequence[int]) -> list[BlockKey]:
        bs = self.block_size
        return [tuple(token_ids[i : i + bs]) for i in range(0, len(token_ids) - bs + 1, bs)]

    def _check_insert_args(self, keys: list[BlockKey], blocks: Sequence[int]) -> None:
        if len(blocks) < len(keys):
            raise InvalidInsertError(
                f"insert of {len(keys)} full blocks got only {len(blocks)} block ids; "
                "pass the block table covering every token whose KV is computed"
            )

    def _check_adoptable(self, new_blocks: Sequence[int], cached: set[int]) -> None:
        repeated = [b for b, n in Counter(new_blocks).items() if n > 1 or b in cached]
        if repeated:
            raise InvalidInsertError(
                f"blocks {repeated} would be cached twice (repeated in the block table or "
                "already holding another cached prefix); each block holds one prefix's KV"
            )

    def _chain_hashes(self, keys: list[BlockKey], parent_hash: int | None) -> list[int]:
        """Chained hashes of ``keys`` after a parent block (None: the sequence start)."""
        flat = [t for key in keys for t in key]
        return block_hashes(
            flat, self.block_size, ROOT_HASH if parent_hash is None else parent_hash
        )

    def _emit_stored(
        self, hashes: list[int], parent_hash: int | None, keys: list[BlockKey]
    ) -> None:
        tokens = [t for key in keys for t in key] if self._events_with_tokens else None
        self._events.append(
            BlockStored(
                block_hashes=hashes,
                parent_hash=parent_hash,
                block_size=self.block_size,
                token_ids=tokens,
            )
        )

    def _emit_removed(self, hashes: list[int]) -> None:
        if hashes:
            self._events.append(BlockRemoved(block_hashes=hashes))

    def _emit_cleared(self) -> None:
        self._events.append(AllCleared())


@dataclass
class _Entry:
    block: int
    hash: int
    last_access: int
    lock_ref: int = 0


@dataclass(frozen=True)
class _NaiveHandle:
    keys: tuple[BlockKey, ...]


class NaivePrefixCache(PrefixCache):
    """One entry per cached prefix (a tuple of block keys); every query scans."""

    def _init_index(self) -> None:
        self._entries: dict[tuple[BlockKey, ...], _Entry] = {}

    def match_prefix(self, token_ids: Sequence[int]) -> PrefixMatch:
        keys = tuple(self._block_keys(token_ids))
        n = self._touch_prefix(keys)
        blocks = tuple(self._entries[keys[: i + 1]].block for i in range(n))
        return PrefixMatch(n * self.block_size, blocks, _NaiveHandle(keys[:n]))

    def lock(self, handle: object) -> None:
        for entry in self._handle_entries(handle):
            entry.lock_ref += 1

    def unlock(self, handle: object) -> None:
        entries = self._handle_entries(handle)
        if any(e.lock_ref == 0 for e in entries):
            raise LockError("unlock of a prefix that is not locked; unlock once per lock")
        for entry in entries:
            entry.lock_ref -= 1

    def insert(self, token_ids: Sequence[int], blocks: Sequence[int]) -> int:
        keys = tuple(self._block_keys(token_ids))
        self._check_insert_args(list(keys), blocks)
        n = self._touch_prefix(keys)
        new_blocks = list(blocks[n : len(keys)])
        self._check_adoptable(new_blocks, {e.block for e in self._entries.values()})
        if not new_blocks:
            return n * self.block_size
        self.pool.incref(new_blocks)
        parent_hash = self._entries[keys[:n]].hash if n else None
        new_keys = list(keys[n:])
        hashes = self._chain_hashes(new_keys, parent_hash)
        for i, (block, block_hash) in enumerate(zip(new_blocks, hashes, strict=True)):
            self._entries[keys[: n + i + 1]] = _Entry(block, block_hash, self._clock)
        self._emit_stored(hashes, parent_hash, new_keys)
        return n * self.block_size

    def evict(self, num_blocks: int) -> int:
        removed: list[int] = []
        while len(removed) < num_blocks:
            prefix = self._lru_unlocked_leaf()
            if prefix is None:
                break
            entry = self._entries.pop(prefix)
            self.pool.free([entry.block])
            removed.append(entry.hash)
        self._emit_removed(removed)
        return len(removed)

    def reset(self) -> None:
        if self.protected_blocks:
            raise LockError(f"reset with {self.protected_blocks} locked blocks; unlock first")
        self.pool.free([e.block for e in self._entries.values()])
        self._entries.clear()
        self._emit_cleared()

    @property
    def evictable_blocks(self) -> int:
        return sum(1 for e in self._entries.values() if e.lock_ref == 0)

    @property
    def protected_blocks(self) -> int:
        return sum(1 for e in self._entries.values() if e.lock_ref > 0)

    def check_integrity(self) -> None:
        blocks = [e.block for e in self._entries.values()]
        if len(set(blocks)) != len(blocks):
            raise RuntimeError("a block is cached under two prefixes")
        for prefix, entry in self._entries.items():
            parent = self._entries.get(prefix[:-1])
            if len(prefix) > 1 and parent is None:
                raise RuntimeError(f"cached prefix of {len(prefix)} blocks lacks its parent")
            parent_hash = parent.hash if parent else None
            if [entry.hash] != self._chain_hashes([prefix[-1]], parent_hash):
                raise RuntimeError(f"wrong chained hash at block {len(prefix) - 1}")
            if entry.lock_ref < 0 or (parent and parent.lock_ref < entry.lock_ref):
                raise RuntimeError("lock count below zero or below a descendant's")
            if self.pool.refcount(entry.block) < 1:
                raise RuntimeError(f"cached block {entry.block} is free in the pool")

    def _touch_prefix(self, keys: tuple[BlockKey, ...]) -> int:
        """Refresh the LRU time of the cached prefix of ``keys``; return its length."""
        now = self._tick()
        n = 0
        while n < len(keys) and keys[: n + 1] in self._entries:
            self._entries[keys[: n + 1]].last_access = now
            n += 1
        return n

    def _handle_entries(self, handle: object) -> list[_Entry]:
        if not isinstance(handle, _NaiveHandle):
            raise TypeError(f"not a NaivePrefixCache handle: {handle!r}")
        entries = [self._entries.get(handle.keys[: i + 1]) for i in range(len(handle.keys))]
        if any(e is None for e in entries):
            raise StaleHandleError("matched blocks were evicted before lock; match again")
        return entries  # type: ignore[return-value]

    def _lru_unlocked_leaf(self) -> tuple[BlockKey, ...] | None:
        parents = {prefix[:-1] for prefix in self._entries}
        leaves = [p for p, e in self._entries.items() if e.lock_ref == 0 and p not in parents]
        return min(leaves, key=lambda p: self._entries[p].last_access, default=None)
