"""One step's forward pass: the scheduled sequences as batches the model runs, their
last-token logits back in the order the scheduler gave.

Through the paged CPU kernel the whole step is one batch (no padding: each query token
attends over its own sequence), so the weights are read once a step. Through SDPA,
decodes and multi-token passes (prefill chunks, extends) run as two batches: attention
pads every query to the longest in its batch, so one 512-token chunk beside 31 decodes
would otherwise cost 32 x 512 queries.
"""

from __future__ import annotations

import torch

from pdd.worker.engine.scheduler import ScheduledSeq
from pdd.worker.model.batch import ForwardBatch, SeqInput
from pdd.worker.model.kv_cache import PagedKVCache
from pdd.worker.model.llama import LlamaForCausalLM


def last_token_logits(
    model: LlamaForCausalLM, kv: PagedKVCache, scheduled: list[ScheduledSeq], block_size: int
) -> torch.Tensor:
    """Last-token logits ``[len(scheduled), vocab]``, in ``scheduled`` order."""
    decodes = [i for i, s in enumerate(scheduled) if s.num_tokens == 1]
    others = [i for i, s in enumerate(scheduled) if s.num_tokens > 1]
    if not decodes or not others or _paged(model):
        return _run(model, kv, [_seq_input(s) for s in scheduled], block_size)
    short = _run(model, kv, [_seq_input(scheduled[i]) for i in decodes], block_size)
    long = _run(model, kv, [_seq_input(scheduled[i]) for i in others], block_size)
    logits = short.new_empty((len(scheduled), short.shape[1]))
    logits[decodes] = short
    logits[others] = long
    return logits


def _run(
    model: LlamaForCausalLM, kv: PagedKVCache, seqs: list[SeqInput], block_size: int
) -> torch.Tensor:
    return model(ForwardBatch.build(seqs, block_size, kv.device, paged=_paged(model)), kv)


def _paged(model: LlamaForCausalLM) -> bool:
    """Whether this step's batches are built for the paged CPU attention kernel."""
    kernels = model.kernels
    return kernels is not None and kernels.paged_attention is not None


def _seq_input(s: ScheduledSeq) -> SeqInput:
    start = s.request.num_computed
    return SeqInput(
        token_ids=s.request.token_range(start, start + s.num_tokens),
        start_pos=start,
        block_table=s.request.block_table,
    )
