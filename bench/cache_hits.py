"""MD's prefix-cache hit rate under cache pressure: measured on the stack against the cache
model's prediction for the same requests.

    python bench/cache_hits.py [--md-blocks 48 96 192 384] [--conversations 10]
                               [--turns 4] [--port 8161] [--json OUT]

For each MD size, starts real ``pdd worker`` processes (P and an MD with that many KV
blocks; the tiny model) and ``pdd router`` on loopback, and replays conversations one
request at a time, round robin (turn 1 of every conversation, then turn 2, ...), so a
conversation's next turn comes after every other conversation's: the reuse distance the
cache must bridge is the whole working set. Each turn's prompt is the conversation so far
(token IDs: earlier prompts and the answers MD gave) plus 60 new tokens.

Measured: MD's own counters (``pdd_worker_prefix_hit_tokens_total`` over
``pdd_worker_prompt_tokens_total``, role main). Predicted: the simulator's cache model
(``pdd.simulator.prefix_cache.PrefixCache``: leaf-first LRU over chained block keys, the
pool's tokens as its capacity) fed the same prompts in the same order, each followed by
the conversation's answer as MD caches it. Requests run one at a time, so the model's
capacity is the whole pool (nothing is held by running requests between them).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import tempfile
from pathlib import Path

import httpx
from overload import run_router

from pdd.common.block_hash import block_hashes
from pdd.local.cluster import LinkSpec, LocalCluster, WorkerSpec
from pdd.simulator.prefix_cache import HolderIndex, PrefixCache

BLOCK = 16
TURN_TOKENS = 60
MAX_TOKENS = 24


def md_counters(cluster: LocalCluster) -> tuple[float, float]:
    """MD's (prefix hit tokens, prompt tokens) so far."""
    text = httpx.get(f"{cluster['md'].url}/metrics").text

    def value(name: str) -> float:
        match = re.search(rf'^{name}{{role="main"}} (\S+)$', text, re.M)
        return float(match.group(1)) if match else 0.0

    return value("pdd_worker_prefix_hit_tokens_total"), value("pdd_worker_prompt_tokens_total")


async def replay(url: str, conversations: int, turns: int, seed: int) -> list[list[int]]:
    """Every request's prompt, then its answer, in the order sent: [prompt, answer, ...]."""
    rng = random.Random(seed)
    history: list[list[int]] = [[] for _ in range(conversations)]
    sent: list[list[int]] = []
    async with httpx.AsyncClient(timeout=300) as http:
        for _ in range(turns):
            for c in range(conversations):
                prompt = history[c] + [rng.randrange(3, 250) for _ in range(TURN_TOKENS)]
                body = {
                    "model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS,
                    "ignore_eos": True, "temperature": 0.0, "logprobs": 1,
                    "return_tokens_as_token_ids": True,
                }  # fmt: skip
                reply = await http.post(f"{url}/v1/completions", json=body)
                reply.raise_for_status()
                tokens = reply.json()["choices"][0]["logprobs"]["tokens"]
                answer = [int(t.removeprefix("token_id:")) for t in tokens]
                sent += [prompt, answer]
                history[c] = prompt + answer
    return sent


def predicted(sent: list[list[int]], capacity_tokens: int) -> tuple[int, int]:
    """(hit tokens, prompt tokens) the cache model gives for the same requests."""
    cache = PrefixCache("md", capacity_tokens, BLOCK, HolderIndex(BLOCK))
    hit = total = 0
    for prompt, answer in zip(sent[::2], sent[1::2], strict=True):
        keys = block_hashes(prompt, BLOCK)
        hit += cache.match(keys) * BLOCK
        total += len(prompt)
        # MD caches the prompt as its KV lands, then the answer's computed tokens (every
        # output token but the last, whose KV no step computed).
        cache.insert(keys)
        cache.insert(block_hashes(prompt + answer[:-1], BLOCK))
    return hit, total


def one_size(blocks: int, args: argparse.Namespace) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix=f"pdd-cache-hits-{blocks}-"))
    specs = [
        WorkerSpec("p", "prefill"),
        WorkerSpec("md", "main", wan_facing=True, args=("--num-blocks", str(blocks))),
    ]
    common = ["--model", "tiny", "--torch-threads", "1"]
    cluster = LocalCluster.start(specs, tmp, LinkSpec(gbps=10.0), common_args=common)
    router = None
    try:
        router = run_router(cluster, args.port, tmp / "router.log")
        hit0, prompt0 = md_counters(cluster)
        url = f"http://127.0.0.1:{args.port}"
        sent = asyncio.run(replay(url, args.conversations, args.turns, args.seed))
        hit1, prompt1 = md_counters(cluster)
    finally:
        if router is not None:
            router.terminate()
            router.wait(30)
        cluster.stop()
    model_hit, model_prompt = predicted(sent, blocks * BLOCK)
    last = sent[-2 * args.conversations :]  # each conversation's last prompt and answer
    measured = (hit1 - hit0) / (prompt1 - prompt0)
    return {
        "md_blocks": blocks,
        "capacity_tokens": blocks * BLOCK,
        "working_set_tokens": sum(len(turn) for turn in last),
        "requests": len(sent) // 2,
        "measured_hit_rate": round(measured, 4),
        "model_hit_rate": round(model_hit / model_prompt, 4),
        "measured_prompt_tokens": prompt1 - prompt0,
        "model_prompt_tokens": model_prompt,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--md-blocks", type=int, nargs="+", default=[48, 96, 192, 384])
    parser.add_argument("--conversations", type=int, default=10)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--seed", type=int, default=39)
    parser.add_argument("--port", type=int, default=8161)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    rows = [one_size(blocks, args) for blocks in args.md_blocks]
    for row in rows:
        print(json.dumps(row))
    if args.json:
        args.json.write_text(json.dumps({"block_size": BLOCK, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
