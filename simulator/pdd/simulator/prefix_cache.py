"""Per-instance prefix caches over chained block keys, and the index of who holds what.

A block key names its whole prefix (keys are prefix-chained, as the worker's block
hashes are), so a cache is a set of keys and a prompt's hit is the run of its keys,
from the first, that the cache holds. Capacity is in tokens (``blocks x block_size``).

Eviction is LRU that only ever removes leaves, as a radix cache does: every insert or
hit touches a prompt's keys from the deepest to the first, so a parent is always at
least as recent as its children and the least recent key is always a leaf.

:class:`HolderIndex` is the global view the router's prefix index keeps (key ->
instances holding it); here it is exact, since the simulator sees every eviction.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence


class HolderIndex:
    """key -> the instances whose cache holds it; ``hits`` is ``PrefixIndex.match``."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._holders: dict[int, set[str]] = {}

    def add(self, instance_id: str, keys: Iterable[int]) -> None:
        holders = self._holders
        for key in keys:
            held = holders.get(key)
            if held is None:
                holders[key] = {instance_id}
            else:
                held.add(instance_id)

    def remove(self, instance_id: str, key: int) -> None:
        held = self._holders.get(key)
        if held is not None:
            held.discard(instance_id)
            if not held:
                del self._holders[key]

    def hits(self, keys: Sequence[int], input_tokens: int) -> dict[str, int]:
        """Tokens of this prompt each instance holds (only instances holding >= 1 block).

        Walks the prompt's keys while someone still holds the chain; a level whose holders
        include every instance still on the chain (the common case: one P and one MD hold
        the whole conversation) costs a subset test and no new set."""
        holders = self._holders
        current: set[str] = holders.get(keys[0], set()) if keys else set()
        depth: dict[str, int] = {}
        i = 1
        while current and i < len(keys):
            held = holders.get(keys[i])
            if held is None or not current <= held:
                nxt = current.intersection(held or ())
                for gone in current - nxt:
                    depth[gone] = i
                current = nxt
            i += 1
        for inst in current:
            depth[inst] = i
        return {inst: min(d * self.block_size, input_tokens) for inst, d in depth.items()}


class PrefixCache:
    """One instance's cache: leaf-first LRU over block keys, ``capacity_tokens`` big."""

    def __init__(
        self, instance_id: str, capacity_tokens: int, block_size: int, index: HolderIndex
    ) -> None:
        if capacity_tokens < 0 or block_size <= 0:
            raise ValueError(f"{instance_id}: cache capacity must be >= 0 and block size > 0")
        self.instance_id = instance_id
        self.capacity_blocks = capacity_tokens // block_size
        self.block_size = block_size
        self._lru: OrderedDict[int, None] = OrderedDict()
        self._index = index
        self.evicted_blocks = 0

    def __len__(self) -> int:
        return len(self._lru)

    def match(self, keys: Sequence[int]) -> int:
        """Leading blocks held; never mutates (a lookup is not a use)."""
        n = 0
        for key in keys:
            if key not in self._lru:
                break
            n += 1
        return n

    def insert(self, keys: Sequence[int]) -> None:
        """Hold (and touch) every key of a prompt, deepest first; evict leaves over capacity."""
        if self.capacity_blocks == 0:
            return
        keep = keys[: self.capacity_blocks]  # a prompt larger than the cache keeps its head
        lru = self._lru
        new = [key for key in keep if key not in lru]
        lru.update(dict.fromkeys(new))
        # Touch deepest first, so the first block ends most recent; map() in a zero-length
        # deque runs the moves in C (a prompt has tens of blocks, inserted per request).
        deque(map(lru.move_to_end, reversed(keep)), maxlen=0)
        self._index.add(self.instance_id, new)
        self._evict(len(lru) - self.capacity_blocks)

    def _evict(self, count: int) -> None:
        for _ in range(max(0, count)):
            key, _ = self._lru.popitem(last=False)
            self._index.remove(self.instance_id, key)
            self.evicted_blocks += 1

    def keys(self) -> Iterable[int]:
        return iter(self._lru)
