"""Radix tree prefix cache over token IDs, in the manner of SGLang's ``radix_cache.py``.

Each node holds a run of full blocks (token keys, block ids and chained hashes, one
per block); children are keyed by the token tuple of their first block, so a lookup
costs one dictionary probe per node. A match or insert that diverges inside a node
splits it at the block boundary, so a handle always names a whole node and locks
count whole nodes. ``lock_ref`` on a node counts the locks of its subtree, so a
locked node's ancestors are never leaves-to-evict, and the evictable/protected
block counts move exactly when a node's ``lock_ref`` crosses zero.

Eviction pops the least recently used unlocked leaf from a heap. Entries are
pushed whenever a node becomes an unlocked leaf or its access time changes, and
checked when popped (lazy deletion), so an eviction never walks the whole tree;
a parent whose last child goes is pushed then. Unlike SGLang, a leaf larger than
what is still needed loses only its tail blocks: ``evict(n)`` frees exactly what
was asked and keeps the rest of a long conversation cached, which also lets the
block-by-block ``NaivePrefixCache`` serve as an exact oracle in tests.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

from pdd.worker.engine.prefix_cache import (
    BlockKey,
    LockError,
    PrefixCache,
    PrefixMatch,
    StaleHandleError,
)


class _Node:
    __slots__ = ("blocks", "children", "hashes", "id", "keys", "last_access", "lock_ref", "parent")

    def __init__(
        self,
        node_id: int,
        keys: list[BlockKey],
        blocks: list[int],
        hashes: list[int],
        parent: _Node | None,
        last_access: int,
    ) -> None:
        self.id = node_id  # creation order: a stable tie-break in the heap
        self.keys = keys
        self.blocks = blocks
        self.hashes = hashes
        self.parent = parent  # None for the root and for nodes dropped from the tree
        self.children: dict[BlockKey, _Node] = {}
        self.lock_ref = 0
        self.last_access = last_access

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)


@dataclass(frozen=True, eq=False)
class _RadixHandle:
    node: _Node
    num_blocks: int  # depth of ``node`` when matched; a shorter depth means it was evicted


_HeapEntry = tuple[int, int, _Node]  # (last_access, node id, node)


class RadixCache(PrefixCache):
    """Radix-tree ``PrefixCache``; see the module docstring for the design."""

    def _init_index(self) -> None:
        self._root = _Node(0, [], [], [], None, 0)
        self._next_id = 1
        self._num_nodes = 0  # excluding the root
        self._evictable = 0
        self._protected = 0
        self._block_ids: set[int] = set()
        self._heap: list[_HeapEntry] = []

    def match_prefix(self, token_ids: Sequence[int]) -> PrefixMatch:
        node, n = self._walk(self._block_keys(token_ids))
        return PrefixMatch(n * self.block_size, self._path_blocks(node), _RadixHandle(node, n))

    def lock(self, handle: object) -> None:
        node = self._live_node(handle)
        while node is not self._root:
            if node.lock_ref == 0:
                self._evictable -= node.num_blocks
                self._protected += node.num_blocks
            node.lock_ref += 1
            node = node.parent  # type: ignore[assignment]

    def unlock(self, handle: object) -> None:
        node = self._live_node(handle)
        if node is not self._root and node.lock_ref == 0:
            raise LockError("unlock of a prefix that is not locked; unlock once per lock")
        while node is not self._root:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._protected -= node.num_blocks
                self._evictable += node.num_blocks
                self._push_if_evictable(node)
            node = node.parent  # type: ignore[assignment]

    def insert(self, token_ids: Sequence[int], blocks: Sequence[int]) -> int:
        keys = self._block_keys(token_ids)
        self._check_insert_args(keys, blocks)
        node, n = self._walk(keys)
        new_blocks = list(blocks[n : len(keys)])
        self._check_adoptable(new_blocks, self._block_ids)
        if new_blocks:
            self.pool.incref(new_blocks)
            self._add_leaf(node, keys[n:], new_blocks)
        return n * self.block_size

    def evict(self, num_blocks: int) -> int:
        removed: list[int] = []
        while len(removed) < num_blocks and self._heap:
            entry = heapq.heappop(self._heap)
            if self._is_current(entry):
                node = entry[2]
                take = min(node.num_blocks, num_blocks - len(removed))
                removed.extend(self._drop_tail(node, take))
        self._emit_removed(removed)
        return len(removed)

    def reset(self) -> None:
        if self._protected:
            raise LockError(f"reset with {self._protected} locked blocks; unlock first")
        self.pool.free(self._block_ids)
        for node in self._nodes():
            node.parent = None  # so handles into the old tree read as stale
        self._root.children.clear()
        self._num_nodes = self._evictable = 0
        self._block_ids.clear()
        self._heap.clear()
        self._emit_cleared()

    @property
    def evictable_blocks(self) -> int:
        return self._evictable

    @property
    def protected_blocks(self) -> int:
        return self._protected

    def check_integrity(self) -> None:
        current = {entry[2].id for entry in self._heap if self._is_current(entry)}
        evictable = protected = 0
        blocks: list[int] = []
        nodes = self._nodes()
        for node in nodes:
            self._check_node(node, current)
            blocks.extend(node.blocks)
            if node.lock_ref:
                protected += node.num_blocks
            else:
                evictable += node.num_blocks
        if (evictable, protected) != (self._evictable, self._protected):
            raise RuntimeError(
                f"counted evictable/protected {evictable}/{protected} but kept "
                f"{self._evictable}/{self._protected}"
            )
        if len(nodes) != self._num_nodes or set(blocks) != self._block_ids:
            raise RuntimeError("node count or cached block set out of date")
        if len(set(blocks)) != len(blocks):
            raise RuntimeError("a block is cached under two prefixes")

    # Tree walking and restructuring.

    def _walk(self, keys: list[BlockKey]) -> tuple[_Node, int]:
        """Follow ``keys`` as far as cached, splitting where it diverges inside a node.

        Returns the deepest matched node and the matched block count; refreshes the
        access time of every node on the path.
        """
        now = self._tick()
        node, n = self._root, 0
        while n < len(keys) and (child := node.children.get(keys[n])) is not None:
            m = 1
            while m < child.num_blocks and n + m < len(keys) and child.keys[m] == keys[n + m]:
                m += 1
            if m < child.num_blocks:
                child = self._split(child, m)
            child.last_access = now
            node, n = child, n + m
        self._push_if_evictable(node)
        return node, n

    def _split(self, child: _Node, m: int) -> _Node:
        """Cut ``child`` after ``m`` blocks; the new upper node is returned.

        ``child`` keeps its identity (and the handles naming it) as the lower part.
        """
        parent = child.parent
        assert parent is not None  # internal invariant: only attached nodes are walked
        upper = _Node(
            self._new_id(),
            child.keys[:m],
            child.blocks[:m],
            child.hashes[:m],
            parent,
            child.last_access,
        )
        upper.lock_ref = child.lock_ref
        parent.children[upper.keys[0]] = upper
        child.keys, child.blocks, child.hashes = child.keys[m:], child.blocks[m:], child.hashes[m:]
        child.parent = upper
        upper.children[child.keys[0]] = child
        self._num_nodes += 1
        return upper

    def _add_leaf(self, parent: _Node, keys: list[BlockKey], blocks: list[int]) -> None:
        parent_hash = parent.hashes[-1] if parent is not self._root else None
        hashes = self._chain_hashes(keys, parent_hash)
        leaf = _Node(self._new_id(), keys, blocks, hashes, parent, self._clock)
        parent.children[keys[0]] = leaf
        self._num_nodes += 1
        self._evictable += len(blocks)
        self._block_ids.update(blocks)
        self._push_if_evictable(leaf)
        self._emit_stored(hashes, parent_hash, keys)

    def _drop_tail(self, node: _Node, take: int) -> list[int]:
        """Evict the last ``take`` blocks of an unlocked leaf; return their hashes."""
        keep = node.num_blocks - take
        blocks, hashes = node.blocks[keep:], node.hashes[keep:]
        self.pool.free(blocks)
        self._block_ids.difference_update(blocks)
        self._evictable -= take
        if keep:
            node.keys, node.blocks, node.hashes = (
                node.keys[:keep],
                node.blocks[:keep],
                node.hashes[:keep],
            )
            self._push_if_evictable(node)
        else:
            parent = node.parent
            assert parent is not None  # internal invariant: heap entries are checked current
            del parent.children[node.keys[0]]
            node.parent = None
            self._num_nodes -= 1
            self._push_if_evictable(parent)
        return hashes

    # The eviction heap (lazy deletion).

    def _push_if_evictable(self, node: _Node) -> None:
        if node is self._root or node.children or node.lock_ref:
            return
        heapq.heappush(self._heap, (node.last_access, node.id, node))
        if len(self._heap) > 2 * self._num_nodes + 64:
            self._heap = [entry for entry in self._heap if self._is_current(entry)]
            heapq.heapify(self._heap)

    def _is_current(self, entry: _HeapEntry) -> bool:
        last_access, _, node = entry
        return (
            node.parent is not None
            and not node.children
            and node.lock_ref == 0
            and node.last_access == last_access
        )

    # Small helpers.

    def _new_id(self) -> int:
        self._next_id += 1
        return self._next_id

    def _nodes(self) -> list[_Node]:
        """Every node below the root (a full walk: integrity checks and reset only)."""
        out: list[_Node] = []
        stack = list(self._root.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    def _path_blocks(self, node: _Node) -> tuple[int, ...]:
        runs: list[list[int]] = []
        while node is not self._root:
            runs.append(node.blocks)
            node = node.parent  # type: ignore[assignment]
        return tuple(b for run in reversed(runs) for b in run)

    def _live_node(self, handle: object) -> _Node:
        if not isinstance(handle, _RadixHandle):
            raise TypeError(f"not a RadixCache handle: {handle!r}")
        node, depth = handle.node, 0
        while node is not self._root:
            if node.parent is None:
                raise StaleHandleError("matched blocks were evicted before lock; match again")
            depth += node.num_blocks
            node = node.parent
        if depth != handle.num_blocks:
            raise StaleHandleError("matched blocks were evicted before lock; match again")
        return handle.node

    def _check_node(self, node: _Node, current_heap_ids: set[int]) -> None:
        if not node.keys or not len(node.keys) == len(node.blocks) == len(node.hashes):
            raise RuntimeError(f"node {node.id} keys/blocks/hashes lengths differ or are empty")
        parent = node.parent
        if parent is None or parent.children.get(node.keys[0]) is not node:
            raise RuntimeError(f"node {node.id} is not its parent's child under its first key")
        if any(len(key) != self.block_size for key in node.keys):
            raise RuntimeError(f"node {node.id} holds a partial block")
        parent_hash = parent.hashes[-1] if parent is not self._root else None
        if node.hashes != self._chain_hashes(node.keys, parent_hash):
            raise RuntimeError(f"node {node.id} hashes do not chain from its parent")
        if node.lock_ref < 0 or (parent is not self._root and parent.lock_ref < node.lock_ref):
            raise RuntimeError(f"node {node.id} lock_ref is negative or above its parent's")
        if any(self.pool.refcount(b) < 1 for b in node.blocks):
            raise RuntimeError(f"node {node.id} caches a block that is free in the pool")
        if not node.children and not node.lock_ref and node.id not in current_heap_ids:
            raise RuntimeError(f"evictable leaf {node.id} is missing from the eviction heap")
