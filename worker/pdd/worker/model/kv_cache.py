"""The paged KV cache: fixed-size blocks of K/V shared by all sequences of one worker.

A sequence's K/V lives in the blocks its block table names (block ``i`` holds token
positions ``[i*block_size, (i+1)*block_size)``), so prefixes can be shared between
requests by sharing block ids, and KV can be exported or imported per token range
without touching other sequences. Block bookkeeping (who owns which block) is the
BlockPool's job; this class only stores and moves tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from pdd.worker.model.config import ModelConfig


@dataclass(frozen=True)
class KVLayout:
    """Shape of one worker's cache; two workers can exchange KV only with equal layouts."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def itemsize(self) -> int:
        """Bytes of one element in the cache's dtype."""
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token over all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.itemsize

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size

    @classmethod
    def from_config(cls, config: ModelConfig, block_size: int, dtype: torch.dtype) -> KVLayout:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        return cls(config.num_layers, config.num_kv_heads, config.head_dim, block_size, dtype)


class PagedKVCache:
    """K and V tensors ``[num_layers, num_kv_heads, num_blocks * block_size, head_dim]``.

    Allocated once at startup for the whole budget, so serving never allocates KV
    memory on the hot path and the pool size is known to the scheduler.

    Heads come before slots so that a gathered sequence is one contiguous
    ``[tokens, head_dim]`` slab per KV head, the layout SDPA streams fastest (on the
    CPU, decode attention over token-major K/V measured 2-3x slower). K and V are
    views of one tensor, a layer's K beside its V, so one ``index_select`` gathers both.
    """

    def __init__(self, layout: KVLayout, num_blocks: int, device: torch.device | str) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.layout = layout
        self.num_blocks = num_blocks
        self.device = torch.device(device)
        shape = (
            layout.num_layers,
            2,  # K, V: adjacent per layer, so one index_select gathers both
            layout.num_kv_heads,
            num_blocks * layout.block_size,
            layout.head_dim,
        )
        self._kv = torch.zeros(shape, dtype=layout.dtype, device=self.device)
        self.k, self.v = self._kv[:, 0], self._kv[:, 1]
        # Per layer [1, Hkv, slots, D] views for span(): one narrow() per call, not a slice.
        self._spans = [(layer[0:1], layer[1:2]) for layer in self._kv]
        # First row of each K and V head in the [2 * Hkv * num_blocks, block_size * D] view.
        heads = torch.arange(2 * layout.num_kv_heads, device=self.device)
        self._head_rows = (heads * num_blocks).view(-1, 1)
        # gather() output, reused: a fresh multi-MB tensor per call costs page faults.
        self._scratch = self._kv.new_empty(0)

    @classmethod
    def blocks_for_budget(cls, layout: KVLayout, budget_bytes: int) -> int:
        """How many blocks fit in ``budget_bytes`` (raises when not even one does)."""
        blocks = budget_bytes // layout.bytes_per_block
        if blocks < 1:
            raise ValueError(
                f"KV budget {budget_bytes} B is below one block ({layout.bytes_per_block} B); "
                "raise the budget or lower block_size"
            )
        return blocks

    @property
    def block_size(self) -> int:
        return self.layout.block_size

    def layer(self, layer: int) -> torch.Tensor:
        """One layer's K and V, [2, Hkv, slots, D] (contiguous): what the paged kernel reads."""
        return self._kv[layer]

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K/V [T, Hkv, D] of T tokens at flat slots ``block * block_size + offset``."""
        self.k[layer].index_copy_(1, slots, k.transpose(0, 1).to(self.layout.dtype))
        self.v[layer].index_copy_(1, slots, v.transpose(0, 1).to(self.layout.dtype))

    def gather(self, layer: int, block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of whole blocks per sequence: each [B, Hkv, max_blocks * block_size, D].

        Positions past a sequence's length hold whatever the (padding) blocks hold; the
        attention mask (or a narrower key length) hides them. One ``index_select`` of
        whole blocks for K and V together, because on the CPU it is several times faster
        than advanced indexing, and this runs per layer per step. The result lives in a
        buffer that the next ``gather`` overwrites: use it before gathering again.
        """
        b, n = block_tables.shape
        lay = self.layout
        rows = (block_tables.reshape(1, -1) + self._head_rows).reshape(-1)
        width = lay.block_size * lay.head_dim
        if self._scratch.numel() < rows.numel() * width:
            self._scratch = self._kv.new_empty(rows.numel() * width)
        out = self._scratch[: rows.numel() * width].view(-1, width)
        blocks = self._kv[layer].view(-1, width)  # a row per (K or V, head, block)
        torch.index_select(blocks, 0, rows, out=out)
        k, v = out.view(2, lay.num_kv_heads, b, n * lay.block_size, lay.head_dim)
        return k.transpose(0, 1), v.transpose(0, 1)

    def span(self, layer: int, first_slot: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V [1, Hkv, length, D] of ``length`` consecutive slots: views, nothing copied.

        Valid for a sequence whose blocks are consecutive ids (so its slots are too).
        """
        k, v = self._spans[layer]
        return k.narrow(2, first_slot, length), v.narrow(2, first_slot, length)

    def read_tokens(self, block_table: Sequence[int], start: int, end: int) -> torch.Tensor:
        """K/V of token positions [start, end) of one sequence: [L, 2, end-start, Hkv, D].

        The unit of KV export: a contiguous token range, all layers, K and V.
        """
        slots = self._slots(block_table, start, end)
        return self._kv[:, :, :, slots].transpose(2, 3)

    def write_tokens(self, block_table: Sequence[int], start: int, data: torch.Tensor) -> None:
        """Import K/V [L, 2, n, Hkv, D] (as ``read_tokens`` returns) at positions start.."""
        expected = (self.layout.num_layers, 2)
        tail = (self.layout.num_kv_heads, self.layout.head_dim)
        if tuple(data.shape[:2]) != expected or tuple(data.shape[3:]) != tail:
            raise ValueError(
                f"KV data shape {tuple(data.shape)} does not fit layout "
                f"[{expected[0]}, 2, n, {tail[0]}, {tail[1]}]"
            )
        slots = self._slots(block_table, start, start + data.shape[2])
        data = data.to(device=self.device, dtype=self.layout.dtype)
        self._kv[:, :, :, slots] = data.transpose(2, 3)

    def _slots(self, block_table: Sequence[int], start: int, end: int) -> torch.Tensor:
        return token_slots(block_table, self.layout.block_size, start, end).to(self.device)


def token_slots(block_table: Sequence[int], block_size: int, start: int, end: int) -> torch.Tensor:
    """Cache slots (block id * block_size + offset) of a sequence's positions [start, end)."""
    if not 0 <= start <= end <= len(block_table) * block_size:
        raise ValueError(
            f"token range [{start}, {end}) is outside the block table "
            f"({len(block_table)} blocks of {block_size} tokens)"
        )
    positions = torch.arange(start, end)
    table = torch.as_tensor(list(block_table), dtype=torch.long)
    return table[positions // block_size] * block_size + positions % block_size
