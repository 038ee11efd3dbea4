"""Batched decode across sequences of different context lengths equals one-by-one."""

from __future__ import annotations

import pytest
import torch

from pdd.worker.model import LoadedModel, load_model
from pdd.worker.model import batch as batch_module
from pdd.worker.model.batch import ForwardBatch, SeqInput
from pdd.worker.model.kv_cache import PagedKVCache

pytestmark = pytest.mark.unit

BLOCK_SIZE = 4
CONTEXT_LENS = (3, 10, 17, 1)
STEPS = 4


@pytest.fixture(params=["tiny", "llama"])
def loaded(request, hf_checkpoint) -> LoadedModel:
    if request.param == "tiny":
        return load_model("tiny")
    return load_model(str(hf_checkpoint("llama")), dtype="float32")


def decode_greedy(loaded: LoadedModel, batched: bool) -> list[list[torch.Tensor]]:
    """Prefill every prompt, then STEPS greedy decode steps; logits per sequence per step."""
    gen = torch.Generator().manual_seed(0)
    vocab = loaded.config.vocab_size
    seqs = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in CONTEXT_LENS]
    blocks_each = -(-(max(CONTEXT_LENS) + STEPS) // BLOCK_SIZE)
    tables = [list(range(i * blocks_each, (i + 1) * blocks_each)) for i in range(len(seqs))]
    kv = PagedKVCache(loaded.kv_layout(BLOCK_SIZE), blocks_each * len(seqs), "cpu")
    forward = loaded.model
    forward(
        ForwardBatch.build(
            [SeqInput(s, 0, t) for s, t in zip(seqs, tables, strict=True)], BLOCK_SIZE, "cpu"
        ),
        kv,
    )
    history: list[list[torch.Tensor]] = [[] for _ in seqs]
    next_ids = [(s[-1] + 1) % vocab for s in seqs]  # any first token; then greedy
    for _ in range(STEPS):
        step = [SeqInput([t], len(s), tb) for t, s, tb in zip(next_ids, seqs, tables, strict=True)]
        if batched:
            logits = list(forward(ForwardBatch.build(step, BLOCK_SIZE, "cpu"), kv))
        else:
            logits = [forward(ForwardBatch.build([x], BLOCK_SIZE, "cpu"), kv)[0] for x in step]
        for i, lg in enumerate(logits):
            history[i].append(lg)
            seqs[i].append(next_ids[i])
        next_ids = [int(lg.argmax()) for lg in logits]
    return history


@pytest.mark.parametrize("group_overhead", [None, 0], ids=["default-groups", "group-each"])
def test_batched_decode_matches_one_by_one(loaded, group_overhead, monkeypatch) -> None:
    """Also with every sequence its own attention group, reordered by length."""
    if group_overhead is not None:
        monkeypatch.setattr(batch_module, "GROUP_OVERHEAD", group_overhead)
    batched, single = decode_greedy(loaded, batched=True), decode_greedy(loaded, batched=False)
    for seq_b, seq_s in zip(batched, single, strict=True):
        torch.testing.assert_close(torch.stack(seq_b), torch.stack(seq_s), atol=1e-4, rtol=0)


def test_decode_over_cache_views_matches_gathered_decode(loaded, monkeypatch) -> None:
    """The copy-free path (consecutive blocks, long keys) against gathering the same KV."""
    monkeypatch.setattr(batch_module, "SPAN_MIN_KEYS", 0)
    views = decode_greedy(loaded, batched=True)
    monkeypatch.setattr(batch_module, "SPAN_MIN_KEYS", 10**9)
    gathered = decode_greedy(loaded, batched=True)
    for seq_v, seq_g in zip(views, gathered, strict=True):
        torch.testing.assert_close(torch.stack(seq_v), torch.stack(seq_g), atol=1e-4, rtol=0)
