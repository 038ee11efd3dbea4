"""P, RLD and MD on different engines (issue 56): ``pdd up --main-engine vllm`` (P and RLD
on the pdd engine, MD on vLLM) on the real SmolLM2-135M-Instruct (float32, greedy), checked
against the pdd engine alone.

Both engines read and write the same per-token KV chunks (``kv_transfer``), so P's KV
crosses from one engine to the other, and the relay's handed-over token IDs too:
- the router answers "What is the capital of France?" through P-RLD-MD (a TTFT budget no
  line meets) with the pdd engine alone's text, MD's vLLM computing only handed-over IDs;
- ``PDD_VLLM_CONVERSATIONS`` held-out questions (default 4), planned through P-RLD-MD and
  P-MD as the router plans them, are token-equal to the pdd engine alone.

One vLLM instance (MD); the reference runs the pdd engine in this process. Slow; skipped
without vLLM (the ``pdd[vllm]`` extra) or without the pulled model.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from .conftest import CONVERSATIONS, MAX_TOKENS, VLLM_ENV, VLLM_MISSING

if VLLM_MISSING:
    pytest.skip(VLLM_MISSING, allow_module_level=True)

from pdd.local.stack import LocalStack
from pdd.router.tokenization import load_prompt_tokenizer
from pdd.testing.pipelines import QUESTIONS, md_computed, start_stack, through_workers
from pdd.worker.engine.engine import Engine
from pdd.worker.engine.sampling import SamplingParams
from pdd.worker.model.loader import load_model

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]

SECRET = "mixed-engines-secret"
#: MD alone on vLLM: its blocks of 32 (vLLM's CPU attention), the others' of 16 (the
#: router's), every worker in float32 (the chunks' dtype must agree).
STACK_FLAGS = (
    "--main-engine=vllm", "--worker-arg=--dtype=float32", "--main-arg=--enforce-eager",
    "--main-arg=--block-size=32", "--main-arg=--max-model-len=2048",
)  # fmt: skip


@dataclass(frozen=True)
class Alone:
    """What the pdd engine alone answers: the chat's text, each question's IDs and answer."""

    chat: list[dict[str, str]]
    text: str
    questions: list[list[int]]
    answers: list[list[int]]


@pytest.fixture(scope="module")
def alone(model: Path) -> Alone:
    tokenizer = load_prompt_tokenizer(model)
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    questions = [
        tokenizer.chat_ids([{"role": "user", "content": q}]) for q in QUESTIONS[:CONVERSATIONS]
    ]
    loaded = load_model(str(model), "float32")
    engine = Engine(loaded, block_size=16, num_blocks=512)
    said, *answers = engine.generate(
        [tokenizer.chat_ids(chat), *questions],
        SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0),
    )
    eos = set(loaded.config.eos_token_ids)
    text = tokenizer.tokenizer.decode(said[:-1] if said and said[-1] in eos else said)
    return Alone(chat, text, questions, answers)


@pytest.fixture(scope="module")
def stack(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    argv = ["--model", str(model), "--ttft-budget-s", "0.001", "--ready-timeout-s", "1500"]
    env = {**VLLM_ENV, "PDD_SHARED_SECRET": SECRET}
    started = start_stack([*argv, *STACK_FLAGS], "pdd", tmp_path_factory.mktemp("stack"), env)
    try:
        yield started
    finally:
        started.stop()


def test_the_router_answers_through_p_rld_md_as_the_pdd_engine_alone(
    stack: LocalStack, model: Path, alone: Alone
) -> None:
    body = {"model": model.name, "messages": alone.chat, "max_tokens": MAX_TOKENS,
            "temperature": 0}  # fmt: skip
    answer = httpx.post(f"{stack.info.router_url}/v1/chat/completions", json=body, timeout=600)
    assert answer.status_code == 200, answer.text
    assert answer.headers["x-pdd-pipeline"] == "P-RLD-MD", answer.headers.get("x-pdd-reason")
    assert answer.json()["choices"][0]["message"]["content"] == alone.text
    # MD (vLLM) computed only what the relay (pdd engine) handed over; P's KV did the rest.
    (computed,) = md_computed(Path(stack.info.log_dir) / "pdd-main-0.log", 1)
    assert computed[0] <= MAX_TOKENS < computed[1], computed


@pytest.mark.parametrize("pipeline", ["P-RLD-MD", "P-MD"])
def test_both_pipelines_across_engines_are_token_equal_to_one_engine_alone(
    stack: LocalStack, alone: Alone, pipeline: str
) -> None:
    got = asyncio.run(through_workers(stack, SECRET, alone.questions, pipeline, MAX_TOKENS))
    mismatched = [i for i, (g, w) in enumerate(zip(got, alone.answers, strict=True)) if g != w]
    assert not mismatched, f"{len(mismatched)}/{len(got)} differ: {mismatched}"
    computed = md_computed(Path(stack.info.log_dir) / "pdd-main-0.log", len(got), f"eq-{pipeline}-")
    assert len(computed) == len(got), computed
    if pipeline == "P-MD":  # only P's first token: P's KV (pdd engine) loaded for the rest
        assert all(c == 1 for c, _ in computed), computed
    assert all(c <= MAX_TOKENS < p for c, p in computed), computed
