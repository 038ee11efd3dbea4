"""Which MD a new conversation goes to: consistent hashing on its first block.

Each instance owns ``points`` pseudo-random positions on a 64-bit ring; a key (the
conversation's first block hash, mixed so that small or structured keys spread too)
prefers the owners of the positions clockwise from its own, in that order. Choosing
is a binary search plus a short walk past instances that cannot take the request:
O(log n) instead of hashing the key against every instance (rendezvous hashing),
with the same promises: each key has one stable preference order, and removing an
instance only moves the keys that preferred it.

The ring is kept up one member at a time: a pod that comes, goes or is left out for a
retry places or lifts its own points (O(points log n)), never rebuilding the whole
ring (1.6 million points at 10,000 instances: seconds). The points live in buckets by
their top bits, each a short sorted list, so an insertion moves a bucket's entries
rather than the whole ring's; the positions are uniform, so the buckets stay even.
"""

from __future__ import annotations

import bisect
import hashlib
import struct
from collections.abc import Iterable, Iterator
from operator import itemgetter

#: Positions per instance: enough that each instance's share of new conversations is
#: within a few percent of 1/n (the spread of a share shrinks as 1/sqrt(points)).
POINTS_PER_INSTANCE = 160
#: Buckets by the positions' top bits: about 400 points each at 10,000 instances.
_BUCKET_BITS = 12
_SHIFT = 64 - _BUCKET_BITS

_Point = tuple[int, str]  # (position, owner): the ring's order, ties to the lower id
_position_of = itemgetter(0)


def _position(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def key_position(key: int) -> int:
    """Where ``key`` sits on the ring."""
    return _position(struct.pack("<Q", key & ((1 << 64) - 1)))


class AffinityRing:
    """The members' points in position order, changed one member at a time."""

    def __init__(self, instance_ids: Iterable[str], points: int = POINTS_PER_INSTANCE) -> None:
        self._points = points
        self._members: dict[str, list[_Point]] = {i: self._points_of(i) for i in instance_ids}
        self._buckets: list[list[_Point]] = [[] for _ in range(1 << _BUCKET_BITS)]
        for point in sorted(p for owned in self._members.values() for p in owned):
            self._buckets[point[0] >> _SHIFT].append(point)

    def __contains__(self, instance_id: object) -> bool:
        return instance_id in self._members

    def add(self, instance_id: str) -> None:
        """Place a new member's points (a member already here is left as it is)."""
        if instance_id in self._members:
            return
        owned = self._members[instance_id] = self._points_of(instance_id)
        for point in owned:
            bisect.insort(self._buckets[point[0] >> _SHIFT], point)

    def remove(self, instance_id: str) -> None:
        """Lift a member's points (an unknown id is ignored)."""
        for point in self._members.pop(instance_id, ()):
            bucket = self._buckets[point[0] >> _SHIFT]
            del bucket[bisect.bisect_left(bucket, point)]

    def preference(self, key: int) -> Iterator[str]:
        """The instances in the order ``key`` prefers them, each once."""
        if not self._members:
            return
        seen: set[str] = set()
        for _, owner in self._clockwise(key_position(key)):
            if owner not in seen:
                seen.add(owner)
                yield owner
                if len(seen) == len(self._members):
                    return

    def _clockwise(self, position: int) -> Iterator[_Point]:
        """Every point once, from the first one past ``position`` round the ring."""
        buckets, b = self._buckets, position >> _SHIFT
        start = bisect.bisect_right(buckets[b], position, key=_position_of)
        yield from buckets[b][start:]
        for k in range(1, len(buckets)):
            yield from buckets[(b + k) % len(buckets)]
        yield from buckets[b][:start]

    def _points_of(self, owner: str) -> list[_Point]:
        return [(_position(f"{owner}#{v}".encode()), owner) for v in range(self._points)]
