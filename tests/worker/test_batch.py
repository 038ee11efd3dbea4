"""ForwardBatch: the one input builder for prefill, decode, extend and mixes of them."""

from __future__ import annotations

import pytest
import torch

from pdd.worker.batch import ForwardBatch, InvalidBatchError, SeqInput

BS = 4


def test_mixed_batch_indices() -> None:
    seqs = [
        SeqInput([10, 11, 12], start_pos=0, block_table=[7]),  # prefill
        SeqInput([20], start_pos=5, block_table=[2, 9]),  # decode at position 5
        SeqInput([30, 31], start_pos=3, block_table=[4, 1, 8], all_logits=True),  # extend
    ]
    b = ForwardBatch.build(seqs, BS, "cpu")

    assert b.input_ids.tolist() == [10, 11, 12, 20, 30, 31]
    assert b.positions.tolist() == [0, 1, 2, 5, 3, 4]
    # position p of a sequence lives in slot table[p // BS] * BS + p % BS
    assert b.slot_mapping.tolist() == [28, 29, 30, 9 * 4 + 1, 4 * 4 + 3, 1 * 4 + 0]
    assert b.logits_indices.tolist() == [2, 3, 4, 5]
    assert b.q_lens == (3, 1, 2) and b.kv_lens == (3, 6, 5) and b.max_q == 3
    assert not b.prefill_only
    # Only the blocks each sequence uses, padded with block 0.
    assert b.block_tables.tolist() == [[7, 0], [2, 9], [4, 1]]
    assert b.query_index.tolist() == [0, 1, 2, 3, 6, 7]


def test_attention_mask_is_causal_over_cached_prefix() -> None:
    seqs = [SeqInput([1, 2], start_pos=3, block_table=[0, 1]), SeqInput([5], 0, [2])]
    mask = ForwardBatch.build(seqs, BS, "cpu").attn_mask
    assert mask.shape == (2, 1, 2, 8)
    assert mask[0, 0].int().tolist() == [[1, 1, 1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 1, 0, 0, 0]]
    # Padding query row 1 of the second sequence still sees a real key (no NaN rows).
    assert mask[1, 0].int().tolist() == [[1, 0, 0, 0, 0, 0, 0, 0], [1, 0, 0, 0, 0, 0, 0, 0]]


def test_decode_batch_needs_no_query_padding() -> None:
    seqs = [SeqInput([1], 2, [0]), SeqInput([2], 9, [1, 2, 3])]
    b = ForwardBatch.build(seqs, BS, "cpu")
    assert b.query_index is None and b.max_q == 1
    assert b.attn_mask[:, 0, 0].sum(-1).tolist() == [3, 10]


def test_prefill_only_masks_over_new_tokens_and_unpadded_prefill_is_causal() -> None:
    two = ForwardBatch.build([SeqInput([1, 2, 3], 0, [0]), SeqInput([4], 0, [1])], BS, "cpu")
    assert two.prefill_only and two.attn_mask.shape == (2, 1, 3, 3)
    one = ForwardBatch.build([SeqInput([1, 2, 3], 0, [0])], BS, "cpu")
    assert one.attn_mask is None  # plain causal attention
    equal = ForwardBatch.build([SeqInput([1, 2], 0, [0]), SeqInput([3, 4], 0, [1])], BS, "cpu")
    assert equal.attn_mask is None and equal.query_index is None


@pytest.mark.parametrize(
    ("seqs", "message"),
    [
        ([], "at least one"),
        ([SeqInput([], 0, [0])], "no new tokens"),
        ([SeqInput([1], -1, [0])], "negative start_pos"),
        ([SeqInput([1, 2], 3, [0])], "needs 2 blocks"),
    ],
)
def test_invalid_inputs(seqs: list[SeqInput], message: str) -> None:
    with pytest.raises(InvalidBatchError, match=message):
        ForwardBatch.build(seqs, BS, "cpu")


def test_tensors_land_on_the_requested_device() -> None:
    b = ForwardBatch.build([SeqInput([1, 2], 1, [3])], BS, torch.device("cpu"))
    assert {t.device.type for t in (b.input_ids, b.slot_mapping, b.attn_mask)} == {"cpu"}
