"""The pool of fixed-size KV blocks: who owns which block, counted by reference.

A block id is an index into the paged KV tensors (see ``kv_cache.py``); this module
never touches those tensors, it only decides which ids are free. A block is shared
by counting references: a running request holds one, and the prefix cache holds
one for every block it adopted, so a block returns to the free list only when its
last holder lets go. Running out of blocks is a normal state (the scheduler makes
the request wait, evicts from the prefix cache, or preempts), never a crash, so it
is a typed error that says what was asked and what was left.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable


class OutOfBlocksError(Exception):
    """Fewer free blocks than requested; nothing was allocated."""

    def __init__(self, requested: int, num_free: int, num_total: int) -> None:
        self.requested = requested
        self.num_free = num_free
        self.num_total = num_total
        super().__init__(
            f"requested {requested} KV blocks but only {num_free} of {num_total} are free; "
            "evict from the prefix cache, wait for running requests to finish, "
            "or raise the KV memory budget"
        )


class BlockRefcountError(ValueError):
    """A block id was used against its reference count (double free, incref of a free block)."""


class BlockPool:
    """Reference-counted allocator of ``num_blocks`` block ids ``0 .. num_blocks - 1``."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(
                f"num_blocks must be positive, got {num_blocks}; "
                "the KV memory budget is too small for even one block"
            )
        self._refcounts = [0] * num_blocks
        # A stack popped from the end: reversed so a fresh pool hands out 0, 1, 2, ...
        self._free = list(range(num_blocks - 1, -1, -1))

    @property
    def num_total(self) -> int:
        return len(self._refcounts)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_total - self.num_free

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free blocks at refcount 1, all or nothing (raises ``OutOfBlocksError``)."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({n})")
        if n > self.num_free:
            raise OutOfBlocksError(n, self.num_free, self.num_total)
        blocks = [self._free.pop() for _ in range(n)]
        for block in blocks:
            self._refcounts[block] = 1
        return blocks

    def incref(self, blocks: Iterable[int]) -> None:
        """Add a holder to blocks that are already allocated (sharing, never reviving)."""
        counts = Counter(blocks)
        for block in counts:
            if self._checked(block) == 0:
                raise BlockRefcountError(
                    f"incref of free block {block}: only allocated blocks can be shared; "
                    "allocate() it first"
                )
        for block, count in counts.items():
            self._refcounts[block] += count

    def free(self, blocks: Iterable[int]) -> None:
        """Drop one reference per listed block; a block at zero goes back to the free list.

        Validated before anything changes, so a double free leaves the pool untouched.
        """
        counts = Counter(blocks)
        for block, count in counts.items():
            held = self._checked(block)
            if count > held:
                raise BlockRefcountError(
                    f"double free of block {block}: freeing {count} reference(s) but it holds "
                    f"{held}; each holder must free a block exactly once"
                )
        for block, count in counts.items():
            self._refcounts[block] -= count
            if self._refcounts[block] == 0:
                self._free.append(block)

    def refcount(self, block: int) -> int:
        return self._checked(block)

    def check_integrity(self) -> None:
        """Raise if the free list and the reference counts disagree."""
        free = set(self._free)
        if len(free) != len(self._free):
            raise RuntimeError("block pool free list holds a block twice")
        unreferenced = {b for b, rc in enumerate(self._refcounts) if rc == 0}
        if free != unreferenced:
            raise RuntimeError(
                f"block pool free list {sorted(free)} != blocks at refcount 0 "
                f"{sorted(unreferenced)}"
            )
        if any(rc < 0 for rc in self._refcounts):
            raise RuntimeError("block pool holds a negative reference count")

    def _checked(self, block: int) -> int:
        if not 0 <= block < self.num_total:
            raise BlockRefcountError(
                f"block id {block} is outside this pool (0 .. {self.num_total - 1})"
            )
        return self._refcounts[block]
