"""Extend (q_len=k after start_pos=n) equals one prefill of n+k: the recompute kernel.

When the main decoder takes over from the relay it recomputes the relayed tokens'
K/V in one pass over its cached prefix. That pass must leave the same K/V in the
cache and produce the same logits as if it had prefilled everything itself.
"""

from __future__ import annotations

import random

import pytest
import torch

from pdd.worker.model import LoadedModel, load_model
from pdd.worker.model import batch as batch_module
from pdd.worker.model.batch import ForwardBatch, SeqInput
from pdd.worker.model.kv_cache import PagedKVCache

pytestmark = pytest.mark.unit

BLOCK_SIZE = 5  # divides none of the lengths below
NUM_BLOCKS = 48


@pytest.fixture(params=["tiny", "qwen2", "qwen3"])
def loaded(request, hf_checkpoint) -> LoadedModel:
    """The tiny preset, Qwen2 (q/k/v bias) and Qwen3 (q/k norm), all fp32."""
    if request.param == "tiny":
        return load_model("tiny")
    return load_model(str(hf_checkpoint(request.param)), dtype="float32")


class Blocks:
    """Hands out block ids in a shuffled order so tables are never the identity."""

    def __init__(self, seed: int) -> None:
        self.free = list(range(NUM_BLOCKS))
        random.Random(seed).shuffle(self.free)

    def take(self, num_tokens: int) -> list[int]:
        n = -(-num_tokens // BLOCK_SIZE)
        taken, self.free = self.free[:n], self.free[n:]
        return taken


def run(loaded: LoadedModel, kv: PagedKVCache, seqs: list[SeqInput]) -> list[torch.Tensor]:
    """Forward one batch; logits split per sequence."""
    logits = loaded.model(ForwardBatch.build(seqs, BLOCK_SIZE, "cpu"), kv)
    counts = [len(s.token_ids) if s.all_logits else 1 for s in seqs]
    return list(logits.split(counts))


def prompts(vocab: int, lens: list[int], seed: int = 3) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lens]


@pytest.mark.parametrize(("prefix_lens", "extend_lens"), [([7, 13, 22], [3, 9, 1])])
def test_extend_matches_single_prefill(loaded, prefix_lens, extend_lens) -> None:
    full = prompts(
        loaded.config.vocab_size, [n + k for n, k in zip(prefix_lens, extend_lens, strict=True)]
    )
    kv_a, kv_b = (PagedKVCache(loaded.kv_layout(BLOCK_SIZE), NUM_BLOCKS, "cpu") for _ in "ab")
    blocks_a, blocks_b = Blocks(seed=1), Blocks(seed=2)
    tables_a = [blocks_a.take(len(p)) for p in full]
    tables_b = [blocks_b.take(len(p)) for p in full]

    prefill = [SeqInput(p[:n], 0, t) for p, n, t in zip(full, prefix_lens, tables_a, strict=True)]
    run(loaded, kv_a, prefill)
    extend = [
        SeqInput(p[n:], n, t, all_logits=True)
        for p, n, t in zip(full, prefix_lens, tables_a, strict=True)
    ]
    extended = run(loaded, kv_a, extend)
    whole = run(
        loaded,
        kv_b,
        [SeqInput(p, 0, t, all_logits=True) for p, t in zip(full, tables_b, strict=True)],
    )

    for p, k, ta, tb, ext, ref in zip(
        full, extend_lens, tables_a, tables_b, extended, whole, strict=True
    ):
        torch.testing.assert_close(ext, ref[-k:], atol=1e-4, rtol=0)
        kv_ext, kv_ref = kv_a.read_tokens(ta, 0, len(p)), kv_b.read_tokens(tb, 0, len(p))
        torch.testing.assert_close(kv_ext, kv_ref, atol=1e-5, rtol=0)


def test_chunked_prefill_matches_single_prefill(loaded) -> None:
    """Prefill in uneven chunks (each an extend of the previous) ends where one pass does."""
    (prompt,) = prompts(loaded.config.vocab_size, [31])
    kv_a, kv_b = (PagedKVCache(loaded.kv_layout(BLOCK_SIZE), NUM_BLOCKS, "cpu") for _ in "ab")
    ta, tb = Blocks(seed=4).take(31), Blocks(seed=5).take(31)
    chunks = [(0, 4), (4, 16), (16, 17), (17, 31)]
    pieces = [
        run(loaded, kv_a, [SeqInput(prompt[a:b], a, ta, all_logits=True)])[0] for a, b in chunks
    ]
    whole = run(loaded, kv_b, [SeqInput(prompt, 0, tb, all_logits=True)])[0]

    torch.testing.assert_close(torch.cat(pieces), whole, atol=1e-4, rtol=0)
    torch.testing.assert_close(kv_a.read_tokens(ta, 0, 31), kv_b.read_tokens(tb, 0, 31))


@pytest.mark.parametrize("group_overhead", [None, 0], ids=["default-groups", "group-each"])
def test_mixed_batch_matches_each_sequence_alone(loaded, group_overhead, monkeypatch) -> None:
    """A fresh prefill, an extend and a decode in one step give what each gives alone,
    whether they share one attention call or each has its own."""
    if group_overhead is not None:
        monkeypatch.setattr(batch_module, "GROUP_OVERHEAD", group_overhead)
    full = prompts(loaded.config.vocab_size, [12, 19, 26])
    kv_a, kv_b = (PagedKVCache(loaded.kv_layout(BLOCK_SIZE), NUM_BLOCKS, "cpu") for _ in "ab")
    blocks_a, blocks_b = Blocks(seed=6), Blocks(seed=7)
    tables = [(blocks_a.take(len(p)), blocks_b.take(len(p))) for p in full]
    cached = [0, 11, 25]  # prefill, extend of 8, decode
    for kv, side in ((kv_a, 0), (kv_b, 1)):
        warm = [
            SeqInput(p[:c], 0, t[side]) for p, c, t in zip(full, cached, tables, strict=True) if c
        ]
        run(loaded, kv, warm)
    step = [
        SeqInput(p[c:], c, t[0], all_logits=True)
        for p, c, t in zip(full, cached, tables, strict=True)
    ]

    mixed = run(loaded, kv_a, step)
    alone = [
        run(loaded, kv_b, [SeqInput(p[c:], c, t[1], all_logits=True)])[0]
        for p, c, t in zip(full, cached, tables, strict=True)
    ]

    for m, a in zip(mixed, alone, strict=True):
        torch.testing.assert_close(m, a, atol=1e-4, rtol=0)
