"""vLLM's KV cache seen as PDD's: per-token K and V, so PDD's chunk format and codecs apply.

vLLM's CPU attention keeps one tensor per layer, ``[num_blocks, kv_heads, block_size,
2 * head_dim]``, whose K half is packed for the instruction set (transposed for AVX-512,
tiled for AMX, plain for 16-wide): a block is opaque. Rather than hard-code each
packing, ``probe_block_layout`` asks vLLM's own cache writer where each element of a
block lands, once at start, and ``VllmPagedKV`` then gathers and scatters through that
map. It offers what ``pdd.worker.engine.kv_transfer`` needs of a KV cache (``layout``,
``device``, ``read_tokens``, ``write_tokens``), so vLLM's KV leaves and enters as PDD's
per-token chunks ``[L, 2, n, Hkv, D]``: the same checks, the same codecs (exact, fp8,
int8, int4, which code per token and head and so need the unpacked vectors), and two
instances of different block size or instruction set still exchange KV.

No vLLM import: the connector hands in vLLM's writer, and the tests a stand-in.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from pdd.worker.model.kv_cache import KVLayout, token_slots

#: vLLM's cache writer, ``(key, value, key_cache, value_cache, slot_mapping)``, with
#: key and value ``[tokens, kv_heads, head_dim]``.
CacheWriter = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]
#: Integers that every KV dtype (bfloat16's 8 significant bits included) holds exactly.
_DIGIT = 256


class UnsupportedKVLayoutError(RuntimeError):
    """vLLM's cache writer does not move each element of a block to one place of its own."""


def split_kv(block_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The K and V caches vLLM's CPU attention writes into, as views of ``block_cache``
    ``[num_blocks, kv_heads, block_size, 2 * head_dim]`` (as its ``forward`` makes them)."""
    num_blocks, kv_heads, block_size, _ = block_cache.shape
    k, v = block_cache.view(num_blocks, kv_heads, 2 * block_size, -1).chunk(2, dim=2)
    return k, v


def probe_block_layout(
    write: CacheWriter, kv_heads: int, block_size: int, head_dim: int, dtype: torch.dtype
) -> torch.Tensor:
    """Where each element of one block lands: ``[block_size, 2 (k, v), kv_heads, head_dim]``
    element offsets into one block's flat storage.

    Writes every element's own number through vLLM's writer into a scratch block, one
    base-256 digit a pass (exact in any KV dtype), and reads back which number each
    place holds. Raises UnsupportedKVLayoutError unless that is a one-to-one map.
    """
    count = block_size * 2 * kv_heads * head_dim
    numbers = torch.arange(count).view(block_size, 2, kv_heads, head_dim)
    found = torch.zeros(count, dtype=torch.long)
    scale = 1
    while scale < count:
        block = torch.zeros(1, kv_heads, block_size, 2 * head_dim, dtype=dtype)
        digits = (numbers // scale % _DIGIT).to(dtype)
        write(digits[:, 0], digits[:, 1], *split_kv(block), torch.arange(block_size))
        found += block.reshape(-1).to(torch.long) * scale
        scale *= _DIGIT
    offsets = torch.full((count,), -1, dtype=torch.long)
    offsets[found] = torch.arange(count)
    if found.unique().numel() != count or bool((offsets < 0).any()):
        raise UnsupportedKVLayoutError(
            f"vLLM's KV cache writer for {dtype} blocks of {block_size} tokens does not place "
            "each element once; this KV cache layout is not supported by the PDD connector"
        )
    return offsets.view(block_size, 2, kv_heads, head_dim)


class VllmPagedKV:
    """vLLM's per-layer block caches behind the ``read_tokens`` / ``write_tokens`` of
    PDD's ``PagedKVCache``; a sequence's positions are named by its block table, as there."""

    def __init__(self, layers: Sequence[torch.Tensor], block_layout: torch.Tensor) -> None:
        first = layers[0]
        _, kv_heads, block_size, width = first.shape
        self.layout = KVLayout(len(layers), kv_heads, width // 2, block_size, first.dtype)
        self.device = first.device
        self._flat = [layer.view(-1) for layer in layers]
        self._block_numel = kv_heads * block_size * width
        self._block_layout = block_layout.to(self.device)

    def read_tokens(self, block_table: Sequence[int], start: int, end: int) -> torch.Tensor:
        """K/V of positions ``[start, end)``: ``[L, 2, end - start, Hkv, D]``."""
        places = self._places(block_table, start, end)
        return torch.stack([flat[places] for flat in self._flat]).transpose(1, 2)

    def write_tokens(self, block_table: Sequence[int], start: int, data: torch.Tensor) -> None:
        """Write ``data`` ``[L, 2, n, Hkv, D]`` (as ``read_tokens`` returns) at ``start``."""
        lay = self.layout
        expected = (lay.num_layers, 2, lay.num_kv_heads, lay.head_dim)
        if (*data.shape[:2], *data.shape[3:]) != expected:
            raise ValueError(
                f"KV data shape {tuple(data.shape)} does not fit layout "
                f"[{lay.num_layers}, 2, n, {lay.num_kv_heads}, {lay.head_dim}]"
            )
        places = self._places(block_table, start, start + data.shape[2])
        tokens_first = data.to(device=self.device, dtype=lay.dtype).transpose(1, 2)
        for flat, layer_data in zip(self._flat, tokens_first, strict=True):
            flat[places] = layer_data

    def _places(self, block_table: Sequence[int], start: int, end: int) -> torch.Tensor:
        """Flat offsets ``[n, 2, Hkv, D]`` of positions ``[start, end)`` in a layer."""
        bs = self.layout.block_size
        slots = token_slots(block_table, bs, start, end).to(self.device)
        blocks, offsets = slots // bs, slots % bs
        base = blocks * self._block_numel
        return base.view(-1, 1, 1, 1) + self._block_layout[offsets]
