"""A request whose worker fails before the first token is routed around by the router.

Two cases: a dead prefill worker (refuses the plan) and a dead main-decode worker (its
stream breaks before any token).

A second prefill worker, ``a-victim``, sorts first, so with equal load and no prefix
hit the router picks it. The router polls once at start and then not for an hour, so
it cannot learn of the death from its registry: only the request path can. The victim
is SIGKILLed; the next request must still succeed, on ``p``, with the same tokens as
a request that never met the victim, and the router must count one re-dispatch, leave
the victim out at once (the next request goes straight to ``p``) and say so in its log.
"""

from __future__ import annotations

import httpx
import pytest

from pdd.local.cluster import LinkSpec, LocalCluster, WorkerSpec
from pdd.router.affinity_ring import AffinityRing
from pdd.router.policy import RequestFeatures

pytestmark = pytest.mark.integration

VICTIM = "a-victim"
PROMPT = [(i * 37 + 11) % 241 + 3 for i in range(70)]  # no other test's prefix
COMMON = ["--model", "tiny", "--num-blocks", "512", "--torch-threads", "1"]


@pytest.fixture
def victim(tmp_path):
    c = LocalCluster.start(
        [WorkerSpec(VICTIM, "prefill")], tmp_path, LinkSpec(gbps=10.0), common_args=COMMON
    )
    yield c[VICTIM]
    c.stop()


@pytest.fixture
def md_victim(tmp_path):
    spec = WorkerSpec(VICTIM, "main", wan_facing=True)
    c = LocalCluster.start([spec], tmp_path, LinkSpec(gbps=10.0), common_args=COMMON)
    yield c[VICTIM]
    c.stop()


def metrics(url: str) -> str:
    return httpx.get(f"{url}/metrics", timeout=10).text


def recoveries(url: str) -> float:
    text = metrics(url)
    lines = [ln for ln in text.splitlines() if ln.startswith("pdd_router_recoveries_total{")]
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in lines if 'kind="redispatch"' in ln)


def complete(url: str, prompt: list[int] = PROMPT) -> httpx.Response:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=120)


def test_a_dead_prefill_is_routed_around_before_the_first_token(
    victim, worker_flags, start_router
) -> None:
    flags = [*worker_flags(), "--prefill", f"{VICTIM}={victim.url}", "--poll-interval-s", "3600"]
    router = start_router(*flags)
    # Its one poll (at start) saw both prefill workers; it will not poll again.
    assert 'pdd_router_instances_ready{role="prefill"} 2.0' in metrics(router.url)
    victim.proc.kill()
    victim.proc.wait()

    first = complete(router.url)
    assert first.status_code == 200, first.text
    assert recoveries(router.url) == 1
    assert f"re-dispatching without {VICTIM}" in router.log.read_text()

    again = complete(router.url)  # the victim is left out already: no second recovery
    assert again.status_code == 200, again.text
    assert again.json()["choices"][0]["text"] == first.json()["choices"][0]["text"]
    assert recoveries(router.url) == 1


def prompt_whose_conversation_lands_on(
    instance: str, others: tuple[str, ...], stride: int
) -> list[int]:
    """A prompt that the affinity ring gives to ``instance`` while no MD holds any of it:
    each test passes its own ``stride``, so no earlier test left it in an MD's cache (a
    holder would win on its hit instead)."""
    for seed in range(1000):
        prompt = [(i * stride + seed) % 239 + 5 for i in range(70)]
        key = RequestFeatures.from_prompt(prompt, 12, block_size=16).affinity_key
        if next(AffinityRing((instance, *others)).preference(key)) == instance:
            return prompt
    raise AssertionError("no prompt lands on the victim")


def test_a_dead_main_decode_is_routed_around_before_the_first_token(
    md_victim, worker_flags, start_router
) -> None:
    flags = [*worker_flags(), "--main", f"{VICTIM}={md_victim.url}", "--poll-interval-s", "3600"]
    router = start_router(*flags)
    assert 'pdd_router_instances_ready{role="main"} 3.0' in metrics(router.url)
    prompt = prompt_whose_conversation_lands_on(VICTIM, ("md1", "md2"), stride=53)
    md_victim.proc.kill()
    md_victim.proc.wait()

    answer = complete(router.url, prompt)
    assert answer.status_code == 200, answer.text
    assert recoveries(router.url) == 1
    assert f"re-dispatching without {VICTIM}" in router.log.read_text()
    again = complete(router.url, prompt)
    assert again.json()["choices"][0]["text"] == answer.json()["choices"][0]["text"]
