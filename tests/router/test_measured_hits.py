"""The hits the workers measured, read off token events, correct the router's estimates."""

import pytest

from pdd.common.block_hash import block_hashes
from pdd.common.cache_events import BlockStored
from pdd.common.wire import Endpoint, PipelinePlan, TokenEvent
from pdd.router.generation import MeasuredHits
from pdd.router.prefix_index import PrefixIndex, PrefixIndexConfig

pytestmark = pytest.mark.unit

BS = 4
PROMPT = list(range(30))  # 7 full blocks


def endpoint(name: str) -> Endpoint:
    return Endpoint(instance_id=name, http_url=f"http://{name}", fast_addr="h:1", wan_addr="h:2")


def plan(pipeline: str = "P-MD") -> PipelinePlan:
    return PipelinePlan(
        request_id="r", prompt_ids=PROMPT, pipeline=pipeline,
        prefill=endpoint("p"), relay=endpoint("rld"), main=endpoint("md"),
    )  # fmt: skip


def event(seq: int, source: str, **hits: int) -> TokenEvent:
    return TokenEvent(request_id="r", seq=seq, token_id=7, source=source, **hits)


def index_claiming(md_blocks: int) -> PrefixIndex:
    index = PrefixIndex(PrefixIndexConfig(block_size=BS))
    hashes = block_hashes(PROMPT, BS)[:md_blocks]
    if hashes:
        index.apply("md", BlockStored(block_hashes=hashes, parent_hash=None, block_size=BS))
    return index


def test_md_handshake_truth_replaces_a_stale_overestimate() -> None:
    index = index_claiming(md_blocks=7)  # MD evicted most of it since; no event said so
    hits = MeasuredHits(index, plan())
    hits.observe(event(0, "md", cached_tokens=0, md_hit_tokens=8))
    assert index.match(index.hashes(PROMPT)) == {"md": 8}


def test_md_handshake_truth_fills_in_what_the_index_missed() -> None:
    index = index_claiming(md_blocks=0)  # the store events were lost
    hits = MeasuredHits(index, plan("P-RLD-MD"))
    hits.observe(event(0, "rld", cached_tokens=12))
    assert index.match(index.hashes(PROMPT)) == {}
    hits.observe(event(5, "md", md_hit_tokens=28))
    assert index.match(index.hashes(PROMPT)) == {"md": 28}


def test_cached_tokens_is_what_the_seq0_event_reports() -> None:
    index = index_claiming(md_blocks=3)
    hits = MeasuredHits(index, plan())
    assert hits.cached_tokens == 0
    hits.observe(event(0, "md", cached_tokens=24))
    hits.observe(event(1, "md"))
    assert hits.cached_tokens == 24
    assert index.match(index.hashes(PROMPT)) == {"md": 12}  # no md_hit_tokens: unchanged
