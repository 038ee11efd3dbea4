"""ForwardBatch: the one input builder for prefill, decode, extend and mixes of them."""

from __future__ import annotations

import pytest
import torch

from pdd.worker.model import batch as batch_module
from pdd.worker.model.batch import ForwardBatch, InvalidBatchError, SeqInput

pytestmark = pytest.mark.unit

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
    assert b.q_lens == (3, 1, 2) and b.kv_lens == (3, 6, 5)
    (g,) = b.groups  # too small to be worth a second attention call
    assert (g.start, g.end, g.num_seqs, g.max_q, g.key_len) == (0, 6, 3, 3, 6)
    # Only the blocks each sequence uses, padded with block 0.
    assert g.block_tables.tolist() == [[7, 0], [2, 9], [4, 1]]
    assert g.query_index.tolist() == [0, 1, 2, 3, 6, 7]


def test_attention_mask_is_causal_over_cached_prefix() -> None:
    seqs = [SeqInput([1, 2], start_pos=3, block_table=[0, 1]), SeqInput([5], 0, [2])]
    mask = ForwardBatch.build(seqs, BS, "cpu").groups[0].attn_mask
    assert mask.shape == (2, 1, 2, 5)  # keys up to the longest sequence, not whole blocks
    assert mask[0, 0].int().tolist() == [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    # Padding query row 1 of the second sequence still sees a real key (no NaN rows).
    assert mask[1, 0].int().tolist() == [[1, 0, 0, 0, 0], [1, 0, 0, 0, 0]]


def test_decode_batch_needs_no_query_padding() -> None:
    seqs = [SeqInput([1], 2, [0]), SeqInput([2], 9, [1, 2, 3])]
    (g,) = ForwardBatch.build(seqs, BS, "cpu").groups
    assert g.query_index is None and g.max_q == 1 and g.key_len == 10
    assert g.attn_mask[:, 0, 0].sum(-1).tolist() == [3, 10]


def test_decodes_of_one_length_need_no_mask() -> None:
    seqs = [SeqInput([1], 5, [0, 4]), SeqInput([2], 5, [1, 2])]
    (g,) = ForwardBatch.build(seqs, BS, "cpu").groups
    assert g.attn_mask is None and not g.is_causal and g.key_len == 6


def test_prefill_only_masks_over_new_tokens_and_unpadded_prefill_is_causal() -> None:
    (two,) = ForwardBatch.build(
        [SeqInput([1, 2, 3], 0, [0]), SeqInput([4], 0, [1])], BS, "cpu"
    ).groups
    assert two.block_tables is None and two.attn_mask.shape == (2, 1, 3, 3)
    (one,) = ForwardBatch.build([SeqInput([1, 2, 3], 0, [0])], BS, "cpu").groups
    assert one.attn_mask is None and one.is_causal  # plain causal attention
    (equal,) = ForwardBatch.build(
        [SeqInput([1, 2], 0, [0]), SeqInput([3, 4], 0, [1])], BS, "cpu"
    ).groups
    assert equal.attn_mask is None and equal.query_index is None


def test_far_apart_lengths_attend_in_separate_groups_in_caller_order() -> None:
    """Long and short decodes split into two groups; logits still follow the caller."""
    long_table = list(range(10, 10 + 500))
    seqs = [
        SeqInput([100], 1999, long_table),
        SeqInput([101], 9, [1, 2, 3]),
        SeqInput([102, 103], 1998, long_table, all_logits=True),
        SeqInput([104], 9, [4, 5, 6]),
    ]
    b = ForwardBatch.build(seqs, BS, "cpu")
    assert [(g.start, g.end, g.key_len) for g in b.groups] == [(0, 2, 10), (2, 5, 2000)]
    assert b.input_ids[b.logits_indices].tolist() == [100, 101, 102, 103, 104]
    assert b.q_lens == (1, 1, 2, 1) and b.kv_lens == (2000, 10, 2000, 10)


def test_every_sequence_alone_without_group_overhead(monkeypatch) -> None:
    monkeypatch.setattr(batch_module, "GROUP_OVERHEAD", 0)
    seqs = [SeqInput([1], 7, [0, 1]), SeqInput([2, 3], 0, [2]), SeqInput([4], 2, [3])]
    b = ForwardBatch.build(seqs, BS, "cpu")
    assert [g.num_seqs for g in b.groups] == [1, 1, 1]
    assert b.input_ids[b.logits_indices].tolist() == [1, 3, 4]


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
    mask = b.groups[0].attn_mask
    assert {t.device.type for t in (b.input_ids, b.slot_mapping, mask)} == {"cpu"}


def test_long_decodes_over_consecutive_blocks_attend_over_cache_spans(monkeypatch) -> None:
    monkeypatch.setattr(batch_module, "SPAN_MIN_KEYS", 4)
    runs = [SeqInput([1], 5, [3, 4, 9]), SeqInput([2], 8, [6, 7, 8])]  # 9: unused (6 keys)
    (g,) = ForwardBatch.build(runs, BS, "cpu").groups
    assert g.kv_spans == ((12, 6), (24, 9))  # (first slot, keys) per sequence
    assert g.block_tables is None and g.attn_mask is None
    scattered = [runs[0], SeqInput([2], 8, [6, 8, 7])]
    (g,) = ForwardBatch.build(scattered, BS, "cpu").groups
    assert g.kv_spans is None and g.block_tables is not None  # one copy-free call is not enough
    accelerator = ForwardBatch.build(runs, BS, "meta").groups[0]  # a launch per sequence: no
    assert accelerator.kv_spans is None and accelerator.block_tables is not None
    monkeypatch.setattr(batch_module, "SPAN_MIN_KEYS", 8)  # mean keys 7.5: too short
    assert ForwardBatch.build(runs, BS, "cpu").groups[0].kv_spans is None


def test_paged_batches_give_each_token_its_blocks_and_visible_keys() -> None:
    """What the compiled kernel reads: per query token, in token order, its sequence's
    blocks and position + 1 keys (causal within a chunk, everything before it)."""
    runs = [SeqInput([7, 8, 9], 5, [3, 4, 9]), SeqInput([2], 8, [6, 8, 7])]
    b = ForwardBatch.build(runs, BS, "cpu", paged=True)
    assert b.input_ids.tolist() == [7, 8, 9, 2] and b.groups == ()  # no grouping, no reorder
    assert b.token_kv_lens.tolist() == [6, 7, 8, 9]
    assert b.token_tables.tolist() == [[3, 4, 0], [3, 4, 0], [3, 4, 0], [6, 8, 7]]
    assert b.slot_mapping.tolist() == [4 * 4 + 1, 4 * 4 + 2, 4 * 4 + 3, 7 * 4 + 0]
    grouped = ForwardBatch.build(runs, BS, "cpu")  # for SDPA
    assert grouped.groups and grouped.token_tables is None and grouped.token_kv_lens is None
    with pytest.raises(ValueError, match="CPU only"):
        ForwardBatch.build(runs, BS, "meta", paged=True)
