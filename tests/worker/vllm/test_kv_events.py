"""vLLM's KV events renamed into the router's hash chain (``pdd.worker.vllm.kv_events``), on
synthetic events: what the router's ``PrefixIndex`` predicts from them is what vLLM holds.
No vLLM needed."""

from __future__ import annotations

import logging

import pytest

from pdd.common.block_hash import block_hashes
from pdd.common.cache_events import AllCleared, BlockRemoved, BlockStored, CacheEvent
from pdd.router.prefix_index import PrefixIndex, PrefixIndexConfig, reusable
from pdd.worker.vllm.kv_events import RouterChains

pytestmark = pytest.mark.unit

TOKENS = list(range(1000, 1000 + 512))


def index_of(events: list[CacheEvent], block_size: int = 16) -> PrefixIndex:
    index = PrefixIndex(PrefixIndexConfig(block_size=block_size))
    index.apply_all("vm", events)
    return index


def hit(index: PrefixIndex, tokens: list[int]) -> int:
    return index.match(index.hashes(tokens)).get("vm", 0)


def test_a_vllm_block_of_128_is_8_router_blocks_of_16_from_the_root() -> None:
    events = RouterChains(16).stored([b"v0"], None, TOKENS[:128], 128)
    assert events == [
        BlockStored(block_hashes=block_hashes(TOKENS[:128], 16), parent_hash=None, block_size=16)
    ]
    assert hit(index_of(events), [*TOKENS[:128], 7, 7, 7]) == 128


def test_a_child_stored_later_continues_its_parents_chain() -> None:
    chains = RouterChains(16)
    events = chains.stored([b"v0"], None, TOKENS[:128], 128)
    events += chains.stored([b"v1", b"v2"], b"v0", TOKENS[128:384], 128)
    expected = block_hashes(TOKENS[:384], 16)
    assert events[1].block_hashes == expected[8:]
    assert events[1].parent_hash == expected[7]
    assert hit(index_of(events), TOKENS[:400]) == 384


def test_removing_a_vllm_block_removes_its_router_blocks_only() -> None:
    chains = RouterChains(16)
    events = chains.stored([b"v0", b"v1"], None, TOKENS[:256], 128)
    removed = chains.removed([b"v1", b"never-stored"])
    assert removed == [BlockRemoved(block_hashes=block_hashes(TOKENS[:256], 16)[8:])]
    assert hit(index_of(events + removed), TOKENS[:300]) == 128
    assert chains.removed([b"v1"]) == []


def test_all_blocks_cleared_clears_the_instance_and_forgets_the_chains() -> None:
    chains = RouterChains(16)
    events = chains.stored([b"v0"], None, TOKENS[:128], 128) + chains.cleared()
    assert events[-1] == AllCleared()
    assert hit(index_of(events), TOKENS[:200]) == 0
    assert chains.stored([b"v1"], b"v0", TOKENS[128:256], 128) == []
    assert chains.removed([b"v0"]) == []


def test_an_unknown_parent_is_dropped_and_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    chains = RouterChains(16)
    with caplog.at_level(logging.WARNING, logger="pdd.worker.vllm.kv_events"):
        assert chains.stored([b"v1"], b"unseen", TOKENS[128:256], 128) == []
        assert chains.stored([b"v2"], b"v1", TOKENS[256:384], 128) == []
    assert chains.num_unknown_parents == 2
    assert len(caplog.records) == 1
    assert "never saw stored" in caplog.records[0].getMessage()


def test_router_blocks_straddling_vllm_blocks_belong_to_the_block_they_end_in() -> None:
    """Router blocks of 24 over vLLM blocks of 32: only whole router blocks are named, the
    hit rounds down to them, and a straddling block leaves with the block it ends in."""
    chains = RouterChains(24)
    first = chains.stored([b"v0"], None, TOKENS[:32], 32)
    second = chains.stored([b"v1", b"v2"], b"v0", TOKENS[32:96], 32)
    expected = block_hashes(TOKENS[:96], 24)
    assert [e.block_hashes for e in first + second] == [expected[:1], expected[1:]]
    assert hit(index_of(first + second, 24), TOKENS[:100]) == 96
    assert hit(index_of(first, 24), TOKENS[:100]) == 24  # vLLM holds 32: 24 predicted
    removed = chains.removed([b"v1"])  # tokens 32..63 end router block 1 (24..47)
    assert removed == [BlockRemoved(block_hashes=expected[1:2])]
    assert hit(index_of(first + second + removed, 24), TOKENS[:100]) == 24


@pytest.mark.parametrize("router_block", [16, 24])
def test_the_routers_hit_rounded_to_vllms_blocks_is_never_more_than_vllm_reuses(
    router_block: int,
) -> None:
    """vLLM cached 96 tokens in blocks of 32; a prompt sharing ``d`` of them reuses ``d``
    rounded down to vLLM's blocks. The index's hit in router blocks overshoots that where
    the prompt leaves vLLM's block inside a router block vLLM named (d = 48 with blocks of
    16); rounded to vLLM's block (``reusable``, what the router predicts per worker) it is
    exact where the router's block divides vLLM's, and short by at most one vLLM block
    where it does not (24: sharing 32..47 tokens, no whole router block ends in vLLM's
    second block), never over."""
    vllm_block = 32
    index = index_of(
        RouterChains(router_block).stored([b"v0", b"v1", b"v2"], None, TOKENS[:96], vllm_block),
        router_block,
    )
    over = []
    for shared in range(97):
        prompt = [*TOKENS[:shared], *range(7, 7 + 40)]  # leaves the cached tokens at ``shared``
        vllm_reuses = shared // vllm_block * vllm_block
        raw = hit(index, prompt)
        predicted = reusable({"vm": raw}, lambda _: vllm_block).get("vm", 0)
        over += [shared] if raw > vllm_reuses else []
        assert vllm_reuses - vllm_block <= predicted <= vllm_reuses
        if vllm_block % router_block == 0:
            assert predicted == vllm_reuses
    assert over  # the router's blocks alone over-predicted some of them


def test_a_router_block_named_by_two_vllm_blocks_leaves_with_the_last() -> None:
    """vLLM replaces a partial block by the full one (or stores a prefix twice): the
    router's block stays while either names it; a re-stored block is owned once."""
    chains = RouterChains(16)
    chains.stored([b"partial"], None, TOKENS[:16], 16)
    chains.stored([b"full"], None, TOKENS[:32], 32)
    chains.stored([b"full"], None, TOKENS[:32], 32)
    assert chains.removed([b"partial"]) == []
    assert chains.removed([b"full"]) == [BlockRemoved(block_hashes=block_hashes(TOKENS[:32], 16))]


def test_a_block_shorter_than_a_router_block_names_nothing_until_a_child_completes_it() -> None:
    chains = RouterChains(16)
    assert chains.stored([b"v0"], None, TOKENS[:8], 8) == []
    events = chains.stored([b"v1"], b"v0", TOKENS[8:16], 8)
    assert events == [
        BlockStored(block_hashes=block_hashes(TOKENS[:16], 16), parent_hash=None, block_size=16)
    ]


def test_tokens_that_do_not_fill_the_blocks_are_refused() -> None:
    with pytest.raises(ValueError, match="2 blocks of 128 tokens, 200 token IDs"):
        RouterChains(16).stored([b"a", b"b"], None, TOKENS[:200], 128)
