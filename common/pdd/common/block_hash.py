"""Chained block hashes over token IDs: the one definition workers and router share.

A block is ``block_size`` consecutive token IDs starting at a multiple of
``block_size``. Its hash covers its own tokens *and* its parent's hash, so equal
hashes mean equal whole prefixes, not merely equal blocks. Workers publish these
hashes in their cache events; the router hashes a prompt the same way and asks
which instance holds the longest chain. Only full blocks are hashed: a partial
tail block is never cached, so it never needs a name.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

#: The parent hash of the first block of every sequence.
ROOT_HASH = 0
#: Tokens per block unless a deployment sets its own: the workers' KV block and the
#: router's prefix-index block, which must agree (one setting, spec.blockSize / --block-size).
DEFAULT_BLOCK_SIZE = 16

_MASK64 = (1 << 64) - 1


def hash_block(parent_hash: int, token_ids: Sequence[int]) -> int:
    """Hash one block given its parent's hash; stable across processes and machines.

    sha256 (not Python's ``hash``, which is salted per process) truncated to an
    unsigned 64-bit integer, so it fits JSON, Redis keys and int64 columns.
    """
    h = hashlib.sha256()
    h.update(struct.pack("<Q", parent_hash & _MASK64))
    h.update(struct.pack(f"<{len(token_ids)}I", *token_ids))
    return int.from_bytes(h.digest()[:8], "little")


def block_hashes(
    token_ids: Sequence[int], block_size: int, parent_hash: int = ROOT_HASH
) -> list[int]:
    """Chained hashes of every *full* block of ``token_ids`` (the tail is ignored)."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    hashes: list[int] = []
    parent = parent_hash
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes
