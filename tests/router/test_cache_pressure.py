"""More live conversations than MD's KV holds: MD evicts and keeps serving, and no request
fails for lack of blocks, one at a time or all at once (then the requests whose blocks
are not free wait on MD for running ones to finish, as in vLLM's waiting queue, instead
of being refused with a 429)."""

import asyncio

import httpx
import pytest

from pdd.local.cluster import LinkSpec, LocalCluster, WorkerSpec

pytestmark = pytest.mark.integration

#: MD holds 48 blocks of 16 tokens (768 tokens); each of ten conversations reaches about
#: 400 tokens in three turns (one request fits with room to spare), all of them together
#: about 4,000: what MD caches is evicted again and again, turn after turn. One request at
#: a time, then all ten at once: two of them fill MD's blocks.
MD_BLOCKS = 48
CONVERSATIONS, TURNS, CONCURRENT = 10, 3, 1


@pytest.fixture(scope="module")
def small_md(tmp_path_factory):
    specs = [
        WorkerSpec("p", "prefill"),
        WorkerSpec("md", "main", wan_facing=True, args=("--num-blocks", str(MD_BLOCKS))),
    ]
    common = ["--model", "tiny", "--torch-threads", "1"]
    c = LocalCluster.start(
        specs, tmp_path_factory.mktemp("pressure"), LinkSpec(gbps=10.0), common_args=common
    )
    yield c
    c.stop()


async def _conversation(url: str, n: int, gate: asyncio.Semaphore) -> tuple[list[int], int]:
    """Three turns, each the whole conversation so far plus a new user line; the statuses
    and the last turn's prompt tokens."""
    statuses, history, prompt_tokens = [], f"conversation {n}: ", 0
    async with httpx.AsyncClient(timeout=300) as http:
        for turn in range(TURNS):
            history += f"turn {turn} of conversation {n}, the quick brown fox. " * 2
            async with gate:
                body = {"model": "tiny", "prompt": history, "max_tokens": 24, "ignore_eos": True}
                reply = await http.post(f"{url}/v1/completions", json=body)
            statuses.append(reply.status_code)
            if reply.status_code == 200:
                history += reply.json()["choices"][0]["text"]
                prompt_tokens = reply.json()["usage"]["prompt_tokens"]
    return statuses, prompt_tokens


def _kv_block_waits(md_url: str) -> float:
    text = httpx.get(f"{md_url}/metrics").text
    line = next(x for x in text.splitlines() if x.startswith("pdd_worker_kv_block_waits_total "))
    return float(line.split()[1])


@pytest.mark.parametrize(
    "concurrent", [CONCURRENT, CONVERSATIONS], ids=["one-by-one", "all-at-once"]
)
def test_more_conversations_than_md_holds_all_get_served(small_md, start_router, concurrent):
    router = start_router(
        "--prefill", f"p={small_md['p'].url}", "--main", f"md={small_md['md'].url}"
    )
    waits_before = _kv_block_waits(small_md["md"].url)

    async def run() -> list[tuple[list[int], int]]:
        gate = asyncio.Semaphore(concurrent)
        return await asyncio.gather(
            *(_conversation(router.url, n, gate) for n in range(CONVERSATIONS))
        )

    results = asyncio.run(run())
    assert all(s == 200 for turns, _ in results for s in turns), results
    # Each conversation fits MD on its own; all of them together are several times more.
    longest = max(tokens for _, tokens in results)
    assert longest < MD_BLOCKS * 16 < 4 * MD_BLOCKS * 16 < sum(t for _, t in results)
    states = small_md.wait_quiescent(timeout_s=180)
    assert all(s.quiescent for s in states.values()), states
    md = states["md"]
    assert md.kv_blocks_total == MD_BLOCKS
    if concurrent > 1:  # requests did find MD's blocks taken, and waited for them
        assert _kv_block_waits(small_md["md"].url) > waits_before
