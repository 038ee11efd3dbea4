"""One forward-step input builder for prefill, chunked prefill, decode and extend.

Every step is "some sequences each append q_len >= 1 new tokens after start_pos tokens
whose K/V is already cached". Prefill is start_pos 0, decode is q_len 1, a prefill
chunk or the recompute "extend" of relayed tokens is any q_len after any start_pos, and
one batch may mix them all. Building all index tensors here, vectorised and once per
step, keeps the model's forward free of per-sequence Python.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


class InvalidBatchError(ValueError):
    """A SeqInput that cannot be computed (empty, or a block table too short)."""


@dataclass(frozen=True)
class SeqInput:
    """One sequence's part of a forward step.

    token_ids: the NEW tokens of this step (at least one).
    start_pos: how many tokens of this sequence already have K/V in the cache.
    block_table: cache blocks of this sequence; must cover start_pos + len(token_ids).
    all_logits: return logits for every new token (parity tests, scoring), else the last.
    """

    token_ids: Sequence[int]
    start_pos: int
    block_table: Sequence[int]
    all_logits: bool = False


@dataclass(frozen=True)
class ForwardBatch:
    """Flat [T] token tensors plus what the attention needs to pad per sequence.

    Tokens of all sequences are concatenated (T in total) so embeddings, norms and MLPs
    run without padding. Attention pads queries to [B, max_q] through ``query_index``
    and keys either to the new tokens (``prefill_only``: nothing cached, no gather) or
    to the gathered blocks of ``block_tables``; ``attn_mask`` (True = visible) hides
    padding and the future. ``attn_mask`` is None for a fresh prefill of equal-length
    sequences (one, or a benchmark batch), where plain causal attention is exact and
    runs the fastest kernel.
    """

    input_ids: torch.Tensor  # [T] long
    positions: torch.Tensor  # [T] long: position of each token in its sequence
    slot_mapping: torch.Tensor  # [T] long: flat cache slot to write each token's K/V
    block_tables: torch.Tensor  # [B, max_blocks] long, padded with block 0
    logits_indices: torch.Tensor  # [N] long: tokens whose logits are returned
    query_index: torch.Tensor | None  # [T] long into [B * max_q]; None when no padding
    attn_mask: torch.Tensor | None  # [B, 1, max_q, max_kv] bool
    q_lens: tuple[int, ...]
    kv_lens: tuple[int, ...]
    max_q: int
    prefill_only: bool

    @property
    def batch_size(self) -> int:
        return len(self.q_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @classmethod
    def build(
        cls, seqs: Sequence[SeqInput], block_size: int, device: torch.device | str
    ) -> ForwardBatch:
        """Validate the inputs and build every index tensor, on ``device``."""
        _validate(seqs, block_size)
        q_lens = [len(s.token_ids) for s in seqs]
        starts = [s.start_pos for s in seqs]
        kv_lens = [s + q for s, q in zip(starts, q_lens, strict=True)]
        max_q, b = max(q_lens), len(seqs)
        prefill_only = not any(starts)

        q_len_t = torch.tensor(q_lens)
        seq_of_token = torch.repeat_interleave(torch.arange(b), q_len_t)
        first_token = torch.cumsum(q_len_t, 0) - q_len_t
        offset_in_seq = torch.arange(len(seq_of_token)) - first_token[seq_of_token]
        positions = torch.tensor(starts)[seq_of_token] + offset_in_seq
        tables = _padded_tables(seqs, kv_lens, block_size)
        slots = tables[seq_of_token, positions // block_size] * block_size + positions % block_size

        want_all = torch.tensor([s.all_logits for s in seqs])
        is_last = offset_in_seq == q_len_t[seq_of_token] - 1
        logits_indices = torch.nonzero(want_all[seq_of_token] | is_last).flatten()
        padded = len(seq_of_token) != b * max_q
        query_index = seq_of_token * max_q + offset_in_seq if padded else None
        key_width = max_q if prefill_only else tables.shape[1] * block_size
        mask = None
        if not (prefill_only and not padded):
            mask = _attention_mask(torch.tensor(starts), torch.tensor(kv_lens), max_q, key_width)

        def dev(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device)

        ids = torch.tensor([t for s in seqs for t in s.token_ids], dtype=torch.long)
        return cls(
            input_ids=ids.to(device),
            positions=positions.to(device),
            slot_mapping=slots.to(device),
            block_tables=tables.to(device),
            logits_indices=logits_indices.to(device),
            query_index=dev(query_index),
            attn_mask=dev(mask),
            q_lens=tuple(q_lens),
            kv_lens=tuple(kv_lens),
            max_q=max_q,
            prefill_only=prefill_only,
        )


def _validate(seqs: Sequence[SeqInput], block_size: int) -> None:
    if not seqs:
        raise InvalidBatchError("a forward batch needs at least one sequence")
    for i, s in enumerate(seqs):
        if len(s.token_ids) == 0:
            raise InvalidBatchError(f"sequence {i} has no new tokens; q_len must be >= 1")
        if s.start_pos < 0:
            raise InvalidBatchError(f"sequence {i} has negative start_pos {s.start_pos}")
        needed = -(-(s.start_pos + len(s.token_ids)) // block_size)
        if len(s.block_table) < needed:
            raise InvalidBatchError(
                f"sequence {i} needs {needed} blocks of {block_size} tokens for "
                f"{s.start_pos}+{len(s.token_ids)} tokens but its block table has "
                f"{len(s.block_table)}; allocate blocks before the step"
            )


def _padded_tables(seqs: Sequence[SeqInput], kv_lens: list[int], block_size: int) -> torch.Tensor:
    """[B, max_blocks] with only the blocks each sequence uses, padded with block 0."""
    used = [-(-n // block_size) for n in kv_lens]
    width = max(used)
    rows = [list(s.block_table[:u]) + [0] * (width - u) for s, u in zip(seqs, used, strict=True)]
    return torch.tensor(rows, dtype=torch.long)


def _attention_mask(
    starts: torch.Tensor, kv_lens: torch.Tensor, max_q: int, key_width: int
) -> torch.Tensor:
    """Key j is visible to query i of sequence b iff j < kv_len[b] and j <= start[b] + i.

    Padding queries (i >= q_len) still see every real key, so no row is fully masked
    (a fully masked row would make SDPA return NaN); their outputs are discarded.
    """
    i = torch.arange(max_q).view(1, max_q, 1)
    j = torch.arange(key_width).view(1, 1, key_width)
    visible = (j < kv_lens.view(-1, 1, 1)) & (j <= starts.view(-1, 1, 1) + i)
    return visible.unsqueeze(1)
