"""One forward-step input builder for prefill, chunked prefill, decode and extend.

Every step is "some sequences each append q_len >= 1 new tokens after start_pos tokens
whose K/V is already cached". Prefill is start_pos 0, decode is q_len 1, a prefill
chunk or the recompute "extend" of relayed tokens is any q_len after any start_pos, and
one batch may mix them all. Building all index tensors here, vectorised and once per
step, keeps the model's forward free of per-sequence Python.

Attention is the one padded operation (every query of a sequence against every key of
the widest sequence beside it), so the builder sorts sequences by length and cuts
them into attention groups, each one SDPA call padded only to its own widest member.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import torch

# What one more attention call costs, in padded (query + 1) x key units (see _group_order):
# its fixed per-call overhead on the CPU is about that of gathering and attending ~2k keys.
GROUP_OVERHEAD = 2048
# A decode group attends sequence by sequence over views of the cache (no gather copy)
# when its sequences average at least this many keys: below it, one padded call over a
# gathered copy is cheaper than a call per sequence (measured on the CPU, tiny preset).
# CPU only: on an accelerator a launch per sequence costs more than the copy.
SPAN_MIN_KEYS = 192


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
class AttentionGroup:
    """Sequences whose attention is ONE padded SDPA call: tokens [start, end) of the batch.

    Queries are padded per sequence to ``max_q`` (through ``query_index``) and keys to
    ``key_len``: the group's new tokens when nothing is cached (``block_tables`` is
    None: a fresh prefill), else the first ``key_len`` positions gathered through
    ``block_tables``. ``attn_mask`` (True = visible) hides padding and the future; it
    is None where every key is visible (decodes of one length) or where plain causal
    attention is exact (fresh prefills of one length).

    ``kv_spans`` replaces gathering for decode groups whose sequences each hold one
    contiguous run of blocks: per sequence (first cache slot, key count), so SDPA
    reads the cache through views, one unpadded call per sequence.
    """

    start: int
    end: int
    num_seqs: int
    max_q: int
    key_len: int
    query_index: torch.Tensor | None  # [end - start] long into [num_seqs * max_q]; None: unpadded
    block_tables: torch.Tensor | None  # [num_seqs, blocks] long, padded with block 0
    attn_mask: torch.Tensor | None  # [num_seqs, 1, max_q, key_len] bool
    kv_spans: tuple[tuple[int, int], ...] | None = None

    @property
    def is_causal(self) -> bool:
        """Plain (top-left) causal attention is exact: equal-length fresh prefills."""
        return self.attn_mask is None and self.max_q > 1


@dataclass(frozen=True)
class ForwardBatch:
    """Flat [T] token tensors plus the attention groups that pad them per sequence.

    Tokens of all sequences are concatenated (T in total) so embeddings, norms and MLPs
    run without padding; only attention pads, per group. The builder may reorder the
    sequences (to group similar lengths), so the token tensors are in group order, but
    ``logits_indices`` lists the returned tokens in the caller's sequence order and
    ``q_lens`` / ``kv_lens`` follow the caller's order too.

    A batch built ``paged`` (for the compiled CPU kernel, ``cpu_kernels.py``, which
    attends query token by query token over the paged cache, the whole batch in one
    call) has ``token_tables`` and ``token_kv_lens`` instead of groups: per token, its
    sequence's blocks and how many keys it sees (its position + 1, which is the causal
    mask). Otherwise it has groups, which SDPA attends.
    """

    input_ids: torch.Tensor  # [T] long
    positions: torch.Tensor  # [T] long: position of each token in its sequence
    slot_mapping: torch.Tensor  # [T] long: flat cache slot to write each token's K/V
    logits_indices: torch.Tensor  # [N] long: tokens whose logits are returned
    groups: tuple[AttentionGroup, ...]  # covering [0, T) in order; () when paged
    q_lens: tuple[int, ...]
    kv_lens: tuple[int, ...]
    token_tables: torch.Tensor | None = None  # [T, blocks] long
    token_kv_lens: torch.Tensor | None = None  # [T] long

    @property
    def batch_size(self) -> int:
        return len(self.q_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @classmethod
    def build(
        cls,
        seqs: Sequence[SeqInput],
        block_size: int,
        device: torch.device | str,
        paged: bool = False,
    ) -> ForwardBatch:
        """Validate the inputs and build every index tensor, on ``device``.

        ``paged``: for a model that attends through the paged CPU kernel (its loader
        chose ``cpu_kernels``): per-token tables instead of attention groups, which
        also spares the grouping search (a per-step cost of its own).
        """
        _validate(seqs, block_size)
        if paged and torch.device(device).type != "cpu":
            raise ValueError("the paged attention kernel runs on the CPU only")
        order, bounds = (list(range(len(seqs))), []) if paged else _group_order(seqs)
        caller_q_lens = tuple(len(s.token_ids) for s in seqs)
        caller_kv_lens = tuple(s.start_pos + q for s, q in zip(seqs, caller_q_lens, strict=True))
        seqs = [seqs[i] for i in order]
        q_lens = [caller_q_lens[i] for i in order]
        starts = [s.start_pos for s in seqs]
        kv_lens = [caller_kv_lens[i] for i in order]

        q_len_t = torch.tensor(q_lens)
        seq_of_token = torch.repeat_interleave(torch.arange(len(seqs)), q_len_t)
        first_token = torch.cumsum(q_len_t, 0) - q_len_t
        offset_in_seq = torch.arange(len(seq_of_token)) - first_token[seq_of_token]
        positions = torch.tensor(starts)[seq_of_token] + offset_in_seq
        tables = _padded_tables(seqs, kv_lens, block_size)
        slots = tables[seq_of_token, positions // block_size] * block_size + positions % block_size

        want_all = torch.tensor([s.all_logits for s in seqs])
        is_last = offset_in_seq == q_len_t[seq_of_token] - 1
        logits_indices = torch.nonzero(want_all[seq_of_token] | is_last).flatten()
        if order != sorted(order):  # back to the caller's sequence order (stable within one)
            caller_seq = torch.tensor(order)[seq_of_token[logits_indices]]
            logits_indices = logits_indices[torch.argsort(caller_seq, stable=True)]

        groups: tuple[AttentionGroup, ...] = ()
        if not paged:
            tables_in_order = [s.block_table for s in seqs]
            layout = _Layout(
                q_lens, starts, kv_lens, first_token.tolist(), block_size, tables_in_order
            )
            groups = tuple(
                _attention_group(layout, a, b, tables, seq_of_token, offset_in_seq, device)
                for a, b in bounds
            )
        ids = array("q")
        for s in seqs:
            ids.extend(s.token_ids)
        return cls(
            input_ids=_long_tensor(ids).to(device),
            positions=positions.to(device),
            slot_mapping=slots.to(device),
            logits_indices=logits_indices.to(device),
            groups=groups,
            q_lens=caller_q_lens,
            kv_lens=caller_kv_lens,
            token_tables=tables[seq_of_token] if paged else None,
            token_kv_lens=positions + 1 if paged else None,
        )


@dataclass(frozen=True)
class _Layout:
    """Per-sequence lengths in batch order, shared by the group builders."""

    q_lens: list[int]
    starts: list[int]
    kv_lens: list[int]
    first_token: list[int]
    block_size: int
    block_tables: list[Sequence[int]]


def _group_order(seqs: Sequence[SeqInput]) -> tuple[list[int], list[tuple[int, int]]]:
    """A sequence order and its cut into attention groups ``[a, b)`` of that order.

    A group costs ``num_seqs * key_len * (max_q + 1)`` (padded query-key pairs plus
    gathering the keys) and ``GROUP_OVERHEAD`` per call; over the order sorted by
    length the cheapest cut is found exactly by dynamic programming. When one
    group is cheapest the caller's order is kept.
    """
    b = len(seqs)
    caller_kv = [s.start_pos + len(s.token_ids) for s in seqs]
    order = sorted(range(b), key=caller_kv.__getitem__)  # stable: ties keep the caller's order
    q = [len(seqs[i].token_ids) for i in order]
    kv = [caller_kv[i] for i in order]  # ascending
    fresh = [seqs[i].start_pos == 0 for i in order]
    best, cut = [0] + [float("inf")] * b, [0] * (b + 1)
    for j in range(1, b + 1):
        max_q, all_fresh, best_j, cut_j = 0, True, best[j], 0
        for i in range(j - 1, -1, -1):  # the group order[i:j]
            max_q = q[i] if q[i] > max_q else max_q
            all_fresh = all_fresh and fresh[i]
            group = (j - i) * (max_q if all_fresh else kv[j - 1]) * (max_q + 1) + GROUP_OVERHEAD
            if group >= best_j:
                break  # wider groups only cost more, and best[i] >= 0
            if best[i] + group < best_j:
                best_j, cut_j = best[i] + group, i
        best[j], cut[j] = best_j, cut_j
    bounds, j = [], b
    while j > 0:
        bounds.append((cut[j], j))
        j = cut[j]
    if len(bounds) == 1:
        return list(range(b)), [(0, b)]
    return order, bounds[::-1]


def _attention_group(
    layout: _Layout,
    a: int,
    b: int,
    tables: torch.Tensor,
    seq_of_token: torch.Tensor,
    offset_in_seq: torch.Tensor,
    device: torch.device | str,
) -> AttentionGroup:
    """The group of batch sequences [a, b), its index tensors on ``device``."""
    q_lens, starts, kv_lens = layout.q_lens[a:b], layout.starts[a:b], layout.kv_lens[a:b]
    max_q, cached = max(q_lens), any(starts)
    key_len = max(kv_lens) if cached else max_q
    start = layout.first_token[a]
    end = start + sum(q_lens)
    query_index = None
    if end - start != (b - a) * max_q:
        query_index = (seq_of_token[start:end] - a) * max_q + offset_in_seq[start:end]
    on_cpu = torch.device(device).type == "cpu"
    spans = _kv_spans(layout, a, b) if max_q == 1 and cached and on_cpu else None
    all_visible = max_q == 1 and min(kv_lens) == key_len
    plain_causal = not cached and query_index is None
    mask = None
    if not (all_visible or plain_causal or spans):
        mask = _attention_mask(torch.tensor(starts), torch.tensor(kv_lens), max_q, key_len)
    block_tables = None
    if cached and not spans:
        block_tables = tables[a:b, : -(-key_len // layout.block_size)]
    return AttentionGroup(
        start=start,
        end=end,
        num_seqs=b - a,
        max_q=max_q,
        key_len=key_len,
        query_index=None if query_index is None else query_index.to(device),
        block_tables=None if block_tables is None else block_tables.to(device),
        attn_mask=None if mask is None else mask.to(device),
        kv_spans=spans,
    )


def _kv_spans(layout: _Layout, a: int, b: int) -> tuple[tuple[int, int], ...] | None:
    """(first slot, key count) per sequence of [a, b) when attending over views pays.

    That needs every sequence's used blocks to be one run of consecutive ids (the pool
    places them so) and keys long enough to outweigh a call per sequence.
    """
    kv_lens, bs = layout.kv_lens[a:b], layout.block_size
    if sum(kv_lens) < SPAN_MIN_KEYS * (b - a):
        return None
    spans = []
    for table, n in zip(layout.block_tables[a:b], kv_lens, strict=True):
        if not _is_run(table, -(-n // bs)):
            return None
        spans.append((table[0] * bs, n))
    return tuple(spans)


def _is_run(table: Sequence[int], used: int) -> bool:
    """The first ``used`` blocks are consecutive ids (the last one checked first: cheap)."""
    first = table[0]
    return table[used - 1] == first + used - 1 and list(table[:used]) == [
        *range(first, first + used)
    ]


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
    flat = array("q")
    for s, u in zip(seqs, used, strict=True):
        flat.extend(s.block_table[:u])
        flat.extend([0] * (width - u))
    return _long_tensor(flat).view(len(seqs), width)


def _long_tensor(values: array) -> torch.Tensor:
    """A CPU long tensor over ``values``' memory (non-empty): ~3x faster than from a list."""
    return torch.frombuffer(values, dtype=torch.long)


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
