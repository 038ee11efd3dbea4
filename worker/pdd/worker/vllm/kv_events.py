"""vLLM's KV events as the router's cache events: its blocks renamed into the router's chain.

vLLM names a cached block by its own hash (a different function, and blocks of its own
size: 128 on the CPU by default, multiples of 32), while the router's prefix index
names a prompt's blocks by ``pdd.common.block_hash`` over blocks of the router's size
(16 by default). vLLM's ``BlockStored`` carries each block's token IDs and its parent's
hash, which is all a rename needs: the router's hashes are computed over the tokens, and
``RouterChains`` remembers, per vLLM hash, where the router's chain stands at the end of
that block (the last full router block's hash, and the tokens after it), so a child
stored later continues its parent's chain.

Any pair of block sizes works, not only a router size dividing vLLM's: only whole router
blocks are named, and a router block that straddles two vLLM blocks belongs to the one
it ends in (it is usable only while that one is cached: vLLM's cache, like the router's
match, stops at the first missing block, so the child holds it exactly when the whole
prefix is held). vLLM reuses only whole blocks of its own, so the router rounds the hit
its index counts down to the block size this worker's ``/health`` reports
(``pdd.router.prefix_index.reusable``): never more than vLLM reuses. Refusing such sizes
would only have forced users to match block sizes vLLM constrains (multiples of 32 on
the CPU) to the router's.

A router block can be named by two vLLM blocks at once (vLLM replaces a partial block by
the full one, or stores the same prefix twice): each router hash counts its vLLM owners
and leaves the index only with the last. A block whose parent was never seen (its
events predate the subscription, or were lost) cannot be placed in the chain: it is
dropped, logged once, and counted. Blocks the router's plain token hash cannot name are
dropped too: a LoRA's, or those with extra keys (multimodal input, a cache salt), and
blocks of an offload tier (medium other than vLLM's own ``GPU`` pool).

Pure: no vLLM import; ``kv_events_feed`` decodes vLLM's messages and calls this.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from pdd.common.block_hash import ROOT_HASH, hash_block
from pdd.common.cache_events import AllCleared, BlockRemoved, BlockStored, CacheEvent

log = logging.getLogger(__name__)

#: vLLM's own name for a block: bytes, or an int with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``.
VllmHash = Hashable


@dataclass(frozen=True)
class _ChainEnd:
    """Where the router's chain stands after one vLLM block."""

    #: Hash of the last full router block up to this vLLM block's end (ROOT_HASH: none yet).
    router_hash: int
    #: Tokens after that router block, up to this vLLM block's end (fewer than a block).
    tail: tuple[int, ...]
    #: The router blocks that end inside this vLLM block: removed with it.
    owned: tuple[int, ...]


class RouterChains:
    """vLLM's stored / removed / cleared blocks in, the router's ``CacheEvent``s out."""

    def __init__(self, router_block_size: int) -> None:
        if router_block_size <= 0:
            raise ValueError(f"router block size must be positive, got {router_block_size}")
        self.block_size = router_block_size
        self._blocks: dict[VllmHash, _ChainEnd] = {}
        self._owners: dict[int, int] = {}  # router hash -> vLLM blocks naming it
        #: Stored events dropped because their parent was unknown (logged once).
        self.num_unknown_parents = 0

    def stored(
        self,
        block_hashes: Sequence[VllmHash],
        parent_hash: VllmHash | None,
        token_ids: Sequence[int],
        block_size: int,
    ) -> list[CacheEvent]:
        """vLLM cached ``block_hashes`` (each ``block_size`` of ``token_ids``, the first
        a child of ``parent_hash``): the router blocks they complete."""
        if len(token_ids) != len(block_hashes) * block_size:
            raise ValueError(
                f"{len(block_hashes)} blocks of {block_size} tokens, {len(token_ids)} token IDs"
            )
        start = self._start(parent_hash)
        if start is None:
            return []
        parent_router = start.router_hash
        end = start
        named: list[int] = []
        for i, vllm_hash in enumerate(block_hashes):
            end = self._extend(end, token_ids[i * block_size : (i + 1) * block_size])
            if vllm_hash not in self._blocks:
                self._own(end.owned)
            else:  # stored again (a reused prefix): the same router blocks, owned once
                self._disown(self._blocks[vllm_hash].owned)
                self._own(end.owned)
            self._blocks[vllm_hash] = end
            named.extend(end.owned)
        if not named:
            return []
        parent = None if parent_router == ROOT_HASH else parent_router
        return [BlockStored(block_hashes=named, parent_hash=parent, block_size=self.block_size)]

    def removed(self, block_hashes: Sequence[VllmHash]) -> list[CacheEvent]:
        """vLLM evicted ``block_hashes``: the router blocks no cached vLLM block names now."""
        gone: list[int] = []
        for vllm_hash in block_hashes:
            end = self._blocks.pop(vllm_hash, None)
            if end is not None:
                gone.extend(self._disown(end.owned))
        return [BlockRemoved(block_hashes=gone)] if gone else []

    def cleared(self) -> list[CacheEvent]:
        """vLLM reset its prefix cache: nothing it held is held."""
        self._blocks.clear()
        self._owners.clear()
        return [AllCleared()]

    def _start(self, parent_hash: VllmHash | None) -> _ChainEnd | None:
        if parent_hash is None:
            return _ChainEnd(ROOT_HASH, (), ())
        start = self._blocks.get(parent_hash)
        if start is None:
            if self.num_unknown_parents == 0:
                log.warning(
                    "vLLM stored blocks whose parent block %r this worker never saw stored "
                    "(events from before it subscribed, or lost): dropped, and the ones "
                    "after this are counted, not logged",
                    parent_hash,
                )
            self.num_unknown_parents += 1
        return start

    def _extend(self, start: _ChainEnd, tokens: Sequence[int]) -> _ChainEnd:
        """The chain after ``tokens`` more: the router blocks they complete, and the rest."""
        pending = [*start.tail, *tokens]
        parent, owned = start.router_hash, []
        full = len(pending) - len(pending) % self.block_size
        for at in range(0, full, self.block_size):
            parent = hash_block(parent, pending[at : at + self.block_size])
            owned.append(parent)
        return _ChainEnd(parent, tuple(pending[full:]), tuple(owned))

    def _own(self, router_hashes: Sequence[int]) -> None:
        for h in router_hashes:
            self._owners[h] = self._owners.get(h, 0) + 1

    def _disown(self, router_hashes: Sequence[int]) -> list[int]:
        """Drop one owner of each; the hashes left with none."""
        gone = []
        for h in router_hashes:
            left = self._owners.get(h, 0) - 1
            if left > 0:
                self._owners[h] = left
            else:
                self._owners.pop(h, None)
                gone.append(h)
        return gone
