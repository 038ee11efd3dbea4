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


def test_md_streaming_means_the_whole_prompt_landed_whatever_it_held_before() -> None:
    index = index_claiming(md_blocks=2)
    hits = MeasuredHits(index, plan(), main_caches=True)
    hits.observe(event(0, "md", cached_tokens=0, md_hit_tokens=8))  # its handshake hit
    assert index.match(index.hashes(PROMPT)) == {"md": 28}  # every full block is cached now


def test_md_streaming_over_a_lossy_codec_confirms_nothing() -> None:
    """KV that crossed through a lossy codec stays the request's own on MD (it is not
    cached there), so the index must not count it as a hit for the next turn."""
    index = index_claiming(md_blocks=2)
    hits = MeasuredHits(index, plan(), main_caches=False)
    hits.observe(event(0, "md", cached_tokens=0, md_hit_tokens=8))
    assert index.match(index.hashes(PROMPT)) == {"md": 8}  # only what MD held before


def test_md_streaming_fills_in_what_the_index_missed() -> None:
    index = index_claiming(md_blocks=0)  # the store events were lost
    hits = MeasuredHits(index, plan("P-RLD-MD"), main_caches=True)
    hits.observe(event(0, "rld", cached_tokens=12))
    assert index.match(index.hashes(PROMPT)) == {}
    hits.observe(event(5, "md", md_hit_tokens=12))
    assert index.match(index.hashes(PROMPT)) == {"md": 28}


@pytest.mark.parametrize("pipeline", ["P-MD", "P-RLD-MD"])
def test_an_answered_request_counts_prompt_and_answer_as_md_s(pipeline: str) -> None:
    """The next turn (prompt + answer + a new message) is predicted to hit all of the
    conversation on MD before MD's cache events could say so; the last output token has
    no KV there."""
    index = index_claiming(md_blocks=0)
    hits = MeasuredHits(index, plan(pipeline), main_caches=True)
    answer = [100 + i for i in range(11)]
    hits.answered(answer)
    next_turn = PROMPT + answer + [7, 7, 7]
    assert index.match(index.hashes(next_turn)) == {"md": 40}  # 30 + 10 tokens, full blocks


def test_an_answer_on_a_route_that_bypasses_md_s_cache_is_not_counted() -> None:
    index = index_claiming(md_blocks=0)
    hits = MeasuredHits(index, plan("naive"), main_caches=False)
    hits.answered([100 + i for i in range(11)])
    assert index.match(index.hashes(PROMPT)) == {}


def test_cached_tokens_is_what_the_seq0_event_reports() -> None:
    index = index_claiming(md_blocks=3)
    hits = MeasuredHits(index, plan())
    assert hits.cached_tokens == 0
    hits.observe(event(0, "md", cached_tokens=24))
    hits.observe(event(1, "md"))
    assert hits.cached_tokens == 24
    assert index.match(index.hashes(PROMPT)) == {"md": 12}  # no md_hit_tokens: unchanged
