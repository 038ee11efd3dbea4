"""Greedy outputs of token-ID prompts through a whole local stack, compared token by token.

``pdd bench`` replays text and compares the outputs' text. A lossy WAN KV codec is
judged better on a checkpoint whose logits mean something (the trained test ones), fed
prompts from what it learned, as token IDs. This runs such prompts through a stack's
router (``/v1/completions``, greedy, ``ignore_eos``, the tokens named by ID), one at a
time, and reads what the workers counted: the pipelines the router chose and the WAN
KV bytes, raw and as sent. ``bench/kv_codec.py --stack`` prints the figures and a slow
test holds int8 to the issue's bar with them.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import httpx

from pdd.bench import quiescence
from pdd.bench.report import share_of_equal_positions
from pdd.local.probes import summed, total
from pdd.local.stack import LocalStack, Say
from pdd.local.topology import StackConfig
from pdd.router.openai_protocol import TOKEN_ID_PREFIX

REQUEST_TIMEOUT_S = 300.0


@dataclass
class StackGreedy:
    """What one stack produced for the prompts, and what its workers counted."""

    #: Per prompt, the generated token IDs.
    outputs: list[list[int]] = field(default_factory=list)
    pipelines: Counter[str] = field(default_factory=Counter)
    #: ``pdd_worker_wan_kv_bytes_total`` (MD's miss at the engine's bytes per token) and
    #: ``pdd_worker_wan_kv_coded_bytes_total`` (the chunks as sent), summed over the workers.
    wan_kv_bytes: float = 0.0
    wan_kv_wire_bytes: float = 0.0

    def agreement_with(self, reference: StackGreedy) -> float | None:
        """The share of generated positions equal to ``reference``'s, prompt by prompt."""
        return share_of_equal_positions(zip(self.outputs, reference.outputs, strict=True))

    def outputs_differing_from(self, reference: StackGreedy) -> int:
        return sum(a != b for a, b in zip(self.outputs, reference.outputs, strict=True))


def run_greedy(
    config: StackConfig, prompts: Sequence[Sequence[int]], max_tokens: int, say: Say = print
) -> StackGreedy:
    """Start ``config``'s stack, run every prompt through its router, stop it."""
    stack = LocalStack.start(config, say)
    try:
        return asyncio.run(_run(stack, prompts, max_tokens))
    finally:
        stack.stop()


async def _run(stack: LocalStack, prompts: Sequence[Sequence[int]], max_tokens: int) -> StackGreedy:
    result = StackGreedy()
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S) as client:
        for prompt in prompts:
            body = {
                "model": stack.info.model,
                "prompt": list(prompt),
                "max_tokens": max_tokens,
                "temperature": 0.0,
                "ignore_eos": True,
                "logprobs": 0,
                "return_tokens_as_token_ids": True,
            }
            answer = await client.post(f"{stack.info.base_url}/completions", json=body)
            answer.raise_for_status()
            result.pipelines[answer.headers.get("x-pdd-pipeline", "?")] += 1
            names = answer.json()["choices"][0]["logprobs"]["tokens"]
            result.outputs.append([int(n.removeprefix(TOKEN_ID_PREFIX)) for n in names])
        # Counters are final once no transfer is in flight anywhere.
        states = await quiescence.settle(stack.info.workers, stack.secret)
        if not all(s.quiescent for s in states.values()):
            raise RuntimeError(f"workers did not settle: {sorted(states)}")
        _, workers = await stack.info.probes.metrics(client)
    samples = summed(workers)
    result.wan_kv_bytes = total(samples, "pdd_worker_wan_kv_bytes_total")
    result.wan_kv_wire_bytes = total(samples, "pdd_worker_wan_kv_coded_bytes_total")
    return result
