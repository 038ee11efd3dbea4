"""P, RLD and MD on vLLM (issue 56): ``pdd up --engine vllm --mode pdd`` on the real
SmolLM2-135M-Instruct (float32, eager, greedy), checked against vLLM run alone.

- The router answers "What is the capital of France?" with Paris through P-RLD-MD (the
  TTFT budget is set below any line, so the router relays), and the conversation's next
  turn, through whatever pipeline the router picks, says what vLLM alone says.
- MD computes only the handed-over tokens: its vLLM reports the rest of the prompt
  loaded (the role engine logs vLLM's own ``num_cached_tokens`` per request).
- Token equality on ``PDD_VLLM_CONVERSATIONS`` held-out conversations (default 4) through
  both pipelines, P-RLD-MD and P-MD, driven as the router drives them (plans to P, the
  streams of RLD and MD merged by position).

One stack (three vLLM instances) and one offline vLLM for the reference, one after the
other. Slow; skipped without vLLM (the ``pdd[vllm]`` extra) or without the pulled model.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from .conftest import CONVERSATIONS, MAX_TOKENS, VLLM_ENV, VLLM_MISSING, WORKER_FLAGS

if VLLM_MISSING:
    pytest.skip(VLLM_MISSING, allow_module_level=True)

from pdd.local.stack import LocalStack
from pdd.router.tokenization import load_prompt_tokenizer
from pdd.testing.pipelines import QUESTIONS, md_computed, start_stack, through_workers
from pdd.worker.engine.sampling import SamplingParams
from pdd.worker.vllm.engine_args import VllmEngineSettings
from pdd.worker.vllm.offline import generate_all

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]

SECRET = "vllm-pipelines-secret"


@dataclass(frozen=True)
class Alone:
    """What vLLM alone answers: the chat's two turns (as text) and each question (IDs)."""

    first: list[dict[str, str]]
    second: list[dict[str, str]]
    texts: tuple[str, str]
    questions: list[list[int]]
    answers: list[list[int]]


@pytest.fixture(scope="module")
def alone(model: Path) -> Alone:
    """vLLM run alone, before the stack starts (so never four instances at once)."""
    tokenizer = load_prompt_tokenizer(model)
    value = json.loads((model / "generation_config.json").read_text())["eos_token_id"]
    eos = set(value if isinstance(value, list) else [value])
    first = [{"role": "user", "content": "What is the capital of France?"}]
    questions = [
        tokenizer.chat_ids([{"role": "user", "content": q}]) for q in QUESTIONS[:CONVERSATIONS]
    ]
    said, *answers = reference(model, [tokenizer.chat_ids(first), *questions])
    said_text = tokenizer.tokenizer.decode(_text_ids(said, eos))
    second = [*first, {"role": "assistant", "content": said_text},
              {"role": "user", "content": "And of Italy?"}]  # fmt: skip
    (follow,) = reference(model, [tokenizer.chat_ids(second)])
    texts = (said_text, tokenizer.tokenizer.decode(_text_ids(follow, eos)))
    return Alone(first, second, texts, questions, answers)


@pytest.fixture(scope="module")
def stack(
    model: Path, alone: Alone, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalStack]:
    """``pdd up --engine vllm --mode pdd``, relaying every request (a TTFT budget no line
    meets), as the CLI builds it; started once vLLM alone has answered (``alone``)."""
    argv = ["--model", str(model), "--engine", "vllm", "--ttft-budget-s", "0.001"]
    argv += ["--ready-timeout-s", "1500", *(f"--worker-arg={f}" for f in WORKER_FLAGS)]
    env = {**VLLM_ENV, "PDD_SHARED_SECRET": SECRET}
    started = start_stack(argv, "pdd", tmp_path_factory.mktemp("stack"), env)
    try:
        yield started
    finally:
        started.stop()


def reference(model: Path, prompts: list[list[int]]) -> list[list[int]]:
    """vLLM alone, the same settings (greedy, float32, eager): each prompt's tokens."""
    settings = VllmEngineSettings(
        model=str(model), dtype="float32", enforce_eager=True, block_size=32,
        max_model_len=2048, kv_cache_memory_bytes=1 << 30, seed=0,
    )  # fmt: skip
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    return [r.token_ids for r in generate_all(settings, prompts, params)]


def chat(router_url: str, model: Path, messages: list[dict[str, str]]) -> httpx.Response:
    body = {"model": model.name, "messages": messages, "max_tokens": MAX_TOKENS,
            "temperature": 0}  # fmt: skip
    return httpx.post(f"{router_url}/v1/chat/completions", json=body, timeout=600)


def test_paris_through_p_rld_md_and_the_next_turn_as_vllm_alone(
    stack: LocalStack, model: Path, alone: Alone
) -> None:
    answer = chat(stack.info.router_url, model, alone.first)
    assert answer.status_code == 200, answer.text
    assert answer.headers["x-pdd-pipeline"] == "P-RLD-MD", answer.headers.get("x-pdd-reason")
    said = answer.json()["choices"][0]["message"]["content"]
    assert "Paris" in said
    follow = chat(stack.info.router_url, model, alone.second)
    assert follow.status_code == 200, follow.text
    assert (said, follow.json()["choices"][0]["message"]["content"]) == alone.texts
    # MD computed only what a relay handed over: its vLLM loaded the rest of the prompt.
    computed = md_computed(Path(stack.info.log_dir) / "pdd-main-0.log", 2)
    assert len(computed) == 2, computed
    assert all(c <= MAX_TOKENS < p for c, p in computed), computed


@pytest.mark.parametrize("pipeline", ["P-RLD-MD", "P-MD"])
def test_both_pipelines_are_token_equal_to_vllm_alone(
    stack: LocalStack, alone: Alone, pipeline: str
) -> None:
    got = asyncio.run(through_workers(stack, SECRET, alone.questions, pipeline, MAX_TOKENS))
    mismatched = [i for i, (g, w) in enumerate(zip(got, alone.answers, strict=True)) if g != w]
    assert not mismatched, f"{len(mismatched)}/{len(got)} differ: {mismatched}"
    # MD computed only the handed-over IDs: P's first token on P-MD, the relay's too on
    # P-RLD-MD; vLLM loaded every other prompt token (its count, logged per request).
    computed = md_computed(Path(stack.info.log_dir) / "pdd-main-0.log", len(got), f"eq-{pipeline}-")
    assert len(computed) == len(got), computed
    if pipeline == "P-MD":
        assert all(c == 1 for c, _ in computed), computed
    assert all(c <= MAX_TOKENS < p for c, p in computed), computed


def _text_ids(ids: list[int], eos: set[int]) -> list[int]:
    """The IDs the router shows as text: an end of turn ends it, unshown."""
    return ids[:-1] if ids and ids[-1] in eos else ids
