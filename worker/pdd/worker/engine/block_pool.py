"""The pool of fixed-size KV blocks: who owns which block, counted by reference.

A block id is an index into the paged KV tensors (see ``kv_cache.py``); this module
never touches those tensors, it only decides which ids are free. A block is shared
by counting references: a running request holds one, and the prefix cache holds
one for every block it adopted, so a block returns to the free list only when its
last holder lets go. Running out of blocks is a normal state (the scheduler makes
the request wait, evicts from the prefix cache, or preempts), never a crash, so it
is a typed error that says what was asked and what was left.

Blocks are placed so that a sequence's table tends to be one contiguous run of ids:
a growing sequence takes the blocks right after its last one when they are free, and
a new one starts in the middle of the largest free run, leaving room on both sides.
Attention reads a contiguous run of blocks as a view of the cache instead of copying
it out block by block (see ``kv_cache.py``), so contiguity is worth a little search.
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
        # 1 where a block is free: bytearray.find walks free / used runs at C speed.
        self._is_free = bytearray(b"\x01") * num_blocks
        self._num_free = num_blocks

    @property
    def num_total(self) -> int:
        return len(self._refcounts)

    @property
    def num_free(self) -> int:
        return self._num_free

    @property
    def num_used(self) -> int:
        return self.num_total - self.num_free

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free

    def allocate(self, n: int, after: int | None = None) -> list[int]:
        """Take ``n`` free blocks at refcount 1, all or nothing (raises ``OutOfBlocksError``).

        ``after``: the last block of the sequence being grown; the blocks following it
        are taken first while they are free, so the sequence stays one contiguous run.
        """
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({n})")
        if n > self._num_free:
            raise OutOfBlocksError(n, self._num_free, self.num_total)
        blocks: list[int] = []
        if after is not None:
            self._checked(after)
            block, is_free = after + 1, self._is_free
            while len(blocks) < n and block < len(is_free) and is_free[block]:
                blocks.append(block)
                is_free[block] = 0
                block += 1
        if len(blocks) < n:  # enough are free: n <= num_free was checked above
            placed = self._place(n - len(blocks))
            for block in placed:
                self._is_free[block] = 0
            blocks += placed
        for block in blocks:
            self._refcounts[block] = 1
        self._num_free -= n
        return blocks

    def _place(self, n: int) -> list[int]:
        """``n`` free blocks: the middle of the largest free run if it is long enough.

        Centring a new run leaves free blocks after it to grow into, and after the
        run before it too; a free run at id 0 follows no run, so it starts there (a
        fresh pool hands out 0, 1, 2, ...). When no run is long enough, the lowest ids.
        """
        runs = self._free_runs()
        start, end = max(runs, key=lambda r: r[1] - r[0])
        if end - start >= n:
            first = start + (end - start - n) // 2 if start else 0
            return list(range(first, first + n))
        blocks: list[int] = []
        for start, end in runs:
            blocks += range(start, min(end, start + n - len(blocks)))
        return blocks

    def _free_runs(self) -> list[tuple[int, int]]:
        """Maximal runs ``[start, end)`` of free blocks, in id order."""
        runs, is_free, pos = [], self._is_free, 0
        while (start := is_free.find(1, pos)) >= 0:
            end = is_free.find(0, start)
            end = len(is_free) if end < 0 else end
            runs.append((start, end))
            pos = end
        return runs

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
                self._is_free[block] = 1
                self._num_free += 1

    def refcount(self, block: int) -> int:
        return self._checked(block)

    def check_integrity(self) -> None:
        """Raise if the free flags, the free count and the reference counts disagree."""
        free = {b for b, flag in enumerate(self._is_free) if flag}
        if len(free) != self._num_free:
            raise RuntimeError(
                f"block pool counts {self._num_free} free blocks but flags {len(free)} free"
            )
        unreferenced = {b for b, rc in enumerate(self._refcounts) if rc == 0}
        if free != unreferenced:
            raise RuntimeError(
                f"block pool free blocks {sorted(free)} != blocks at refcount 0 "
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
