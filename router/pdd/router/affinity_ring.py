"""Which MD a new conversation goes to: consistent hashing on its first block.

Each instance owns ``points`` pseudo-random positions on a 64-bit ring; a key (the
conversation's first block hash, mixed so that small or structured keys spread too)
prefers the owners of the positions clockwise from its own, in that order. Choosing
is a binary search plus a short walk past instances that cannot take the request:
O(log n) instead of hashing the key against every instance (rendezvous hashing),
with the same promises: each key has one stable preference order, and removing an
instance only moves the keys that preferred it.
"""

from __future__ import annotations

import bisect
import hashlib
import struct
from collections.abc import Iterable, Iterator

#: Positions per instance: enough that each instance's share of new conversations is
#: within a few percent of 1/n (the spread of a share shrinks as 1/sqrt(points)).
POINTS_PER_INSTANCE = 160


def _position(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def key_position(key: int) -> int:
    """Where ``key`` sits on the ring."""
    return _position(struct.pack("<Q", key & ((1 << 64) - 1)))


class AffinityRing:
    """A fixed membership's ring; build a new one when instances come or go (O(n log n))."""

    def __init__(self, instance_ids: Iterable[str], points: int = POINTS_PER_INSTANCE) -> None:
        ring = sorted(
            (_position(f"{instance_id}#{v}".encode()), instance_id)
            for instance_id in instance_ids
            for v in range(points)
        )
        self._positions = [p for p, _ in ring]
        self._owners = [i for _, i in ring]

    def preference(self, key: int) -> Iterator[str]:
        """The instances in the order ``key`` prefers them, each once."""
        owners, n = self._owners, len(self._owners)
        start = bisect.bisect_right(self._positions, key_position(key))
        seen: set[str] = set()
        for k in range(n):
            owner = owners[(start + k) % n]
            if owner not in seen:
                seen.add(owner)
                yield owner
