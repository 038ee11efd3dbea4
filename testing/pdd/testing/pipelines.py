"""A ``pdd up`` stack's workers driven as the router drives them, for the tests that check
P, RLD and MD token for token against one engine alone (whichever engines they run).

``start_stack`` builds the stack as the CLI does (``pdd up``'s parser and ``stack_config``)
with the environment its workers need set only while they start; ``through_workers``
sends each prompt as a ``PipelinePlan`` to P and merges the relay's and MD's streams with
the router's own ``relay_tokens``, so a pipeline is exercised exactly, not as the router's
policy happens to pick it; ``md_computed`` reads what MD's vLLM computed per request;
``QUESTIONS`` are the held-out chat turns both the single-engine and the mixed tests ask.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

from pdd.common.vocabulary import Pipeline
from pdd.common.wire import PipelinePlan, SamplingSpec
from pdd.local.cluster import free_port
from pdd.local.stack import LocalStack
from pdd.local.up import build_parser, stack_config
from pdd.router.stream_relay import relay_tokens
from pdd.router.worker_client import WorkerClient
from pdd.testing.waiting import until_sync

#: Held-out user turns (none of them in the model card or the bench samples).
QUESTIONS = (
    "Name three rivers in South America and one fact about each.",
    "How does a bicycle's derailleur change gears?",
    "Write a haiku about a lighthouse in winter.",
    "What is the difference between weather and climate?",
    "Explain what a hash function is to a ten-year-old.",
    "Give two reasons why the sky looks blue during the day.",
    "Suggest a name for a bakery that only sells bread made with rye.",
    "What does a compiler do, in two sentences?",
    "List the planets of the solar system from the sun outwards.",
    "Why do cats purr? Keep it short.",
    "Describe the smell of rain to someone who has never smelled it.",
    "What is photosynthesis? Answer in one paragraph.",
    "Translate 'good morning, how are you?' into French and Spanish.",
    "What should I pack for a two-day hike in the mountains?",
    "Explain the rules of tic-tac-toe.",
    "How do vaccines train the immune system?",
    "What is the tallest mountain in Africa, and how tall is it?",
    "Give me a short recipe for pancakes.",
    "Why is the ocean salty?",
    "What is a prime number? Give three examples.",
)


def start_stack(
    argv: Sequence[str], mode: str, log_dir: Path, env: Mapping[str, str]
) -> LocalStack:
    """``pdd up ARGV --mode MODE`` as the CLI builds it; ``env`` is in the environment the
    workers inherit while they start, and this process's is as it was afterwards."""
    args = build_parser().parse_args(list(argv))
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        return LocalStack.start(stack_config(args, mode, free_port(), log_dir))
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def worker_urls(stack: LocalStack) -> dict[str, str]:
    """The control URL of the first worker of each role P, RLD and MD."""
    return {
        role: next(url for name, url in stack.info.workers.items() if f"-{role}-" in name)
        for role in ("prefill", "relay", "main")
    }


async def through_workers(
    stack: LocalStack, secret: str, prompts: Sequence[Sequence[int]], pipeline: str,
    max_tokens: int, sampling: SamplingSpec | None = None,
) -> list[list[int]]:  # fmt: skip
    """Each prompt planned as the router plans ``pipeline`` (greedy, or ``sampling``), one
    at a time, as request ``eq-<pipeline>-<i>``; the token IDs the client would get, in
    order."""
    if sampling is None:
        sampling = SamplingSpec(max_tokens=max_tokens, temperature=0.0, seed=0)
    client = WorkerClient(secret)
    try:
        roles = worker_urls(stack)
        endpoints = {role: (await client.health(url)).endpoint for role, url in roles.items()}
        outputs = []
        for i, prompt in enumerate(prompts):
            plan = PipelinePlan(
                request_id=f"eq-{pipeline}-{i}", prompt_ids=list(prompt),
                pipeline=Pipeline(pipeline), prefill=endpoints["prefill"], main=endpoints["main"],
                relay=endpoints["relay"] if pipeline == "P-RLD-MD" else None,
                sampling=sampling,
            )  # fmt: skip
            events = [e async for e in relay_tokens(plan, client, timeout_s=600)]
            outputs.append([e.token_id for e in events if e.token_id is not None])
        return outputs
    finally:
        await client.aclose()


def md_computed(log: Path, count: int, prefix: str | None = None) -> list[tuple[int, int]]:
    """(computed, prompt) per vLLM request a vLLM worker ran whose ID starts with ``prefix``
    (None: the router's, not ``through_workers``' ``eq-*``), from its role engine's log,
    once ``count`` of them are there: the worker's log reaches the file after its answer
    may have reached the test (CI read it too early once)."""
    pattern = re.compile(r"vLLM request (\S+): computed (\d+) of (\d+) prompt tokens")

    def logged() -> list[tuple[int, int]]:
        return [
            (int(a), int(b))
            for rid, a, b in pattern.findall(log.read_text())
            if (rid.startswith(prefix) if prefix else not rid.startswith("eq-"))
        ]

    until_sync(lambda: len(logged()) >= count, f"{count} vLLM requests logged in {log.name}")
    return logged()
