"""vLLM's packed KV blocks read and written as PDD's per-token KV (pdd.worker.vllm.paged_view),
with stand-ins for vLLM's cache writer: no vLLM needed.

The stand-in packs K as vLLM's AVX-512 path does (each block's K of one head transposed,
``[head_dim, block_size]``; V plain), so a view that ignored the packing would read K
scrambled. The chunks then go through PDD's own ``kv_transfer`` and codecs unchanged.
"""

from __future__ import annotations

import pytest
import torch

from pdd.worker.engine.kv_transfer import encode_chunk, import_chunk
from pdd.worker.vllm.paged_view import (
    UnsupportedKVLayoutError,
    VllmPagedKV,
    probe_block_layout,
    split_kv,
)

pytestmark = pytest.mark.unit

LAYERS, HEADS, DIM = 2, 3, 8
FINGERPRINT = "test-model"


def transposed_k_writer(key, value, key_cache, value_cache, slots) -> None:
    """K of each block and head stored ``[head_dim, block_size]``, V ``[block_size, head_dim]``."""
    block_size, head_dim = key_cache.shape[2], key_cache.shape[3]
    for i, slot in enumerate(slots.tolist()):
        block, t = divmod(slot, block_size)
        for h in range(key.shape[1]):
            key_cache[block, h].view(head_dim, block_size)[:, t] = key[i, h]
            value_cache[block, h, t] = value[i, h]


def plain_writer(key, value, key_cache, value_cache, slots) -> None:
    block_size = key_cache.shape[2]
    for i, slot in enumerate(slots.tolist()):
        block, t = divmod(slot, block_size)
        key_cache[block, :, t] = key[i]
        value_cache[block, :, t] = value[i]


def make_view(writer, block_size: int, num_blocks: int, dtype=torch.float32):
    layers = [
        torch.zeros(num_blocks, HEADS, block_size, 2 * DIM, dtype=dtype) for _ in range(LAYERS)
    ]
    layout = probe_block_layout(writer, HEADS, block_size, DIM, dtype)
    return layers, VllmPagedKV(layers, layout)


def model_writes(writer, layers, block_table, kv: torch.Tensor) -> None:
    """Write ``kv`` ``[L, 2, n, H, D]`` at positions 0.. as vLLM's attention would."""
    block_size = layers[0].shape[2]
    positions = torch.arange(kv.shape[2])
    table = torch.tensor(block_table)
    slots = table[positions // block_size] * block_size + positions % block_size
    for layer, (k, v) in zip(layers, kv, strict=True):
        writer(k, v, *split_kv(layer), slots)


def test_reads_what_the_model_wrote_through_the_packing() -> None:
    layers, view = make_view(transposed_k_writer, block_size=4, num_blocks=6)
    table = [5, 1, 3]  # out of order: positions 4..7 live in block 1
    kv = torch.randn(LAYERS, 2, 11, HEADS, DIM)
    model_writes(transposed_k_writer, layers, table, kv)
    assert torch.equal(view.read_tokens(table, 0, 11), kv)
    assert torch.equal(view.read_tokens(table, 3, 9), kv[:, :, 3:9])


def test_writes_where_the_model_reads() -> None:
    layers, view = make_view(transposed_k_writer, block_size=4, num_blocks=6)
    reference, _ = make_view(transposed_k_writer, block_size=4, num_blocks=6)
    table, kv = [2, 0], torch.randn(LAYERS, 2, 7, HEADS, DIM)
    view.write_tokens(table, 0, kv)
    model_writes(transposed_k_writer, reference, table, kv)
    for mine, theirs in zip(layers, reference, strict=True):
        assert torch.equal(mine, theirs)


def test_bfloat16_blocks_larger_than_one_digit() -> None:
    # 2 * 3 * 8 * 32 = 1536 elements a block: the probe needs two base-256 passes.
    layers, view = make_view(transposed_k_writer, 32, 2, torch.bfloat16)
    kv = torch.randn(LAYERS, 2, 40, HEADS, DIM).to(torch.bfloat16)
    model_writes(transposed_k_writer, layers, [1, 0], kv)
    assert torch.equal(view.read_tokens([1, 0], 0, 40), kv)


def test_pdd_chunks_cross_between_block_sizes_and_packings() -> None:
    src_layers, src = make_view(transposed_k_writer, block_size=4, num_blocks=5)
    _, dst = make_view(plain_writer, block_size=8, num_blocks=3)
    ids = list(range(100, 113))
    kv = torch.randn(LAYERS, 2, len(ids), HEADS, DIM)
    model_writes(transposed_k_writer, src_layers, [4, 0, 2, 1], kv)
    held = 5  # the receiver's own prefix: kept, never overwritten
    dst.write_tokens([2, 0], 0, kv[:, :, :held])
    for start in (0, 8):
        end = min(start + 8, len(ids))
        chunk = encode_chunk(
            src.read_tokens([4, 0, 2, 1], start, end), start, FINGERPRINT, ids[:end]
        )
        held = import_chunk(dst, [2, 0], ids, held, chunk, FINGERPRINT)
    assert held == len(ids)
    assert torch.equal(dst.read_tokens([2, 0], 0, len(ids)), kv)


def test_coded_chunks_apply_to_unpacked_vectors() -> None:
    src_layers, src = make_view(transposed_k_writer, block_size=4, num_blocks=4)
    _, dst = make_view(transposed_k_writer, block_size=4, num_blocks=4)
    ids = list(range(12))
    kv = torch.randn(LAYERS, 2, len(ids), HEADS, DIM)
    model_writes(transposed_k_writer, src_layers, [0, 1, 2], kv)
    chunk = encode_chunk(src.read_tokens([0, 1, 2], 0, 12), 0, FINGERPRINT, ids, codec="int8")
    assert import_chunk(dst, [3, 2, 1], ids, 0, chunk, FINGERPRINT, codec="int8") == 12
    got = dst.read_tokens([3, 2, 1], 0, 12)
    # int8 per (token, head) vector: error at most half a step of that vector's range
    step = (kv.amax(-1, keepdim=True) - kv.amin(-1, keepdim=True)) / 254
    assert bool(((got - kv).abs() <= step * 0.6 + 1e-6).all())
    assert not torch.equal(got, kv)


def test_refuses_a_writer_that_does_not_place_every_element() -> None:
    def drops_v(key, value, key_cache, value_cache, slots) -> None:
        plain_writer(key, torch.zeros_like(value), key_cache, value_cache, slots)

    with pytest.raises(UnsupportedKVLayoutError, match="not supported by the PDD connector"):
        probe_block_layout(drops_v, HEADS, 4, DIM, torch.float32)
