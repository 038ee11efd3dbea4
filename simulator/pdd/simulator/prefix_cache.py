"""Per-instance prefix caches over chained block keys, and the index of who holds what.

A block key names its whole prefix (keys are prefix-chained, as the worker's block
hashes are), so a cache is a set of keys and a prompt's hit is the run of its keys,
from the first, that the cache holds. Capacity is in tokens (``blocks x block_size``).

Eviction is LRU that only ever removes leaves, as a radix cache does: every insert
touches a prompt's keys from the deepest to the first, so a parent is always at least
as recent as its children and the least recent key is always a leaf. So every cache is
*prefix-closed* (it holds a key only with all of the key's ancestors), and two facts
follow that make a prompt's work logarithmic instead of linear in its blocks:

* the keys a cache holds are a leading run of the prompt's keys, found by binary search;
* along a prompt's keys, the set of instances holding each key only ever shrinks, so the
  index finds each instance's depth by binary search for where that set changes.

These caches sit on the simulator's hottest path (two inserts and one lookup per
request, tens of blocks each), hence the representation below; the order of evictions
is exactly that of an ``OrderedDict`` LRU touched deepest-first
(``tests/simulator/test_prefix_cache.py`` holds the two equal on random inserts).

:class:`HolderIndex` is the global view the router's prefix index keeps (key ->
instances holding it); here it is exact, since the simulator sees every eviction.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Sequence
from itertools import compress, repeat
from operator import eq


def _leading(keys: Sequence[int], held: Callable[[int], bool], lo: int = 0) -> int:
    """The first index from ``lo`` on whose key fails ``held`` (``len(keys)`` if none), for
    a property that, once false along the keys, stays false (prefix-closure): O(log n)."""
    hi = len(keys)
    # The usual answers first: none held (a new conversation) or all held (a repeat).
    if lo == hi or not held(keys[lo]):
        return lo
    if held(keys[hi - 1]):
        return hi
    lo += 1
    hi -= 1
    while lo < hi:
        mid = (lo + hi) // 2
        if held(keys[mid]):
            lo = mid + 1
        else:
            hi = mid
    return lo


class HolderIndex:
    """key -> the instances whose cache holds it; ``hits`` is ``PrefixIndex.match``.

    Holders are a bit mask per key (one bit per instance, given on first use): adding a
    brand-new key costs no set, and comparing two holder sets is one integer compare.
    """

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._holders: dict[int, int] = {}
        self._ids: list[str] = []
        self._bits: dict[str, int] = {}

    def bit(self, instance_id: str) -> int:
        """The instance's bit in the holder masks."""
        bit = self._bits.get(instance_id)
        if bit is None:
            bit = self._bits[instance_id] = 1 << len(self._ids)
            self._ids.append(instance_id)
        return bit

    def add(self, bit: int, keys: Sequence[int]) -> None:
        """Record that the instance of ``bit`` now holds ``keys``, a chain of keys none of
        which it held. Keys nobody holds form a tail of the chain (prefix-closure), so
        they go in at C speed; the others get the bit one by one."""
        holders = self._holders
        shared = _leading(keys, holders.__contains__)
        for key in keys[:shared]:
            holders[key] |= bit
        holders.update(zip(keys[shared:], repeat(bit)))

    def remove(self, bit: int, keys: Iterable[int]) -> None:
        """Record that the instance of ``bit`` no longer holds ``keys`` (one call per
        eviction, not per key: evictions run on every insert of a full cache)."""
        holders = self._holders
        get, pop, others = holders.get, holders.pop, ~bit
        for key in keys:
            mask = get(key, 0) & others
            if mask:
                holders[key] = mask
            else:
                pop(key, None)

    def hits(self, keys: Sequence[int], input_tokens: int) -> dict[str, int]:
        """Tokens of this prompt each instance holds (only instances holding >= 1 block).

        The holder mask along the keys only loses bits, so each change is found by binary
        search: O(log n) lookups per distinct depth (usually one: the P and the MD that
        hold the conversation so far) instead of one per block."""
        if not keys:
            return {}
        get = self._holders.get
        current = get(keys[0], 0)
        depth: dict[str, int] = {}
        start = 1
        while current:

            def held_by_current(key: int, same: int = current) -> bool:
                return get(key, 0) == same

            end = _leading(keys, held_by_current, start)
            nxt = get(keys[end], 0) if end < len(keys) else 0
            self._set_depth(depth, current & ~nxt, end)
            current, start = nxt, end + 1
        return {inst: min(d * self.block_size, input_tokens) for inst, d in depth.items()}

    def _set_depth(self, depth: dict[str, int], mask: int, blocks: int) -> None:
        while mask:
            low = mask & -mask
            depth[self._ids[low.bit_length() - 1]] = blocks
            mask ^= low


class PrefixCache:
    """One instance's cache: leaf-first LRU over block keys, ``capacity_tokens`` big.

    An insert stamps every key of the prompt with the insert's number (one C-level dict
    update) and remembers the prompt as a *touch*. The LRU order is then (stamp, deepest
    first), so eviction walks the oldest touch from its deepest key, skipping keys a
    later touch stamped again. Each touched key is walked at most once; touches whose
    keys were all touched again are compacted away so they cannot pile up.
    """

    def __init__(
        self, instance_id: str, capacity_tokens: int, block_size: int, index: HolderIndex
    ) -> None:
        if capacity_tokens < 0 or block_size <= 0:
            raise ValueError(f"{instance_id}: cache capacity must be >= 0 and block size > 0")
        self.instance_id = instance_id
        self.capacity_blocks = capacity_tokens // block_size
        self.block_size = block_size
        self._stamps: dict[int, int] = {}  # key -> the insert that last touched it
        # Oldest first: [stamp, keys, how many of keys (from the first) are still unwalked].
        self._touches: deque[list] = deque()
        self._unwalked = 0  # sum of the touches' unwalked counts
        self._clock = 0
        self._index = index
        self._bit = index.bit(instance_id)
        self.evicted_blocks = 0

    def __len__(self) -> int:
        return len(self._stamps)

    def match(self, keys: Sequence[int]) -> int:
        """Leading blocks held; never mutates (a lookup is not a use)."""
        return _leading(keys, self._stamps.__contains__)

    def insert(self, keys: Sequence[int]) -> None:
        """Hold (and touch) every key of a prompt, deepest first; evict leaves over capacity."""
        if self.capacity_blocks == 0:
            return
        keep = keys[: self.capacity_blocks]  # a prompt larger than the cache keeps its head
        held = self.match(keep)
        self._clock += 1
        self._stamps.update(zip(keep, repeat(self._clock)))
        self._touches.append([self._clock, keep, len(keep)])
        self._unwalked += len(keep)
        self._index.add(self._bit, keep[held:])
        self._evict(len(self._stamps) - self.capacity_blocks)
        if self._unwalked > 4 * len(self._stamps) + 4096:
            self._compact()

    def _evict(self, count: int) -> None:
        if count <= 0:
            return
        stamps, touches = self._stamps, self._touches
        gone: list[int] = []
        while count > 0:
            touch = touches[0]
            stamp, keys, left = touch
            while left and count:
                left -= 1
                key = keys[left]
                if stamps.get(key) == stamp:
                    del stamps[key]
                    gone.append(key)
                    count -= 1
            self._unwalked -= touch[2] - left
            if left:
                touch[2] = left
            else:
                touches.popleft()
        self.evicted_blocks += len(gone)
        self._index.remove(self._bit, gone)

    def _compact(self) -> None:
        """Drop from every touch the keys a later touch stamped again (same LRU order)."""
        stamps = self._stamps
        kept: deque[list] = deque()
        for stamp, keys, left in self._touches:
            walk = keys[:left]  # C-level filter: this runs over every touched key once
            live = tuple(compress(walk, map(eq, map(stamps.get, walk), repeat(stamp))))
            if live:
                kept.append([stamp, live, len(live)])
        self._touches = kept
        self._unwalked = sum(touch[2] for touch in kept)

    def keys(self) -> Iterable[int]:
        return iter(self._stamps)
